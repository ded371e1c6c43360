"""Teacher-forced logits on the lean decoder's weights: the forward the re-test's drift runs.

Sampling (decoding.LeanStepper) decodes one token per step; measuring how far a candidate moved
from the baseline needs each policy's full next-token distribution at every token of given
completions, all positions at once. `LeanScorer` runs that forward with the decoder's own
layers, shares what every sequence shares, and batches prompts so that a prompt's numbers do
not depend on which prompts share its forward (`tiled_linear`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grpogate.sampling.decoding import (MASKED, WIDTH_BUCKET, causal_mask, decoder_layers,
                                       decoder_logits, round_up)
from grpogate.sampling.lean_weights import LeanDecoder, linear

SCORE_GROUPS = 16  # prompts per teacher-forced forward of LeanScorer
SCORE_TILE = 128  # rows per matrix product in LeanScorer


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 tile: int = SCORE_TILE) -> torch.Tensor:
    """`linear` on x's rows in products of exactly `tile` rows (the last one zero-padded).

    The CPU's matmul kernels round a row differently at another row count (measured with
    oneDNN's bfloat16 kernels: a row's result at 16 rows differs from the same row's at 48, 64
    or 256), but at one row count a row's result depends neither on its place nor on the other
    rows; so with every product `tile` rows, a row computes the same numbers in any batch."""
    flat = x.reshape(-1, x.shape[-1])
    count = flat.shape[0]
    whole = count - count % tile
    pieces = [linear(flat[i:i + tile], weight, bias) for i in range(0, whole, tile)]
    if whole < count:  # only the last tile is copied, to be padded
        last = torch.cat([flat[whole:], flat.new_zeros(tile - (count - whole), flat.shape[1])])
        pieces.append(linear(last, weight, bias)[:count - whole])
    out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    return out.view(*x.shape[:-1], out.shape[-1])


class LeanScorer:
    """Teacher-forced logits on the lean decoder's weights: the drift's forward (drift.py).

    The prefix every scored sequence shares is forwarded once, at batch 1, when the scorer is
    built. `score(groups)` takes prompts (their tokens after that prefix) with their
    completions; each prompt's own tokens, left-padded to a WIDTH_BUCKET multiple, are
    forwarded once, attending to the prefix, and its completions, right-padded likewise, attend
    to both. It returns each completion's next-token logits at its own tokens (the first
    predicted by the prompt's last position): the model's forward on each whole sequence, with
    the LM head on those positions alone. A small forward costs what reading every weight
    costs, so up to SCORE_GROUPS prompts go through one forward: prompts of one padded shape,
    every matrix product in tiles of one row count (`tiled_linear`) — so a prompt computes the
    same numbers whichever prompts share its forward (a rank's shard and one process agree bit
    for bit; tested).
    """

    def __init__(self, decoder: LeanDecoder, prefix: list[int]):
        self.decoder, self.prefix = decoder, len(prefix)
        self.cache = None
        if prefix:
            self.cache = self._forward([prefix], [0], None, keep=True)[1]

    def _forward(self, rows: list[list[int]], starts: list[int], cache, keep: bool = False,
                 pad_id: int = 0, owner: torch.Tensor | None = None):
        """rows padded to a WIDTH_BUCKET multiple (left with `keep`, else right), row r's first
        token at position starts[r], attending to its `owner[r]`'s entry of `cache` (every
        row to the one entry without `owner`) -> (hidden [n, W, D], with `keep` the cache
        extended by the rows' own keys, values and additive mask, else None)."""
        dec, n = self.decoder, len(rows)
        device = dec.embed.device
        width = round_up(max(len(r) for r in rows), WIDTH_BUCKET)
        ids = torch.full((n, width), pad_id, dtype=torch.long)
        real = torch.zeros((n, width), dtype=torch.long)
        for row, tokens in enumerate(rows):
            where = slice(width - len(tokens), width) if keep else slice(0, len(tokens))
            ids[row, where] = torch.tensor(tokens, dtype=torch.long)
            real[row, where] = 1
        real = real.to(device)
        offsets = (real.cumsum(-1) - 1).clamp(min=0) if keep else torch.arange(width, device=device)
        cos, sin = dec.rotary(dec.embed[:1], torch.tensor(starts, device=device)[:, None] + offsets)

        def earlier(tensor):
            return tensor.expand(n, *tensor.shape[1:]) if owner is None else tensor[owner]

        mask = causal_mask(real)  # [n, W, W]
        if cache is not None:
            mask = torch.cat([earlier(cache[2])[:, None].expand(-1, width, -1), mask], dim=-1)
        keys, values = [], []

        def attend(index, k, v):
            k_t, v = k.permute(0, 2, 3, 1), v.transpose(1, 2)
            if cache is not None:
                k_t = torch.cat([earlier(cache[0][index]), k_t], dim=-1)
                v = torch.cat([earlier(cache[1][index]), v], dim=-2)
            keys.append(k_t)
            values.append(v)
            return k_t, v

        hidden = decoder_layers(dec, F.embedding(ids.to(device), dec.embed), cos[:, :, None],
                         sin[:, :, None], mask, attend, tiled_linear)
        if not keep:
            return hidden, None
        own_mask = torch.where(real.bool(), 0.0, MASKED)
        return hidden, (keys, values, own_mask if cache is None else
                        torch.cat([earlier(cache[2]), own_mask], dim=-1))

    @torch.no_grad()
    def score(self, groups: list[tuple[list[int], list[list[int]]]], pad_id: int
              ) -> list[list[torch.Tensor]]:
        """[(a prompt's tokens after the prefix (at least one), its completions)] -> per prompt,
        one [len(completion), V] tensor of next-token logits per completion."""
        shapes: dict[tuple[int, int], list[int]] = {}
        for index, (suffix, completions) in enumerate(groups):
            width = round_up(max([len(c) - 1 for c in completions] + [1]), WIDTH_BUCKET)
            shapes.setdefault((round_up(len(suffix), WIDTH_BUCKET), width), []).append(index)
        results: list = [None] * len(groups)
        for members in shapes.values():
            for start in range(0, len(members), SCORE_GROUPS):
                chunk = members[start:start + SCORE_GROUPS]
                scored = self._score_alike([groups[i] for i in chunk], pad_id)
                for index, logits in zip(chunk, scored):
                    results[index] = logits
        return results

    def _score_alike(self, groups: list, pad_id: int) -> list[list[torch.Tensor]]:
        """`score` for prompts of one padded own width and one padded completion width."""
        suffixes = [suffix for suffix, _ in groups]
        own, cache = self._forward(suffixes, [self.prefix] * len(groups), self.cache, keep=True,
                                   pad_id=pad_id)
        parts = [own[:, -1]]  # [n, D]: each prompt's first-token prediction
        rows = [(g, c) for g, (_, completions) in enumerate(groups) for c in completions]
        if any(len(c) > 1 for _, c in rows):
            owner = torch.tensor([g for g, _ in rows], device=own.device)
            hidden, _ = self._forward([c[:-1] or [pad_id] for _, c in rows],
                                      [self.prefix + len(suffixes[g]) for g, _ in rows], cache,
                                      pad_id=pad_id, owner=owner)
            row_of = torch.cat([torch.full((len(c) - 1,), r, dtype=torch.long)
                                for r, (_, c) in enumerate(rows) if len(c) > 1])
            column = torch.cat([torch.arange(len(c) - 1) for _, c in rows if len(c) > 1])
            parts.append(hidden[row_of.to(own.device), column.to(own.device)])
        # [n + sum(len - 1), V]
        logits = decoder_logits(self.decoder, torch.cat(parts), tiled_linear)
        firsts = logits[:len(groups)]
        rests = iter(logits[len(groups):].split([max(len(c) - 1, 0) for _, c in rows]))
        return [[torch.cat([firsts[g:g + 1], next(rests)])[:len(c)] for c in completions]
                for g, (_, completions) in enumerate(groups)]
