"""The update's native RMSNorm and SwiGLU (engines/cpu/fused_layers.py): hand-computed kernel
values, gradients against autograd on transformers' own modules, and where they step aside."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpogate.engines.cpu import declines
from grpogate.engines.cpu.fused_layers import fused_norms_and_swiglu


def test_rms_norm_backward_by_hand(kernels):
    # x = [3, 4], w = [1, 2], eps 0: mean square 12.5, r = 1 / sqrt(12.5) = 0.2828427,
    # r^3 = 0.0226274. grad [1, 1]: gh = grad w = [1, 2]; sum(gh x) = 3 + 8 = 11;
    # dx = r gh - x r^3 11 / 2 = [0.2828427 - 3 x 0.1244508, 0.5656854 - 4 x 0.1244508]
    #    = [-0.0905097, 0.0678823].
    x, weight = torch.tensor([[3.0, 4.0]]), torch.tensor([1.0, 2.0])
    got = kernels.rms_norm_backward(x, weight, torch.ones(1, 2), 0.0)
    torch.testing.assert_close(got, torch.tensor([[-0.0905097, 0.0678823]]))


def test_swiglu_and_its_backward_by_hand(kernels):
    # gate 0: silu 0, logistic 1/2, silu' = 1/2 (1 + 0) = 0.5. gate 2: logistic 0.8807971,
    # silu 1.7615942, silu' = 0.8807971 (1 + 2 x 0.1192029) = 1.0907843. up [3, -1], grad
    # [2, 4]: out = [0, -1.7615942]; d_up = grad silu = [0, 7.0463768]; d_gate = grad up silu'
    # = [2 x 3 x 0.5, 4 x -1 x 1.0907843] = [3, -4.3631372].
    gate, up, grad = torch.tensor([0.0, 2.0]), torch.tensor([3.0, -1.0]), torch.tensor([2.0, 4.0])
    torch.testing.assert_close(kernels.swiglu(gate, up), torch.tensor([0.0, -1.7615942]))
    d_gate, d_up = kernels.swiglu_backward(gate, up, grad)
    torch.testing.assert_close(d_up, torch.tensor([0.0, 7.0463768]))
    torch.testing.assert_close(d_gate, torch.tensor([3.0, -4.3631372]))


def _model(dtype):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).to(dtype)
    for name, parameter in model.named_parameters():  # only the MLPs' and q's weights train,
        parameter.requires_grad_("mlp" in name or "q_proj" in name)  # as LoRA would
    return model


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    loss = (logits.float() ** 2).mean()
    loss.backward()
    return logits.detach(), {n: p.grad.float().clone() for n, p in model.named_parameters()
                             if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_and_gradients_match_transformers(kernels, dtype):
    """float32: logits and every weight gradient within float32 rounding of transformers'
    modules; bfloat16: within the bfloat16 rounding that moves (relative L2 error of the
    gradients under 2 %, of the logits under 1 %)."""
    model = _model(dtype)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    reference_logits, reference = _loss_and_grads(model, ids)
    with fused_norms_and_swiglu(model):
        logits, grads = _loss_and_grads(model, ids)
    assert set(grads) == set(reference)
    if dtype == torch.float32:
        torch.testing.assert_close(logits, reference_logits, atol=1e-5, rtol=1e-5)
        for name in grads:
            torch.testing.assert_close(grads[name], reference[name], atol=1e-6, rtol=1e-4)
        return
    error = (logits.float() - reference_logits.float()).norm() / reference_logits.float().norm()
    assert error < 0.01
    for name in grads:
        assert (grads[name] - reference[name]).norm() / reference[name].norm() < 0.02, name


def test_a_trainable_norm_weight_or_another_activation_keeps_transformers(kernels):
    """A norm whose weight trains gets transformers' forward (its weight needs a gradient); a
    model with an MLP of another activation is one the accelerator declines (its decode would
    compute SiLU), so nothing of it is patched; every patch is gone after the block."""
    model = _model(torch.float32)
    norm = model.model.layers[0].input_layernorm
    norm.weight.requires_grad_(True)
    model.model.layers[1].mlp.act_fn = torch.nn.GELU()
    ids = torch.randint(0, 97, (1, 10), generator=torch.Generator().manual_seed(2))
    _, reference = _loss_and_grads(model, ids)
    with fused_norms_and_swiglu(model):
        assert not any("forward" in vars(m) for m in model.modules())
        _, grads = _loss_and_grads(model, ids)
    assert declines(model) == "MLP activation other than SiLU unsupported"
    model.model.layers[1].mlp.act_fn = torch.nn.SiLU()
    with fused_norms_and_swiglu(model):
        assert all("forward" in vars(block.mlp) for block in model.model.layers)
    assert grads["model.layers.0.input_layernorm.weight"].abs().sum() > 0
    torch.testing.assert_close(grads["model.layers.0.input_layernorm.weight"],
                               reference["model.layers.0.input_layernorm.weight"], atol=1e-6,
                               rtol=1e-4)
    assert not any("forward" in vars(m) for m in model.modules())


def test_without_the_kernels_the_block_changes_nothing(monkeypatch):
    monkeypatch.setenv("GRPOGATE_NATIVE", "0")
    model = _model(torch.float32)
    with fused_norms_and_swiglu(model):
        assert not any("forward" in vars(m) for m in model.modules())
