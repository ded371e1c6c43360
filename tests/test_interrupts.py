"""SIGINT / SIGTERM: the run stops at the next safe point, writes `interrupted` evidence with the
decision `reject` (naming `execution`) and the manifest last, and exits 130 / 143.

The signal is sent by the test process to itself from inside a patched stage, through the CLI
run in-process (typer's CliRunner), so the moment is exact and the handlers are the real ones.
"""

from __future__ import annotations

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
    # The manifest was written last and pins what is there; no checkpoint is left behind.
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "interrupted" and manifest["decision"] == "reject"
    assert not (out / "checkpoints").exists()
    recorded = {key: value for key, value in evidence.items() if key != "decision"}
    assert decisions.decide_run(recorded, evidence["config"]["gates"]) == evidence["decision"]
    # `grpogate decide` re-checks it from the files (training rewards aside: patched here).
    mismatches = [m["field"] for m in audit_run(out)["mismatches"]
                  if not re.fullmatch(r"trajectories\.jsonl:\d+ rewards?(\.correctness)?", m["field"])]
    assert mismatches == []


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
