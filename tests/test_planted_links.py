"""Links, FIFOs and huge files planted in a run directory, a checkpoint or a TRL output
directory, built the way a stranger would (a real symlink, os.mkfifo, a sparse file): every
writer refuses to write through them and every reader refuses to follow them out of their root
or to block on them. Each case: exit 2, one `error:` line, the file outside byte-identical.

The hostile-size cases (a FIFO, /dev/zero and a 2 GiB sparse `state.json`) run the CLI in a
subprocess under a 2 GiB address-space cap and a timeout, so a regression fails the test
instead of hanging or exhausting the machine.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import key_pair
from synthetic_run import write_synthetic_run
from typer.testing import CliRunner

from grpogate.cli import app
from grpogate.files import LOCK_FILE

SRC = Path(__file__).resolve().parents[1] / "src"
PRECIOUS = b"a file outside the run directory that grpogate must never write\n"
SIZES = {"train_prompts": 6, "prompts_per_step": 2, "eval_prompts": 2, "group_size": 4,
         "eval_group_size": 2, "max_new_tokens": 8, "lora_r": 4, "generation_batch_size": 16,
         "micro_batch_size": 8, "device": "cpu", "dtype": "float32"}
MEMORY_CAP = 2 << 30


def outside(tmp_path: Path) -> Path:
    path = tmp_path / "outside" / "precious.txt"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(PRECIOUS)
    return path


def error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), output
    return lines[0]


def errors_only(stderr: str) -> str:
    """The one `error:` line of a subprocess's stderr (libraries may log there before it)."""
    return error_line("\n".join(line for line in stderr.splitlines() if line.startswith("error:")))


def refused(args: list, wanted: str) -> str:
    """The CLI in-process: exit 2 and one error line holding `wanted`."""
    result = CliRunner().invoke(app, list(map(str, args)))
    assert result.exit_code == 2, result.output
    line = error_line(result.stderr)
    assert result.stdout.strip() == "", result.output
    assert wanted in line, line
    return line


def capped(*args, timeout: float = 240) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter under a 2 GiB address-space cap (this checkout first)."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))

    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "grpogate", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout, preexec_fn=cap)


# --- writers: the lock, the trajectories log, checkpoints, the signature --------------------------

def test_report_refuses_a_lock_linked_outside(tmp_path):
    run, target = write_synthetic_run(tmp_path), outside(tmp_path)
    (run / LOCK_FILE).symlink_to(target)
    refused(["report", run], f"{LOCK_FILE}: a symbolic link")
    assert target.read_bytes() == PRECIOUS and not (run / "report.html").exists()


def test_sign_refuses_a_lock_or_a_signature_linked_outside(tmp_path):
    pytest.importorskip("model_signing", reason="the signing extra is not installed")
    run, target = write_synthetic_run(tmp_path), outside(tmp_path)
    private, public = key_pair(tmp_path)
    (run / LOCK_FILE).symlink_to(target)
    refused(["sign", run, "--key", private], f"{LOCK_FILE}: a symbolic link")
    assert target.read_bytes() == PRECIOUS and not os.path.lexists(run / "run.sig")

    # A link planted under the signature's own name: refused, its target untouched.
    (run / LOCK_FILE).unlink()
    (run / "run.sig").symlink_to(target)
    refused(["sign", run, "--key", private], "run.sig: a symbolic link")
    assert target.read_bytes() == PRECIOUS
    (run / "run.sig").unlink()
    result = CliRunner().invoke(app, ["sign", str(run), "--key", str(private)])
    assert result.exit_code == 0, result.output
    assert CliRunner().invoke(app, ["decide", str(run), "--verify-key", str(public)]).exit_code == 0


def fixed_rewards(completions, problems, verifier):
    return [1.0 if c.sample_index % 2 == 0 else 0.0 for c in completions]


