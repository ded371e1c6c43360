"""Teacher-forced logits on the lean decoder's weights: the forward the re-test's drift runs.

Sampling (decoding.LeanStepper) decodes one token per step; measuring how far a candidate moved
from the baseline needs each policy's full next-token distribution at every token of given
completions, all positions at once. `LeanScorer` runs that forward with the decoder's own
layers, shares what every sequence shares, and batches prompts so that a prompt's numbers do
not depend on which prompts share its forward (`tiled_linear`).
"""

from __future__ import annotations

import torch

from grpogate.engines.cpu.layers import (MASKED, PROMPTS_PER_FORWARD, chunks_by_shape,
                                        decoder_logits, forward_tokens, prefix_forward,
                                        tiled_linear)
from grpogate.engines.rows import WIDTH_BUCKET, round_up
from grpogate.engines.cpu.weights import LeanDecoder


class LeanScorer:
    """Teacher-forced logits on the lean decoder's weights: the drift's forward (drift.py).

    The prefix every scored sequence shares is forwarded once, at batch 1, when the scorer is
    built. `score(groups)` takes prompts (their tokens after that prefix) with their
    completions and packs each prompt into one row: its own tokens, then every completion's
    tokens but the last, right-padded to a WIDTH_BUCKET multiple (`packed_row`). Each
    completion attends to the prefix, the prompt's tokens and its own earlier tokens, at the
    positions it has in its own sequence, so the row computes the model's forward on every
    whole sequence at once while the prompt's tokens are forwarded once, and no completion is
    padded to its longest sibling. The LM head runs on the positions that predict a completion
    token alone. A small forward costs what reading every weight costs, so prompts whose rows
    have one padded width go through one forward, up to PROMPTS_PER_FORWARD of them and
    ATTENTION_BUDGET score elements (`layers.forward_tokens`, every matrix product in tiles of
    one row count) — so a prompt computes the same numbers whichever prompts share its forward
    (a rank's shard and one process agree bit for bit; tested).
    """

    holds_weights = True  # its decoder's fused copies: valid after the model's weights change

    def __init__(self, decoder: LeanDecoder, prefix: list[int]):
        self.decoder, self.prefix = decoder, len(prefix)
        self.cache = None
        if prefix:
            self.cache = prefix_forward(decoder, prefix)

    def __call__(self, groups: list[tuple[list[int], list[list[int]]]], pad_id: int
                 ) -> list[list[torch.Tensor]]:
        """The `Scorer` interface (engines/__init__.py): whole prompts, each starting with the
        prefix the scorer was built on."""
        return self.score([(prompt[self.prefix:], completions) for prompt, completions in groups],
                          pad_id)

    @torch.no_grad()
    def score(self, groups: list[tuple[list[int], list[list[int]]]], pad_id: int
              ) -> list[list[torch.Tensor]]:
        """[(a prompt's tokens after the prefix (at least one), its completions)] -> per prompt,
        one [len(completion), V] tensor of next-token logits per completion."""
        rows = [packed_row(suffix, completions) for suffix, completions in groups]
        widths = [round_up(len(tokens), WIDTH_BUCKET) for tokens, _ in rows]
        context = round_up(self.prefix, WIDTH_BUCKET) if self.prefix else 0
        results: list = [None] * len(groups)
        for chunk in chunks_by_shape(widths, lambda width: max(1, min(
                PROMPTS_PER_FORWARD, ATTENTION_BUDGET // (width * (context + width))))):
            scored = self._score_alike([rows[i] for i in chunk], [groups[i] for i in chunk],
                                       widths[chunk[0]], pad_id)
            for index, logits in zip(chunk, scored):
                results[index] = logits
        return results

    def _score_alike(self, rows: list, groups: list, width: int, pad_id: int
                     ) -> list[list[torch.Tensor]]:
        """`score` for prompts whose packed rows have one padded `width`."""
        device = self.decoder.embed.device
        n = len(rows)
        ids = torch.full((n, width), pad_id, dtype=torch.long)
        positions = torch.zeros((n, width), dtype=torch.long)
        segment = torch.full((n, width), -1, dtype=torch.long)  # 0 prompt, k completion k
        picks = []  # (row, column) of every position whose prediction is kept, in output order
        for r, ((tokens, layout), (suffix, completions)) in enumerate(zip(rows, groups)):
            ids[r, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            positions[r, :len(suffix)] = torch.arange(len(suffix))
            segment[r, :len(suffix)] = 0
            for k, (column, length) in enumerate(layout, start=1):
                positions[r, column:column + length] = len(suffix) + torch.arange(length)
                segment[r, column:column + length] = k
            picks.append((r, len(suffix) - 1))
            picks += [(r, column + j) for column, length in layout for j in range(length)]
        positions += self.prefix
        hidden, _ = forward_tokens(self.decoder, ids, positions.to(device),
                                   segment_mask(segment).to(device), self.cache)
        where = torch.tensor(picks, dtype=torch.long, device=device)
        logits = decoder_logits(self.decoder, hidden[where[:, 0], where[:, 1]], tiled_linear)
        out, at = [], 0
        for (_, layout), (_, completions) in zip(rows, groups):
            first = logits[at:at + 1]
            at += 1
            mine = []
            for (_, length), completion in zip(layout, completions):
                mine.append(torch.cat([first, logits[at:at + length]])[:len(completion)])
                at += length
            out.append(mine)
        return out


# Attention score elements (query x key columns, per head) one packed forward may hold: with
# SmolLM2's 9 heads about 150 MB of float32 scores. The default re-test's rows (64 columns
# after a 64-column prefix) fit 16 to a forward (PROMPTS_PER_FORWARD); a row of 8 completions
# of 256 tokens (2,048 columns) goes alone.
ATTENTION_BUDGET = 1 << 22


def packed_row(suffix: list[int], completions: list[list[int]]
               ) -> tuple[list[int], list[tuple[int, int]]]:
    """A prompt's tokens then each completion's tokens but its last (the last only predicted)
    -> (the row's tokens, (first column, length) of each completion's block)."""
    tokens, layout = list(suffix), []
    for completion in completions:
        fed = completion[:-1]
        layout.append((len(tokens), len(fed)))
        tokens += fed
    return tokens, layout


def segment_mask(segment: torch.Tensor) -> torch.Tensor:
    """[n, W] segment ids (0 the prompt, k > 0 completion k, -1 padding) -> additive mask
    [n, W, W]: causal, each completion sees the prompt and itself, the prompt itself alone.
    A padding query still attends to itself, so its (unused) output stays finite."""
    width = segment.shape[1]
    query, key = segment[:, :, None], segment[:, None, :]
    causal = torch.ones((width, width), dtype=torch.bool).tril()
    allowed = causal & ((key == query) | (key == 0)) & (query >= 0)
    allowed |= torch.eye(width, dtype=torch.bool)
    return torch.where(allowed, 0.0, MASKED)
