"""Batching: which rows of a rollout's update go into which optimizer step and forward.

Rows are the sequences of an `UpdateBatch`. An optimizer step takes whole groups
(`groups_per_update`); a micro-batch (one forward/backward) takes at most `micro_batch_size`
rows, whole groups when they fit so a group's prompt is forwarded once for all its completions.
A micro-batch is laid out padded or packed into one padding-free row (`logprobs`), whichever
`forward_cost` estimates cheaper: packing drops the padding but its attention is dense over the
row, so it loses when completions are long and many.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpogate.engines.rows import WIDTH_BUCKET, round_up
from grpogate.training.advantages import UpdateBatch
from grpogate.training.logprobs import PackedGroups, PackedRow, common_prefix_length, pack_groups, pack_row

LAYOUTS = ("auto", "padded", "packed")


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


@dataclass(frozen=True)
class ForwardShape:
    """Multiply-adds of a decoder forward: per token (all linear maps but the LM head), per
    attended (query, key) pair, per logit row; all over every layer."""

    per_token: int
    per_pair: int
    per_logit: int

    @classmethod
    def of(cls, config) -> "ForwardShape":
        hidden, layers = config.hidden_size, config.num_hidden_layers
        head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        per_layer = hidden * (2 * q + 2 * kv) + 3 * hidden * config.intermediate_size
        return cls(per_token=layers * per_layer, per_pair=layers * 2 * q,
                   per_logit=hidden * config.vocab_size)


def forward_cost(prompts: list[list[int]], completions: list[list[int]], shape: ForwardShape,
                 layout: str) -> int:
    """Multiply-adds of one forward of a micro-batch (one prompt per group) in `layout`.

    padded: n prompts of P columns (left-padded), then N completions of T - 1 columns attending
    to P + T - 1 keys, logits for all N x T; packed: one row of L positions, L x L attention
    (dense, as SDPA computes it), a logit per distinct predicting position.
    """
    n, total = len(prompts), len(completions)
    if layout == "padded":
        prompt_width = round_up(max(len(p) for p in prompts), WIDTH_BUCKET)
        width = round_up(max(1, max(len(c) for c in completions)), WIDTH_BUCKET)
        positions = n * prompt_width + total * (width - 1)
        pairs = n * prompt_width ** 2 + total * (width - 1) * (prompt_width + width - 1)
        logits = total * width
    else:
        shared = common_prefix_length(prompts)
        real = shared + sum(len(p) - shared for p in prompts) + sum(max(len(c) - 1, 0) for c in completions)
        positions = round_up(real, WIDTH_BUCKET)
        pairs = positions ** 2
        logits = sum(len(c) for c in completions) - sum(1 for c in completions if c) + n
    return positions * shape.per_token + pairs * shape.per_pair + logits * shape.per_logit


def pack_rows(batch: UpdateBatch, rows: list[int], pad_id: int, device, layout: str = "padded",
              shape: ForwardShape | None = None) -> PackedGroups | PackedRow:
    """Rows group-major, equal rows per prompt (`micro_batches`): one prompt per group, in
    `layout` ("auto": the cheaper by `forward_cost` under `shape`)."""
    per_prompt = rows_per_prompt(batch, rows)
    prompts = [batch.prompt_token_ids[i] for i in rows[::per_prompt]]
    completions = [batch.completion_token_ids[i] for i in rows]
    if layout == "auto":
        layout = min(("padded", "packed"),
                     key=lambda name: forward_cost(prompts, completions, shape, name))
    if layout == "packed":
        return pack_row(prompts, completions, per_prompt, pad_id, device)
    return pack_groups(prompts, completions, pad_id, device)


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
