"""SIGINT / SIGTERM: the run stops at the next safe point, writes `interrupted` evidence with the
decision `reject` (naming `execution`) and the manifest last, and exits 130 / 143.

The signal is sent by the test process to itself from inside a patched stage, through the CLI
run in-process (typer's CliRunner), so the moment is exact and the handlers are the real ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from grpogate.evidence import decisions
from grpogate import pipeline
from grpogate.training import loop as training
from grpogate.evidence.audit import audit_run
from grpogate.cli import app
from grpogate.files import read_jsonl
from grpogate.interrupts import stop_on_signals

SIZES = {"train_prompts": 6, "prompts_per_step": 2, "eval_prompts": 2, "group_size": 4,
         "eval_group_size": 2, "max_new_tokens": 8, "lora_r": 4, "generation_batch_size": 16,
         "micro_batch_size": 8, "device": "cpu", "dtype": "float32"}


def cli_args(model_dir: Path, out: Path) -> list[str]:
    args = ["run", "--profile", "smoke", "--model", str(model_dir), "--out", str(out)]
    for key, value in SIZES.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    return args


@pytest.mark.parametrize("signal_number, exit_code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_a_rollout_stops_before_its_update(tiny_model_dir, tmp_path, monkeypatch,
                                                           signal_number, exit_code):
    def rewards_then_signal(completions, problems, verifier):
        calls.append(1)
        if len(calls) == 2:  # during step 1's verification
            os.kill(os.getpid(), signal_number)
        return [1.0 if c.sample_index % 2 == 0 else 0.0 for c in completions]

    calls: list[int] = []
    monkeypatch.setattr(training, "score_completions", rewards_then_signal)
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    out = tmp_path / "run"
    result = CliRunner().invoke(app, cli_args(tiny_model_dir, out))
    assert result.exit_code == exit_code, result.output
    assert {number: signal.getsignal(number) for number in handlers} == handlers  # restored

    evidence = json.loads((out / "evidence.json").read_text())
    name = signal.Signals(signal_number).name
    assert f"interrupted by {name}" in result.output
    assert evidence["status"] == "interrupted"
    assert evidence["interruption"] == {"signal": name, "completed_steps": 1,
                                        "safe_point": "after the rollout of step 1, before its update"}
    assert evidence["decision"]["decision"] == "reject"
    assert "execution" in evidence["decision"]["failed_checks"]
    # Step 1 never reached its update: its trajectories are not part of the run.
    assert {r["step"] for r in read_jsonl(out / "trajectories.jsonl")} == {0}
    assert [s["step"] for s in evidence["steps"]] == [0]
    assert evidence["rollout"]["total_trajectories"] == 2 * 4
    # The re-test was skipped; its fields exist, flagged, and cannot pass a quality gate.
    comparison = evidence["comparison"]
    assert comparison["skipped"] is True and comparison["reward_mean_gain"] == 0.0
    assert {"reward", "pass_at_group", "length_budget"} <= set(evidence["decision"]["failed_checks"])
    assert (out / "eval_completions.jsonl").read_text() == ""
    # The interim manifest was written last and pins what is there; the checkpoint stays, so
    # the polite stop keeps what a SIGKILL would have kept.
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "interrupted" and manifest["decision"] == "reject"
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000001"]
    assert f"grpogate run --resume {out}" in result.output
    recorded = {key: value for key, value in evidence.items() if key != "decision"}
    assert decisions.decide_run(recorded, evidence["config"]["gates"]) == evidence["decision"]
    # `grpogate decide` re-checks it from the files (training rewards aside: patched here).
    mismatches = [m["field"] for m in audit_run(out)["mismatches"]
                  if not re.fullmatch(r"trajectories\.jsonl:\d+ rewards?(\.correctness)?", m["field"])]
    assert mismatches == []


def fixed_rewards(completions, problems, verifier):
    return [1.0 if c.sample_index % 2 == 0 else 0.0 for c in completions]


def test_a_sigterm_stopped_run_resumes_to_the_uninterrupted_result(tiny_model_dir, tmp_path,
                                                                   monkeypatch):
    calls: list[int] = []

    def rewards_then_sigterm(completions, problems, verifier):
        calls.append(1)
        if len(calls) == 2:  # during step 1's verification: stops before its update
            os.kill(os.getpid(), signal.SIGTERM)
        return fixed_rewards(completions, problems, verifier)

    monkeypatch.setattr(training, "score_completions", rewards_then_sigterm)
    out = tmp_path / "run"
    runner = CliRunner()
    result = runner.invoke(app, cli_args(tiny_model_dir, out))
    assert result.exit_code == 143, result.output
    assert json.loads((out / "manifest.json").read_text())["status"] == "interrupted"
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000001"]

    monkeypatch.setattr(training, "score_completions", fixed_rewards)
    result = runner.invoke(app, ["run", "--resume", str(out)])
    assert result.exit_code == 0, result.output
    reference = tmp_path / "reference" / "run"  # the same label: trace ids include it
    result = runner.invoke(app, cli_args(tiny_model_dir, reference))
    assert result.exit_code == 0, result.output

    for name in ("adapter/adapter_model.safetensors", "trajectories.jsonl",
                 "eval_completions.jsonl"):
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    evidence = json.loads((out / "evidence.json").read_text())
    assert evidence["status"] == "ok" and [s["step"] for s in evidence["steps"]] == [0, 1, 2]
    assert [r["from_step"] for r in evidence["resumes"]] == [1]
    manifest = json.loads((out / "manifest.json").read_text())  # the final one replaced it
    assert manifest["status"] == "ok"
    assert manifest["new_policy_version"] == json.loads(
        (reference / "manifest.json").read_text())["new_policy_version"]
    assert not (out / "checkpoints").exists()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # lock released
    result = runner.invoke(app, ["run", "--resume", str(out)])
    assert result.exit_code == 2 and "the run is complete" in result.output, result.output


def test_a_signal_during_the_last_update_skips_the_retest(tiny_model_dir, tmp_path, monkeypatch):
    real_update, calls = training.update_with_retry, []

    def update_then_signal(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the last of 3 steps
            os.kill(os.getpid(), signal.SIGINT)
        return real_update(*args, **kwargs)

    monkeypatch.setattr(training, "score_completions",
                        lambda completions, problems, verifier: [
                            1.0 if c.sample_index % 2 == 0 else 0.0 for c in completions])
    monkeypatch.setattr(training, "update_with_retry", update_then_signal)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, cli_args(tiny_model_dir, out))
    assert result.exit_code == 130, result.output
    evidence = json.loads((out / "evidence.json").read_text())
    assert evidence["interruption"]["safe_point"] == "before the re-test"
    assert evidence["interruption"]["completed_steps"] == 3
    assert evidence["update"]["update_count"] == 3  # every step finished
    assert evidence["comparison"]["skipped"] is True
    assert evidence["decision"]["decision"] == "reject"
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_a_signal_while_loading_writes_nothing(tiny_model_dir, tmp_path, monkeypatch):
    real_load = pipeline.load_policy

    def load_then_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(pipeline, "load_policy", load_then_signal)
    result = CliRunner().invoke(app, cli_args(tiny_model_dir, tmp_path / "run"))
    assert result.exit_code == 143, result.output
    assert "before anything was written" in result.output
    assert not (tmp_path / "run").exists()


def test_a_second_signal_stops_at_once_and_the_run_resumes(tiny_model_dir, tmp_path,
                                                           monkeypatch):
    calls: list[int] = []

    def rewards_then_two_signals(completions, problems, verifier):
        calls.append(1)
        if len(calls) == 2:  # step 1: the second Ctrl-C raises KeyboardInterrupt right here
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return [1.0 if c.sample_index % 2 == 0 else 0.0 for c in completions]

    monkeypatch.setattr(training, "score_completions", rewards_then_two_signals)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, cli_args(tiny_model_dir, out))
    assert result.exit_code == 130, result.output
    assert f"grpogate run --resume {out}" in result.output
    assert not (out / "manifest.json").exists()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000001"]

    result = CliRunner().invoke(app, ["run", "--resume", str(out)])
    assert result.exit_code == 0, result.output
    evidence = json.loads((out / "evidence.json").read_text())
    assert evidence["status"] == "ok" and [s["step"] for s in evidence["steps"]] == [0, 1, 2]
    assert [r["from_step"] for r in evidence["resumes"]] == [1]


def test_a_second_signal_stops_at_once_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with stop_on_signals() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.requested and stop.signal_name == "SIGTERM"
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


HOLD_LOCK = """
import sys, time
from grpogate.files import RunDirLock
lock = RunDirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_writer_of_a_run_directory_is_refused_naming_the_holder(tiny_model_dir, tmp_path,
                                                                        monkeypatch):
    import subprocess
    import sys

    out = interrupted_run(tiny_model_dir, tmp_path / "run", monkeypatch)
    before = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert holder.stdout.readline() == b"held\n"
        for args in (["run", "--resume", str(out)], ["report", str(out)]):
            result = CliRunner().invoke(app, args)
            assert result.exit_code == 2, result.output
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            assert result.stdout.strip() == "", result.output
            assert lines == [f"error: {out}: in use by another grpogate process (pid "
                             f"{holder.pid}); wait for it to finish or stop it first"], lines
        after = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()
                 if p.name != ".grpogate.lock"}
        assert after == before  # the refused resume truncated, wrote and removed nothing
    finally:
        holder.kill()
        holder.wait()
    # The holder died: the kernel dropped its lock, and the run resumes.
    result = CliRunner().invoke(app, ["run", "--resume", str(out)])
    assert result.exit_code == 0, result.output


