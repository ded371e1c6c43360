"""Trackers people already use (TRL's `report_to`): TensorBoard, MLflow, Weights & Biases, Trackio.

Each gets the same per-step scalars (reward, valid group ratio, KL, clip fraction, loss, grad
norm, stage seconds, tokens/s) at the step number the terminal shows (1..N), and at the end the
decision and the re-test gains. Each library is an optional extra, imported only when named;
`check_trackers` refuses a missing one at admission, before anything is written.

- tensorboard: the `tensorboard` package's own event-file writer (no TensorFlow, no torch).
- mlflow: the tracking store of MLFLOW_TRACKING_URI (MLflow's default when unset); experiment
  MLFLOW_EXPERIMENT_NAME or "grpogate"; one MLflow run per grpogate run (a resume starts another).
- wandb: offline unless WANDB_MODE says otherwise (the files sync later with `wandb sync`).
- trackio: local-first; its own TRACKIO_DIR decides where.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import time
from pathlib import Path

from grpogate.config import flatten
from grpogate.errors import InputError
from grpogate.files import run_folder

# Tag -> key of a training step record (training/loop.py); list values are per optimizer
# step within the training step and are logged as their mean.
STEP_SCALARS = (
    ("train/reward", "mean_reward"),
    ("train/valid_group_ratio", "valid_group_ratio"),
    ("update/mean_kl", "mean_kl"),
    ("update/clip_fraction", "clip_fraction"),
    ("update/loss", "loss"),
    ("update/grad_norm", "grad_norm"),
    ("update/learning_rate", "learning_rate"),
    ("time/rollout_seconds", "rollout_seconds"),
    ("time/verification_seconds", "verification_seconds"),
    ("time/update_seconds", "update_seconds"),
    ("throughput/generation_tokens_per_second", "generation_tokens_per_second"),
    ("throughput/update_tokens_per_second", "update_tokens_per_second"),
    ("update/padding_fraction", "padding_fraction"),
)
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb",
            "trackio": "trackio"}
DECISIONS = ("accept", "tune", "reject")


def step_scalars(record: dict) -> dict[str, float]:
    """The scalars of one training step record; a step with no optimizer step has no loss or
    grad_norm to show and leaves those tags out."""
    scalars = {}
    for tag, key in STEP_SCALARS:
        value = record.get(key)
        if isinstance(value, list):
            if not value:
                continue
            value = sum(value) / len(value)
        if value is not None:
            scalars[tag] = float(value)
    return scalars


def final_scalars(evidence: dict) -> dict[str, float]:
    """The decision (one 0/1 indicator per outcome, so any tracker can plot it) and the gains."""
    comparison = evidence.get("comparison") or {}
    verdict = (evidence.get("decision") or {}).get("decision")
    scalars = {f"decision/{name}": float(verdict == name) for name in DECISIONS}
    for name in ("reward_mean_gain", "pass_at_group_gain"):
        if isinstance(comparison.get(name), (int, float)):
            scalars[f"final/{name}"] = float(comparison[name])
    for side in ("baseline", "candidate"):
        value = (comparison.get(side) or {}).get("mean_reward")
        if isinstance(value, (int, float)):
            scalars[f"final/{side}_mean_reward"] = float(value)
    return scalars


def requested(config) -> list[str]:
    """report_to, with tensorboard added when a --tensorboard directory is given."""
    names = list(config.report_to)
    if config.tensorboard and "tensorboard" not in names:
        names.insert(0, "tensorboard")
    return names


def check_trackers(config) -> None:
    for name in requested(config):
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise InputError(f"report_to {name}: the {PACKAGES[name]} package is not installed; "
                             f"pip install 'grpogate[{name}]'")


class TensorBoardTracker:
    def __init__(self, log_dir: Path, run_label: str, config: dict):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = EventFileWriter(str(log_dir))
        self.where = self.writer.get_logdir()

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        values = [summary_pb2.Summary.Value(tag=tag, simple_value=value)
                  for tag, value in scalars.items()]
        self.writer.add_event(event_pb2.Event(wall_time=time.time(), step=step,
                                              summary=summary_pb2.Summary(value=values)))
        self.writer.flush()  # a live TensorBoard shows each step as it finishes

    def finish(self, decision: str) -> None:
        self.writer.close()


class MlflowTracker:
    def __init__(self, log_dir: Path, run_label: str, config: dict):
        import mlflow

        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "grpogate"))
        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=run_label)
        mlflow.log_params({key: str(value)[:6000] for key, value in flatten(config).items()})
        self.where = f"{mlflow.get_tracking_uri()} run {self.run.info.run_id}"

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.mlflow.log_metrics(scalars, step=step)

    def finish(self, decision: str) -> None:
        if decision:
            self.mlflow.set_tag("decision", decision)
        self.mlflow.end_run()


class WandbTracker:
    def __init__(self, log_dir: Path, run_label: str, config: dict):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "grpogate"), name=run_label,
                              config=config, mode=os.environ.get("WANDB_MODE", "offline"),
                              dir=os.environ.get("WANDB_DIR") or None, reinit="create_new")
        self.where = f"wandb {self.run.settings.mode} run {self.run.dir}"

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def finish(self, decision: str) -> None:
        if decision:
            self.run.summary["decision"] = decision
        self.run.finish()


class TrackioTracker:
    def __init__(self, log_dir: Path, run_label: str, config: dict):
        import trackio

        self.trackio = trackio
        with contextlib.redirect_stdout(io.StringIO()):  # its banner would break the bars
            self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "grpogate"),
                                    name=run_label, config=config)
        self.where = f"trackio project {os.environ.get('TRACKIO_PROJECT', 'grpogate')}"

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.trackio.log(scalars, step=step)

    def finish(self, decision: str) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            self.trackio.finish()


TRACKERS = {"tensorboard": TensorBoardTracker, "mlflow": MlflowTracker, "wandb": WandbTracker,
            "trackio": TrackioTracker}


class Trackers:
    """All requested trackers as one: `log_step` is the training loop's `on_step` callback."""

    def __init__(self, config, run_dir: Path, run_label: str):
        log_dir = Path(config.tensorboard) if config.tensorboard else run_dir / "tensorboard"
        if not config.tensorboard and "tensorboard" in requested(config):
            # The run directory's own folder, made or opened as files.run_folder opens it: a
            # `tensorboard` symlink planted in a resumed run is refused, never written through.
            os.close(run_folder(run_dir, "tensorboard", create=True))
        settings = config.to_dict()
        self.opened = []
        try:
            for name in requested(config):
                self.opened.append((name, TRACKERS[name](log_dir, run_label, settings)))
        except BaseException:
            self.close("")
            raise
        self.final_step = 0

    @classmethod
    def none(cls) -> "Trackers":
        """No tracker at all: the ranks other than 0 under torchrun (one writer)."""
        trackers = cls.__new__(cls)
        trackers.opened, trackers.final_step = [], 0
        return trackers

    def log_step(self, record: dict) -> None:
        self.final_step = record["step"] + 1  # the terminal's numbering, 1..N
        for _, tracker in self.opened:
            tracker.log(self.final_step, step_scalars(record))

    def log_final(self, evidence: dict) -> None:
        for _, tracker in self.opened:
            tracker.log(self.final_step, final_scalars(evidence))

    def close(self, decision: str) -> None:
        for _, tracker in self.opened:
            tracker.finish(decision)
        self.opened = []
