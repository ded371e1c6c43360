"""A run directory from a stranger is data: `decide`, `report`, `decide --replay` and
`run --resume` never run code it names, never open a path outside it or one that is not a
regular file, never hang, and bound their cost. Every row: the forged input, the exit code and
the message.

The code-execution rows plant a marker: a run naming `os:popen` with completions that would
`touch` a file, and a real tiny run whose user reward lives in a module that appends to a marker
file when it is imported or called. The marker must not exist after each command; with
`--trust-reward-code` (the user's explicit opt-in) it does, which shows that the marker would
catch an execution.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from synthetic_run import safetensors_bytes, write_synthetic_run

from grpogate.config import load_config
from grpogate.errors import InputError
from grpogate.files import atomic_write_json, read_safetensors
from grpogate.inputs.rewards import build_reward_set

SRC = Path(__file__).resolve().parents[1] / "src"
REWARD = "grpogate_marker_reward:brevity"
MARKER_MODULE = '''
import os


def _mark(what):
    path = os.environ.get("GRPOGATE_TEST_MARKER")
    if path:
        with open(path, "a") as stream:
            stream.write(what + "\\n")


_mark("imported")


def brevity(completion, reference):
    _mark("called")
    return 1.0 / (1.0 + len(str(completion)))
'''


def grpogate(*args, paths=(), marker=None, timeout=120) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter (nothing imported beforehand), this checkout first."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), *map(str, paths)]),
           "COLUMNS": "200"}
    env.pop("GRPOGATE_TEST_MARKER", None)
    if marker is not None:
        env["GRPOGATE_TEST_MARKER"] = str(marker)
    return subprocess.run([sys.executable, "-m", "grpogate", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, (result.stdout, result.stderr)
    assert "error:" not in result.stdout, result.stdout
    return lines[0]


def edit_json(path: Path, change) -> None:
    document = json.loads(path.read_text())
    change(document)
    atomic_write_json(path, document)


# --- item 1: no code a run directory names is ever run -------------------------------------------

@pytest.fixture
def popen_run(tmp_path) -> tuple[Path, Path]:
    """A forged run whose evidence names `os:popen` as a reward, with completions that would
    create the marker and references "r" (popen's read mode): the audit at 999896d ran it."""
    run = write_synthetic_run(tmp_path)
    marker = tmp_path / "popen-marker"

    def add_popen(evidence):
        evidence["config"]["rewards"] = [{"name": "correctness", "weight": 1.0},
                                         {"name": "os:popen", "weight": 1.0}]
        evidence["inputs"]["rewards"].append({"name": "os:popen", "weight": 1.0,
                                              "version": "os:popen@sha256:0000000000000000"})
    edit_json(run / "evidence.json", add_popen)
    records = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    for record in records:
        record["completion"] = f"touch {marker}"
        record["rewards"]["os:popen"] = 0.0
    (run / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    problems = [json.loads(line) for line in (run / "problems.jsonl").read_text().splitlines()]
    (run / "problems.jsonl").write_text("".join(json.dumps({**p, "reference": "r"}) + "\n"
                                                for p in problems))
    return run, marker


def test_decide_never_runs_a_reward_the_run_directory_names(popen_run):
    run, marker = popen_run
    result = grpogate("decide", run)
    assert not marker.exists()
    assert result.returncode == 4, result.stdout  # the forgery changed hashed files
    assert ("re-scored: correctness; taken as recorded (user code, not run): os:popen "
            "(re-score with --trust-reward-code MODULE:FUNCTION)") in result.stdout
    audit = json.loads(grpogate("decide", run, "--json").stdout)
    assert not marker.exists()
    assert audit["rescoring"]["components_as_recorded"] == ["os:popen"]
    assert audit["rescoring"]["components_rescored"] == ["correctness"]


def test_report_and_replay_never_run_a_reward_the_run_directory_names(popen_run):
    run, marker = popen_run
    report = grpogate("report", run)
    assert report.returncode == 0, report.stdout + report.stderr
    assert not marker.exists()
    replay = grpogate("decide", run, "--replay", "1", timeout=300)
    assert not marker.exists()
    # The audit runs first (reject: the forgery changed hashed files), then the replay finds
    # that the recorded model does not exist on this machine.
    assert replay.returncode == 2, replay.stdout + replay.stderr
    assert "taken as recorded (user code, not run): os:popen" not in replay.stdout
    assert error_line(replay).startswith("error:")


def test_trusting_code_the_run_does_not_record_is_refused(popen_run):
    run, marker = popen_run
    result = grpogate("decide", run, "--trust-reward-code", "os:system")
    assert result.returncode == 2
    assert error_line(result) == ("error: --trust-reward-code os:system: the run records no "
                                   "such reward component (its user components: os:popen)")
    assert not marker.exists()


@pytest.fixture(scope="session")
def marker_module(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("marker-module")
    (directory / "grpogate_marker_reward.py").write_text(MARKER_MODULE)
    return directory


@pytest.fixture(scope="session")
def user_reward_run(tiny_config, tmp_path_factory, marker_module) -> tuple[Path, Path]:
    """A real tiny run trained on correctness + the marker module's reward (imported here, with
    no marker set); its checkpoints are kept, and a copy without the manifest is a killed run
    that `--resume` could continue. Returns (finished run, resumable copy)."""
    from grpogate import delivery, pipeline

    root = tmp_path_factory.mktemp("user-reward-run")
    sys.path.insert(0, str(marker_module))
    try:
        config = tiny_config(root, f'rewards=[{{name = "correctness", weight = 1.0}}, '
                                   f'{{name = "{REWARD}", weight = 0.5}}]')
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(delivery, "remove_checkpoints", lambda run_dir: None)
            evidence = pipeline.run(config)
    finally:
        sys.path.remove(str(marker_module))
        sys.modules.pop("grpogate_marker_reward", None)
    run = Path(evidence["run_dir"])
    resumable = root / "killed"
    shutil.copytree(run, resumable)
    (resumable / "manifest.json").unlink()
    return run, resumable


def test_decide_takes_a_user_reward_as_recorded_and_runs_none_of_it(user_reward_run,
                                                                    marker_module, tmp_path):
    run, _ = user_reward_run
    marker = tmp_path / "marker"
    result = grpogate("decide", run, paths=[marker_module], marker=marker)
    assert not marker.exists()
    assert result.returncode == 0, result.stdout
    assert (f"re-scored: correctness; taken as recorded (user code, not run): {REWARD}"
            in result.stdout)
    assert "agrees with the run's own decision" in result.stdout


def test_trusted_reward_code_of_the_recorded_version_is_re_scored_and_agrees(
        user_reward_run, marker_module, tmp_path):
    run, _ = user_reward_run
    marker = tmp_path / "marker"
    result = grpogate("decide", run, "--trust-reward-code", REWARD, paths=[marker_module],
                      marker=marker)
    assert result.returncode == 0, result.stdout
    assert f"re-scored: correctness, {REWARD}\n" in result.stdout
    assert "agrees with the run's own decision" in result.stdout
    # Opted in: the module was imported and the function called (the marker works).
    assert marker.read_text().splitlines()[:2] == ["imported", "called"]


def test_trusted_reward_code_of_another_version_is_not_imported(user_reward_run, tmp_path):
    run, _ = user_reward_run
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / "grpogate_marker_reward.py").write_text(MARKER_MODULE + "\n# edited\n")
    marker = tmp_path / "marker"
    result = grpogate("decide", run, "--trust-reward-code", REWARD, paths=[edited], marker=marker)
    assert not marker.exists()  # the source hash is compared before the module is imported
    assert result.returncode == 4
    assert (f"mismatch inputs.rewards {REWARD} version (--trust-reward-code: not the code the "
            "run recorded; its values are taken as recorded)") in result.stdout


def test_report_and_replay_of_a_user_reward_run_run_none_of_it(user_reward_run, marker_module,
                                                              tmp_path):
    run, _ = user_reward_run
    marker = tmp_path / "marker"
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)  # report writes into the directory
    report = grpogate("report", copy, paths=[marker_module], marker=marker)
    assert report.returncode == 0, report.stdout + report.stderr
    replay = grpogate("decide", run, "--replay", "1", paths=[marker_module], marker=marker,
                      timeout=300)
    assert not marker.exists()
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "completions equal to the stored ones" in replay.stdout


def test_resume_imports_only_reward_code_the_user_names(user_reward_run, marker_module,
                                                        tmp_path):
    _, resumable = user_reward_run
    killed = tmp_path / "killed"
    shutil.copytree(resumable, killed)
    marker = tmp_path / "marker"
    refused = grpogate("run", "--resume", killed, paths=[marker_module], marker=marker,
                       timeout=300)
    assert not marker.exists()
    assert refused.returncode == 2
    assert error_line(refused) == (
        f"error: {killed}: the run's rewards name user code ({REWARD}); --resume imports only "
        "reward code you name: pass --config FILE (or --set 'rewards=[...]') with the same "
        "rewards as the run")
    named = grpogate("run", "--resume", killed, "--set",
                     f'rewards=[{{name = "correctness", weight = 1.0}}, '
                     f'{{name = "{REWARD}", weight = 0.5}}]',
                     paths=[marker_module], marker=marker, timeout=300)
    assert named.returncode == 0, named.stdout + named.stderr
    assert marker.read_text().splitlines()[0] == "imported"  # named by the user: imported


# --- item 4: every path the run names is a regular file inside it; the cost is bounded --------

def test_an_artifact_path_outside_the_run_is_refused_before_it_is_opened(tmp_path):
    run = write_synthetic_run(tmp_path)
    fifos = tmp_path / "fifos"
    fifos.mkdir()
    os.mkfifo(fifos / "adapter_model.safetensors")
    for path in ("/etc/ssl", "../fifos", str(fifos)):
        edit_json(run / "evidence.json", lambda e: e["artifact"].update(path=path))
        result = grpogate("decide", run, timeout=60)  # a FIFO opened would hang past this
        assert result.returncode == 2, result.stdout
        assert error_line(result) == (f"error: {run}/evidence.json: field artifact.path "
                                      f"{path!r} is not a folder inside the run directory")


@pytest.mark.parametrize("name", ["adapter/extra.bin", "evidence.json"])
def test_a_fifo_in_the_run_directory_is_refused_not_waited_on(tmp_path, name):
    run = write_synthetic_run(tmp_path)
    (run / name).unlink(missing_ok=True)
    os.mkfifo(run / name)
    result = grpogate("decide", run, timeout=60)
    assert result.returncode == 2, result.stdout
    not_a_run = f"error: {run}: not a run directory (no evidence.json, or not a regular file)"
    expected = (f"error: {run}/adapter/extra.bin: not a file; a run's adapter/ holds only the "
                "adapter's files (remove it, or this is not a grpogate run directory)"
                if name.startswith("adapter") else not_a_run)
    assert error_line(result) == expected
    report = grpogate("report", run, timeout=60)
    if name == "evidence.json":
        assert report.returncode == 2
        assert error_line(report) == not_a_run


def test_more_records_than_the_config_runs_is_refused(tmp_path):
    run = write_synthetic_run(tmp_path)
    # 2 steps x 2 prompts x G=4 x 1 round = 16 training records; doubled to 32.
    text = (run / "trajectories.jsonl").read_text()
    (run / "trajectories.jsonl").write_text(text + text)
    result = grpogate("decide", run)
    assert result.returncode == 2
    assert error_line(result) == ("error: trajectories.jsonl: 32 records, more than a run of the "
                                  "recorded config writes (16); not a grpogate run directory")


def test_max_rescore_samples_and_says_what_it_sampled(tmp_path):
    run = write_synthetic_run(tmp_path)
    result = grpogate("decide", run, "--max-rescore", "3")
    assert result.returncode == 0, result.stdout
    # 16 training + 2 policies x 2 prompts x 4 samples = 32 records, 3 of them re-scored.
    assert "re-scored: correctness; verifier re-run on 3 of 32 records (random sample, seed " \
        in result.stdout
    assert "the others' values taken as recorded" in result.stdout


def test_a_long_re_scoring_announces_its_cost_first(tmp_path):
    run = write_synthetic_run(tmp_path)

    def math_verify(evidence):
        evidence["inputs"]["verifier"] = {"name": "math-verify-v1", "version": "math-verify-v2"}
    edit_json(run / "evidence.json", math_verify)
    result = grpogate("decide", run)
    # 32 records x 5 s (math-verify's per-completion limit) = 160 s at most; x 0.01 s = 0.32 s.
    assert result.stderr.splitlines()[0] == (
        "decide: re-scoring 32 of 32 records with math-verify-v1: about 0 s, at most 160 s "
        "(each call's time limit); --max-rescore N re-scores a sample")
    capped = grpogate("decide", run, "--max-rescore", "4")
    assert "decide: re-scoring" not in capped.stderr  # 4 x 5 s = 20 s: under the 30 s threshold


# --- item 6: a flagged file is never read; no error message quotes a file -----------------------

SECRET = b"root:x:0:0:root:/root:/bin/bash\n"


def test_symlinked_weights_are_flagged_and_never_read(tmp_path):
    run = write_synthetic_run(tmp_path)
    fifo = tmp_path / "outside.fifo"
    os.mkfifo(fifo)  # reading it would hang: the timeout proves it is not read
    weights = run / "adapter" / "adapter_model.safetensors"
    weights.unlink()
    weights.symlink_to(fifo)
    result = grpogate("decide", run, timeout=60)
    assert result.returncode == 4, result.stdout
    assert ("mismatch files.adapter/adapter_model.safetensors: recorded" in result.stdout
            or "files.adapter/adapter_model.safetensors (escapes the run directory)"
            in result.stdout)
    audit = json.loads(grpogate("decide", run, "--json", timeout=60).stdout)
    fields = [m["field"] for m in audit["mismatches"]]
    assert "files.adapter/adapter_model.safetensors (escapes the run directory)" in fields
    assert "artifact.sha256" in fields  # recomputed as None: the file was not hashed


def test_safetensors_errors_quote_no_byte_of_the_file(tmp_path):
    secret = tmp_path / "passwd"
    secret.write_bytes(SECRET)
    with pytest.raises(InputError) as caught:
        read_safetensors(secret)
    message = str(caught.value)
    assert message == (f"{secret}: truncated or not a safetensors file (its header length field "
                       f"exceeds the file of {len(SECRET)} bytes)")
    assert str(int.from_bytes(SECRET[:8], "little")) not in message
    bad_header = tmp_path / "bad.safetensors"
    bad_header.write_bytes((4).to_bytes(8, "little") + b"\xffroo")
    with pytest.raises(InputError) as caught:
        read_safetensors(bad_header)
    assert str(caught.value) == f"{bad_header}: malformed safetensors header (UnicodeDecodeError)"


def test_a_real_safetensors_file_still_reads(tmp_path):
    path = tmp_path / "ok.safetensors"
    path.write_bytes(safetensors_bytes({"a": [1.0, 2.0]}))
    dtype, shape, data = read_safetensors(path)["a"]
    assert (dtype, shape, bytes(data)) == ("torch.float32", (2,), b"\x00\x00\x80?\x00\x00\x00@")


# --- item 3: weights bounded so totals stay finite; an early failure leaves nothing -------------

@pytest.mark.parametrize("weight, accepted", [(1e6, True), (-1e6, True), (1000001.0, False),
                                              (1e308, False), (-1e308, False)])
def test_reward_weights_are_bounded_at_admission(weight, accepted):
    override = f'rewards=[{{name = "correctness", weight = {weight!r}}}]'
    if accepted:
        assert load_config(overrides=[override]).rewards[0]["weight"] == weight
        return
    with pytest.raises(InputError) as caught:
        load_config(overrides=[override])
    assert str(caught.value) == (f"config: rewards[0].weight must be within +-1e+06 (got "
                                 f"{weight!r}) so that reward totals stay finite")


def test_the_overlong_penalty_factor_is_bounded():
    with pytest.raises(InputError, match=r"overlong_penalty_factor must be a number in \[0, 1e\+06\]"):
        load_config(overrides=["overlong_penalty_factor=1e308"])


def test_a_user_reward_beyond_the_value_bound_scores_zero_and_is_counted(tmp_path, monkeypatch):
    (tmp_path / "huge_reward_22.py").write_text(
        "def huge(c, r):\n    return 1e300\n\ndef edge(c, r):\n    return -1e6\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = build_reward_set([{"name": "huge_reward_22:huge", "weight": 1e6},
                                {"name": "huge_reward_22:edge", "weight": 1.0}], "v",
                               max_new_tokens=8, overlong_buffer_len=4,
                               overlong_penalty_factor=1.0, user_time_limit_seconds=1.0)
    values = rewards.score("x", "#### 1", 1, correctness=0.0)
    sys.modules.pop("huge_reward_22", None)
    assert values == {"huge_reward_22:huge": 0.0, "huge_reward_22:edge": -1e6}
    assert rewards.error_count == 1
    assert rewards.total(values) == -1e6  # 1e6 x 0 + 1 x -1e6


