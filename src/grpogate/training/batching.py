"""Batching: which rows of a rollout's update go into which optimizer step and forward.

Rows are the sequences of an `UpdateBatch`. An optimizer step takes whole groups
(`groups_per_update`); a micro-batch (one forward/backward) takes at most `micro_batch_size`
rows, whole groups when they fit so a group's prompt is forwarded once for all its completions.
"""

from __future__ import annotations

import torch

from grpogate.training.advantages import UpdateBatch
from grpogate.training.logprobs import PackedGroups, pack_groups


def _chunks(indexes: list[int], size: int) -> list[list[int]]:
    return [indexes[i:i + size] for i in range(0, len(indexes), size)]


def step_plan(batch: UpdateBatch, groups_per_update: int) -> list[list[int]]:
    """Sequence indexes of each optimizer step of one pass, whole groups at a time."""
    groups = sorted(set(batch.group_index))
    per_step = groups_per_update or len(groups)
    plan = []
    for step_groups in _chunks(groups, per_step):
        wanted = set(step_groups)
        plan.append([i for i, g in enumerate(batch.group_index) if g in wanted])
    return plan


def micro_batches(batch: UpdateBatch, rows: list[int], micro_batch_size: int) -> list[list[int]]:
    """Rows per forward/backward, at most `micro_batch_size` of them (never more).

    A micro-batch holds whole groups when a group fits (they share one prompt forward), groups
    of similar longest completion together so little compute goes to padding; when a group is
    larger than the micro-batch its completions are split into slices, each forwarded with
    its own copy of the prompt. Every micro-batch is group-major with equal rows per prompt.
    """
    members: dict[int, list[int]] = {}
    for index in rows:
        members.setdefault(batch.group_index[index], []).append(index)
    groups = sorted(members.values(),
                    key=lambda group: max(len(batch.completion_token_ids[i]) for i in group))
    if micro_batch_size < batch.group_size:
        return [piece for group in groups for piece in _chunks(group, micro_batch_size)]
    per_micro = micro_batch_size // batch.group_size
    return [[i for group in groups[k:k + per_micro] for i in group]
            for k in range(0, len(groups), per_micro)]


def rows_per_prompt(batch: UpdateBatch, rows: list[int]) -> int:
    return len(rows) // len({batch.group_index[i] for i in rows})


def pack_rows(batch: UpdateBatch, rows: list[int], pad_id: int, device) -> PackedGroups:
    """Rows group-major, equal rows per prompt (`micro_batches`): one prompt per group."""
    per_prompt = rows_per_prompt(batch, rows)
    return pack_groups([batch.prompt_token_ids[i] for i in rows[::per_prompt]],
                       [batch.completion_token_ids[i] for i in rows], pad_id, device)


def padded_rows(rows: list[int], values: dict[int, list] | list, fill: torch.Tensor) -> torch.Tensor:
    """Each row's values over a copy of `fill` [N, T] (padded positions keep `fill`'s)."""
    out = fill.detach().clone()
    for row, index in enumerate(rows):
        row_values = values[index]
        row_values = (row_values if isinstance(row_values, torch.Tensor)
                      else torch.tensor(row_values, dtype=out.dtype, device=out.device))
        row_values = row_values[:out.shape[1]]
        out[row, :row_values.shape[0]] = row_values
    return out
