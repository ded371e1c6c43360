"""Reward functions written for TRL's `reward_funcs`, used unchanged by the tests under TRL's
GRPOTrainer and under `grpogate run` (as `trl_style_rewards:NAME`)."""

from __future__ import annotations

import time


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def parity_reward(prompts, completions, **kwargs):
    """1 for a completion of odd character length, else 0: splits most groups of a random model."""
    return [float(len(_text(c)) % 2) for c in completions]


def short_answer_reward(prompts, completions, reference, **kwargs):
    """1 when the completion is at most 20 characters, 0 when longer; None ("not applicable")
    when the problem has no reference answer."""
    return [None if not ref else float(len(_text(c)) <= 20)
            for c, ref in zip(completions, reference)]


def echoes_the_question(prompts, completions, **kwargs):
    """1 when the completion contains the user's question text (shows what `prompts` holds)."""
    return [float(p[-1]["content"] in _text(c)) for p, c in zip(prompts, completions)]


def slow_reward(prompts, completions, **kwargs):
    time.sleep(5)
    return [1.0 for _ in completions]