def test_recorded_rewards_that_overflow_are_mismatches_not_a_traceback(tmp_path):
    run = write_synthetic_run(tmp_path)
    path = run / "trajectories.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record in records[:4]:  # 4 x 1e308 overflows any sum of them
        record["reward"] = record["rewards"]["correctness"] = 1e308
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = grpogate("decide", run)
    assert result.returncode == 4, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "mismatch trajectories.jsonl:1 reward: recorded 1e+308, recomputed 1.0" in result.stdout
    assert ("mismatch evidence (cannot be rebuilt from the stored records: OverflowError "
            "intermediate overflow in fsum)") in result.stdout


def test_a_run_failing_before_its_first_checkpoint_leaves_nothing(tiny_model_dir, tmp_path,
                                                                  monkeypatch):
    from typer.testing import CliRunner

    from grpogate import pipeline
    from grpogate.cli import app

    def overflow(*args, **kwargs):
        raise OverflowError("math range error")

    monkeypatch.setattr(pipeline, "train", overflow)  # the training stage
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", "--profile", "smoke", "--model", str(tiny_model_dir),
                                      "--out", str(out), "--set", "train_prompts=2",
                                      "--set", "prompts_per_step=2", "--set", "eval_prompts=2",
                                      "--set", "device='cpu'", "--set", "dtype='float32'"])
    assert result.exit_code == 1, result.output
    assert error_line(result) == (
        f"error: {out}: the run failed before its first checkpoint (OverflowError: math range "
        "error); its directory was removed, so the same --out can be used again once the cause "
        "is fixed")
    assert not out.exists()


