"""The engines' contract (engines/__init__.py), tested once against every engine.

Every engine that runs a model must, on tiny random models of each architecture the CPU
accelerator accepts (float32, so the reference engine's forward is the truth to a few ulps):
sample the same tokens as the reference engine from the same seeds (the sampling contract:
inverse-CDF draws, seeded per prompt and sample), whichever batch a prompt lands in; score
completions teacher-forced to the reference's logits; and leave the update's forward equal,
values and gradients. Models the accelerator declines go to the reference engine, with the
reason recorded; a whole run on one (a tiny Mistral with a sliding window) records it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (Ernie4_5Config, Ernie4_5ForCausalLM, GPT2Config, GPT2LMHeadModel,
                          GraniteConfig, GraniteForCausalLM, HeliumConfig, HeliumForCausalLM,
                          LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, SmolLM3Config, SmolLM3ForCausalLM)

from grpogate.engines import engine_for, row_kernels
from grpogate.engines.cpu import CpuEngine
from grpogate.engines.reference import ReferenceEngine, teacher_forced_logits
from grpogate.sampling.rollout import SamplingSettings, generate_completions

SIZES = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, eos_token_id=96)
ACCEPTED = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SIZES)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SIZES)),  # q/k/v carry biases
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SIZES, sliding_window=None)),
}
def sharp(model):
    """Queries and keys scaled up 8x: a random tiny model's attention is nearly uniform, so
    positions (and a RoPE applied another way) barely reach its logits; a trained model's
    attention, like this one's, depends on them."""
    with torch.no_grad():
        for block in model.model.layers:
            block.self_attn.q_proj.weight.mul_(8)
            block.self_attn.k_proj.weight.mul_(8)
    return model


DECLINED = {
    "mistral-window": (lambda: MistralForCausalLM(MistralConfig(**SIZES, sliding_window=4)),
                       "sliding-window attention unsupported"),
    "phi3": (lambda: Phi3ForCausalLM(Phi3Config(**SIZES, pad_token_id=0)),
             "attention without separate q/k/v/o projections unsupported"),
    "qwen3": (lambda: Qwen3ForCausalLM(Qwen3Config(**SIZES, head_dim=16)),
              "attention with ['k_norm', 'q_norm'] unsupported"),
    "gpt2": (lambda: GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=1, n_head=2)),
             "no decoder stack of the form model.{layers, embed_tokens, norm, rotary_emb}, "
             "lm_head"),
    # Structurally Llama's, computing something else: every 4th layer without RoPE; the
    # attention scaled by its own multiplier (1.0 by default, not 1/sqrt(head_dim)); RoPE on
    # interleaved pairs (Helium, Ernie 4.5), which only the probe of the mathematics sees.
    "smollm3": (lambda: SmolLM3ForCausalLM(SmolLM3Config(
                    **{**SIZES, "num_hidden_layers": 4, "pad_token_id": 0})),
                "attention layers without RoPE unsupported"),
    "granite": (lambda: GraniteForCausalLM(GraniteConfig(**SIZES)),
                "attention scale other than 1/sqrt(head_dim) unsupported"),
    "helium": (lambda: sharp(HeliumForCausalLM(HeliumConfig(**SIZES, head_dim=16))),
               "lean forward differs from the model's on a probe (relative error "),
    "ernie4_5": (lambda: sharp(Ernie4_5ForCausalLM(Ernie4_5Config(**SIZES, head_dim=16))),
                 "lean forward differs from the model's on a probe (relative error "),
}
ENGINES = {"reference": ReferenceEngine, "cpu": CpuEngine,
           "cpu-torch-step": lambda: CpuEngine(native=False)}
PROMPTS = [list(range(1, 21)) + [30, 31], list(range(1, 21)) + [40], [5, 6, 7],
           list(range(1, 21)) + [50] * 9]
SETTINGS = SamplingSettings(max_new_tokens=12, temperature=1.0, top_p=1.0, batch_size=64)


class _Tokenizer:
    eos_token_id, pad_token_id = 96, 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def model_of(kind: str):
    torch.manual_seed(0)
    return ACCEPTED[kind]().eval()


def sample(model, engine, prompts, batch_size: int, indexes=None) -> list[list[int]]:
    settings = SamplingSettings(SETTINGS.max_new_tokens, SETTINGS.temperature, SETTINGS.top_p,
                                batch_size)
    completions = generate_completions(model, _Tokenizer(), prompts, 4, settings, seed=7,
                                       stepper=engine.stepper(model), prompt_indexes=indexes,
                                       shared_prefix=20)
    return [list(c.completion_token_ids) for c in completions]


