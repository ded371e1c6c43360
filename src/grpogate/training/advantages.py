"""Advantages: group-relative advantages and the valid-group filter, from rewards to an update batch.

Groups whose rewards are all equal have zero advantage everywhere, so their policy-gradient term
is exactly zero: they never enter a forward or backward pass (and their KL term goes with them:
the KL penalty only acts on the tokens trained on). Advantages are (r - mean) / (std + 1e-4)
with the unbiased within-group std, as TRL and verl compute them.
Shapes: B groups of G completions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADVANTAGE_EPS = 1e-4


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """rewards [B, G] -> advantages [B, G], normalized within each group."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)  # unbiased, as TRL / verl
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
                       rewards: list[float], group_size: int) -> UpdateBatch:
    """Sequences arrive grouped (G consecutive per prompt); keep only the valid groups'."""
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} completions do not form complete groups of {group_size}")
    reward_matrix = torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)  # [B, G]
    advantages = group_advantages(reward_matrix)  # [B, G]
    valid = valid_group_mask(reward_matrix)  # [B]
    batch = UpdateBatch([], [], [], [])
    for valid_index, group in enumerate(torch.nonzero(valid).flatten().tolist()):
        for member in range(group_size):
            row = group * group_size + member
            batch.prompt_token_ids.append(prompt_token_ids[row])
            batch.completion_token_ids.append(completion_token_ids[row])
            batch.advantages.append(float(advantages[group, member]))
            batch.group_index.append(valid_index)
    return batch
