"""Shared fixtures: a tiny random-weight Llama saved as a Hugging Face directory (no download);
the native kernels, or a skip where they do not build.

The tokenizer is the bundled SmolLM2 one (vocabulary 49,152, EOS id 2), so chat templates and
EOS handling are the real ones; the weights are 2 layers of hidden size 64, built from a config
and seeded, so every test that loads them sees the same model in well under a second.
"""

from __future__ import annotations

from pathlib import Path

import pytest

GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"

# Small sizes for runs on the tiny model: 2 steps of 2 prompts x G=4, 4 eval prompts x 2.
TINY_SIZES = {
    "train_prompts": 4,
    "prompts_per_step": 2,
    "eval_prompts": 4,
    "group_size": 4,
    "eval_group_size": 2,
    "max_new_tokens": 8,
    "lora_r": 4,
    "generation_batch_size": 16,
    "micro_batch_size": 8,
    "device": "cpu",
    "dtype": "float32",
}


@pytest.fixture(scope="session")
def kernels():
    """The native kernels (sampling/native.py) for float32 CPU tensors."""
    import torch

    from grpogate.sampling import native

    found = native.native_kernels(torch.float32, torch.device("cpu"))
    if found is None:
        pytest.skip("no C++ compiler with OpenMP on this machine: the torch path runs")
    return found


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    # The tiny model's kernels are too small to gain from threads, and on a machine shared with
    # other work two intra-op threads wait on each other (measured: 40x slower generate).
    # torch is imported here, not at module level, so pure-module tests stay torch-free.
    torch.set_num_threads(1)

    from grpogate.config import BUNDLED_MODEL, RunConfig
    from grpogate.inputs.policy import default_cache_dir, resolve_base_model

    # Cached after the first dequantization (about 20 s once, then under a second).
    source = resolve_base_model(BUNDLED_MODEL, "", default_cache_dir(RunConfig()))
    tokenizer = AutoTokenizer.from_pretrained(source.load_dir)
    assert tokenizer.eos_token_id == 2
    directory = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


@pytest.fixture(scope="session")
def tiny_config(tiny_model_dir):
    """Factory: tiny_config(tmp_path, "task.train_split=test", group_size=4) -> RunConfig.

    Positional strings are raw `--set` overrides (dotted keys); keyword arguments are top-level
    keys. The run directory is `<tmp_path>/run` unless `out` is given.
    """
    from grpogate.config import load_config

    def make(tmp_path: Path, *sets: str, out: str | None = None, **overrides):
        values = {**TINY_SIZES, **overrides}
        texts = [f"{key}={_toml_value(value)}" for key, value in values.items()] + list(sets)
        return load_config("smoke", overrides=texts, model=str(tiny_model_dir),
                           out=out if out is not None else str(Path(tmp_path) / "run"))

    return make
