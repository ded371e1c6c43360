"""How token rows are laid out for a forward, whichever engine runs it.

Padding widths and row counts are rounded to a few sizes (oneDNN on a CPU builds a kernel
for every new matrix shape, so a run should see a handful of shapes, not hundreds); prompts
are padded on the left for decoding; the tokens every prompt starts with are found once so
that an engine can forward them once.
"""

from __future__ import annotations

import inspect

import torch

# Prompt and completion widths are rounded up to this multiple, batch rows to ROW_BUCKET.
WIDTH_BUCKET = 16
ROW_BUCKET = 8


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def left_pad(sequences: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and attention mask [N, W], W rounded up to WIDTH_BUCKET, sequences flush right."""
    width = round_up(max(len(s) for s in sequences), WIDTH_BUCKET)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, width - len(sequence):] = torch.tensor(sequence, dtype=torch.long)
        attention_mask[row, width - len(sequence):] = 1
    return input_ids.to(device), attention_mask.to(device)


def cache_keyword(model) -> str:
    """transformers 5 calls the KV cache argument `cache`; 4.x called it `past_key_values`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def shared_prefix_length(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with, leaving each at least one token of its own. Not
    rounded: a forward of the prefix pads it to WIDTH_BUCKET columns itself, and rounding it
    down would widen every prompt's own part by up to WIDTH_BUCKET columns."""
    shortest = min(len(p) for p in prompts)
    length = 0
    while length < shortest - 1 and all(p[length] == prompts[0][length] for p in prompts):
        length += 1
    return length
