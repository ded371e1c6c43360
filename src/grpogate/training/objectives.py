"""Objectives: the published policy losses, pure tensor maths (no model, no optimizer).

`micro_batch_loss` is the whole loss of one micro-batch, for every loss type: the per-token
terms, the mask, the aggregation and the denominator; the update only forwards, calls it,
back-propagates and steps. It is built from one function per published piece:
- `importance_log_ratio`: log pi_theta / pi_old per token, or GSPO's length-normalized
  sequence log-ratio (`importance_sampling_level = "sequence"`).
- `clipped_surrogate`: the PPO/GRPO clipped surrogate with clip-higher and dual clip
  (loss types grpo, bnpo, dapo, dr_grpo; they differ only in normalization).
- `cispo_surrogate`: MiniMax-M1's clipped, detached importance weight times log pi.
- `kl_penalty`: Schulman's k1 / k2 / k3 estimators of KL(pi_theta || pi_ref).
- `rollout_correction_weights`: truncated importance weights pi_old / pi_sampler.
- `mismatch_terms`: |delta log p| and k3 between sampler and trainer, per token.
- `high_entropy_mask`: train only on the highest-entropy tokens (arXiv 2506.01939).
- `aggregate_loss` / `loss_denominator` / `Denominator`: the normalizations, one per loss type.

How a step's loss is composed: every micro-batch contributes `aggregate_loss(...) /
denominator`, and the gradients add up over the step's micro-batches, so splitting a step into
micro-batches never changes it (bnpo is the exception by definition: it normalizes per
micro-batch, as TRL does).
Shapes: N sequences, T completion tokens (right-padded; `mask` [N, T] is 1 on real tokens).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from grpogate.config import (IMPORTANCE_SAMPLING_LEVELS, RunConfig, KL_ESTIMATORS, LOSS_TYPES,
                             ROLLOUT_CORRECTIONS)


def importance_log_ratio(logp, old_logp, mask, level: str) -> torch.Tensor:
    """log ratio [N, T] (token level) or [N, 1] (sequence level).

    token: log pi_theta(y_t) - log pi_old(y_t) (DeepSeekMath eq. 3).
    sequence: GSPO (Zheng et al. 2025, arXiv 2507.18071, eq. 7): s_i = (pi_theta(y_i) /
    pi_old(y_i)) ** (1 / |y_i|), i.e. the token log-ratios averaged over the sequence; its
    gradient reaches every token as 1 / |y_i| of the sequence's.
    """
    log_ratio = (logp - old_logp) * mask  # padded positions contribute 0
    if level == "token":
        return log_ratio
    if level == "sequence":
        return log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    raise ValueError(f"unknown importance_sampling_level {level!r}; known: {IMPORTANCE_SAMPLING_LEVELS}")


def clipped_surrogate(log_ratio, advantages, epsilon: float, epsilon_high: float,
                      delta: float = RunConfig.delta):
    """Per-token loss [N, T or 1] and clipped flags: -min(r A, clip(r, 1 - eps, 1 + eps_high) A).

    DeepSeekMath (Shao et al. 2024, arXiv 2402.03300) eq. 3 with DAPO's clip-higher (Yu et al.
    2025, arXiv 2503.14476, eq. 10: a larger upper bound eps_high). `delta` > 0 is the
    two-sided clip of INTELLECT-2 (arXiv 2505.07291): the unclipped ratio is capped at delta,
    which only binds for negative advantages (for positive ones the clipped term is smaller).
    A token is counted as clipped when the clip took its gradient away: r < 1 - eps with A < 0
    or r > 1 + eps_high with A > 0 (TRL's clip_ratio/low_mean and high_mean).
    """
    ratio = torch.exp(log_ratio)
    advantage = advantages[:, None]  # [N, 1]
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon_high) * advantage
    unclipped = (ratio.clamp(max=delta) if delta > 0 else ratio) * advantage
    was_clipped = ((ratio < 1 - epsilon) & (advantage < 0)) | (
        (ratio > 1 + epsilon_high) & (advantage > 0))
    return -torch.minimum(unclipped, clipped), was_clipped


def cispo_surrogate(logp, log_ratio, advantages, epsilon_high: float):
    """Per-token loss [N, T] and clipped flags: -sg(min(r, 1 + eps_high)) * A * log pi_theta.

    CISPO, MiniMax-M1 (arXiv 2506.13585, eq. 4-5): the importance weight is clipped and
    detached, so every token keeps a gradient A * sg(r_hat) * grad log pi (PPO's clip would drop
    it). The cap is 1 + epsilon_high as in the paper (TRL caps at epsilon_high itself; carry a
    TRL config over with epsilon_high reduced by 1). No lower bound, as in the paper's runs.
    """
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(max=1 + epsilon_high).detach()
    was_clipped = (ratio > 1 + epsilon_high) & (advantages[:, None] > 0)
    return -weight * advantages[:, None] * logp, was_clipped


def kl_penalty(logp, ref_logp, estimator: str) -> torch.Tensor:
    """Per-token estimate [N, T] of KL(pi_theta || pi_ref) from samples of pi_theta.

    Schulman, "Approximating KL divergence" (2020), with log r = ref - logp:
    k1 = -log r (unbiased, can be negative), k2 = (log r)^2 / 2, k3 = r - 1 - log r (unbiased,
    >= 0; the GRPO paper's eq. 4).
    """
    log_r = ref_logp - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r ** 2
    if estimator == "k3":
        return torch.exp(log_r) - log_r - 1
    raise ValueError(f"unknown kl_estimator {estimator!r}; known: {KL_ESTIMATORS}")


def rollout_correction_weights(old_logp, sampler_logp, mask, mode: str, cap: float) -> torch.Tensor:
    """Detached importance weights [N, T] for the sampler-trainer mismatch, pi_old / pi_sampler.

    The rollout was drawn by the sampler (merged weights, another kernel; tomorrow vLLM), while
    the objective assumes it came from the trainer's pi_old. Truncated importance sampling
    (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training";
    TRL's vllm_importance_sampling_*, verl's rollout_correction):
    token_tis: w_t = min(pi_old(y_t) / pi_sampler(y_t), cap);
    sequence_mask: w = prod_t pi_old / pi_sampler for the whole sequence (the log-ratios
    summed, as TRL does), and the sequence is dropped (w = 0) when w exceeds the cap.
    """
    log_w = ((old_logp - sampler_logp) * mask).detach()
    if mode == "none":
        return torch.ones_like(log_w)
    if mode == "token_tis":
        return torch.exp(log_w).clamp(max=cap)
    if mode == "sequence_mask":
        weight = torch.exp(log_w.sum(-1, keepdim=True))  # [N, 1]
        return torch.where(weight <= cap, weight, torch.zeros_like(weight)).expand_as(log_w)
    raise ValueError(f"unknown rollout_correction {mode!r}; known: {ROLLOUT_CORRECTIONS}")


def mismatch_terms(trainer_logp, sampler_logp) -> tuple[torch.Tensor, torch.Tensor]:
    """|log pi_trainer - log pi_sampler| and the k3 estimate of KL(sampler || trainer), [N, T].

    The tokens were drawn by the sampler, so k3 with log r = trainer - sampler estimates
    KL(pi_sampler || pi_trainer) without bias. Both are 0 exactly when the two agree. In float64
    with expm1: in float32, exp(x) - x - 1 at |x| ~ 1e-6 (float32 rounding) cancels to noise.
    """
    log_r = (trainer_logp.detach().double() - sampler_logp.detach().double())
    return log_r.abs(), torch.expm1(log_r) - log_r


def high_entropy_mask(entropy, mask, quantile: float) -> torch.Tensor:
    """[N, T] float: 1 on the real tokens whose entropy is in the top `quantile` fraction.

    Wang et al. 2025, "Beyond the 80/20 rule" (arXiv 2506.01939): training on the top 20 %
    highest-entropy ("forking") tokens matches or beats full-token training. The threshold is
    the (1 - quantile) quantile of the real tokens' entropies in this micro-batch (TRL's
    get_high_entropy_mask, per process); quantile 1.0 keeps every token.
    """
    if quantile >= 1.0:
        return mask
    real = entropy.detach()[mask.bool()]
    if real.numel() == 0:
        return mask
    threshold = torch.quantile(real.float(), 1 - quantile)
    return mask * (entropy.detach() >= threshold).to(mask.dtype)


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """The *sum* form of the loss over a micro-batch; divide by `loss_denominator`.

    grpo: each sequence's token mean, summed (DeepSeekMath eq. 3: 1/G sum_i 1/|o_i| sum_t).
    bnpo, dapo, cispo, dr_grpo: the plain token sum; they differ in the denominator.
    """
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    if loss_type in ("bnpo", "dapo", "cispo", "dr_grpo"):
        return (per_token * mask).sum()
    raise ValueError(f"unknown loss_type {loss_type!r}; known: {LOSS_TYPES}")


def loss_denominator(completion_lengths: list[int], loss_type: str, max_new_tokens: int) -> int:
    """What a summed loss over `completion_lengths` (its sequences) is divided by.

    grpo: the number of sequences (mean over sequences).
    dapo, cispo: the real tokens of the optimizer step (DAPO eq. 8, token-level mean; MiniMax-M1
    normalizes CISPO the same way); bnpo: the real tokens of the micro-batch (the caller passes
    the micro-batch's lengths and divides by the micro-batch count too).
    dr_grpo: sequences x max_new_tokens, a constant (Liu et al. 2025, arXiv 2503.20783, sec. 3.1:
    no length normalization, so long wrong answers are not favoured).
    """
    if loss_type == "grpo":
        return max(1, len(completion_lengths))
    if loss_type in ("dapo", "cispo", "bnpo"):
        return max(1, sum(completion_lengths))
    if loss_type == "dr_grpo":
        return max(1, len(completion_lengths) * max_new_tokens)
    raise ValueError(f"unknown loss_type {loss_type!r}; known: {LOSS_TYPES}")


def policy_token_terms(logp, old_logp, ref_logp, advantages, mask, *, loss_type: str,
                       level: str, epsilon: float, epsilon_high: float, delta: float,
                       beta: float, kl_estimator: str, weights=None):
    """Per-token loss [N, T], the KL [N, T] and clipped flags [N, T] of one micro-batch.

    loss = surrogate * weights + beta * KL, as TRL composes it: `weights` (the entropy mask
    and the rollout correction, detached; None: 1) scale the policy term only, never the KL.
    logp / old_logp / ref_logp [N, T], advantages [N], mask [N, T].
    """
    log_ratio = importance_log_ratio(logp, old_logp, mask, level)
    if loss_type == "cispo":
        per_token, was_clipped = cispo_surrogate(logp, log_ratio, advantages, epsilon_high)
    else:
        per_token, was_clipped = clipped_surrogate(log_ratio, advantages, epsilon, epsilon_high,
                                                   delta)
    per_token, was_clipped = per_token.expand_as(logp), was_clipped.expand_as(logp)
    if weights is not None:
        per_token = per_token * weights
    kl = torch.zeros_like(logp) if ref_logp is None else kl_penalty(logp, ref_logp, kl_estimator)
    return per_token + beta * kl, kl, was_clipped


# --- the whole loss of one micro-batch ---------------------------------------------------------


@dataclass(frozen=True)
class LossSettings:
    """The objective's knobs, named as TRL's GRPOConfig names them (config/schema.py documents each)."""

    loss_type: str
    importance_sampling_level: str
    epsilon: float
    epsilon_high: float  # resolved: never 0
    delta: float
    beta: float
    kl_estimator: str
    top_entropy_quantile: float
    rollout_correction: str
    rollout_correction_cap: float
    max_new_tokens: int  # dr_grpo's constant normalizer


@dataclass(frozen=True)
class Denominator:
    """What one micro-batch's summed loss is divided by: it depends on the whole optimizer
    step, so that the micro-batches' gradients add up to the step's (bnpo excepted).
    Lengths are those of the sequences that add loss (masked truncated ones leave it)."""

    step_lengths: list[int]  # completion lengths of the optimizer step's sequences
    micro_lengths: list[int]  # ... of this micro-batch's
    micro_batches: int  # the optimizer step's micro-batch count

    def value(self, loss_type: str, max_new_tokens: int) -> int:
        if loss_type == "bnpo":
            # a token mean per micro-batch, divided by the count as TRL's gradient accumulation does
            return loss_denominator(self.micro_lengths, "bnpo", max_new_tokens) * self.micro_batches
        return loss_denominator(self.step_lengths, loss_type, max_new_tokens)


@dataclass
class MicroBatchTerms:
    """One micro-batch's inputs to the loss, [N, T] unless noted."""

    logp: torch.Tensor  # the policy's log-probs, with their gradient
    old_logp: torch.Tensor  # pi_old, the ratio's denominator
    advantages: torch.Tensor  # [N]
    completion_mask: torch.Tensor  # 1 on real completion tokens
    contributes: torch.Tensor  # [N]: 0 for a sequence that adds no loss (mask_truncated_completions)
    ref_logp: torch.Tensor | None = None  # the reference policy's; None when beta = 0
    sampler_logp: torch.Tensor | None = None  # the sampler's own; None when not recorded
    entropy: torch.Tensor | None = None  # the policy's per-token entropy, when computed

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[N, T]: the tokens in the loss. A cut-off completion's tokens leave the loss (and its
        denominator) but stay in their group's advantages, computed before the update."""
        return self.completion_mask * self.contributes[:, None]


@dataclass
class LossMetrics:
    """What one micro-batch's loss measured, for the update record."""

    tokens: int  # tokens in the loss
    clipped_tokens: int
    kl_sum: float
    trained_tokens: int  # tokens with a non-zero surrogate weight
    max_abs_log_ratio: float  # max |log pi / pi_old| over the loss's tokens
    masked_sequences: int  # forwarded for their group but adding no loss


def surrogate_weights(terms: MicroBatchTerms, settings: LossSettings) -> torch.Tensor | None:
    """The per-token weights [N, T] on the surrogate (entropy mask x rollout correction), or
    None when both are off (then the loss is computed exactly as without them)."""
    weights = None
    if settings.top_entropy_quantile < 1.0:
        weights = high_entropy_mask(terms.entropy, terms.mask, settings.top_entropy_quantile)
    if settings.rollout_correction != "none":
        if terms.sampler_logp is None:
            raise ValueError("rollout_correction needs the sampler's log-probs in the batch")
        correction = rollout_correction_weights(
            terms.old_logp, terms.sampler_logp, terms.mask, settings.rollout_correction,
            settings.rollout_correction_cap)
        weights = correction if weights is None else weights * correction
    return weights


def micro_batch_loss(terms: MicroBatchTerms, settings: LossSettings,
                     denominator: Denominator) -> tuple[torch.Tensor, LossMetrics]:
    """The whole loss of one micro-batch, ready for `backward`, and what it measured.

    Per token, l = surrogate x weights + beta x KL (`policy_token_terms`); over the mask:
      grpo     sum over sequences of each one's token mean, / the step's sequences
      bnpo     token sum, / (the micro-batch's tokens x the step's micro-batch count)
      dapo     token sum, / the step's tokens
      cispo    token sum (CISPO's surrogate), / the step's tokens
      dr_grpo  token sum, / (the step's sequences x max_new_tokens)
    """
    mask = terms.mask
    weights = surrogate_weights(terms, settings)
    per_token, kl, was_clipped = policy_token_terms(
        terms.logp, terms.old_logp, terms.ref_logp, terms.advantages, mask,
        loss_type=settings.loss_type, level=settings.importance_sampling_level,
        epsilon=settings.epsilon, epsilon_high=settings.epsilon_high, delta=settings.delta,
        beta=settings.beta, kl_estimator=settings.kl_estimator, weights=weights)
    loss = (aggregate_loss(per_token, mask, settings.loss_type)
            / denominator.value(settings.loss_type, settings.max_new_tokens))
    metrics = LossMetrics(
        tokens=int(mask.sum()),
        clipped_tokens=int((was_clipped & mask.bool()).sum()),
        kl_sum=float((kl.detach() * mask).sum()),
        trained_tokens=int(((weights if weights is not None else mask) * mask > 0).sum()),
        max_abs_log_ratio=float(((terms.logp.detach() - terms.old_logp).abs() * mask).max()),
        masked_sequences=len(terms.contributes) - int(terms.contributes.sum()))
    return loss, metrics