@pytest.mark.parametrize("kind", sorted(ACCEPTED))
def test_the_accelerator_accepts_by_structure(kind):
    engine = engine_for(model_of(kind))
    assert (engine.name, engine.identity()) == ("cpu", {"name": "cpu", "declined": ""})


@pytest.mark.parametrize("kind", sorted(DECLINED))
def test_a_declined_model_goes_to_the_reference_engine_with_its_reason(kind):
    torch.manual_seed(0)
    build, reason = DECLINED[kind]
    identity = engine_for(build()).identity()
    assert identity["name"] == "reference"
    assert identity["declined"].startswith(f"cpu accelerator: {reason}"), identity


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("kind", sorted(ACCEPTED))
def test_every_engine_samples_the_reference_tokens_whatever_the_batch(kind, engine):
    model = model_of(kind)
    expected = sample(model, ReferenceEngine(), PROMPTS, 64)
    assert sample(model, ENGINES[engine](), PROMPTS, 64) == expected
    # One prompt at a time (batch of G rows), its index kept: the same tokens per prompt.
    alone = [row for i, prompt in enumerate(PROMPTS)
             for row in sample(model, ENGINES[engine](), [prompt], 4, indexes=[i])]
    assert alone == expected
    assert len({tuple(row) for row in expected}) > 4  # the draws are not all one sequence


# No common prefix; then a 20-token common prefix with ragged suffixes.
PROMPT_SETS = [
    [[5, 6, 7, 8, 9], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11]],
    [list(range(1, 21)) + [30, 31], list(range(1, 21)) + [40], list(range(1, 21)) + [50] * 19],
]


@pytest.mark.parametrize("prompts", range(len(PROMPT_SETS)))
@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("kind", sorted(ACCEPTED))
def test_every_engine_steps_the_reference_logits_through_prefill_steps_and_row_drops(
        kind, engine, prompts):
    model, prompts = model_of(kind), PROMPT_SETS[prompts]
    reference, stepper = ReferenceEngine().stepper(model), ENGINES[engine]().stepper(model)
    native = row_kernels(torch.float32, torch.device("cpu")) is not None
    assert stepper.name == {"reference": "model-forward", "cpu-torch-step": "lean",
                            "cpu": "lean-native" if native else "lean"}[engine]
    group = 2
    with torch.no_grad():
        expected = reference.prefill(prompts, 0, group, 6)
        got = stepper.prefill(prompts, 0, group, 6)
        assert got.shape == expected.shape == (len(prompts) * group, SIZES["vocab_size"])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        tokens = torch.randint(0, SIZES["vocab_size"], (len(expected),),
                               generator=torch.Generator().manual_seed(1))
        # Rows leave the batch as finished completions do: at step 2 one row of prompts 0 and
        # 2, at step 4 prompt 0's last row (a prompt's cached part stays while rows of it do).
        drops = {2: torch.tensor([0, 2, 3, 5]), 4: torch.tensor([1, 2, 3])}
        for step in range(6):
            if step in drops:
                reference.select(drops[step])
                stepper.select(drops[step])
                tokens = tokens[drops[step]]
            expected, got = reference.step(tokens), stepper.step(tokens)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            tokens = expected.argmax(-1)


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("kind", sorted(ACCEPTED))
def test_every_engine_scores_the_reference_logits(kind, engine):
    model = model_of(kind)
    groups = [(prompt, [[7, 8, 9, 10], [11], list(range(20, 34)), []]) for prompt in PROMPTS[:2]]
    scorer = ENGINES[engine]().scorer(model, PROMPTS[0][:20])
    with torch.no_grad():
        got = scorer(groups, 0)
        for (prompt, completions), logits in zip(groups, got):
            # The truth: one unpadded forward of each whole sequence.
            for completion, row in zip(completions, logits):
                whole = model(torch.tensor([prompt + completion])).logits[0]
                expected = whole[len(prompt) - 1:len(prompt) - 1 + len(completion)]
                assert row.shape == expected.shape
                torch.testing.assert_close(row, expected, atol=1e-4, rtol=1e-4)
        again = teacher_forced_logits(model, [(groups[0][0], c) for c in groups[0][1]], 0)
        for row, reference in zip(got[0], again):
            torch.testing.assert_close(row, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("kind", sorted(ACCEPTED))
def test_every_engine_keeps_the_update_forward_and_its_gradients(kind, engine):
    """A LoRA policy (frozen base, so the accelerator's norms take the native kernels where
    they build): the loss and every LoRA gradient as the model's own forward gives them."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model_of(kind), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False))
    ids = torch.tensor([PROMPTS[0] + [7, 8, 9]])

    def loss_and_grads():
        model.zero_grad()
        loss = model(input_ids=ids).logits.float().logsumexp(-1).sum()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]

    expected, expected_grads = loss_and_grads()
    with ENGINES[engine]().update_forward(model):
        patched = [m for m in model.modules() if "forward" in vars(m) and not hasattr(m, "lora_A")]
        got, grads = loss_and_grads()
    native = row_kernels(torch.float32, torch.device("cpu")) is not None
    assert bool(patched) == (engine == "cpu" and native)  # the norms and MLPs, where they run
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
    assert len(grads) == len(expected_grads) > 0
    for grad, reference in zip(grads, expected_grads):
        torch.testing.assert_close(grad, reference, atol=1e-5, rtol=1e-4)


def _tiny_mistral(directory: Path, tiny_model_dir: Path) -> Path:
    """The tiny Llama's sizes and tokenizer as a Mistral with a 4-token sliding window."""
    from transformers import AutoTokenizer

    llama = json.loads((tiny_model_dir / "config.json").read_text())
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**{k: llama[k] for k in keys}, sliding_window=4))
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(directory)
    return directory


