"""The lean decoder's weights: the model's weight tensors as `LeanStepper` reads them.

q/k/v and gate/up fused into one matrix each, the norms and biases beside them, and every
matrix reordered once per rollout into oneDNN's blocked layout ("prepacked") where oneDNN runs
the dtype fast: bfloat16 on a CPU with bfloat16 kernels, float32 on any x86 CPU.
`lean_decoder(model)` returns None for anything the lean path does not cover (decoding.py
explains the path and its limits).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpogate.engines.cpu.capability import Decoder, describe


def bf16_kernels_available() -> bool:
    """oneDNN bfloat16 kernels (avx512_bf16 / AMX on x86): bfloat16 is then a fast CPU dtype."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


X86 = ("x86_64", "amd64", "i686", "x86")  # platform.machine(), lowered


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether `prepack` applies: a bfloat16 weight on a CPU with oneDNN bfloat16 kernels, or a
    float32 weight on an x86 CPU with oneDNN.

    In float32, F.linear runs MKL's sgemm; oneDNN on the prepacked weight is the faster kernel
    at the decoder's row counts on x86, for the decode step's products and the LM head alike
    (docs/measurements.md, "Figures moved from code comments"), and rounds differently (a few
    float32 ulps of a product). Other architectures keep F.linear: the choice rests on x86
    measurements alone."""
    if weight.device.type != "cpu" or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if weight.dtype == torch.float32:
        return platform.machine().lower() in X86 and torch.backends.mkldnn.is_available()
    return weight.dtype == torch.bfloat16 and bf16_kernels_available()


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] weight -> the same weight in oneDNN's blocked layout, for `linear`.

    In bfloat16, F.linear hands oneDNN a plain [out, in] matrix, and oneDNN reorders it into its
    blocked layout on every call; at decode batch sizes that reorder costs as much as the product.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, or oneDNN's kernel on a prepacked weight: in bfloat16 the kernel F.linear
    runs too (the same result bits), in float32 another kernel than F.linear's (see
    `can_prepack`)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # [D]
    qkv: torch.Tensor  # [(H + 2 Hkv) d, D]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [D, H d]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [D]
    gate_up: torch.Tensor  # [2 I, D]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [D, I]
    down_bias: torch.Tensor | None


@dataclass(frozen=True)
class LeanDecoder:
    embed: torch.Tensor  # [V, D]
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor  # [D]
    lm_head: torch.Tensor  # [V, D]
    lm_head_bias: torch.Tensor | None
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rotary: torch.nn.Module  # the model's rotary embedding: (x, position_ids) -> cos, sin


def _plain_weights(linear) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) a linear layer applies now; None if an active, unmerged LoRA adds to it."""
    base = linear
    if hasattr(linear, "lora_A") and hasattr(linear, "get_base_layer"):
        active = [name for name in linear.active_adapters if name in linear.lora_A]
        if active and not linear.disable_adapters and not linear.merged:
            return None
        base = linear.get_base_layer()
    return base.weight, base.bias


def _fuse(parts: list[tuple[torch.Tensor, torch.Tensor | None]]):
    weight = torch.cat([w for w, _ in parts])
    if all(b is None for _, b in parts):
        return weight, None
    bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in parts])
    return weight, bias


def lean_decoder(model, pack: bool = True,
                 described: Decoder | None = None) -> LeanDecoder | None:
    """The model's current weights, fused for decoding, or None where this path does not apply:
    a model `capability.describe` declines, a forward hook (it changes what a module returns;
    only the model's own forward runs it), or an active, unmerged LoRA layer.

    With `pack`, weights `can_prepack` are prepacked (a copy: the model's tensors are untouched).
    `described`: the model's description where the caller has it (the engine that accepted it).
    """
    decoder = describe(model) if described is None else described
    if isinstance(decoder, str):
        return None
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return None
    config = decoder.base.config
    linears = []
    for block in decoder.blocks:
        attention, mlp = block.self_attn, block.mlp
        linears.append([_plain_weights(m) for m in (attention.q_proj, attention.k_proj,
                                                    attention.v_proj, attention.o_proj,
                                                    mlp.gate_proj, mlp.up_proj, mlp.down_proj)])
    head = _plain_weights(decoder.lm_head)
    if head is None or any(part is None for layer in linears for part in layer):
        return None
    packed = pack and can_prepack(head[0])
    matrix = prepack if packed else (lambda weight: weight)
    layers = []
    with torch.no_grad():
        for block, (q, k, v, o, gate, up, down) in zip(decoder.blocks, linears):
            qkv, qkv_bias = _fuse([q, k, v])
            gate_up, gate_up_bias = _fuse([gate, up])
            layers.append(LayerWeights(
                input_norm=block.input_layernorm.weight, qkv=matrix(qkv), qkv_bias=qkv_bias,
                o=matrix(o[0]), o_bias=o[1], post_norm=block.post_attention_layernorm.weight,
                gate_up=matrix(gate_up), gate_up_bias=gate_up_bias, down=matrix(down[0]),
                down_bias=down[1]))
        lm_head = matrix(head[0])
    heads = config.num_attention_heads
    return LeanDecoder(
        embed=decoder.embed.weight, layers=tuple(layers), norm=decoder.norm.weight,
        lm_head=lm_head, lm_head_bias=head[1], eps=config.rms_norm_eps, heads=heads,
        kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate=config.intermediate_size, rotary=decoder.rotary)
