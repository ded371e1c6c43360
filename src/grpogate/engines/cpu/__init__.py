"""The CPU accelerator: a second form of the supported decoder (capability.py), built for speed.

Decoding runs the lean decoder (decoding.py: fused and prepacked weights, one KV cache
allocated per rollout, the native decode step); scoring runs its teacher-forced forward
(scoring.py); the update runs the model's forward with its LoRA layers in the base dtype, its
RMSNorms and SwiGLUs on the native kernels and, in bfloat16, the packed row's attention with a
backward by matrix products (lora_forward.py, fused_layers.py, tree_attention.py). The native
kernels (native.py, built by native_build.py from native_kernels.cpp) are optional: without
them each piece runs its torch operations.

This package imports nothing from the pipeline: only the engines' row layout, the reference
engine's forwards (its fallback and the truth its probe compares with) and the cache
directory's rules. Where a forward cannot take the lean path at the moment it runs (a forward
hook, an active unmerged LoRA layer), the reference engine's forward runs instead.
"""

from __future__ import annotations

import contextlib

from grpogate.engines.cpu.capability import Decoder, describe
from grpogate.engines.cpu.decoding import LeanStepper
from grpogate.engines.cpu.fused_layers import fused_norms_and_swiglu
from grpogate.engines.cpu.lora_forward import base_dtype_lora
from grpogate.engines.cpu.native import native_kernels
from grpogate.engines.cpu.probe import probe_reason
from grpogate.engines.cpu.scoring import LeanScorer
from grpogate.engines.cpu.tree_attention import tree_attention
from grpogate.engines.cpu.weights import lean_decoder
from grpogate.engines.reference import ModelScorer, ModelStepper


def accepts(model) -> Decoder | str:
    """`model`'s description where the accelerator runs it, else why not: its structure and
    settings (capability.py), then, once per model, the probe of its mathematics (probe.py)."""
    decoder = describe(model)
    return decoder if isinstance(decoder, str) else probe_reason(model) or decoder


def declines(model) -> str:
    """Why the accelerator does not run `model` ("" where it does)."""
    found = accepts(model)
    return found if isinstance(found, str) else ""


class CpuEngine:
    """The `Engine` for a model `declines` accepts."""

    name = "cpu"
    declined = ""

    def __init__(self, described: Decoder | None = None, lean: bool = True, pack: bool = True,
                 native: bool = True):
        # `described`: the model's description from `accepts` (else each use describes it);
        # the bench turns pieces off
        self.described, self.lean, self.pack, self.native = described, lean, pack, native

    def stepper(self, model):
        """The lean decoder on the model's weights as they are now (with the native decode step
        where it builds and covers the attention shape), else the model's forward."""
        decoder = lean_decoder(model, self.pack, self.described) if self.lean else None
        if decoder is None:
            return ModelStepper(model)
        kernels = native_kernels(decoder.embed.dtype, decoder.embed.device) if self.native else None
        if kernels is not None and not kernels.covers(decoder.heads, decoder.kv_heads,
                                                      decoder.head_dim):
            kernels = None
        return LeanStepper(decoder, kernels)

    def scorer(self, model, prefix: list[int]):
        """The lean scorer on the model's weights as they are now (it keeps its own copies,
        `prefix` forwarded once), else the model's forward."""
        decoder = lean_decoder(model, described=self.described)
        return ModelScorer(model) if decoder is None else LeanScorer(decoder, prefix)

    @contextlib.contextmanager
    def update_forward(self, model):
        """The update's forwards inside this block run their LoRA layers in the base dtype and
        (`native`) their norms and MLPs on the native kernels, where each applies."""
        fused = (fused_norms_and_swiglu(model, self.described) if self.native
                 else contextlib.nullcontext())
        with base_dtype_lora(model), fused:
            yield

    def packed_attention(self, model, segments):
        """The forward of a packed row (training/logprobs.py) inside this block attends through
        `tree_attention`, which skips the row's blocks its `segments` mask whole."""
        return tree_attention(model, segments)

    def identity(self) -> dict:
        return {"name": self.name, "declined": self.declined}