def test_a_run_killed_before_its_first_checkpoint_is_replaced_by_a_new_run(tiny_config,
                                                                           tmp_path):
    from grpogate import pipeline
    from grpogate.training.checkpoint import checkpoint_to_resume

    out = tmp_path / "run"
    out.mkdir()  # what a SIGKILL before the first checkpoint leaves: the log and the lock
    (out / "trajectories.jsonl").write_text('{"step": 0}\n')
    (out / ".grpogate.lock").write_text("999999\n")
    with pytest.raises(InputError) as caught:
        checkpoint_to_resume(out)
    assert str(caught.value) == (f"{out}: no complete checkpoint (the run stopped before its "
                                 "first update step finished); start a new run with a new "
                                 "--label, or the same --out: it replaces this one")
    evidence = pipeline.run(tiny_config(tmp_path, out=str(out)))
    assert evidence["run_dir"] == str(out) and (out / "manifest.json").is_file()
    assert '{"step": 0}' not in (out / "trajectories.jsonl").read_text()


def test_a_directory_holding_anything_else_is_never_replaced(tiny_config, tmp_path):
    from grpogate import pipeline

    out = tmp_path / "run"
    out.mkdir()
    (out / "trajectories.jsonl").write_text("")
    (out / ".grpogate.lock").write_text("999999\n")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(InputError) as caught:
        pipeline.admit(tiny_config(tmp_path, out=str(out)))
    assert str(caught.value) == (f"{out}: output already exists; choose a new run label "
                                 "(--label) or --out")
    assert (out / "notes.txt").read_text() == "mine"


