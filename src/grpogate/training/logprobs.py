"""Log-probabilities of completion tokens under a model, without a full-vocabulary copy.

Two layouts of one micro-batch, held equal (values and gradients) to one whole forward per
sequence by tests (tests/reference_logprobs.py):
- `shared_prompt_logprobs` (padded): each group's prompt forwarded once, its KV cache reused by
  the group's G completions, right-padded to the longest completion (rounded up to 16);
- `packed_logprobs` (padding-free): the whole micro-batch in one row — the prompts' common
  prefix (system prompt, chat template) once, each group's prompt suffix once, then its
  completions — under a tree-shaped causal mask, positions restarting per sequence, logits
  only where a completion token is predicted.
Shapes: n groups, N = n * G sequences, P prompt columns (left-padded), T completion columns
(right-padded), L packed positions, M completion tokens.

The log-prob head (logsumexp over the vocabulary, its backward) runs on the native row kernels
where they are built for the logits (`engines.row_kernels`: a CPU, bfloat16 or float32): each row
of logits read twice forward and once backward, no float32 copy. Elsewhere it runs in torch,
`chunk` positions at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpogate.engines import engine_for, row_kernels
from grpogate.engines.rows import WIDTH_BUCKET, cache_keyword, left_pad, round_up


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
    """logits [N, T, V], token_ids [N, T] -> log-probs [N, T] of the chosen tokens: every
    position predicts its own token, so this is `picked_logprobs` over the N * T positions,
    N * chunk of them per float32 block (as much as `chunk` columns of all N rows). If
    `entropy` is a list, the detached entropy [N, T] of each position's distribution at
    `temperature` is appended to it."""
    rows, width, vocab = logits.shape
    flat = [] if entropy is not None else None
    values = picked_logprobs(logits.reshape(rows * width, vocab),
                             torch.arange(rows * width, device=logits.device),
                             token_ids.reshape(-1), temperature, rows * chunk, flat)
    if entropy is not None:
        entropy.append(flat[0].view(rows, width))
    return values.view(rows, width)


def picked_logprobs(logits: torch.Tensor, index: torch.Tensor, token_ids: torch.Tensor,
                    temperature: float, chunk: int,
                    entropy: list | None = None) -> torch.Tensor:
    """logits [U, V], index [M] into U, token_ids [M] -> log-probs [M] of token m at position
    index[m], as `token_logprobs` computes them (float32 chunks of `chunk` positions, one
    split), with each position's logsumexp computed once however many tokens it predicts:
    in a packed row the position before a group's completions predicts all G first tokens.
    If `entropy` is a list, the detached entropy [M] of each token's position is appended.

    On the native kernels where they apply (`NativeLogProbs`); otherwise in torch, `chunk`
    positions at a time: no full-vocabulary float32 copy of the logits is ever materialized.
    The chunks are one `split`, whose backward concatenates their gradients once; slicing each
    chunk out instead would give every chunk's backward a zero-filled gradient of the whole
    [U, V] to add into, a fill and an add over all the logits per chunk (docs/measurements.md,
    "Figures moved from code comments"). The chosen logit is taken
    from the float32 chunk, so its gradient and the normalizer's meet in float32 and are
    rounded to the logits' dtype once."""
    kernels = row_kernels(logits.dtype, logits.device)
    if kernels is not None:
        values, spread = NativeLogProbs.apply(logits.contiguous(), index, token_ids,
                                              temperature, kernels, entropy is not None)
        if entropy is not None:
            entropy.append(spread)
        return values
    order = torch.argsort(index, stable=True)
    ordered = index[order]  # ascending: each chunk's tokens are one slice of it
    starts = torch.arange(0, logits.shape[0] + chunk, chunk, device=index.device)
    bounds = torch.searchsorted(ordered, starts).tolist()
    pieces, entropies = [], []
    for c, block in enumerate(logits.split(chunk, dim=0)):
        lo, hi = bounds[c], bounds[c + 1]
        local = ordered[lo:hi] - c * chunk
        block = block.float() / temperature
        normalizer = torch.logsumexp(block, dim=-1)
        pieces.append(block[local, token_ids[order[lo:hi]]] - normalizer[local])
        if entropy is not None:
            entropies.append(block_entropy(block, normalizer)[local])
    values = torch.cat(pieces)
    if entropy is not None:
        spread = torch.cat(entropies)
        entropy.append(spread.new_zeros(index.shape).index_put((order,), spread))
    return values.new_zeros(index.shape).index_put((order,), values)  # back to M's order


