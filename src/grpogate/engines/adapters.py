"""A policy's adapters switched off and back exactly as they were: the base model's forward.

The engines' probe compares forwards of the base weights, and sampling (inputs/policy.py)
bypasses the LoRA layers after merging their deltas; both leave every adapter layer's state
as they found it, the probe also when it runs inside sampling's block. PEFT's own
`disable_adapter()` restores the state too, but assembles the model's adapter status on
every call.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def adapters_disabled(model):
    """PEFT's `disable_adapter()` for LoRA (the base model's outputs inside the block, each
    adapter layer's state and requires_grad restored after), without the model status PEFT
    assembles on every call: a quarter of its cost, once per reference forward and sampling."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    layers = [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]
    disabled = [layer.disable_adapters for layer in layers]
    try:
        for layer in layers:
            layer.enable_adapters(False)
        yield
    finally:
        for layer, was in zip(layers, disabled):
            layer.enable_adapters(not was)
