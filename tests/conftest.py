"""Shared fixtures: a tiny random-weight Llama saved as a Hugging Face directory (no download);
the native kernels, or a skip where they do not build.

The tokenizer is the bundled SmolLM2 one (vocabulary 49,152, EOS id 2), so chat templates and
EOS handling are the real ones; the weights are 2 layers of hidden size 64, built from a config
and seeded, so every test that loads them sees the same model in well under a second.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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
    """The native kernels (engines/cpu/native.py) for float32 CPU tensors."""
    import torch

    from grpogate.engines.cpu import native

    found = native.native_kernels(torch.float32, torch.device("cpu"))
    if found is None:
        pytest.skip("no C++ compiler with OpenMP on this machine: the torch path runs")
    return found


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny random Llama (2 layers, hidden 64) on the bundled SmolLM2's tokenizer, built by
    the decision study's own builder (bench/decision_quality.py), so tests and `--quick` share
    one model."""
    import sys

    import torch

    # The tiny model's kernels are too small to gain from threads, and on a machine shared with
    # other work two intra-op threads wait on each other (measured: 40x slower generate).
    # torch is imported here, not at module level, so pure-module tests stay torch-free.
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from decision_quality import tiny_model

    directory = tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(directory).eos_token_id == 2
    return directory


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> tuple[Path, str, str, dict]:
    """`grpogate run --profile smoke` on the real bundled SmolLM2 at two threads, run once a
    session: test_smoke checks its files, output and the dry run's forecast of it,
    test_thread_invariance repeats it under MALLOC_PERTURB_. The threads are fixed because that
    repeat compares bytes at one thread count. Returns (run directory, stdout, stderr,
    {"wall": the run's seconds, "dry_run": the same command's --dry-run --json, made first on
    the same machine}); readers copy the directory before changing anything."""
    out = tmp_path_factory.mktemp("smoke") / "run"
    command = [sys.executable, "-m", "grpogate.cli", "run", "--profile", "smoke", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    dry = subprocess.run(command + ["--dry-run", "--json"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert dry.returncode == 0, dry.stdout[-3000:] + dry.stderr[-3000:]
    started = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    wall = time.perf_counter() - started
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result.stdout, result.stderr, {"wall": wall, "dry_run": json.loads(dry.stdout)}


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


@pytest.fixture(scope="session")
def alternating_run(tiny_config, tmp_path_factory):
    """One tiny run trained on the alternating reward (every group valid, every step updates;
    helpers.alternating_rewards), with tensorboard on, under umask 022: test_pipeline,
    test_delivery, test_trl_gate and test_trl_isolation read it. Returns (config, run
    directory, evidence as returned); a test that changes the run copies it first."""
    from grpogate import pipeline
    from grpogate.training import loop as training
    from helpers import alternating_rewards

    root = tmp_path_factory.mktemp("alternating")
    config = tiny_config(root, tensorboard=str(root / "tensorboard"))
    previous = os.umask(0o022)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(training, "score_completions", alternating_rewards)
            evidence = pipeline.run(config)
    finally:
        os.umask(previous)
    return config, Path(evidence["run_dir"]), evidence


@pytest.fixture(scope="session")
def honest_run(tiny_config, tmp_path_factory) -> dict:
    """One tiny run of 2 train and 2 eval prompts scored by the real verifier end to end: the
    random model earns no reward, so nothing updates. test_pipeline and test_delivery read it;
    returns the evidence as returned (its run_dir names the directory)."""
    from grpogate import pipeline

    root = tmp_path_factory.mktemp("honest")
    return pipeline.run(tiny_config(root, train_prompts=2, eval_prompts=2))
