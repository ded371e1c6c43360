"""Kill a real `grpogate run` with SIGKILL at a random moment, resume it, get the same run.

The runs are subprocesses of the CLI on the tiny random Llama (CPU, one torch thread, fixed
seed), with dynamic sampling on. As in test_pipeline, the training-time verifier is replaced by a
fixed reward pattern (even samples 1, odd 0, on about half the prompts) so that steps refill and
make real optimizer updates; the re-test uses the real verifier. The moment of the kill is drawn from a seed printed on failure; set
GRPOGATE_KILL_SEED to replay one.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import sha256
from typer.testing import CliRunner

from grpogate.evidence.audit import audit_run
from grpogate.files import read_jsonl
from grpogate.cli import app

# The CLI in a fresh interpreter: one torch thread (a shared 2-core machine), the fixed reward
# pattern patched in before the app starts.
LAUNCHER = """
import sys
import torch
torch.set_num_threads(1)
from grpogate.training import loop as training
# About half the prompts (by their id's first hex digit) get a valid group, so dynamic sampling
# refills most steps: the resumed run must continue at the checkpointed prompt cursor.
training.score_completions = lambda completions, problems, verifier: [
    1.0 if c.sample_index % 2 == 0 and problems[c.prompt_index].prompt_id[0] in "01234567"
    else 0.0 for c in completions]
from grpogate.cli import app
app(sys.argv[1:], prog_name="grpogate")
"""
STEPS = 6
SETTINGS = {"train_prompts": 2 * STEPS, "prompts_per_step": 2, "eval_prompts": 4,
            "group_size": 4, "eval_group_size": 2, "max_new_tokens": 8, "lora_r": 4,
            "generation_batch_size": 16, "micro_batch_size": 8, "device": "cpu",
            "dtype": "float32", "seed": 7, "dynamic_sampling": True, "max_generation_rounds": 3,
            # Wall-clock throughput differs between any two runs: keep it out of the decision.
            "gates.minimum_effective_trajectories_per_second": 0.0}

# What legitimately differs between two runs of the same config: clocks, dates, where the run
# lives, how many times it was resumed, and the process's memory high-water mark.
VOLATILE_KEYS = {"created", "run_label", "label", "out", "run_dir", "resumes", "timings",
                 "resources", "evidence_sha256"}
VOLATILE_SUFFIXES = ("_seconds", "per_second")
VOLATILE_CHECK_VALUES = {"effective_throughput", "memory"}  # decision rows read from the above


def strip_volatile(document):
    """`document` without timings, timestamps, paths, run label and memory, at any depth."""
    if isinstance(document, list):
        return [strip_volatile(item) for item in document]
    if not isinstance(document, dict):
        return document
    kept = {}
    for key, value in document.items():
        if key in VOLATILE_KEYS or key.endswith(VOLATILE_SUFFIXES):
            continue
        if key == "value" and document.get("name") in VOLATILE_CHECK_VALUES:
            continue
        kept[key] = strip_volatile(value)
    return kept


def test_strip_volatile_removes_only_what_differs_between_runs():
    document = {"created": "t", "status": "ok", "timings": {"total_seconds": 1.0},
                "steps": [{"step": 0, "update_seconds": 0.2, "loss": [0.5]}],
                "config": {"out": "/a/run", "label": "", "seed": 7},
                "decision": {"checks": [{"name": "memory", "value": 10, "passed": True},
                                        {"name": "reward", "value": 0.1, "passed": True}]}}
    assert strip_volatile(document) == {
        "status": "ok", "steps": [{"step": 0, "loss": [0.5]}], "config": {"seed": 7},
        "decision": {"checks": [{"name": "memory", "passed": True},
                                {"name": "reward", "value": 0.1, "passed": True}]}}


def cli_args(model_dir: Path) -> list[str]:
    args = ["run", "--profile", "smoke", "--model", str(model_dir)]
    for key, value in SETTINGS.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    return args


def start(args: list[str], log: Path) -> subprocess.Popen:
    stream = open(log, "wb")
    return subprocess.Popen([sys.executable, "-c", LAUNCHER, *args], stdout=stream,
                            stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "200"})


def wait_for(predicate, process: subprocess.Popen, timeout: float = 300.0) -> float:
    """Poll every 10 ms; returns the time it became true. Fails if the process exits first."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert process.poll() is None, f"process exited ({process.returncode}) before the wait"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
    return time.monotonic()


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))