def test_a_declined_architecture_runs_a_whole_job_on_the_reference_engine(tmp_path, tiny_model_dir):
    from grpogate import pipeline
    from grpogate.config import load_config
    from grpogate.evidence.audit import audit_run
    from conftest import TINY_SIZES, _toml_value

    model = _tiny_mistral(tmp_path / "mistral", tiny_model_dir)
    sets = [f"{key}={_toml_value(value)}" for key, value in TINY_SIZES.items()]
    config = load_config("smoke", overrides=sets, model=str(model), out=str(tmp_path / "run"))
    evidence = pipeline.run(config)
    run_dir = Path(evidence["run_dir"])
    recorded = json.loads((run_dir / "evidence.json").read_text())
    assert recorded["environment"]["engine"] == {
        "name": "reference", "declined": "cpu accelerator: sliding-window attention unsupported"}
    assert {s["decode_path"] for s in recorded["steps"]} == {"model-forward"}
    assert recorded["decision"]["decision"] in ("accept", "tune", "reject")
    assert audit_run(run_dir)["mismatches"] == []


def test_the_installed_libraries_are_versions_the_accelerator_was_tested_on():
    from grpogate.engines.cpu.versions import untested_versions

    assert untested_versions() == "", (
        f"{untested_versions()}: the CPU accelerator relies on private APIs of this library and "
        "declines it, so runs take the reference engine. Run tests/test_engine_contract.py and "
        "the accelerator's tests on it, then add it to engines/cpu/versions.py TESTED.")


def test_an_untested_version_sends_the_model_to_the_reference_engine(monkeypatch):
    from grpogate.engines.cpu import versions

    installed = versions.installed_version
    monkeypatch.setattr(versions, "installed_version",
                        lambda name: "5.99.0" if name == "transformers" else installed(name))
    versions.untested_versions.cache_clear()
    try:
        assert engine_for(model_of("llama")).identity() == {
            "name": "reference",
            "declined": "cpu accelerator: transformers 5.99.0 untested (tested: 5.25)"}
    finally:
        versions.untested_versions.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(ACCEPTED))
def test_the_probe_passes_the_accepted_models_by_a_margin(kind, dtype):
    """The accepted architectures, attention sharpened as a trained model's: the lean forward
    within rounding of the model's (measured: 2.6e-7 in float32, 0.006 in bfloat16), far
    under the tolerance, while the interleaved-RoPE models above land near 0.5."""
    from grpogate.engines.cpu.probe import HALF_TOLERANCE, TOLERANCE, probe_distance

    distance = probe_distance(sharp(model_of(kind)).to(dtype))
    assert distance < TOLERANCE.get(dtype, HALF_TOLERANCE) / 5


def test_the_probe_leaves_every_adapter_layer_as_it_found_it():
    """Sampling switches the adapters off around the decode (their deltas merged into the
    weights); the probe, run inside, must leave them off, and after it, on. (PEFT 0.21's own
    `disable_adapter()` restores them too; this holds whichever the probe uses.)"""
    from peft import LoraConfig, get_peft_model

    from grpogate.engines import adapters_disabled
    from grpogate.engines.cpu.probe import probe_distance

    model = get_peft_model(model_of("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    layers = [m for m in model.modules() if hasattr(m, "lora_A")]
    with adapters_disabled(model):
        assert probe_distance(model) < 1e-3
        assert all(layer.disable_adapters for layer in layers)
    assert probe_distance(model) < 1e-3
    assert not any(layer.disable_adapters for layer in layers)
