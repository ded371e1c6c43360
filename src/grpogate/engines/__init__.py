"""The engines: the forwards that sample, score and train a policy, behind one interface.

Everything above this package (sampling, training, the re-test, replay, delivery) reaches a
model's forward through `engine_for(model)` and the `Engine` it returns, and through
`row_kernels` for the operations on logits rows; nothing above imports an engine's modules.

- `reference.ReferenceEngine`: the model's own transformers/PEFT forward, unpatched, for any
  causal LM. It is the truth the contract suite (tests/test_engine_contract.py) holds every
  other engine to.
- `cpu.CpuEngine`: the CPU accelerator, for the models its capability check accepts
  (cpu/capability.py reads the loaded model's structure and settings, never its name).

`engine_for` picks the accelerator where it accepts the model and the reference engine
otherwise, and the engine's `identity()` (its name and, for the reference, why the accelerator
declined) goes into every run's evidence.

The sampling contract sits above the engines, in sampling/rollout.py: every completion's
tokens are drawn by inverse CDF from the engine's next-token logits with a generator seeded
per (prompt, sample), so a completion depends on its own prompt and seed only, whichever
batch, rank or engine computes it; an engine supplies the logits (`Stepper`). A future engine
that samples inside itself (vLLM, SGLang) maps onto this interface as docs/design.md
("Engines") describes.
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager
from functools import lru_cache
from typing import Protocol

import torch

from grpogate.engines.adapters import adapters_disabled
from grpogate.engines.cpu import CpuEngine, accepts
from grpogate.engines.cpu.capability import describe
from grpogate.engines.cpu.native import NativeKernels, kernels_identity, native_kernels
from grpogate.engines.cpu.weights import can_prepack, linear, prepack
from grpogate.engines.reference import ReferenceEngine

__all__ = ["Engine", "Scorer", "Stepper", "adapters_disabled", "engine_for", "expected_engine",
           "kernels_identity", "product", "product_weights", "row_kernels"]


class Stepper(Protocol):
    """A decode forward: the logits the sampler draws from, one token per row per step."""

    name: str  # recorded as each step's decode path
    holds_weights: bool  # True: it reads its own copy of the weights and has fresh() -> a new
    # stepper on that copy (the re-test decodes the baseline in lockstep with it)

    def prefill(self, prompts: list[list[int]], pad_id: int, group_size: int,
                max_new_tokens: int, shared: int | None = None) -> torch.Tensor:
        """Prompts -> next-token logits [N, V] for N = len(prompts) * group_size rows, each
        prompt's group_size rows in a row; `shared`: prefix tokens to forward once."""

    def step(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The rows' sampled tokens [N] -> their next-token logits [N, V]."""

    def select(self, keep: torch.Tensor) -> None:
        """Keep only rows `keep` (sorted indices) from now on."""


class Scorer(Protocol):
    """A teacher-forced forward: the logits at every completion token, all positions at once."""

    holds_weights: bool  # True: it keeps the weights it was built on; else it reads the model's

    def __call__(self, groups: list[tuple[list[int], list[list[int]]]],
                 pad_id: int) -> list[list[torch.Tensor]]:
        """[(a prompt's tokens, its completions)] -> per prompt, one [len(completion), V]
        tensor of next-token logits per completion."""


class Engine(Protocol):
    name: str
    declined: str  # why the accelerator declined the model ("" where it did not)

    def stepper(self, model) -> Stepper:
        """The decode forward on `model`'s weights as they are now."""

    def scorer(self, model, prefix: list[int]) -> Scorer:
        """The teacher-forced forward on `model`'s weights; `prefix`: tokens every scored
        prompt starts with."""

    def update_forward(self, model) -> AbstractContextManager:
        """The update's forwards of `model` (with gradients) run inside this block."""

    def packed_attention(self, model, segments) -> AbstractContextManager:
        """The forward of one packed row of `segments` runs inside this block."""

    def identity(self) -> dict:
        """{"name", "declined"}: what the evidence records."""


def engine_for(model) -> Engine:
    """The accelerator where its capability check accepts `model`, else the reference (said
    once on the terminal per reason)."""
    found = accepts(model)
    if not isinstance(found, str):
        return CpuEngine(found)
    _say(f"cpu accelerator: {found}")
    return ReferenceEngine(f"cpu accelerator: {found}")


def expected_engine(model) -> dict:
    """The engine `engine_for` will pick, read from a weightless (meta-device) copy of the
    model before any weight loads: its structure and settings decide here; the probe of its
    mathematics (cpu/probe.py) needs the loaded weights and can still decline at load."""
    found = describe(model)
    if isinstance(found, str):
        return {"name": ReferenceEngine.name, "declined": f"cpu accelerator: {found}"}
    return {"name": CpuEngine.name, "declined": "",
            "note": "from the model's structure; the probe on the loaded weights confirms it"}


@lru_cache(maxsize=16)
def _say(declined: str) -> None:
    print(f"grpogate: engine: reference ({declined})", file=sys.stderr)


def product_weights(weight: torch.Tensor):
    """`weight` [out, in] in the layout the decoder's products read (prepacked where the
    kernels take a packed form), for `product`."""
    return prepack(weight) if can_prepack(weight) else weight


def product(rows: torch.Tensor, weights) -> torch.Tensor:
    """rows @ weights.T through the decoder's own matrix-product kernel: what the dry run's
    forecast times on this machine."""
    return linear(rows, weights, None)


def row_kernels(dtype: torch.dtype, device) -> NativeKernels | None:
    """The native operations on rows of logits (the sampler's draw, log-sum-exp and entropy,
    KL between two rows, the log-prob head's forward and backward) for tensors of `dtype` on
    `device`, or None where they do not build or apply: callers then run torch's. They read
    logits only, so they serve every engine."""
    return native_kernels(dtype, device)
