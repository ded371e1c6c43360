"""The rollout bar moves as rows finish, not only when the whole batch is done."""

from __future__ import annotations

import torch

from grpogate.sampling.rollout import SamplingSettings, _decode_groups

EOS, VOCAB = 2, 4


class ScriptedStepper:
    """Row r (of the original batch) emits EOS at decode step r and token 0 before it."""

    def __init__(self):
        self.rows, self.step_index = [], 0

    def _logits(self) -> torch.Tensor:
        logits = torch.zeros(len(self.rows), VOCAB)  # [rows, V]
        for position, row in enumerate(self.rows):
            logits[position, EOS if row == self.step_index else 0] = 100.0
        return logits

    def prefill(self, prompts, pad_id, group_size, max_new_tokens, shared=None):
        self.rows = list(range(len(prompts) * group_size))
        return self._logits()

    def step(self, chosen):
        self.step_index += 1
        return self._logits()

    def select(self, keep):
        self.rows = [self.rows[i] for i in keep.tolist()]


def run(max_new_tokens: int):
    calls = []
    settings = SamplingSettings(max_new_tokens, temperature=1.0, top_p=1.0, batch_size=64)
    tokens, _ = _decode_groups(ScriptedStepper(), [[5, 6]], 4, settings, {EOS}, 0,
                               torch.Generator().manual_seed(0), torch.device("cpu"),
                               advance=calls.append)
    return tokens, calls


def test_each_finished_row_moves_the_bar_when_it_finishes():
    tokens, calls = run(max_new_tokens=8)
    # Rows finish at steps 0, 1, 2, 3: one advance per step, four rows in all.
    assert calls == [1, 1, 1, 1]
    assert tokens == [[EOS], [0, EOS], [0, 0, EOS], [0, 0, 0, EOS]]


def test_rows_cut_by_the_budget_are_reported_at_the_end():
    tokens, calls = run(max_new_tokens=2)
    # Steps 0 and 1 finish rows 0 and 1; rows 2 and 3 hit the 2-token budget: reported together.
    assert calls == [1, 1, 2]
    assert [len(t) for t in tokens] == [1, 2, 2, 2]
