"""Objectives: the per-token policy loss and its aggregation, pure tensor maths.

One function per published piece, no model, no optimizer:
- `grpo_token_terms`: the DeepSeekMath clipped surrogate (Shao et al. 2024, eq. 3) with the k3
  KL estimator exp(ref - logp) - (ref - logp) - 1 against the reference policy, per token.
- `aggregate_loss` / `loss_denominator`: how per-token terms become one number. The loss of an
  optimizer step is the *sum* of `aggregate_loss` over its micro-batches divided by the
  step's `loss_denominator`, so splitting a step into micro-batches never changes it.
  `sequence_mean` is the paper's token mean per sequence then mean over sequences (the
  denominator counts sequences); `token_mean` (DAPO) averages over all tokens of the step.
- `micro_batch_loss`: the two composed, what the update back-propagates.
Shapes: N sequences, T completion tokens (right-padded, `mask` 1 on real tokens).
"""

from __future__ import annotations

import torch

def grpo_token_terms(logp, old_logp, ref_logp, advantages, clip_epsilon: float, kl_coef: float):
    """Per-token loss, KL and clipped flags; logp/old/ref [N, T], advantages [N]."""
    ratio = torch.exp(logp - old_logp)  # [N, T]
    advantage = advantages[:, None]  # [N, 1]
    unclipped = ratio * advantage
    clipped = ratio.clamp(1 - clip_epsilon, 1 + clip_epsilon) * advantage
    surrogate = torch.minimum(unclipped, clipped)
    if ref_logp is None:
        kl = torch.zeros_like(logp)
    else:
        log_ratio = ref_logp - logp
        kl = torch.exp(log_ratio) - log_ratio - 1  # k3 estimator, >= 0
    per_token = -(surrogate - kl_coef * kl)
    was_clipped = ((ratio < 1 - clip_epsilon) & (advantage < 0)) | (
        (ratio > 1 + clip_epsilon) & (advantage > 0))
    return per_token, kl, was_clipped


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """The *sum* form of the loss over a micro-batch; divide by `loss_denominator` of the step."""
    if aggregation == "sequence_mean":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    if aggregation == "token_mean":
        return (per_token * mask).sum()
    raise ValueError(f"unknown loss aggregation {aggregation!r}")


def loss_denominator(completion_lengths: list[int], aggregation: str) -> int:
    """What the step's summed loss is divided by: sequences, or real tokens (at least 1)."""
    return len(completion_lengths) if aggregation == "sequence_mean" else max(1, sum(completion_lengths))


def micro_batch_loss(logp, old_logp, ref_logp, advantages, mask, *, clip_epsilon: float,
                     kl_coef: float, aggregation: str, denominator: int):
    """One micro-batch's share of its step's loss, with the per-token KL and clipped flags."""
    per_token, kl, was_clipped = grpo_token_terms(logp, old_logp, ref_logp, advantages,
                                                  clip_epsilon, kl_coef)
    return aggregate_loss(per_token, mask, aggregation) / denominator, kl, was_clipped
