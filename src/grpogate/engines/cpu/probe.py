"""The capability check's last step: on the loaded model, the lean forward computes what the
model's own forward computes.

The structural check (capability.py) reads what a model is made of; a model can match it and
still compute something else inside a module (RoPE applied to interleaved pairs rather than
halves, a norm that scales in float32 first). So, once per model, the lean scorer and the
reference engine's teacher-forced forward score one short sequence with the adapters off, and
the accelerator declines a model whose logits differ by more than bfloat16 rounding.
"""

from __future__ import annotations

import weakref

import torch

from grpogate.engines.adapters import adapters_disabled
from grpogate.engines.cpu.capability import base_model
from grpogate.engines.cpu.scoring import LeanScorer
from grpogate.engines.cpu.weights import lean_decoder
from grpogate.engines.reference import teacher_forced_logits

PROBE_TOKENS = 12
# Relative L2 distance of the lean logits from the model's above which the accelerator
# declines, by the model's dtype: the two forwards round their sums in different orders, a few
# float32 ulps or a few bfloat16 steps, while a forward of other mathematics (interleaved RoPE
# under attention that depends on position) lands far above (docs/measurements.md, "The
# engines' probe").
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3}
HALF_TOLERANCE = 0.05  # bfloat16, float16
_RESULTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def probe_reason(model) -> str:
    """"" where the lean forward agrees with `model`'s on the probe, else why not (once per
    model: the result is kept for as long as the model lives)."""
    base = base_model(model)
    if base not in _RESULTS:
        distance = probe_distance(model)
        if distance is None:
            return ""  # a hook: the lean path does not run now; probed when it can
        dtype = next(base.parameters()).dtype
        _RESULTS[base] = "" if distance <= TOLERANCE.get(dtype, HALF_TOLERANCE) else (
            f"lean forward differs from the model's on a probe (relative error {distance:.2g})")
    return _RESULTS[base]


@torch.no_grad()
def probe_distance(model) -> float | None:
    """||lean - model|| / ||model|| over the probe's teacher-forced logits, the adapters off;
    None where the lean decoder does not apply to `model` right now."""
    vocab = base_model(model).config.vocab_size
    ids = [(11 * i + 5) % vocab for i in range(PROBE_TOKENS)]
    prompt, completion = ids[:4], ids[4:]
    with adapters_disabled(model):
        decoder = lean_decoder(model, pack=False)
        if decoder is None:
            return None
        lean = LeanScorer(decoder, [])([(prompt, [completion])], 0)[0][0].float()
        truth = teacher_forced_logits(model, [(prompt, completion)], 0)[0].float()
    return float((lean - truth).norm() / truth.norm().clamp_min(1e-12))
