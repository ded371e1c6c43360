"""`run --resume` trusts no value of a checkpoint's state.json, and a run accepts only when every
configured training step ran.

The checkpoint is a real one: a 4-step run on the tiny model interrupted (SIGINT, in-process)
during step 1, which leaves checkpoints/step-000001. Each case edits a copy the way a stranger
would (a field of state.json rewritten, a tensor file replaced by garbage with its sha256
re-pinned) and resumes it in a fresh interpreter under a 2 GiB address-space cap and a
timeout: exit 2, one `error:` line, and nothing in the run directory changed. The untouched
copy still resumes and completes 4 of 4 steps; `decide` recomputes the step count from the
trajectories.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from synthetic_run import write_synthetic_run
from typer.testing import CliRunner

from grpogate.cli import app
from grpogate.evidence.assemble import assemble_evidence, recorded_facts
from grpogate.evidence.decisions import decide_run
from grpogate.evidence.manifest import build_manifest
from grpogate.files import LOCK_FILE, atomic_write_json, jsonl_bytes, read_jsonl
from grpogate.training import loop as training

SRC = Path(__file__).resolve().parents[1] / "src"
MEMORY_CAP = 2 << 30
STEPS = 4
SIZES = {"train_prompts": 2 * STEPS, "prompts_per_step": 2, "eval_prompts": 2, "group_size": 4,
         "eval_group_size": 2, "max_new_tokens": 8, "lora_r": 4, "generation_batch_size": 16,
         "micro_batch_size": 8, "device": "cpu", "dtype": "float32"}
STATE = "checkpoints/step-000001/state.json"


def alternating(completions, problems, verifier):
    return [1.0 if c.sample_index % 2 == 0 else 0.0 for c in completions]


@pytest.fixture(scope="module")
def interrupted(tiny_model_dir, tmp_path_factory) -> Path:
    """A run of 4 steps stopped by SIGINT during step 1's verification: one checkpoint."""
    calls: list[int] = []

    def rewards_then_signal(completions, problems, verifier):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return alternating(completions, problems, verifier)

    out = tmp_path_factory.mktemp("interrupted") / "run"
    args = ["run", "--profile", "smoke", "--model", str(tiny_model_dir), "--out", str(out)]
    for key, value in SIZES.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    original = training.score_completions
    training.score_completions = rewards_then_signal
    try:
        result = CliRunner().invoke(app, args)
    finally:
        training.score_completions = original
    assert result.exit_code == 130, result.output
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]
    return out


def tree(directory: Path) -> dict[str, str]:
    """Every file's sha256 but the lock's (a resume writes its pid there before it reads)."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


def resume_capped(run_dir: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))

    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "300"}
    return subprocess.run([sys.executable, "-m", "grpogate", "run", "--resume", str(run_dir)],
                          env=env, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=cap)


def edit_state(run_dir: Path, change) -> None:
    """`change(state, checkpoint directory)`, then state.json rewritten."""
    path = run_dir / STATE
    state = json.loads(path.read_text())
    change(state, path.parent)
    path.write_text(json.dumps(state))


def garbage(name: str):
    """Replace a pinned tensor file with garbage and re-pin it, as one who holds the run can."""
    def change(state, directory):
        data = b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage" + os.urandom(64)
        (directory / name).write_bytes(data)
        state["files"][name] = hashlib.sha256(data).hexdigest()
    return change


CASES = {
    "next_step 10^9": (lambda s, _: s.update(next_step=10**9), "field \"next_step\" is 1000000000"),
    "next_step ahead of the records": (lambda s, _: s.update(next_step=3), "field \"next_step\""),
    "a step record dropped": (lambda s, _: s.update(steps=[]), "holds 0 step record(s)"),
    "no trajectories_offset": (lambda s, _: s.pop("trajectories_offset"),
                               "field \"trajectories_offset\" must be a whole number"),
    "trajectories_offset -1": (lambda s, _: s.update(trajectories_offset=-1),
                               "field \"trajectories_offset\" must be a whole number >= 0"),
    "trajectories_offset mid-line": (lambda s, _: s.update(trajectories_offset=5),
                                     "is not the end of a line"),
    "trajectories_offset past the file": (lambda s, _: s.update(trajectories_offset=10**8),
                                          "not a regular file of at least"),
    "garbage trainable.safetensors": (garbage("trainable.safetensors"),
                                      "trainable.safetensors: not a safetensors file"),
    "garbage rng.safetensors": (garbage("rng.safetensors"),
                                "rng.safetensors: not a safetensors file"),
    "rng state of the wrong shape": (lambda s, _: s["rng"].update(python=[3, [1, 2], None]),
                                     "field \"rng\""),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_forged_checkpoint_state_is_one_error_line_and_changes_nothing(interrupted, tmp_path,
                                                                          case):
    change, wanted = CASES[case]
    run_dir = tmp_path / "run"
    shutil.copytree(interrupted, run_dir)

    edit_state(run_dir, change)
    before = tree(run_dir)
    result = resume_capped(run_dir)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(lines) == 1 and wanted in lines[0], result.stderr
    assert result.stdout.strip() == "", result.stdout
    assert "Traceback" not in result.stderr
    assert tree(run_dir) == before  # nothing truncated, appended or half-written


def test_the_untouched_checkpoint_resumes_and_runs_every_step(interrupted, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    shutil.copytree(interrupted, run_dir)
    monkeypatch.setattr(training, "score_completions", alternating)
    result = CliRunner().invoke(app, ["run", "--resume", str(run_dir)])
    assert result.exit_code == 0, result.output
    evidence = json.loads((run_dir / "evidence.json").read_text())
    assert evidence["training_steps"] == {"configured": STEPS, "completed": STEPS,
                                          "early_stop": None}
    assert {r["step"] for r in read_jsonl(run_dir / "trajectories.jsonl")} == set(range(STEPS))
    rows = {r["name"]: r for r in evidence["decision"]["checks"]}
    assert rows["steps"]["passed"] is True and rows["steps"]["value"] == "4/4"


def test_the_interrupted_run_names_its_early_stop(interrupted):
    evidence = json.loads((interrupted / "evidence.json").read_text())
    assert evidence["training_steps"] == {"configured": STEPS, "completed": 1,
                                          "early_stop": "interrupted"}
    rows = {r["name"]: r for r in evidence["decision"]["checks"]}
    assert rows["steps"]["passed"] is True  # named; `execution` rejects the run
    assert "execution" in evidence["decision"]["failed_checks"]


def skipped_pass_run(tmp_path: Path) -> Path:
    """A finished synthetic run (2 steps) whose step 1 never ran, re-assembled and re-pinned
    with the product's own functions: what a resume that skipped a training pass writes."""
    run_dir = write_synthetic_run(tmp_path)
    evidence = json.loads((run_dir / "evidence.json").read_text())
    assert evidence["decision"]["decision"] == "accept"
    trajectories = [r for r in read_jsonl(run_dir / "trajectories.jsonl") if r["step"] == 0]
    (run_dir / "trajectories.jsonl").write_bytes(jsonl_bytes(trajectories))
    eval_records = read_jsonl(run_dir / "eval_completions.jsonl")
    forged = assemble_evidence(recorded_facts(evidence), evidence["config"],
                               evidence["steps"][:1], trajectories, eval_records)
    atomic_write_json(run_dir / "evidence.json", forged)
    atomic_write_json(run_dir / "manifest.json", build_manifest(forged, run_dir, trajectories))
    return run_dir


