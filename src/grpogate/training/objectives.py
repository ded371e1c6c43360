"""Objectives: the published policy losses, pure tensor maths (no model, no optimizer).

One function per published piece:
- `importance_log_ratio`: log pi_theta / pi_old per token, or GSPO's length-normalized
  sequence log-ratio (`importance_sampling_level = "sequence"`).
- `clipped_surrogate`: the PPO/GRPO clipped surrogate with clip-higher and dual clip
  (loss types grpo, bnpo, dapo, dr_grpo; they differ only in normalization).
- `cispo_surrogate`: MiniMax-M1's clipped, detached importance weight times log pi.
- `kl_penalty`: Schulman's k1 / k2 / k3 estimators of KL(pi_theta || pi_ref).
- `rollout_correction_weights`: truncated importance weights pi_old / pi_sampler.
- `mismatch_terms`: |delta log p| and k3 between sampler and trainer, per token.
- `high_entropy_mask`: train only on the highest-entropy tokens (arXiv 2506.01939).
- `aggregate_loss` / `loss_denominator`: the normalizations, one per loss type.

How a step's loss is composed: every micro-batch contributes `aggregate_loss(...) /
denominator`, and the gradients add up over the step's micro-batches, so splitting a step into
micro-batches never changes it (bnpo is the exception by definition: it normalizes per
micro-batch, as TRL does).
Shapes: N sequences, T completion tokens (right-padded; `mask` [N, T] is 1 on real tokens).
"""

from __future__ import annotations

import torch

from grpogate.config import (IMPORTANCE_SAMPLING_LEVELS, KL_ESTIMATORS, LOSS_TYPES,
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
                      delta: float = 0.0):
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
