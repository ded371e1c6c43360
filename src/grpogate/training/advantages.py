"""Advantages: group-relative advantages and the valid-group filter, from rewards to an update batch.

Groups whose rewards are all equal have zero advantage everywhere, so their policy-gradient term
is exactly zero: they never enter a forward or backward pass (and their KL term goes with them:
the KL penalty only acts on the tokens trained on). Advantages are (r - group mean) / (std + 1e-4),
as TRL computes them, with `scale_rewards` choosing the std: `group` (the unbiased within-group
std, DeepSeekMath), `batch` (the unbiased std of all the step's rewards, TRL's "batch") or
`none` (no division: Dr. GRPO, arXiv 2503.20783, sec. 3.1, drops it as a difficulty bias).
Shapes: B groups of G completions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpogate.config import SCALE_REWARDS

ADVANTAGE_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, scale_rewards: str = "group") -> torch.Tensor:
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
    # The sampler's log-prob of each completion token (same length as the completion); empty
    # when the caller has none (then no mismatch is measured and no correction applies).
    sampler_logprobs: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.advantages)

    @property
    def group_count(self) -> int:
        return len(set(self.group_index))

    @property
    def group_size(self) -> int:
        """Sequences per group (every group is complete: `build_update_batch` checks it)."""
        return len(self) // self.group_count if len(self) else 0


def build_update_batch(prompt_token_ids: list[list[int]], completion_token_ids: list[list[int]],
                       rewards: list[float], group_size: int, scale_rewards: str = "group",
                       sampler_logprobs: list[list[float]] | None = None) -> UpdateBatch:
    """Sequences arrive grouped (G consecutive per prompt); keep only the valid groups'."""
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} completions do not form complete groups of {group_size}")
    reward_matrix = torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)  # [B, G]
    advantages = group_advantages(reward_matrix, scale_rewards)  # [B, G]
    valid = valid_group_mask(reward_matrix)  # [B]
    batch = UpdateBatch([], [], [], [])
    for valid_index, group in enumerate(torch.nonzero(valid).flatten().tolist()):
        for member in range(group_size):
            row = group * group_size + member
            batch.prompt_token_ids.append(prompt_token_ids[row])
            batch.completion_token_ids.append(completion_token_ids[row])
            batch.advantages.append(float(advantages[group, member]))
            batch.group_index.append(valid_index)
            if sampler_logprobs is not None:
                batch.sampler_logprobs.append(sampler_logprobs[row])
    return batch
