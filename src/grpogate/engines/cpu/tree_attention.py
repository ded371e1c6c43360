"""The packed update's attention: SDPA's forward, a backward by matrix products (design §16).

The packed micro-batch (`logprobs.packed_logprobs`) is one row of L positions under a
tree-shaped additive mask, which SDPA on a CPU runs in its flash kernel. In bfloat16 that
kernel's backward costs several times its forward, and more than the products below
(docs/measurements.md, "Figures moved from code comments"). `TreeAttention` keeps the flash
forward, so every forward value is bit-identical to SDPA's, and computes the backward from
the saved query, key and value in five batched bfloat16 products and torch's fused softmax
and softmax backward:

    S = scale * Q K^T + mask        P = softmax(S)           (recomputed, bfloat16)
    dV = P^T dO    dP = dO V^T      dS = P * (dP - rowsum(dP * P))
    dQ = scale * dS K               dK = scale * dS^T Q

Its error against a float64 reference is that of the flash backward (the tests hold it
within about twice the flash backward's): the scores are rounded to bfloat16 once, as
transformers' eager attention rounds them. No L x L tensor is kept between the forward and
the backward, so memory is what SDPA's costs.

It applies where the products are the faster backward: a CPU, bfloat16, a gradient to
compute, one row under a 4D additive mask. Anywhere else (float32, where the flash backward
is the faster; the reference forward, under no_grad; another device) the call goes to
transformers' SDPA attention unchanged. `tree_attention(model)` selects it for the forwards
inside its block when the model runs SDPA.

Given the packed row's segments (`tree_attention(model, segments)`), bfloat16 forwards on a CPU,
the reference forward under no_grad included, take `SegmentedTreeAttention` instead: the same
mathematics on the blocks of the row that can attend at all (a group's queries against the
prefix's and the group's own keys), about a third of the dense row's score entries at the
default.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

NAME = "grpogate_tree_sdpa"
# The packed row's segments (`logprobs.PackedRow.segments`) while `tree_attention` runs a
# forward of it: ((query start, query end, key positions [K] int64), ...).
_SEGMENTS: contextvars.ContextVar = contextvars.ContextVar("grpogate_tree_segments",
                                                           default=None)


class TreeAttention(torch.autograd.Function):
    """query, key, value [1, H, L, d] (key and value already repeated to H heads), mask
    [1, 1, L, L] additive, of the same dtype -> [1, H, L, d]."""

    @staticmethod
    def forward(ctx, query, key, value, mask, scale: float):
        out = _flash(query, key, value, mask, scale)
        ctx.save_for_backward(query, key, value, mask)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, mask = ctx.saved_tensors
        batch, heads, length, dim = query.shape
        q, k, v, d_out = (t.reshape(batch * heads, length, dim)
                          for t in (query, key, value, grad_out.contiguous()))
        d_query, d_key, d_value = _backward_products(q, k, v, d_out,
                                                     mask.reshape(-1, length, length), ctx.scale)
        shape = (batch, heads, length, dim)
        return (d_query.view(shape), d_key.mul_(ctx.scale).view(shape), d_value.view(shape),
                None, None)


def _flash(query, key, value, mask, scale: float) -> torch.Tensor:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, False, attn_mask=mask, scale=scale)[0]


def _backward_products(q, k, v, d_out, mask, scale: float):
    """q, d_out [B, n, d], k, v [B, m, d], additive mask broadcastable to [B, n, m] -> (dQ,
    dSᵀ Q (dK before its scale), dV): the backward's five products around the recomputed
    softmax, in the inputs' dtype (the module's docstring has the formulas)."""
    scores = torch.baddbmm(mask, q, k.transpose(1, 2), alpha=scale)  # [B, n, m]
    probs = torch.softmax(scores, dim=-1)
    del scores
    d_value = torch.bmm(probs.transpose(1, 2), d_out)
    d_scores = torch._softmax_backward_data(torch.bmm(d_out, v.transpose(1, 2)), probs, -1,
                                            probs.dtype)
    del probs
    return torch.bmm(d_scores, k).mul_(scale), torch.bmm(d_scores.transpose(1, 2), q), d_value


class SegmentedTreeAttention(torch.autograd.Function):
    """`TreeAttention` on the blocks of the row that can attend at all: each segment's queries
    (the shared prefix; one group's prompt suffix and completions; the padding) against the keys
    its queries may see (the prefix and the group's own span), each segment's scores
    S = scale · Q_s K_sᵀ + mask_s alone. A group's queries never see another group's keys, so the
    dense row's L × L products computed mostly masked entries: at the default's update (a 62-token
    prefix, 3-5 groups of about 200 positions) the segments hold about a third of them.
    query, key, value [1, H, L, d], mask [1, 1, L, L], segments as `_SEGMENTS` -> [1, H, L, d].

    Forward: SDPA's flash kernel per segment (the same mathematics; the online softmax sums
    another split of the keys, so values move by rounding). Backward: `TreeAttention`'s products
    per segment, the keys' and values' gradients accumulated in float32 (or wider) over the
    segments that read them (the prefix's, by every group's) and rounded once."""

    @staticmethod
    def forward(ctx, query, key, value, mask, scale: float, segments):
        out = torch.empty_like(query)
        for start, end, keys in segments:
            out[:, :, start:end] = _flash(
                query[:, :, start:end], key.index_select(2, keys), value.index_select(2, keys),
                mask[:, :, start:end].index_select(3, keys), scale)
        ctx.save_for_backward(query, key, value, mask)
        ctx.scale, ctx.segments = scale, segments
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, mask = ctx.saved_tensors
        scale = ctx.scale
        q_all, k_all, v_all, d_all = (t[0] for t in (query, key, value, grad_out))  # [H, L, d]
        d_query = torch.empty_like(q_all)
        wide = torch.promote_types(key.dtype, torch.float32)  # the gradients' accumulator
        d_key, d_value = (torch.zeros(t.shape, dtype=wide) for t in (k_all, v_all))
        for start, end, keys in ctx.segments:
            segment_query, segment_key, segment_value = _backward_products(
                q_all[:, start:end], k_all.index_select(1, keys), v_all.index_select(1, keys),
                d_all[:, start:end].contiguous(), mask[0, :, start:end].index_select(2, keys),
                scale)  # [H, n, d], [H, m, d], [H, m, d]
            d_query[:, start:end] = segment_query
            d_value.index_add_(1, keys, segment_value.to(wide))
            d_key.index_add_(1, keys, segment_key.to(wide).mul_(scale))
        return (d_query[None], d_key.to(key.dtype)[None], d_value.to(value.dtype)[None], None,
                None, None)


# The segments' share of the dense row's L x L scores at or under which they run: the
# per-segment calls pay off only where they skip enough of the row's entries, so a row of one
# group stays dense (docs/measurements.md, "Figures moved from code comments").
SEGMENTED_SHARE = 0.5


def _one_bfloat16_row(query: torch.Tensor, key: torch.Tensor, mask, dropout: float,
                      kwargs) -> bool:
    """What both attentions here need: bfloat16 on a CPU, one row of L positions attending to
    itself under its [1, 1, L, L] additive mask, no dropout, softcap or position bias."""
    return (query.device.type == "cpu" and query.dtype == torch.bfloat16
            and query.shape[0] == 1 and query.shape[2] == key.shape[2] and dropout == 0.0
            and isinstance(mask, torch.Tensor) and mask.dtype == query.dtype
            and mask.shape == (1, 1, query.shape[2], key.shape[2])
            and kwargs.get("softcap") is None and kwargs.get("position_bias") is None)


def segments_apply(query: torch.Tensor, key: torch.Tensor, mask, dropout: float, kwargs,
                   segments) -> bool:
    """Whether `SegmentedTreeAttention` runs this call: one bfloat16 row on a CPU, and segments
    that cover the row (the forwards of `tree_attention(model, segments)`, the reference
    forward under no_grad included) and hold at most SEGMENTED_SHARE of its scores."""
    length = query.shape[2]
    return (segments is not None and _one_bfloat16_row(query, key, mask, dropout, kwargs)
            and sum(end - start for start, end, _ in segments) == length
            and sum((end - start) * len(keys) for start, end, keys in segments)
            <= SEGMENTED_SHARE * length * length)


def applies(query: torch.Tensor, key: torch.Tensor, mask, dropout: float, kwargs) -> bool:
    """Whether `TreeAttention` runs this call (see the module's docstring)."""
    return (torch.is_grad_enabled() and query.requires_grad
            and _one_bfloat16_row(query, key, mask, dropout, kwargs))


def tree_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                        scaling: float | None = None, is_causal=None, **kwargs):
    """A transformers attention function: `TreeAttention` where it applies, else SDPA's."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    segments = _SEGMENTS.get()
    segmented = segments_apply(query, key, attention_mask, dropout, kwargs, segments)
    if not segmented and not applies(query, key, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if segmented:
        out = SegmentedTreeAttention.apply(query, key, value, attention_mask, scale, segments)
    else:
        out = TreeAttention.apply(query, key, value, attention_mask.contiguous(), scale)
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _register() -> None:
    """Make NAME known to transformers, once per process."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, tree_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # a 4D mask passes through as-is


@contextlib.contextmanager
def tree_attention(model, segments=None):
    """Inside this block, `model` (running SDPA) attends through `tree_sdpa_attention`;
    `segments` (a packed row's, `logprobs.PackedRow.segments`) let it skip the blocks of the
    row that are masked whole."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    _register()
    config._attn_implementation = NAME
    token = _SEGMENTS.set(segments)
    try:
        yield
    finally:
        _SEGMENTS.reset(token)
        config._attn_implementation = "sdpa"
