"""The update's LoRA layers in the base's dtype (engines/cpu/lora_forward.py): a layer by hand, the
fallbacks to PEFT's own forward, and the tiny model's packed update against PEFT's."""

from __future__ import annotations

import pytest
import torch

from grpogate.engines.cpu.lora_forward import base_dtype_lora


@pytest.fixture
def layer():
    """One bfloat16 linear [[1, 0], [0, 1]] with a float32 LoRA of rank 1, alpha 2 (scale 2):
    A = [[1, 2]], B = [[0.5], [0.25]]."""
    from peft import LoraConfig, get_peft_model

    base = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False)).to(torch.bfloat16)
    with torch.no_grad():
        base[0].weight.copy_(torch.eye(2))
    model = get_peft_model(base, LoraConfig(r=1, lora_alpha=2, target_modules=["0"]))
    lora = model.base_model.model[0]
    with torch.no_grad():
        lora.lora_A["default"].weight.copy_(torch.tensor([[1.0, 2.0]]))
        lora.lora_B["default"].weight.copy_(torch.tensor([[0.5], [0.25]]))
    assert lora.lora_A["default"].weight.dtype == torch.float32  # PEFT's float32 adapter
    return model, lora


def test_a_layer_by_hand(layer):
    # x = [1, 1]: base x W^T = [1, 1]; x A^T = 3; scale B = [1, 0.5]; y = [1 + 3, 1 + 1.5].
    # Loss sum(y): dA = (scale B)^T 1 x = 1.5 [1, 1]; dB = scale (x A^T) 1 = 2 * 3 = 6 per row.
    model, lora = layer
    x = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
    with base_dtype_lora(model):
        assert "forward" in vars(lora)
        y = model(x)
    assert "forward" not in vars(lora)  # PEFT's own forward again after the block
    assert y.dtype == torch.bfloat16 and y.tolist() == [[4.0, 2.5]]
    y.float().sum().backward()
    a, b = lora.lora_A["default"].weight, lora.lora_B["default"].weight
    assert a.grad.dtype == torch.float32 and a.grad.tolist() == [[1.5, 1.5]]
    assert b.grad.tolist() == [[6.0], [6.0]]
    peft_y = model(x)  # PEFT computes the same numbers here (all exact in bfloat16)
    assert peft_y.tolist() == [[4.0, 2.5]]


def test_falls_back_to_pefts_forward(layer):
    model, lora = layer
    calls = []
    peft_forward = type(lora).forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return peft_forward(self, *args, **kwargs)

    type(lora).forward = counted
    try:
        x = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
        with base_dtype_lora(model):
            with model.disable_adapter():
                assert model(x).tolist() == [[1.0, 1.0]]  # the base alone, by PEFT
            model.float()
            assert model(x.float()).tolist() == [[4.0, 2.5]]  # float32: PEFT's forward
            model(x.float()).sum().backward()
        assert len(calls) == 3
    finally:
        type(lora).forward = peft_forward


def test_tiny_packed_update_against_pefts(tiny_config, tmp_path, monkeypatch):
    """The tiny model in bfloat16, the packed row: log-probs and LoRA gradients within bfloat16
    rounding of PEFT's float32-adapter forward."""
    import contextlib

    from grpogate.engines import cpu
    from helpers import bf16_packed_row, relative_distance

    _, row, run = bf16_packed_row(tiny_config, tmp_path, [[1, 5, 9, 30, 31], [1, 5, 9, 40]],
                                  [[504, 3077, 2], [905, 28], [1011, 2], [77, 44, 2]])
    ours, our_grads = run()
    monkeypatch.setattr(cpu, "base_dtype_lora", lambda model: contextlib.nullcontext())
    theirs, their_grads = run()
    # log-probs of magnitude ~11, their logits in bfloat16 (a step of 1/16 there): 0.007
    # measured, within two steps
    assert (ours - theirs).mul(row.completion_mask).abs().max() <= 0.125
    assert not torch.equal(ours, theirs)  # the new forward really ran
    assert all(g.dtype == torch.float32 for g in our_grads)
    assert relative_distance(our_grads, their_grads) < 3e-2  # 1.3 % measured
