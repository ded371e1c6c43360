"""Rollback: the training state before a rollout's update, so a failed update leaves no trace.

An update is all or nothing (update.update_with_retry): any failure restores the trainable
parameters and the optimizer state from a `TrainingSnapshot`, and an out-of-memory error,
recognized by `is_out_of_memory` on any device, is retried once at half the micro-batch.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


@dataclass
class TrainingSnapshot:
    """CPU copies of the trainable parameters and the optimizer state before a rollout's update."""

    parameters: list[torch.Tensor]
    optimizer_state: dict

    @classmethod
    def take(cls, parameters, optimizer) -> "TrainingSnapshot":
        def to_cpu(value):
            if isinstance(value, torch.Tensor):
                return value.detach().to("cpu", copy=True)
            if isinstance(value, dict):
                return {key: to_cpu(item) for key, item in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(to_cpu(item) for item in value)
            return value

        return cls([p.detach().to("cpu", copy=True) for p in parameters],
                   to_cpu(optimizer.state_dict()))

    def restore(self, parameters, optimizer) -> None:
        with torch.no_grad():
            for parameter, saved in zip(parameters, self.parameters):
                parameter.copy_(saved.to(parameter.device))
        # load_state_dict keeps CPU tensors as they are; a deep copy keeps the snapshot intact
        # for a second restore after the retry.
        optimizer.load_state_dict(copy.deepcopy(self.optimizer_state))
        optimizer.zero_grad(set_to_none=True)


def is_out_of_memory(error: BaseException) -> bool:
    out_of_memory = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    return isinstance(error, out_of_memory) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower())


def first_line(error: BaseException) -> str:
    """An error as one line: its type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def release_cached_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
