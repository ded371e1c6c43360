"""The packed update's attention (engines/cpu/tree_attention.py): SDPA's forward, the backward by
matrix products: a case by hand, gradcheck, bfloat16 against SDPA, and where it applies."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from grpogate.training.logprobs import pack_row
from grpogate.engines.cpu.tree_attention import (
    NAME,
    SEGMENTED_SHARE,
    SegmentedTreeAttention,
    TreeAttention,
    applies,
    segments_apply,
    tree_attention,
    tree_sdpa_attention,
)


def _additive(allowed: torch.Tensor, dtype) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def _tree(length: int, prefix: int, seed: int) -> torch.Tensor:
    """A packed row's mask: a causal prefix, then sequences that see it and themselves."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.zeros(length, length, dtype=torch.bool)
    allowed[:, :prefix] = True
    start = prefix
    while start < length:
        end = min(length, start + int(torch.randint(3, 12, (1,), generator=generator)))
        allowed[start:end, start:end] = True
        start = end
    return allowed & torch.ones(length, length, dtype=torch.bool).tril()


def test_backward_by_hand():
    # One head, d = 1, scale 1. q = [1, 2], k = [1, 0], v = [3, 5], causal.
    # Row 0 sees key 0 only: out 3. Row 1: scores [2, 0], p = [e^2, 1] / (e^2 + 1)
    # = [0.880797, 0.119203], out 3 p0 + 5 p1 = 3.238406.
    # Loss out0 + out1 (dO = 1): dV = P^T 1 = [1 + p0, p1] = [1.880797, 0.119203];
    # row 1: dP = v = [3, 5], dS = p * (dP - 3.238406) = [-0.209987, 0.209987]; row 0: dS 0.
    # dQ = dS k = [0, -0.209987]; dK = dS^T q = [-0.209987 * 2, 0.209987 * 2].
    q = torch.tensor([[[[1.0], [2.0]]]], dtype=torch.float64, requires_grad=True)
    k = torch.tensor([[[[1.0], [0.0]]]], dtype=torch.float64, requires_grad=True)
    v = torch.tensor([[[[3.0], [5.0]]]], dtype=torch.float64, requires_grad=True)
    mask = _additive(torch.ones(2, 2, dtype=torch.bool).tril(), torch.float64)
    out = TreeAttention.apply(q, k, v, mask, 1.0)
    p0 = math.exp(2) / (math.exp(2) + 1)
    assert out.flatten().tolist() == pytest.approx([3.0, 3 * p0 + 5 * (1 - p0)], abs=1e-12)
    out.sum().backward()
    ds = p0 * (3 - (3 * p0 + 5 * (1 - p0)))  # -0.209987
    assert ds == pytest.approx(-0.209987, abs=1e-6)
    assert v.grad.flatten().tolist() == pytest.approx([1 + p0, 1 - p0], abs=1e-12)
    assert q.grad.flatten().tolist() == pytest.approx([0.0, ds], abs=1e-12)
    assert k.grad.flatten().tolist() == pytest.approx([2 * ds, -2 * ds], abs=1e-12)