# --- item 11: math-verify reads bare LaTeX references, and refuses one it cannot read -----------

def test_math_verify_reads_a_bare_latex_reference():
    from grpogate.inputs.verifiers import MathVerifyVerifier

    verifier = MathVerifyVerifier()
    try:
        assert verifier.score("$\\boxed{2\\sqrt{2}}$", "\\sqrt{8}") == 1.0
        # Unwrapped, "2\sqrt{2}" parsed as its leading 2: the answer 2 scored 1.0.
        assert verifier.score("$\\boxed{2}$", "#### 2\\sqrt{2}") == 0.0
        assert verifier.score("$\\boxed{2\\sqrt{2}}$", "#### 2\\sqrt{2}") == 1.0
        assert verifier.readable("\\sqrt{8}") and not verifier.readable("olleh")
    finally:
        verifier.close()


def test_a_run_whose_references_math_verify_cannot_read_does_not_start(tmp_path):
    from grpogate import pipeline

    config = load_config("smoke", overrides=[
        "task.name=spell_backward", "task.params={}", "verifier=math-verify-v1",
        "train_prompts=2", "prompts_per_step=2", "eval_prompts=2"], out=str(tmp_path / "run"))
    with pytest.raises(InputError) as caught:
        pipeline.admit(config)
    message = str(caught.value)
    assert message.startswith("reasoning-gym/spell_backward:seed=")
    assert ': field "answer": math-verify-v1 cannot read the reference answer ' in message
    assert message.endswith("as math (not even as $...$ LaTeX); fix it, or choose another "
                            "verifier")
    assert not (tmp_path / "run").exists()