class NativeLogProbs(torch.autograd.Function):
    """`picked_logprobs` on the native log-prob head. Forward: each row's logsumexp (and
    entropy) in float32 from the logits as they are; backward: the logits' gradient, each
    element (its chosen-token part and its normalizer part together) in float32, rounded to
    the logits' dtype once. The logits themselves are what it keeps for the backward."""

    @staticmethod
    def forward(ctx, logits, index, token_ids, temperature, kernels, want_entropy):
        lse, spread = kernels.row_logsumexp(logits, temperature, want_entropy)
        values = logits[index, token_ids].float() / temperature - lse[index]
        ctx.save_for_backward(logits, lse, index, token_ids)
        ctx.temperature, ctx.kernels = temperature, kernels
        picked = spread[index] if want_entropy else values.new_zeros(0)
        ctx.mark_non_differentiable(picked)
        return values, picked

    @staticmethod
    def backward(ctx, grad, _):
        logits, lse, index, token_ids = ctx.saved_tensors
        order = torch.argsort(index, stable=True)  # each row's tokens as one slice
        offsets = torch.searchsorted(index[order], torch.arange(logits.shape[0] + 1))
        out = ctx.kernels.logprob_backward(logits, lse, ctx.temperature, offsets, order,
                                           token_ids.contiguous(), grad.float().contiguous())
        return out, None, None, None, None, None


def block_entropy(block: torch.Tensor, normalizer: torch.Tensor) -> torch.Tensor:
    """Detached entropy of softmax(block) per position, from its logsumexp."""
    with torch.no_grad():
        return normalizer - (torch.softmax(block, dim=-1) * block).sum(-1)


@dataclass
class PackedGroups:
    """One prompt per group and its G completions (group-major), as padded tensors."""

    prompt_ids: torch.Tensor  # [n, P] left-padded
    prompt_mask: torch.Tensor  # [n, P]
    completion_ids: torch.Tensor  # [N, T] right-padded
    completion_mask: torch.Tensor  # [N, T] float, 1 on real tokens

    def forwarded_tokens(self) -> tuple[int, int]:
        """(positions one forward computes, padding included; the real ones among them): the
        prompt pass, then every completion's first T - 1 columns (the last is only predicted)."""
        width = self.completion_ids.shape[1] - 1
        real_inputs = (self.completion_mask.sum(1) - 1).clamp(min=0).sum()
        return (self.prompt_ids.numel() + self.completion_ids.shape[0] * width,
                int(self.prompt_mask.sum() + real_inputs))


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


