"""Log-probabilities of completion tokens under a model, without a full-vocabulary copy.

`shared_prompt_logprobs` forwards each group's prompt once and reuses its KV cache for the
group's G completions; a test holds it equal (values and gradients) to one whole forward per
sequence (tests/reference_logprobs.py).
Shapes: n groups, N = n * G sequences, P prompt columns (left-padded), T completion columns
(right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpogate.sampling.decoding import WIDTH_BUCKET, cache_keyword, left_pad, round_up


def right_pad(sequences: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [N, W] and float mask [N, W], W rounded up to WIDTH_BUCKET, sequences flush left."""
    width = round_up(max(1, max(len(s) for s in sequences)), WIDTH_BUCKET)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.float32)
    for row, sequence in enumerate(sequences):
        if sequence:
            ids[row, :len(sequence)] = torch.tensor(sequence)
            mask[row, :len(sequence)] = 1
    return ids.to(device), mask.to(device)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float,
                    chunk: int, entropy: list | None = None) -> torch.Tensor:
    """logits [N, T, V], token_ids [N, T] -> log-probs [N, T] of the chosen tokens.

    The chosen token's logit minus a logsumexp, chunk by chunk over the sequence: no
    full-vocabulary log-softmax copy of the batch is ever materialized. If `entropy` is a list,
    the detached entropy [N, T] of each position's distribution at `temperature` is appended to
    it (logsumexp - sum p * z, computed from the same chunk: no second pass over the logits).
    """
    pieces, entropies = [], []
    for start in range(0, token_ids.shape[1], chunk):
        block = logits[:, start:start + chunk].float() / temperature
        chosen = block.gather(-1, token_ids[:, start:start + chunk, None]).squeeze(-1)
        normalizer = torch.logsumexp(block, dim=-1)
        pieces.append(chosen - normalizer)
        if entropy is not None:
            with torch.no_grad():
                entropies.append(normalizer - (torch.softmax(block, dim=-1) * block).sum(-1))
    if entropy is not None:
        entropy.append(torch.cat(entropies, dim=1))
    return torch.cat(pieces, dim=1)


@dataclass
class PackedGroups:
    """One prompt per group and its G completions (group-major), as padded tensors."""

    prompt_ids: torch.Tensor  # [n, P] left-padded
    prompt_mask: torch.Tensor  # [n, P]
    completion_ids: torch.Tensor  # [N, T] right-padded
    completion_mask: torch.Tensor  # [N, T] float, 1 on real tokens


def pack_groups(prompts: list[list[int]], completions: list[list[int]], pad_id: int,
                device) -> PackedGroups:
    """Widths rounded up to WIDTH_BUCKET."""
    return PackedGroups(*left_pad(prompts, pad_id, device), *right_pad(completions, pad_id, device))


def shared_prompt_logprobs(model, packed: PackedGroups, group_size: int, temperature: float,
                           chunk: int = 64, entropy: list | None = None) -> torch.Tensor:
    """Log-probs [n * G, T] of the completions, the prompt forwarded once per group.

    `group_size` is the completions per prompt in this pack: a group's G, or fewer when a
    micro-batch smaller than a group carries a slice of one. `entropy`: see `token_logprobs`.

    All G completions of a group share one prompt, so the prompt runs once (with gradient) and
    its KV cache is repeated G times for the completion pass; gradients flow back through the
    cache into the prompt positions, so the result equals one forward per sequence (tested), at
    P + G*T instead of G*(P + T) tokens per group.
    """
    from transformers import DynamicCache

    prompt_ids, prompt_mask = packed.prompt_ids, packed.prompt_mask
    completion_ids, completion_mask = packed.completion_ids, packed.completion_mask
    keyword = cache_keyword(model)
    position_ids = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # [n, P]
    cache = DynamicCache(config=model.config)
    prompt_out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids,
                       use_cache=True, logits_to_keep=1, **{keyword: cache})
    first_logits = prompt_out.logits[:, -1:].repeat_interleave(group_size, dim=0)  # [N, 1, V]
    cache.batch_repeat_interleave(group_size)
    width = completion_ids.shape[1]
    repeated_mask = prompt_mask.repeat_interleave(group_size, dim=0)  # [N, P]
    attention_mask = torch.cat([repeated_mask, completion_mask[:, :width - 1].long()], dim=1)
    start = position_ids[:, -1:].repeat_interleave(group_size, dim=0) + 1  # [N, 1]
    completion_positions = start + torch.arange(width - 1, device=start.device)[None]  # [N, T-1]
    if width > 1:
        rest = model(input_ids=completion_ids[:, :-1], attention_mask=attention_mask,
                     position_ids=completion_positions, use_cache=True, **{keyword: cache}).logits
        logits = torch.cat([first_logits, rest], dim=1)  # [N, T, V]
    else:
        logits = first_logits
    return token_logprobs(logits, completion_ids, temperature, chunk, entropy)
