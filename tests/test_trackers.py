"""--report-to: the same scalars reach TensorBoard, MLflow, W&B and Trackio, read back where we can."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import grpogate
from grpogate.config import load_config
from grpogate.errors import InputError
from grpogate.evidence import trackers
from grpogate.evidence.trackers import Trackers, final_scalars, step_scalars

STEP = {"step": 0, "mean_reward": 0.25, "valid_group_ratio": 0.5, "mean_kl": 0.01,
        "clip_fraction": 0.0, "loss": [0.2, 0.4], "grad_norm": [], "rollout_seconds": 2.0,
        "verification_seconds": 0.1, "update_seconds": 3.0, "generation_tokens_per_second": 400.0}
EVIDENCE = {"decision": {"decision": "tune"},
            "comparison": {"reward_mean_gain": -0.03125, "pass_at_group_gain": 0.125,
                           "baseline": {"mean_reward": 0.15625}, "candidate": {"mean_reward": 0.125}}}


def test_step_scalars_by_hand():
    scalars = step_scalars(STEP)
    assert scalars["update/loss"] == pytest.approx(0.3)  # mean of the two optimizer steps (0.2+0.4)/2
    assert "update/grad_norm" not in scalars  # no optimizer step recorded a norm
    assert scalars["train/reward"] == 0.25 and len(scalars) == 9


def test_final_scalars_by_hand():
    assert final_scalars(EVIDENCE) == {
        "decision/accept": 0.0, "decision/tune": 1.0, "decision/reject": 0.0,
        "final/reward_mean_gain": -0.03125, "final/pass_at_group_gain": 0.125,
        "final/baseline_mean_reward": 0.15625, "final/candidate_mean_reward": 0.125}


def log_a_run(tmp_path: Path, *names: str, **keys) -> None:
    config = load_config("smoke", overrides=[f"report_to={','.join(names)}"], **keys)
    opened = Trackers(config, tmp_path, "test-run")
    assert [name for name, _ in opened.opened] == list(names)
    opened.log_step(STEP)
    opened.log_step(STEP | {"step": 1, "mean_reward": 0.5})
    opened.log_final(EVIDENCE)
    opened.close("tune")


def test_tensorboard_files_read_back_with_the_tensorboard_package(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_a_run(tmp_path, "tensorboard")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/reward")] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("decision/tune")] == [(2, 1.0)]


def test_mlflow_against_a_local_sqlite_store(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    log_a_run(tmp_path, "mlflow")
    client = mlflow.tracking.MlflowClient(uri)
    experiment = client.get_experiment_by_name("grpogate")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "test-run" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/reward")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.5)]
    assert run.data.metrics["final/reward_mean_gain"] == -0.03125
    assert run.data.tags["decision"] == "tune"
    assert run.data.params["group_size"] == "4"  # the smoke profile's G


def test_wandb_logs_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    log_a_run(tmp_path, "wandb")
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


def test_trackio_logs_locally(tmp_path):
    pytest.importorskip("trackio")
    # trackio reads TRACKIO_DIR once, at import: a fresh interpreter gets the temporary one.
    source = str(Path(grpogate.__file__).resolve().parents[1])
    tests = str(Path(__file__).resolve().parent)
    code = ("from pathlib import Path\nfrom test_trackers import log_a_run\n"
            f"log_a_run(Path({str(tmp_path)!r}), 'trackio')\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, cwd=tmp_path,
                   env={**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"),
                        "PYTHONPATH": os.pathsep.join([source, tests])})
    (database,) = (tmp_path / "trackio").glob("*.db")
    with sqlite3.connect(database) as db:
        steps = db.execute("select step from metrics order by step").fetchall()
    assert [step for (step,) in steps][:2] == [1, 2], steps


def test_an_unknown_or_missing_tracker_is_bad_input(monkeypatch):
    with pytest.raises(InputError, match="report_to: unknown tracker 'comet'"):
        load_config("smoke", overrides=["report_to=comet"])
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(InputError, match=r"pip install 'grpogate\[mlflow\]'"):
        trackers.check_trackers(load_config("smoke", overrides=["report_to=mlflow"]))