def tree(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): sha256(p) for p in sorted(directory.rglob("*"))
            if p.is_file()}


def assert_same_trajectories(resumed: Path, reference: Path, where: str) -> None:
    """Every record equal field for field — tokens, text, rewards, ids exactly — except the
    sampler's float32 log-probs (decode-path rounding, not trained on), held to 1e-5. One
    run in eight on a loaded machine was once seen with a differing trajectories file but an
    identical adapter, cause unconfirmed; a failure here names the line and the field."""
    got, want = read_jsonl(resumed), read_jsonl(reference)
    assert len(got) == len(want), where
    for line, (a, b) in enumerate(zip(got, want), 1):
        logp_a, logp_b = a.pop("sampler_logprobs", None), b.pop("sampler_logprobs", None)
        assert a == b, f"{where}: trajectories.jsonl:{line}"
        assert (logp_a is None) == (logp_b is None) and len(logp_a or []) == len(logp_b or []), where
        assert all(abs(x - y) <= 1e-5 for x, y in zip(logp_a or [], logp_b or [])), \
            f"{where}: trajectories.jsonl:{line} sampler_logprobs"


def test_a_run_killed_at_a_random_moment_resumes_to_the_same_result(tiny_model_dir, tmp_path):
    seed = int(os.environ.get("GRPOGATE_KILL_SEED", random.SystemRandom().randrange(2**32)))
    rng = random.Random(seed)
    args = cli_args(tiny_model_dir)

    # 1. The uninterrupted reference; it also measures the window in which a kill is resumable.
    reference = tmp_path / "reference" / "run"
    process = start(args + ["--out", str(reference)], tmp_path / "reference.log")
    first_checkpoint = wait_for(lambda: checkpoints(reference), process)
    manifest_written = wait_for(lambda: (reference / "manifest.json").exists(), process)
    assert process.wait(timeout=300) == 0, (tmp_path / "reference.log").read_text()
    window = manifest_written - first_checkpoint

    # 2. The same run, killed with SIGKILL at a random moment after its first checkpoint. On a
    # busy machine the run may outpace the window and finish first; then try a shorter delay.
    delay = rng.uniform(0.0, 0.8 * window)
    for attempt in range(3):
        killed = tmp_path / f"killed-{attempt}" / "run"
        where = f"kill seed {seed}: SIGKILL {delay:.3f} s after the first checkpoint"
        process = start(args + ["--out", str(killed)], tmp_path / "killed.log")
        wait_for(lambda: checkpoints(killed), process)
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        if not (killed / "manifest.json").exists():
            break
        delay /= 4
    assert process.returncode == -signal.SIGKILL, where
    assert not (killed / "manifest.json").exists(), f"{where}: the run finished every time"
    state = json.loads((killed / "checkpoints" / checkpoints(killed)[-1] / "state.json").read_text())
    where += (f" (last checkpoint: next step {state['next_step']}, "
              f"prompt cursor {state['next_prompt']})")
    print(where)  # shown with -s and in the report of a failure
    # A kill in the middle of an append leaves a torn line after the checkpoint's offset; make
    # sure there is one, so that the truncation is exercised whatever the moment was.
    with open(killed / "trajectories.jsonl", "ab") as stream:
        stream.write(b'{"step": 99, "prompt_id": "torn')

    # 3. A resume that would change the config, or relocate the run, is refused untouched.
    before = tree(killed)
    runner = CliRunner()
    for extra, message in ((["--seed", "8"], "seed (stored 7, given 8)"),
                           (["--set", "group_size=8"], "group_size (stored 4, given 8)"),
                           (["--out", str(tmp_path / "elsewhere")], "do not pass --out")):
        result = runner.invoke(app, ["run", "--resume", str(killed), *extra])
        assert result.exit_code == 2, result.output
        assert message in result.output, result.output
    assert tree(killed) == before

    # 4. Resume (repeating a stored value is not a change) and finish normally.
    process = start(["run", "--resume", str(killed), "--seed", "7"], tmp_path / "resume.log")
    assert process.wait(timeout=300) == 0, f"{where}\n{(tmp_path / 'resume.log').read_text()}"

    # 5. Same adapter, same trajectories and re-test completions, same evidence numbers.
    for name in ("adapter/adapter_model.safetensors", "adapter/adapter_config.json",
                 "eval_completions.jsonl"):
        assert sha256(killed / name) == sha256(reference / name), f"{where}: {name}"
    assert_same_trajectories(killed / "trajectories.jsonl", reference / "trajectories.jsonl", where)
    evidence = {run: json.loads((run / "evidence.json").read_text()) for run in (reference, killed)}
    assert evidence[reference]["status"] == "ok"
    assert evidence[reference]["update"]["update_count"] == STEPS  # real updates every step
    assert evidence[reference]["rollout"]["dynamic_sampling"]["refill_prompts"] > 0
    assert strip_volatile(evidence[killed]) == strip_volatile(evidence[reference]), where
    assert evidence[killed]["resumes"][0]["from_step"] == state["next_step"]
    assert evidence[reference]["resumes"] == []
    manifests = {run: json.loads((run / "manifest.json").read_text()) for run in (reference, killed)}
    for manifest in manifests.values():
        manifest["files"].pop("evidence.json")
    assert strip_volatile(manifests[killed]) == strip_volatile(manifests[reference]), where
    assert manifests[killed]["adapter"]["sha256"] == sha256(killed / "adapter/adapter_model.safetensors")
    # A finished run keeps no checkpoint and no staging leftovers, and audits clean apart from
    # the training rewards, which the audit re-scores with the real verifier (patched here).
    assert not (killed / "checkpoints").exists()
    assert not [p.name for p in killed.iterdir() if p.name.startswith(".")]
    mismatches = [m["field"] for m in audit_run(killed)["mismatches"]
                  if not re.fullmatch(r"trajectories\.jsonl:\d+ rewards?(\.correctness)?",
                                      m["field"])]
    assert mismatches == [], where

    # 6. A complete run cannot be resumed.
    result = runner.invoke(app, ["run", "--resume", str(killed)])
    assert result.exit_code == 2 and "the run is complete" in result.output, result.output


