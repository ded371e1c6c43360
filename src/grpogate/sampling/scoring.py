"""Teacher-forced logits on the lean decoder's weights: the forward the re-test's drift runs.

Sampling (decoding.LeanStepper) decodes one token per step; measuring how far a candidate moved
from the baseline needs each policy's full next-token distribution at every token of given
completions, all positions at once. `LeanScorer` runs that forward with the decoder's own
layers, shares what every sequence shares, and batches prompts so that a prompt's numbers do
not depend on which prompts share its forward (`tiled_linear`).
"""

from __future__ import annotations

import torch

from grpogate.sampling.layers import (WIDTH_BUCKET, chunks_by_shape, decoder_logits,
                                     forward_rows, round_up, tiled_linear)
from grpogate.sampling.lean_weights import LeanDecoder


class LeanScorer:
    """Teacher-forced logits on the lean decoder's weights: the drift's forward (drift.py).

    The prefix every scored sequence shares is forwarded once, at batch 1, when the scorer is
    built. `score(groups)` takes prompts (their tokens after that prefix) with their
    completions; each prompt's own tokens, left-padded to a WIDTH_BUCKET multiple, are
    forwarded once, attending to the prefix, and its completions, right-padded likewise, attend
    to both. It returns each completion's next-token logits at its own tokens (the first
    predicted by the prompt's last position): the model's forward on each whole sequence, with
    the LM head on those positions alone. A small forward costs what reading every weight
    costs, so up to PROMPTS_PER_FORWARD prompts of one padded shape go through one forward
    (`layers.forward_rows`, every matrix product in tiles of one row count) — so a prompt
    computes the same numbers whichever prompts share its forward (a rank's shard and one
    process agree bit for bit; tested).
    """

    def __init__(self, decoder: LeanDecoder, prefix: list[int]):
        self.decoder, self.prefix = decoder, len(prefix)
        self.cache = None
        if prefix:
            self.cache = forward_rows(decoder, [prefix], [0], None, keep=True)[1]

    @torch.no_grad()
    def score(self, groups: list[tuple[list[int], list[list[int]]]], pad_id: int
              ) -> list[list[torch.Tensor]]:
        """[(a prompt's tokens after the prefix (at least one), its completions)] -> per prompt,
        one [len(completion), V] tensor of next-token logits per completion."""
        shapes = [(round_up(len(suffix), WIDTH_BUCKET),
                   round_up(max([len(c) - 1 for c in completions] + [1]), WIDTH_BUCKET))
                  for suffix, completions in groups]
        results: list = [None] * len(groups)
        for chunk in chunks_by_shape(shapes):
            for index, logits in zip(chunk, self._score_alike([groups[i] for i in chunk],
                                                              pad_id)):
                results[index] = logits
        return results

    def _score_alike(self, groups: list, pad_id: int) -> list[list[torch.Tensor]]:
        """`score` for prompts of one padded own width and one padded completion width."""
        suffixes = [suffix for suffix, _ in groups]
        own, cache = forward_rows(self.decoder, suffixes, [self.prefix] * len(groups), self.cache,
                                  keep=True, pad_id=pad_id)
        parts = [own[:, -1]]  # [n, D]: each prompt's first-token prediction
        rows = [(g, c) for g, (_, completions) in enumerate(groups) for c in completions]
        if any(len(c) > 1 for _, c in rows):
            owner = torch.tensor([g for g, _ in rows], device=own.device)
            hidden, _ = forward_rows(self.decoder, [c[:-1] or [pad_id] for _, c in rows],
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
