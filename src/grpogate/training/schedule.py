"""The learning rate of each training step: TRL's (transformers') schedules, stepped per rollout.

    rate(step) = learning_rate x factor(step),  step = 0 .. steps - 1
    W = ceil(warmup_ratio x steps)

    warmup (step < W):  factor = step / W    (the first step's rate is 0, as in transformers)
    constant:           factor = 1
    constant_with_warmup: 1 after the warmup
    linear:             factor = (steps - step) / (steps - W)
    cosine:             factor = (1 + cos(pi x (step - W) / (steps - W))) / 2

transformers steps its scheduler once per optimizer step; here the factor is a function of the
rollout step, and every optimizer step of one rollout (num_iterations, groups_per_update) takes
that step's rate. So the rate needs no state of its own: a resumed run or a torchrun shard
computes the same rate at the same step, and each step record carries the rate it used.
Pure arithmetic: no torch.
"""

from __future__ import annotations

import math

from grpogate.config.schema import LR_SCHEDULER_TYPES, RunConfig


def warmup_steps(steps: int, warmup_ratio: float) -> int:
    """transformers' rounding: the warmup is ceil(ratio x steps) steps."""
    return math.ceil(warmup_ratio * steps)


def rate_factor(step: int, steps: int, kind: str,
                warmup_ratio: float = RunConfig.warmup_ratio) -> float:
    """The multiplier of `learning_rate` at training step `step` (0-based) of `steps`."""
    if kind not in LR_SCHEDULER_TYPES:
        raise ValueError(f"lr_scheduler_type must be one of {', '.join(LR_SCHEDULER_TYPES)} "
                         f"(got {kind!r})")
    warmup = warmup_steps(steps, warmup_ratio) if kind != "constant" else 0
    if step < warmup:
        return step / warmup
    if kind in ("constant", "constant_with_warmup"):
        return 1.0
    progress = (step - warmup) / max(1, steps - warmup)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def learning_rate_at(step: int, config) -> float:
    """The rate a run with this RunConfig trains at in training step `step`."""
    return config.learning_rate * rate_factor(step, config.steps, config.lr_scheduler_type,
                                              config.warmup_ratio)
