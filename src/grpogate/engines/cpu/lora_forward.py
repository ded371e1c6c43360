"""The update's LoRA layers computed in the base model's dtype (design §16).

PEFT keeps the adapter's weights in float32 over a bfloat16 base, and its `lora.Linear.forward`
casts each layer's input to float32 for the adapter, multiplies the adapter's [L, out] output by
the scale, adds it to the base output (promoting that to float32) and casts the sum back: four
passes over [L, out] or [L, in] tensors per layer and as many in the backward, for two products
of rank r: passes that cost more than the base products themselves (docs/measurements.md,
"Figures moved from code comments").

Inside `base_dtype_lora(model)` a plain adapted linear instead computes

    base(x) + (x A^T) (scale B)^T      with A and scale B cast to x's dtype (differentiably)

so its big tensors stay in bfloat16. The float32 weights are still what the optimizer steps
and what the gradients reach, through the cast: each product sums in float32 and rounds its
output to bfloat16 once, as the base products do. It applies to a plain
LoRA (no DoRA or other variant, no LoRA bias, no dropout, one active adapter) on a CPU with a
bfloat16 input and a weight of another dtype; every other call runs PEFT's own forward
unchanged, so float32 runs and the reference forward (adapters disabled) compute what they did.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F


def _forward(module, peft_forward, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    active = [name for name in module.active_adapters if name in module.lora_A]
    if (args or kwargs or module.disable_adapters or module.merged or len(active) != 1
            or x.dtype != torch.bfloat16 or x.device.type != "cpu"):
        return peft_forward(x, *args, **kwargs)
    name = active[0]
    lora_a, lora_b = module.lora_A[name], module.lora_B[name]
    if (name in getattr(module, "lora_variant", {}) or module.use_dora.get(name, False)
            or lora_b.bias is not None or lora_a.weight.dtype == x.dtype
            or not isinstance(module.lora_dropout[name], torch.nn.Identity)):
        return peft_forward(x, *args, **kwargs)
    down = F.linear(x, lora_a.weight.to(x.dtype))  # [..., r]
    return module.base_layer(x) + F.linear(down, (lora_b.weight * module.scaling[name]).to(x.dtype))


@contextlib.contextmanager
def base_dtype_lora(model):
    """Inside this block, `model`'s plain LoRA linears run in the base's dtype (see above)."""
    from peft.tuners.lora import Linear

    with forwards_replaced((module, functools.partial(_forward, module, module.forward))
                           for module in model.modules()
                           if type(module) is Linear and not module.fan_in_fan_out
                           and "forward" not in vars(module)):
        yield


@contextlib.contextmanager
def forwards_replaced(replacements):
    """(module, forward) pairs: inside this block each module's forward is the one given (an
    instance attribute, deleted after the block, so the class's forward returns)."""
    patched = []
    try:
        for module, forward in replacements:
            module.forward = forward
            patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward
