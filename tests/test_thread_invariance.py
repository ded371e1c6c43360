"""What the trajectories depend on, on the real bundled SmolLM2: the number of processes does
not change them at one thread per process (`grpogate run --nproc 2`, whose workers run one
thread each, equals one process run with OMP_NUM_THREADS=1, adapter and trajectories byte for
byte). The number of threads per process can change them: bfloat16 matrix products split their
work by thread count, so their sums round differently after the first update (README, "Several
processes"). This test holds the guarantee the README states.
"""

import hashlib
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def _run(out, *extra, threads: str = "1") -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS=threads)
    return subprocess.run([sys.executable, "-m", "grpogate.cli", "run", "--profile", "smoke",
                           "--out", str(out), *extra], env=env, capture_output=True, text=True,
                          timeout=1200)


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_one_and_two_processes_at_one_thread_each_train_the_same_adapter(tmp_path):
    one, two = tmp_path / "one" / "run", tmp_path / "two" / "run"
    for out, extra in ((one, ()), (two, ("--nproc", "2"))):
        result = _run(out, *extra)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (two / "trajectories.jsonl").read_bytes() == (one / "trajectories.jsonl").read_bytes()
    assert (two / "eval_completions.jsonl").read_bytes() == (
        one / "eval_completions.jsonl").read_bytes()
    weights = "adapter/adapter_model.safetensors"
    assert _sha256(two / weights) == _sha256(one / weights)
    decisions = [json.loads((run / "evidence.json").read_text())["decision"]["decision"]
                 for run in (one, two)]
    assert decisions[0] == decisions[1]


def test_two_runs_of_one_seed_at_two_threads_repeat_whatever_memory_held(smoke_run, tmp_path):
    """At a fixed thread count a run repeats. The second run has glibc fill every fresh heap
    allocation with a non-zero byte (MALLOC_PERTURB_), so a buffer the decoder read without
    writing would change its tokens: the native step's own caches, left as torch.empty, made
    a process's first decode differ in 3 of 9 processes (docs/measurements.md). The plain run
    is conftest's `smoke_run` (two threads, the same command)."""
    plain, perturbed = smoke_run[0], tmp_path / "perturbed" / "run"
    env = dict(os.environ, OMP_NUM_THREADS="2", MALLOC_PERTURB_="165")
    result = subprocess.run([sys.executable, "-m", "grpogate.cli", "run", "--profile", "smoke",
                             "--out", str(perturbed)], env=env, capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (perturbed / "trajectories.jsonl").read_bytes() == (
        plain / "trajectories.jsonl").read_bytes()
    weights = "adapter/adapter_model.safetensors"
    assert _sha256(perturbed / weights) == _sha256(plain / weights)