def interrupted_run(model_dir: Path, out: Path, monkeypatch) -> Path:
    """A run stopped by SIGTERM after step 0's checkpoint; training rewards fixed from then on."""
    calls: list[int] = []

    def rewards_then_sigterm(completions, problems, verifier):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return fixed_rewards(completions, problems, verifier)

    monkeypatch.setattr(training, "score_completions", rewards_then_sigterm)
    assert CliRunner().invoke(app, cli_args(model_dir, out)).exit_code == 143
    monkeypatch.setattr(training, "score_completions", fixed_rewards)
    return out


def test_a_malformed_optimizer_state_on_resume_is_one_error_line(tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    import io

    import torch

    out = interrupted_run(tiny_model_dir, tmp_path / "run", monkeypatch)
    checkpoint = out / "checkpoints" / "step-000001"
    buffer = io.BytesIO()  # plain tensor data (weights_only admits it), not this optimizer's
    torch.save({"state": {}, "param_groups": [{"params": [0, 1, 2]}]}, buffer)
    (checkpoint / "optimizer.pt").write_bytes(buffer.getvalue())
    state = json.loads((checkpoint / "state.json").read_text())
    state["files"]["optimizer.pt"] = hashlib.sha256(buffer.getvalue()).hexdigest()
    (checkpoint / "state.json").write_text(json.dumps(state))
    before = {str(p): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    result = CliRunner().invoke(app, ["run", "--resume", str(out)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "optimizer.pt: not this run's optimizer state" in lines[0], lines
    assert result.stdout.strip() == ""
    assert {str(p): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_full_disk_during_a_run_is_one_error_line_with_the_os_reason(tiny_model_dir, tmp_path,
                                                                       monkeypatch):
    import errno

    from grpogate.training import checkpoint as checkpoints

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "run" / "x"))

    monkeypatch.setattr(training, "score_completions", fixed_rewards)
    monkeypatch.setattr(checkpoints, "save_tensors", no_space)
    result = CliRunner().invoke(app, cli_args(tiny_model_dir, tmp_path / "run"))
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert lines == [f"error: {tmp_path / 'run' / 'x'}: No space left on device; free space or "
                     "choose another --out (a started run continues with --resume)"]