@pytest.fixture(scope="module")
def stopped_run(tiny_model_dir, tmp_path_factory) -> Path:
    """A real tiny run stopped by SIGTERM after step 0's checkpoint: resumable."""
    from grpogate.training import loop as training

    out = tmp_path_factory.mktemp("stopped") / "run"
    calls: list[int] = []

    def rewards_then_sigterm(completions, problems, verifier):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return fixed_rewards(completions, problems, verifier)

    args = ["run", "--profile", "smoke", "--model", str(tiny_model_dir), "--out", str(out)]
    for key, value in SIZES.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(training, "score_completions", rewards_then_sigterm)
        assert CliRunner().invoke(app, args).exit_code == 143
    assert any((out / "checkpoints").glob("step-*"))
    return out


@pytest.fixture
def resumable(stopped_run, tmp_path, monkeypatch) -> Path:
    from grpogate.training import loop as training

    monkeypatch.setattr(training, "score_completions", fixed_rewards)
    run = tmp_path / "run"
    shutil.copytree(stopped_run, run, symlinks=True)
    return run


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def test_resume_refuses_a_lock_linked_outside(resumable, tmp_path):
    target = outside(tmp_path)
    (resumable / LOCK_FILE).symlink_to(target)
    before = snapshot(resumable)
    refused(["run", "--resume", resumable], f"{LOCK_FILE}: a symbolic link")
    assert target.read_bytes() == PRECIOUS and snapshot(resumable) == before


def test_resume_refuses_trajectories_linked_outside(resumable, tmp_path):
    target = outside(tmp_path)
    target.write_bytes((resumable / "trajectories.jsonl").read_bytes())
    kept = target.read_bytes()
    (resumable / "trajectories.jsonl").unlink()
    (resumable / "trajectories.jsonl").symlink_to(target)
    before = snapshot(resumable)
    refused(["run", "--resume", resumable], "trajectories.jsonl: a symbolic link")
    assert target.read_bytes() == kept and snapshot(resumable) == before


def test_resume_refuses_checkpoints_linked_outside(resumable, tmp_path):
    moved = tmp_path / "outside" / "checkpoints"
    moved.parent.mkdir(exist_ok=True)
    shutil.move(resumable / "checkpoints", moved)
    (resumable / "checkpoints").symlink_to(moved)
    before = snapshot(moved)
    refused(["run", "--resume", resumable], "checkpoints: escapes the run directory")
    assert snapshot(moved) == before


def test_a_writer_refuses_a_fifo_or_link_in_its_place(tmp_path):
    from grpogate.errors import InputError
    from grpogate.files import JsonlLog, open_in_run_dir

    target = outside(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "trajectories.jsonl")
    with pytest.raises(InputError, match="not a regular file"):
        JsonlLog(run / "trajectories.jsonl", existing=True).append([{"a": 1}])
    (run / "linked").symlink_to(target.parent)
    with pytest.raises(InputError, match="not a real folder"):
        open_in_run_dir(run, "linked/precious.txt", "a")
    assert target.read_bytes() == PRECIOUS


def test_the_tensorboard_folder_of_a_run_is_never_a_planted_link(tmp_path):
    from types import SimpleNamespace

    from grpogate.errors import InputError
    from grpogate.evidence.trackers import Trackers

    pytest.importorskip("tensorboard", reason="the trackers extra is not installed")
    elsewhere = tmp_path / "outside" / "events"
    elsewhere.mkdir(parents=True)
    run = tmp_path / "run"
    run.mkdir()
    (run / "tensorboard").symlink_to(elsewhere)
    config = SimpleNamespace(tensorboard="", report_to=["tensorboard"], to_dict=dict)
    with pytest.raises(InputError, match="tensorboard: not a real folder"):
        Trackers(config, run, "label")
    assert list(elsewhere.iterdir()) == []


# --- readers: a checkpoint's state.json -----------------------------------------------------------

