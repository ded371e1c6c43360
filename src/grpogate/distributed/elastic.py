"""The run directory of a torchrun job, and what a worker group restarted by its elastic agent
does with it.

torchrun's agent restarts every worker of a failed group (`--max-restarts K`) with the same
arguments and a higher TORCHELASTIC_RESTART_COUNT. A restarted group must continue the run its
first attempt started, not start another, so:
- the run directory must be the same over attempts: `--out` / `--label` are; the default label
  (a date under one process) becomes `<profile>-job-<rendezvous id>` under torchrun (the id
  `--standalone` draws, or `--rdzv-id`), which every attempt of the job shares;
- rank 0 writes `checkpoints/torchrun-job.json` (the job's id) as soon as it creates the run
  directory; a restarted group that finds its own job there resumes from the last checkpoint,
  or, when the first attempt died before its first step, starts the run afresh in it. A
  directory of any other job or run is never touched (the new run then refuses it as usual).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from grpogate.config import RunConfig
from grpogate.distributed import World
from grpogate.errors import InputError
from grpogate.files import atomic_write_json, parse_json, read_confined
from grpogate.training.checkpoint import CHECKPOINTS, latest_checkpoint

JOB_FILE = "torchrun-job.json"


def has_job_id(world: World) -> bool:
    return world.job_id not in ("", "none")


def settle_run_dir(config: RunConfig, world: World) -> None:
    """Give `config` the run directory every rank and every attempt of the job shares."""
    if not config.out and not config.label and has_job_id(world):
        config.label = f"{config.profile}-job-{world.job_id[:12]}"
    if world.distributed and not config.out:
        # A date label read on each rank could differ by a second: rank 0's holds.
        if not config.label and world.is_main:
            from datetime import datetime

            config.label = f"{config.profile}-{datetime.now():%Y%m%d-%H%M%S}"
        config.label = world.broadcast_object(config.label)


def mark_job(run_dir: Path, world: World) -> None:
    """Rank 0, right after creating the run directory: which job it belongs to."""
    if has_job_id(world) and world.is_main:
        (run_dir / CHECKPOINTS).mkdir(exist_ok=True)
        atomic_write_json(run_dir / CHECKPOINTS / JOB_FILE, {"job": world.job_id})


def _ours(run_dir: Path, world: World) -> bool:
    try:
        marker = parse_json(read_confined(run_dir, f"{CHECKPOINTS}/{JOB_FILE}"),
                            JOB_FILE)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, InputError):
        return False
    return isinstance(marker, dict) and marker.get("job") == world.job_id


def restart_action(run_dir: Path, world: World) -> str:
    """What a worker of this job does with `run_dir`: "resume" (a restarted group, its job's
    checkpoint there), "fresh" (anything else; a restarted group whose first attempt died
    before its first checkpoint first clears its own directory, rank 0 alone)."""
    if world.restart_count == 0 or not has_job_id(world) or not _ours(run_dir, world):
        return "fresh"
    if latest_checkpoint(run_dir) is not None:
        return "resume"
    world.barrier()  # every rank has looked before rank 0 removes it
    if world.is_main:
        shutil.rmtree(run_dir)
    world.barrier()
    return "fresh"
