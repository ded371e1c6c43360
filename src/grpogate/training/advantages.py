"""Advantages: group-relative advantages and the valid-group filter, from rewards to an update batch.

Groups whose rewards are all equal have zero advantage everywhere, so their policy-gradient term
is exactly zero: they never enter a forward or backward pass (and their KL term goes with them:
the KL penalty only acts on the tokens trained on). Advantages are (r - group mean) / (std + 1e-4),
as TRL computes them, with `scale_rewards` choosing the std: `group` (the unbiased within-group
std, DeepSeekMath), `batch` (the unbiased std of all the step's rewards, TRL's "batch") or
`none` (no division: Dr. GRPO, arXiv 2503.20783, sec. 3.1, drops it as a difficulty bias).

Several reward components combine as TRL's `multi_objective_aggregation` names it:
`sum_then_normalize` normalizes the weighted total within each group; `normalize_then_sum`
(GDPO) normalizes each component within its group, sums them weighted, then normalizes that sum
over the step's batch — here the valid groups only, the ones that enter the update, so that
refilled (dynamic-sampling) or skipped groups never shift it. A group is valid when its weighted
total differs (the same rule the evidence counts by); under normalize_then_sum a group whose
components vary but whose total is constant is skipped too, so trained groups and counted
valid groups are always the same.
Shapes: B groups of G completions, K reward components.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpogate.config import SCALE_REWARDS, RunConfig

ADVANTAGE_EPS = 1e-4


def group_advantages(rewards: torch.Tensor,
                     scale_rewards: str = RunConfig.scale_rewards) -> torch.Tensor:
    """rewards [B, G] -> advantages [B, G]: centred on the group mean, scaled per `scale_rewards`."""
    mean = rewards.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        std = rewards.std(dim=1, keepdim=True)  # unbiased, as TRL / verl
    elif scale_rewards == "batch":
        std = rewards.std()  # over every reward of the step, zero-variance groups included
    elif scale_rewards == "none":
        return rewards - mean
    else:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; known: {SCALE_REWARDS}")
    return (rewards - mean) / (std + ADVANTAGE_EPS)


def aggregate_advantages(components: torch.Tensor, weights: torch.Tensor, aggregation: str,
                         valid: torch.Tensor,
                         scale_rewards: str = RunConfig.scale_rewards) -> torch.Tensor:
    """components [B, G, K], weights [K], valid [B] -> advantages [B, G] (zero off `valid`)."""
    if aggregation == "sum_then_normalize":
        return group_advantages((components * weights).sum(-1), scale_rewards) * valid[:, None]
    if aggregation != "normalize_then_sum":
        raise ValueError(f"unknown multi_objective_aggregation {aggregation!r}")
    per_component = torch.stack([group_advantages(components[..., k], scale_rewards)
                                 for k in range(components.shape[-1])], dim=-1)  # [B, G, K]
    summed = (per_component * weights).sum(-1)  # [B, G]
    advantages = torch.zeros_like(summed)
    kept = summed[valid]  # [V, G]
    if kept.numel() > 1:
        advantages[valid] = (kept - kept.mean()) / (kept.std() + ADVANTAGE_EPS)
    return advantages


def valid_group_mask(rewards: torch.Tensor) -> torch.Tensor:
    """rewards [B, G] -> [B] bool: groups whose rewards differ, the only ones with a gradient."""
    return rewards.max(dim=1).values > rewards.min(dim=1).values


@dataclass
class UpdateBatch:
    """The sequences of the valid groups, with their advantages; plain lists, easy to shard."""

    prompt_token_ids: list[list[int]]
    completion_token_ids: list[list[int]]
    advantages: list[float]
    group_index: list[int]  # which valid group (0..valid_groups-1) each sequence belongs to
    # False: the sequence adds no loss (mask_truncated_completions), its advantage unchanged.
    contributes: list[bool] | None = None
    # The sampler's per-token log-probs, when the ratio must be taken against the truncated
    # distribution it sampled from (top_k / top_p / min_p); None: the trainer's own.
    old_logprobs: list[list[float]] | None = None
    # The sampler's log-prob of each completion token (same length as the completion); empty
    # when the caller has none (then no mismatch is measured and no correction applies).
    sampler_logprobs: list[list[float]] = field(default_factory=list)

    def contributing(self, index: int) -> bool:
        return self.contributes is None or self.contributes[index]

    @property
    def masked_count(self) -> int:
        return 0 if self.contributes is None else self.contributes.count(False)

    def __len__(self) -> int:
        return len(self.advantages)

    @property
    def group_count(self) -> int:
        return len(set(self.group_index))

    @property
    def group_size(self) -> int:
        """Sequences per group (every group is complete: `build_update_batch` checks it)."""
        return len(self) // self.group_count if len(self) else 0


@dataclass(frozen=True)
class RewardComponents:
    """A step's reward components and how they combine into advantages (TRL's
    `multi_objective_aggregation`); without them the weighted totals are the one component."""

    values: list[list[float]]  # [N][K] in the reward set's order
    weights: list[float]  # [K]
    aggregation: str = "sum_then_normalize"


def build_update_batch(prompt_token_ids: list[list[int]], completion_token_ids: list[list[int]],
                       rewards: list[float], group_size: int, *,
                       components: RewardComponents | None = None,
                       scale_rewards: str = RunConfig.scale_rewards,
                       contributes: list[bool] | None = None,
                       sampler_logprobs: list[list[float]] | None = None,
                       old_logprobs: list[list[float]] | None = None) -> UpdateBatch:
    """Sequences arrive grouped (G consecutive per prompt); keep only the valid groups'.

    `rewards` are the weighted totals (what decides a group's validity); `components` feed the
    aggregation. Per sequence: `contributes[i]` False keeps sequence i in its group's
    advantages but out of the loss (a valid group none of whose sequences contributes is
    dropped, since it would add an optimizer step with no gradient); `sampler_logprobs[i]`
    (one per completion token) feed the sampler-trainer mismatch and `rollout_correction`;
    `old_logprobs[i]` are the ratio's old log-probs when the sampler truncated its
    distribution (otherwise the trainer computes them).
    """
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} completions do not form complete groups of {group_size}")
    totals = torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)  # [B, G]
    components = components or RewardComponents(values=[[r] for r in rewards], weights=[1.0])
    matrix = torch.tensor(components.values, dtype=torch.float64).view(
        totals.shape[0], group_size, -1)  # [B, G, K]
    valid = valid_group_mask(totals)  # [B]
    advantages = aggregate_advantages(matrix, torch.tensor(components.weights, dtype=torch.float64),
                                      components.aggregation, valid, scale_rewards)  # [B, G]
    batch = UpdateBatch(prompt_token_ids=[], completion_token_ids=[], advantages=[],
                        group_index=[], contributes=None if contributes is None else [],
                        old_logprobs=None if old_logprobs is None else [])
    for group in torch.nonzero(valid).flatten().tolist():
        rows = range(group * group_size, (group + 1) * group_size)
        if contributes is not None and not any(contributes[row] for row in rows):
            continue
        index = len(set(batch.group_index))
        for member, row in enumerate(rows):
            batch.prompt_token_ids.append(prompt_token_ids[row])
            batch.completion_token_ids.append(completion_token_ids[row])
            batch.advantages.append(float(advantages[group, member]))
            batch.group_index.append(index)
            if contributes is not None:
                batch.contributes.append(bool(contributes[row]))
            if sampler_logprobs is not None:
                batch.sampler_logprobs.append(list(sampler_logprobs[row]))
            if old_logprobs is not None:
                batch.old_logprobs.append(list(old_logprobs[row]))
    return batch