def planted_state(tmp_path: Path, plant) -> Path:
    """A run directory whose newest checkpoint's state.json is what `plant(path)` puts there."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000001").mkdir(parents=True)
    (run / "trajectories.jsonl").write_bytes(b"")
    plant(run / "checkpoints" / "step-000001" / "state.json")
    return run


def sparse(path: Path) -> None:
    with open(path, "wb") as stream:
        stream.truncate(2 << 30)


@pytest.mark.parametrize("plant, wanted", [
    (os.mkfifo, "state.json: not a regular file"),
    (lambda path: path.symlink_to("/dev/zero"), "state.json: escapes the run directory"),
    (sparse, "state.json: 2147483648 bytes, over the limit"),
], ids=["fifo", "dev-zero", "sparse-2GiB"])
def test_resume_refuses_a_hostile_state_file_without_blocking_or_reading_it(tmp_path, plant,
                                                                             wanted):
    run = planted_state(tmp_path, plant)
    result = capped("run", "--resume", run)
    assert result.returncode == 2, (result.stdout, result.stderr[-2000:])
    assert wanted in errors_only(result.stderr) and result.stdout.strip() == ""


def test_resume_refuses_a_state_file_linked_outside(tmp_path):
    target = outside(tmp_path)
    target.write_text(json.dumps({"checkpoint_format": 1}))
    kept = target.read_bytes()
    run = planted_state(tmp_path, lambda path: path.symlink_to(target))
    refused(["run", "--resume", run], "state.json: escapes the run directory")
    assert target.read_bytes() == kept


# --- readers: a TRL output directory --------------------------------------------------------------

@pytest.fixture(scope="module")
def peft_adapter(tiny_model_dir, tmp_path_factory) -> Path:
    """A real PEFT LoRA adapter of the tiny model, saved as TRL's save_model saves one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("adapter")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))
    peft.save_pretrained(directory)
    return directory


def trainer_state() -> dict:
    steps = [{"step": s, "loss": 0.0, "frac_reward_zero_std": 0.5, "reward": 0.5,
              "completions/clipped_ratio": 0.0} for s in (1, 2)]
    return {"global_step": 2, "train_batch_size": 8, "log_history": steps + [
        {"step": 2, "train_runtime": 1.0}]}


def gate(trl_dir: Path, tmp_path: Path, model_dir: Path, wanted: str) -> str:
    args = ["gate", "--profile", "smoke", "--from-trl", trl_dir, "--num-generations", 4,
            "--baseline", model_dir, "--train-from-config", "--out", tmp_path / "gated"]
    for key, value in SIZES.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    line = refused(args, wanted)
    assert not (tmp_path / "gated").exists()
    return line


def test_gate_refuses_a_checkpoint_folder_linked_outside(peft_adapter, tiny_model_dir, tmp_path):
    elsewhere = tmp_path / "outside" / "checkpoint"
    shutil.copytree(peft_adapter, elsewhere)
    (elsewhere / "trainer_state.json").write_text(json.dumps(trainer_state()))
    before = snapshot(elsewhere)
    trl_dir = tmp_path / "trl"
    trl_dir.mkdir()
    (trl_dir / "checkpoint-9").symlink_to(elsewhere)
    gate(trl_dir, tmp_path, tiny_model_dir, "checkpoint-9: escapes the TRL output directory")
    assert snapshot(elsewhere) == before


def test_gate_refuses_adapter_weights_linked_outside(peft_adapter, tiny_model_dir, tmp_path):
    target = tmp_path / "outside" / "weights.safetensors"
    target.parent.mkdir()
    shutil.copyfile(peft_adapter / "adapter_model.safetensors", target)
    kept = target.read_bytes()
    trl_dir = tmp_path / "trl"
    trl_dir.mkdir()
    shutil.copyfile(peft_adapter / "adapter_config.json", trl_dir / "adapter_config.json")
    (trl_dir / "adapter_model.safetensors").symlink_to(target)
    (trl_dir / "trainer_state.json").write_text(json.dumps(trainer_state()))
    gate(trl_dir, tmp_path, tiny_model_dir,
         "adapter_model.safetensors: escapes the TRL output directory")
    assert target.read_bytes() == kept
