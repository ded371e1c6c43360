"""What the CPU accelerator supports, read from the loaded model's structure, never its name.

The accelerator implements one decoder: a stack of blocks, each an RMSNorm, attention through
separate q/k/v/o projections under full causal attention with position-independent RoPE
tables, a second RMSNorm and a SiLU-gated MLP (gate/up/down), then a final RMSNorm and an LM
head. `describe(model)` checks the loaded model against that description, module by module
and setting by setting, and returns either the modules the accelerator reads (`Decoder`: its
decode forward reads their weights, its update patches replace their norms' and MLPs'
forwards) or the first reason it declines, worded for the evidence ("sliding-window attention
unsupported"). It declines too on a torch, transformers or PEFT version its private uses were
not tested on (versions.py). What structure cannot show (RoPE applied to interleaved pairs, a
norm of another rounding) the probe (probe.py) finds on the loaded model itself. Llama,
Qwen2, Mistral without a sliding window and SmolLM2 match; Phi-3 (fused projections), Qwen3
(per-head q/k norms), Gemma (GELU, norms of another form), SmolLM3 (layers without RoPE) and
Granite (its own attention scale) do not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpogate.engines.cpu.versions import untested_versions

BLOCK_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP_PARTS = {"gate_proj", "up_proj", "down_proj"}
# Settings that change the mathematics of a block or the head in ways the accelerator does not
# implement; a model that sets one to anything but "off" (None, 1) is declined. (An attention
# scale is read off the attention module itself, `_attention_reason`.)
UNSUPPORTED_SETTINGS = ("attn_logit_softcapping", "final_logit_softcapping",
                        "embedding_multiplier", "residual_multiplier", "logits_scaling",
                        "query_pre_attn_scalar", "partial_rotary_factor")
# What the lean decoder reads from the config.
REQUIRED_SETTINGS = ("num_attention_heads", "num_key_value_heads", "hidden_size",
                     "intermediate_size", "rms_norm_eps")
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True)
class Decoder:
    """The modules of a supported model the accelerator reads."""

    base: torch.nn.Module  # the transformers model under any PEFT wrapper
    blocks: tuple[torch.nn.Module, ...]
    embed: torch.nn.Module
    norm: torch.nn.Module
    lm_head: torch.nn.Module
    rotary: torch.nn.Module

    @property
    def norms(self) -> tuple[torch.nn.Module, ...]:
        """Every RMSNorm: each block's two and the final one."""
        pairs = [(b.input_layernorm, b.post_attention_layernorm) for b in self.blocks]
        return tuple(n for pair in pairs for n in pair) + (self.norm,)

    @property
    def mlps(self) -> tuple[torch.nn.Module, ...]:
        return tuple(b.mlp for b in self.blocks)


def base_model(model) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _children(module) -> set[str]:
    """Names of the child modules that hold parameters (activations and rotary tables hold
    none)."""
    return {name for name, child in module.named_children()
            if any(True for _ in child.parameters())}


def _is_rms_norm(module) -> bool:
    parameters = dict(module.named_parameters(recurse=False))
    return (set(parameters) == {"weight"} and parameters["weight"].dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float))


def _is_silu(activation) -> bool:
    """Whether `activation` computes SiLU (probed on a few values: a module's class name or
    the config's `hidden_act` can say one thing while the module computes another)."""
    probe = torch.linspace(-4.0, 4.0, 9)
    try:
        return bool(torch.allclose(activation(probe.clone()), torch.nn.functional.silu(probe)))
    except (TypeError, RuntimeError):
        return False


def _config_reason(config) -> str:
    missing = [name for name in REQUIRED_SETTINGS if getattr(config, name, None) is None]
    if missing:
        return f"config without {', '.join(missing)} unsupported"
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()) or (
            getattr(config, "sliding_window", None) is not None
            and getattr(config, "use_sliding_window", True) is not False):
        return "sliding-window attention unsupported"
    for name in UNSUPPORTED_SETTINGS:
        if getattr(config, name, None) not in (None, 1, 1.0):
            return f"{name} unsupported"
    return ""


def _attention_reason(attention) -> str:
    """What an attention module says of itself that the lean decoder does not implement."""
    if not getattr(attention, "use_rope", True):
        return "attention layers without RoPE unsupported"
    if getattr(attention, "sliding_window", None) is not None:
        return "sliding-window attention unsupported"
    head_dim, scaling = getattr(attention, "head_dim", None), getattr(attention, "scaling", None)
    if head_dim and scaling is not None and not math.isclose(scaling, head_dim ** -0.5,
                                                             rel_tol=1e-6):
        return "attention scale other than 1/sqrt(head_dim) unsupported"
    return ""


def _block_reason(block) -> str:
    parts = _children(block)
    if parts != BLOCK_PARTS:
        return f"decoder block of parts {sorted(parts)} unsupported (expects {sorted(BLOCK_PARTS)})"
    reason = _attention_reason(block.self_attn)
    if reason:
        return reason
    attention = _children(block.self_attn)
    if not ATTENTION_PARTS <= attention:
        return "attention without separate q/k/v/o projections unsupported"
    if attention != ATTENTION_PARTS:
        return f"attention with {sorted(attention - ATTENTION_PARTS)} unsupported"
    if _children(block.mlp) != MLP_PARTS:
        return "MLP without separate gate/up/down projections unsupported"
    if not _is_silu(getattr(block.mlp, "act_fn", None)):
        return "MLP activation other than SiLU unsupported"
    if not (_is_rms_norm(block.input_layernorm) and _is_rms_norm(block.post_attention_layernorm)):
        return "norms other than RMSNorm (weight, variance_epsilon) unsupported"
    return ""


def describe(model) -> Decoder | str:
    """`model`'s modules as the accelerator reads them, or why it declines the model."""
    untested = untested_versions()
    if untested:
        return untested
    base = base_model(model)
    inner = getattr(base, "model", None)
    parts = ("layers", "embed_tokens", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, p) for p in parts) or not hasattr(base, "lm_head"):
        return "no decoder stack of the form model.{layers, embed_tokens, norm, rotary_emb}, lm_head"
    reason = _config_reason(base.config)
    if not reason:
        rope_type = str(getattr(inner.rotary_emb, "rope_type", "default"))
        if any(kind in rope_type for kind in LENGTH_DEPENDENT_ROPE):
            reason = f"length-dependent RoPE ({rope_type}) unsupported"
    for block in [] if reason else inner.layers:
        reason = _block_reason(block)
        if reason:
            break
    if not reason and not _is_rms_norm(inner.norm):
        reason = "final norm other than RMSNorm unsupported"
    if reason:
        return reason
    return Decoder(base=base, blocks=tuple(inner.layers), embed=inner.embed_tokens,
                   norm=inner.norm, lm_head=base.lm_head, rotary=inner.rotary_emb)
