"""The update's RMSNorms and SwiGLUs as native kernels, forward and backward (design §16).

A transformers RMSNorm is eight tensor operations forward (a float32 copy, square,
mean, add, rsqrt, multiply, the cast back, the weight's multiply) and about twice as many in
the backward; its MLP's `silu(gate) * up` is two forward and four backward. At the update's
packed row (one row of 300-600 positions) each operation is a pass over a few hundred KB to a
few MB, dispatched on its own: together a sizeable share of the update's time on a CPU
(docs/measurements.md, "Figures moved from code comments"). Inside
`fused_norms_and_swiglu(model)` each such norm and MLP computes the same mathematics in one
native call forward and one backward (`engines/cpu/native_kernels.cpp`):

- RMSNorm: the decode step's `rms_norm` kernel forward (float32 sums, the normalized value
  rounded to the dtype, then scaled); backward dx = r gh - x r^3 sum(gh x) / D with gh the
  dtype-rounded grad x weight, in float32, rounded once. The norm's weight must be frozen (it
  is: only LoRA trains), else the module runs transformers' forward.
- SwiGLU: round(silu(gate)) * up forward; backward the roundings autograd makes on those
  operations (grad x up rounded before silu's derivative).

Both only where the native kernels build for the dtype (bfloat16 or float32) on a CPU; a
norm's sums run in the kernels' fixed order, not torch's, so values move by float32 rounding
of the variance (as the decode step's native norms sum).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from grpogate.engines.cpu.capability import Decoder, describe
from grpogate.engines.cpu.lora_forward import forwards_replaced
from grpogate.engines.cpu.native import NativeKernels, native_kernels



class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, kernels: NativeKernels):
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        ctx.save_for_backward(flat)
        ctx.weight, ctx.eps, ctx.kernels, ctx.shape = weight, eps, kernels, x.shape
        return kernels.rms_norm(flat, weight, eps).view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        (flat,) = ctx.saved_tensors
        grad = grad.reshape(flat.shape).contiguous()
        d_x = ctx.kernels.rms_norm_backward(flat, ctx.weight, grad, ctx.eps)
        return d_x.view(ctx.shape), None, None, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, kernels: NativeKernels):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        ctx.kernels = kernels
        return kernels.swiglu(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        d_gate, d_up = ctx.kernels.swiglu_backward(gate, up, grad.contiguous())
        return d_gate, d_up, None


def _norm_forward(module, transformers_forward, kernels, x: torch.Tensor) -> torch.Tensor:
    if (x.dtype != module.weight.dtype or module.weight.requires_grad
            or x.device.type != "cpu"):
        return transformers_forward(x)
    return _RMSNorm.apply(x, module.weight.detach().contiguous(), module.variance_epsilon,
                          kernels)


def _mlp_forward(module, transformers_forward, kernels, x: torch.Tensor) -> torch.Tensor:
    gate, up = module.gate_proj(x), module.up_proj(x)
    if gate.dtype != up.dtype or gate.dtype != x.dtype or x.device.type != "cpu":
        return module.down_proj(module.act_fn(gate) * up)
    return module.down_proj(_SwiGLU.apply(gate, up, kernels))


@contextlib.contextmanager
def fused_norms_and_swiglu(model, described: Decoder | None = None):
    """Inside this block, the RMSNorms and SiLU MLPs of a model the accelerator supports
    (`capability.describe`, or `described` where the caller has the description) run the
    native kernels (see above) where they build for the model's dtype on a CPU; elsewhere a
    no-op."""
    parameter = next(model.parameters())
    kernels = native_kernels(parameter.dtype, parameter.device)
    decoder = "no native kernels"
    if kernels is not None:
        decoder = describe(model) if described is None else described
    replacements = []
    if not isinstance(decoder, str):
        replacements = [(module, functools.partial(forward, module, module.forward, kernels))
                        for modules, forward in ((decoder.norms, _norm_forward),
                                                 (decoder.mlps, _mlp_forward))
                        for module in modules if "forward" not in vars(module)]
    with forwards_replaced(replacements):
        yield