def test_resume_without_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    result = CliRunner().invoke(app, ["run", "--resume", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert "no complete checkpoint" in result.output
    assert list((tmp_path / "run").iterdir()) == []


# --- the checkpoint files themselves -------------------------------------------------------------


def small_training_state(seed: int):
    import torch

    torch.manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(3, 2))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    weight.grad = torch.ones_like(weight)
    optimizer.step()
    return weight, optimizer


def test_a_checkpoint_restores_tensors_optimizer_and_rng_and_replaces_the_previous(tmp_path):
    import numpy as np
    import torch

    from grpogate.training.checkpoint import latest_checkpoint, restore_training_state, save_checkpoint

    weight, optimizer = small_training_state(0)
    save_checkpoint(tmp_path, {"next_step": 1}, {"w": weight}, optimizer)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    path = save_checkpoint(tmp_path, {"next_step": 2, "note": "second"}, {"w": weight}, optimizer)
    expected_draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    assert checkpoints(tmp_path) == ["step-000002"] and path.name == "step-000002"

    other, other_optimizer = small_training_state(1)
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint.state["note"] == "second"
    restore_training_state(checkpoint, {"w": other}, other_optimizer)
    assert torch.equal(other, weight)
    assert torch.equal(other_optimizer.state_dict()["state"][0]["exp_avg"],
                       optimizer.state_dict()["state"][0]["exp_avg"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected_draws


def test_a_damaged_or_pickled_checkpoint_is_refused(tmp_path, monkeypatch):
    import pickle

    from grpogate.training.checkpoint import latest_checkpoint, restore_training_state, save_checkpoint
    from grpogate.errors import InputError

    weight, optimizer = small_training_state(0)
    path = save_checkpoint(tmp_path, {"next_step": 1}, {"w": weight}, optimizer)
    (path / "optimizer.pt").write_bytes(b"truncated")
    with pytest.raises(InputError, match="does not match the sha256 recorded"):
        latest_checkpoint(tmp_path)

    # Even a file whose hash was forged to match is only read as tensors, never unpickled.
    monkeypatch.chdir(tmp_path)

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch pwned",))

    forged = pickle.dumps(Payload())
    (path / "optimizer.pt").write_bytes(forged)
    state = json.loads((path / "state.json").read_text())
    state["files"]["optimizer.pt"] = hashlib.sha256(forged).hexdigest()
    (path / "state.json").write_text(json.dumps(state))
    with pytest.raises(InputError, match="refused, not plain tensor data"):
        restore_training_state(latest_checkpoint(tmp_path), {"w": weight}, optimizer)
    assert not (tmp_path / "pwned").exists()