def test_gradcheck_under_a_tree_mask():
    torch.manual_seed(0)
    shape = (1, 2, 24, 8)
    q, k, v = (torch.randn(shape, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = _additive(_tree(24, 5, seed=1), torch.float64)
    assert torch.autograd.gradcheck(lambda a, b, c: TreeAttention.apply(a, b, c, mask, 0.35),
                                    (q, k, v))


def test_bfloat16_forward_is_sdpas_and_backward_as_accurate():
    torch.manual_seed(0)
    length, dim = 160, 64
    allowed = _tree(length, 40, seed=2)
    mask = _additive(allowed, torch.bfloat16)
    data = [torch.randn(1, 3, length, dim) for _ in range(4)]
    grad_out = data[3].to(torch.bfloat16)

    def run(attend, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in data[:3]]
        out = attend(*leaves)
        out.backward(grad_out.to(dtype))
        return out.detach(), [leaf.grad for leaf in leaves]

    ours, our_grads = run(lambda a, b, c: TreeAttention.apply(a, b, c, mask, dim ** -0.5),
                          torch.bfloat16)
    flash, flash_grads = run(lambda a, b, c: F.scaled_dot_product_attention(
        a, b, c, attn_mask=mask, scale=dim ** -0.5), torch.bfloat16)
    _, exact = run(lambda a, b, c: F.scaled_dot_product_attention(
        a, b, c, attn_mask=_additive(allowed, torch.float64), scale=dim ** -0.5), torch.float64)
    assert torch.equal(ours, flash)  # the same kernel forward
    for mine, theirs, truth in zip(our_grads, flash_grads, exact):
        error = ((mine.double() - truth).norm() / truth.norm()).item()
        flash_error = ((theirs.double() - truth).norm() / truth.norm()).item()
        # bfloat16 keeps 8 bits (relative rounding 2^-9 = 0.2 %): both backwards are a few
        # tenths of a percent from float64; ours within twice SDPA's own error.
        assert error < 1e-2 and error < 2 * flash_error + 1e-3, (error, flash_error)


def _packed(seed: int):
    """A packed row of 3 prompts (a 5-token prefix) with G = 2 completions of 2-9 tokens each:
    its `allowed` mask and segments."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [[1, 2, 3, 4, 5] + [10 + g] * (1 + g) for g in range(3)]
    completions = [list(range(100, 100 + int(torch.randint(2, 10, (1,), generator=generator))))
                   for _ in range(6)]
    row = pack_row(prompts, completions, 2, 0, torch.device("cpu"))
    return row.allowed, row.segments


def test_segmented_equals_the_dense_attention_in_float64():
    """Skipping the blocks masked whole changes no value: forward and gradients equal the
    dense row's within float64 rounding, on a packed row with padding."""
    torch.manual_seed(0)
    allowed, segments = _packed(seed=4)
    length = allowed.shape[0]
    assert length % 16 == 0 and len(segments) == 5  # prefix, 3 groups, padding
    mask = _additive(allowed, torch.float64)
    data = [torch.randn(1, 2, length, 8, dtype=torch.float64) for _ in range(4)]

    def run(attend):
        leaves = [t.clone().requires_grad_() for t in data[:3]]
        out = attend(*leaves)
        out.backward(data[3])
        return [out.detach()] + [leaf.grad for leaf in leaves]

    dense = run(lambda a, b, c: TreeAttention.apply(a, b, c, mask, 0.35))
    ours = run(lambda a, b, c: SegmentedTreeAttention.apply(a, b, c, mask, 0.35, segments))
    for mine, theirs in zip(ours, dense):
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda a, b, c: SegmentedTreeAttention.apply(a, b, c, mask, 0.35, segments),
        tuple(t[:, :1].clone().requires_grad_() for t in data[:3]))


def test_segmented_bfloat16_is_as_accurate_as_the_dense_attention():
    torch.manual_seed(0)
    allowed, segments = _packed(seed=5)
    length, dim = allowed.shape[0], 64
    mask = _additive(allowed, torch.bfloat16)
    data = [torch.randn(1, 3, length, dim) for _ in range(4)]

    def run(attend, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in data[:3]]
        out = attend(*leaves)
        out.backward(data[3].to(dtype))
        return [out.detach()] + [leaf.grad for leaf in leaves]

    ours = run(lambda a, b, c: SegmentedTreeAttention.apply(a, b, c, mask, dim ** -0.5,
                                                            segments), torch.bfloat16)
    dense = run(lambda a, b, c: TreeAttention.apply(a, b, c, mask, dim ** -0.5), torch.bfloat16)
    exact = run(lambda a, b, c: F.scaled_dot_product_attention(
        a, b, c, attn_mask=_additive(allowed, torch.float64), scale=dim ** -0.5), torch.float64)
    for mine, theirs, truth in zip(ours, dense, exact):
        error = ((mine.double() - truth).norm() / truth.norm()).item()
        dense_error = ((theirs.double() - truth).norm() / truth.norm()).item()
        # bfloat16 rounds at 2^-9 = 0.2 %: both a few tenths of a percent from float64.
        assert error < 1e-2 and error < 2 * dense_error + 1e-3, (error, dense_error)


def test_segments_apply_only_where_they_cover_the_row():
    allowed, segments = _packed(seed=6)
    length = allowed.shape[0]
    mask = _additive(allowed, torch.bfloat16)
    q = torch.randn(1, 2, length, 8, dtype=torch.bfloat16)
    assert segments_apply(q, q, mask, 0.0, {}, segments)  # no gradient needed: the reference
    assert not segments_apply(q, q, mask, 0.0, {}, None)  # no packed row: dense
    assert not segments_apply(q, q, mask, 0.0, {}, segments[:-1])  # not the whole row
    assert not segments_apply(q.float(), q.float(), mask.float(), 0.0, {}, segments)
    assert not segments_apply(q, q, mask, 0.1, {}, segments)
    # One group: its segment holds most of the row's scores, where the dense row is faster.
    one = pack_row([[1, 2, 3, 4, 5, 9]], [list(range(100, 130))] * 2, 2, 0, torch.device("cpu"))
    share = sum((b - a) * len(keys) for a, b, keys in one.segments) / one.allowed.numel()
    assert share > SEGMENTED_SHARE
    single = torch.randn(1, 2, one.allowed.shape[0], 8, dtype=torch.bfloat16)
    assert not segments_apply(single, single, _additive(one.allowed, torch.bfloat16), 0.0, {},
                              one.segments)


class _Layer(torch.nn.Module):
    num_key_value_groups = 3


def test_gqa_heads_and_where_it_applies():
    torch.manual_seed(0)
    length = 32
    mask = _additive(_tree(length, 8, seed=3), torch.bfloat16)
    q = torch.randn(1, 6, length, 16, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, length, 16, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    assert applies(q, k, mask, 0.0, {})
    out, weights = tree_sdpa_attention(_Layer(), q, k, v, mask, scaling=0.25)
    assert weights is None and out.shape == (1, length, 6, 16)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1),
                                              v.repeat_interleave(3, 1), attn_mask=mask,
                                              scale=0.25).transpose(1, 2)
    assert torch.equal(out, expected)
    out.float().sum().backward()
    assert k.grad.shape == (1, 2, length, 16)  # the repeated heads' gradients summed back
    with torch.no_grad():
        assert not applies(q, k, mask, 0.0, {})  # the reference forward: plain SDPA
    assert not applies(q.float(), k.float(), mask.float(), 0.0, {})  # float32: SDPA's backward
    assert not applies(q, k, mask, 0.1, {})  # dropout
    assert not applies(q, k, None, 0.0, {})  # no mask: SDPA's causal kernel