def test_a_run_that_skipped_a_training_pass_is_rejected_and_decide_agrees(tmp_path):
    run_dir = skipped_pass_run(tmp_path)
    evidence = json.loads((run_dir / "evidence.json").read_text())
    assert evidence["training_steps"] == {"configured": 2, "completed": 1, "early_stop": None}
    assert evidence["decision"]["decision"] == "reject"
    assert "steps" in evidence["decision"]["failed_checks"]
    decided = CliRunner().invoke(app, ["decide", str(run_dir)])
    assert "agrees" in decided.output and "reject" in decided.output, decided.output


def test_decide_recomputes_the_step_count_from_the_trajectories(tmp_path):
    """The forged run claims 2 of 2 steps (and accept): decide counts 1 in the trajectories."""
    run_dir = skipped_pass_run(tmp_path)
    evidence = json.loads((run_dir / "evidence.json").read_text())
    evidence["training_steps"]["completed"] = 2
    evidence["decision"] = decide_run(evidence, evidence["config"]["gates"])
    assert evidence["decision"]["decision"] == "accept"  # the lie, decided on its own terms
    atomic_write_json(run_dir / "evidence.json", evidence)
    trajectories = read_jsonl(run_dir / "trajectories.jsonl")
    atomic_write_json(run_dir / "manifest.json", build_manifest(evidence, run_dir, trajectories))
    decided = CliRunner().invoke(app, ["decide", str(run_dir)])
    assert decided.exit_code == 4, decided.output
    assert "training_steps" in decided.output, decided.output


@pytest.mark.parametrize("section, status, passed", [
    ({"configured": 4, "completed": 4, "early_stop": None}, "ok", True),
    ({"configured": 4, "completed": 1, "early_stop": None}, "ok", False),
    ({"configured": 4, "completed": 1, "early_stop": "interrupted"}, "ok", False),
    ({"configured": 4, "completed": 1, "early_stop": "interrupted"}, "interrupted", True),
    ({"configured": 4, "completed": 5, "early_stop": None}, "ok", False),
    ({"configured": 4, "completed": True, "early_stop": None}, "ok", False),
    ({"configured": "4", "completed": 4, "early_stop": None}, "ok", False),
    ("4/4", "ok", False),
])
def test_the_steps_row(section, status, passed):
    from grpogate.evidence.step_checks import steps_rows

    [row] = steps_rows({"training_steps": section, "status": status})
    assert row["passed"] is passed and row["on_fail"] == "reject"
    assert steps_rows({"status": "ok"}) == []  # a run gated from another trainer's log


def test_the_steps_row_is_in_the_whole_run_decision():
    evidence = {"training_steps": {"configured": 4, "completed": 1, "early_stop": None}}
    assert "steps" in decide_run(evidence, {})["failed_checks"]