def common_prefix_length(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with, leaving each at least one token of its own."""
    shortest = min(len(p) for p in prompts)
    length = 0
    while length < shortest - 1 and all(p[length] == prompts[0][length] for p in prompts):
        length += 1
    return length


@dataclass
class PackedRow:
    """A micro-batch as one padding-free row (`pack_row`); completions also as [N, T]."""

    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L] restarting at 0 for every prompt
    allowed: torch.Tensor  # [L, L] bool: query i may attend key j
    logit_positions: torch.Tensor  # [U] the positions whose next-token logits are needed
    logit_index: torch.Tensor  # [M] each completion token's predicting position, into U
    rows: torch.Tensor  # [M] each completion token's row in [N, T]
    columns: torch.Tensor  # [M] ... and column
    completion_ids: torch.Tensor  # [N, T] right-padded
    completion_mask: torch.Tensor  # [N, T] float, 1 on real tokens
    real_tokens: int  # positions of L that are not padding
    # (query start, query end, key positions [K]) per block of positions that attend alike:
    # the prefix (its own keys), each group (the prefix's and its own), the padding (its own).
    segments: tuple = ()

    def forwarded_tokens(self) -> tuple[int, int]:
        """(positions the forward computes, padding included; the real ones among them)."""
        return self.input_ids.numel(), self.real_tokens


def pack_row(prompts: list[list[int]], completions: list[list[int]], per_prompt: int,
             pad_id: int, device) -> PackedRow:
    """One row: [common prefix | suffix 1, its completions | suffix 2, ... | padding].

    Completion r of prompt g sees the prefix, suffix g and its own earlier tokens; padding
    (L rounded up to WIDTH_BUCKET, so a run sees few shapes) sees only padding. A completion's
    last token is never an input: it is only predicted.
    """
    shared = common_prefix_length(prompts)
    ids, positions = list(prompts[0][:shared]), list(range(shared))
    group, branch = [-1] * shared, [-1] * shared  # -1: shared by all groups / all branches
    predicted_at, rows, columns, spans = [], [], [], []
    for g, prompt in enumerate(prompts):
        spans.append(len(ids))
        ids += prompt[shared:]
        positions += range(shared, len(prompt))
        group += [g] * (len(prompt) - shared)
        branch += [-1] * (len(prompt) - shared)
        last = len(ids) - 1  # predicts every completion's first token
        for r in range(g * per_prompt, (g + 1) * per_prompt):
            completion, start = completions[r], len(ids)
            if not completion:
                continue
            inputs = completion[:-1]
            ids += inputs
            positions += range(len(prompt), len(prompt) + len(inputs))
            group += [g] * len(inputs)
            branch += [r] * len(inputs)
            predicted_at += [last] + list(range(start, start + len(inputs)))
            rows += [r] * len(completion)
            columns += range(len(completion))
    real = len(ids)
    spans.append(real)
    padding = round_up(real, WIDTH_BUCKET) - real
    ids += [pad_id] * padding
    positions += [0] * padding
    group += [-2] * padding
    branch += [-2] * padding
    g, b = torch.tensor(group), torch.tensor(branch)
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    shared_key = (g[None] == -1) & (g[:, None] != -2)  # [L, L]: the prefix, to real queries
    related = shared_key | ((g[None] == g[:, None]) & ((b[None] == -1) | (b[None] == b[:, None])))
    unique = sorted(set(predicted_at))
    where = {position: index for index, position in enumerate(unique)}
    completion_ids, completion_mask = right_pad(completions, pad_id, device)
    return PackedRow(
        input_ids=torch.tensor([ids], device=device),
        position_ids=torch.tensor([positions], device=device),
        allowed=(causal & related).to(device),
        logit_positions=torch.tensor(unique, device=device),
        logit_index=torch.tensor([where[p] for p in predicted_at], dtype=torch.long,
                                 device=device),
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        columns=torch.tensor(columns, dtype=torch.long, device=device),
        completion_ids=completion_ids, completion_mask=completion_mask, real_tokens=real,
        segments=_segments(shared, spans, len(ids), device))


def _segments(shared: int, starts: list[int], length: int, device) -> tuple:
    """`PackedRow.segments`: `starts` holds each group's first position, then the padding's."""
    def positions(*ranges):
        return torch.cat([torch.arange(a, b) for a, b in ranges]).to(device)

    blocks = [(0, shared, positions((0, shared)))] if shared else []
    blocks += [(a, b, positions((0, shared), (a, b))) for a, b in zip(starts, starts[1:])]
    if starts[-1] < length:
        blocks.append((starts[-1], length, positions((starts[-1], length))))
    return tuple(blocks)


def packed_logprobs(model, packed: PackedRow, temperature: float, chunk: int = 64,
                    entropy: list | None = None, engine=None) -> torch.Tensor:
    """Log-probs [N, T] of the completions (0 on padding), from one forward of `packed`'s row.

    The mask goes to the model as a 4D additive float mask, which transformers passes to the
    attention unchanged (eager and SDPA alike); with SDPA, `tree_attention` takes the call.
    `entropy`: see `token_logprobs`, [N, T] too. `engine`: the model's (default `engine_for`).
    """
    engine = engine or engine_for(model)
    dtype = next(model.parameters()).dtype
    mask = torch.zeros(packed.allowed.shape, dtype=dtype, device=packed.allowed.device)
    mask = mask.masked_fill(~packed.allowed, torch.finfo(dtype).min)[None, None]  # [1, 1, L, L]
    with engine.packed_attention(model, packed.segments):
        logits = model(input_ids=packed.input_ids, attention_mask=mask,
                       position_ids=packed.position_ids, use_cache=False,
                       logits_to_keep=packed.logit_positions).logits  # [1, U, V]
    targets = packed.completion_ids[packed.rows, packed.columns]  # [M]
    pieces = [] if entropy is not None else None
    values = picked_logprobs(logits.squeeze(0), packed.logit_index, targets, temperature, chunk,
                             pieces)  # [M]
    out = values.new_zeros(packed.completion_ids.shape)
    out = out.index_put((packed.rows, packed.columns), values)  # [N, T], differentiable
    if entropy is not None:
        entropy.append(out.detach().new_zeros(out.shape).index_put(
            (packed.rows, packed.columns), pieces[0]))
    return out


def micro_batch_logprobs(model, packed: PackedGroups | PackedRow, per_prompt: int,
                         temperature: float, entropy: list | None = None) -> torch.Tensor:
    """Log-probs [N, T] of a micro-batch in either layout (`batching.pack_rows` chooses), the
    forwards inside the engine's `update_forward` (the accelerator's: LoRA layers in the
    base's dtype, RMSNorms and SwiGLUs on the native kernels, where each applies)."""
    engine = engine_for(model)
    with engine.update_forward(model):
        if isinstance(packed, PackedRow):
            return packed_logprobs(model, packed, temperature, entropy=entropy, engine=engine)
        return shared_prompt_logprobs(model, packed, per_prompt, temperature, entropy=entropy)