def test_context_switches_sdpa_models_only(tiny_config, tmp_path):
    from grpogate.inputs.policy import load_policy

    policy = load_policy(tiny_config(tmp_path), seed=0)
    config = policy.model.config
    assert config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError):
        with tree_attention(policy.model):
            assert config._attn_implementation == NAME
            raise RuntimeError("the forward failed")
    assert config._attn_implementation == "sdpa"  # restored on the way out
    config._attn_implementation = "eager"
    with tree_attention(policy.model):
        assert config._attn_implementation == "eager"  # another implementation is left alone
    config._attn_implementation = "sdpa"


def test_packed_bfloat16_update_matches_sdpa(tiny_config, tmp_path, monkeypatch):
    """The packed row of the tiny model in bfloat16: log-probs and LoRA gradients within
    bfloat16 rounding of plain SDPA's, and the segmented backward really ran."""
    import contextlib

    from grpogate.engines.cpu import CpuEngine
    from helpers import bf16_packed_row, relative_distance

    _, row, run = bf16_packed_row(tiny_config, tmp_path,
                                  [[1, 5, 9, 30, 31, 32], [1, 5, 9, 40, 41]],
                                  [[504, 3077, 314, 2], [905, 28], [1011, 29, 17, 44, 2], [77, 2]])
    calls = []
    original = SegmentedTreeAttention.backward
    monkeypatch.setattr(SegmentedTreeAttention, "backward",
                        staticmethod(lambda ctx, g: calls.append(1) or original(ctx, g)))
    ours, our_grads = run()
    assert len(calls) == 2  # one per layer
    monkeypatch.setattr(CpuEngine, "packed_attention",
                        lambda self, model, segments: contextlib.nullcontext())
    plain, plain_grads = run()
    real = row.completion_mask.bool()
    assert (ours - plain)[real].abs().max() < 0.02  # measured 0.003 of log-probs near -11
    assert relative_distance(our_grads, plain_grads) < 3e-2  # bfloat16 rounding
