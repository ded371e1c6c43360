"""What `--resume` takes from a checkpoint, checked before a weight loads or a file is cut.

A checkpoint's state.json pins its tensor files by sha256, but it is itself only JSON that
anyone holding the run directory can edit (pins included). So none of its values is trusted:
every field the resume reads has its type and range checked, and the step counter must agree
with the records the run holds: `next_step` equals the number of step records (numbered 0, 1,
...), the set of steps in trajectories.jsonl up to `trajectories_offset`, and the checkpoint's
own name (step-NNNNNN), and lies within the config's steps. A counter pushed past the records
would skip training passes and still finish `ok`; one behind them would train steps twice.
The tensor files must parse as safetensors and the RNG tensors have the shape torch restores.
Any failure is one InputError, raised before the trajectories are truncated or a file written.
"""

from __future__ import annotations

import json
import math
import os
import random
import stat
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as load_tensors

from grpogate.errors import InputError
from grpogate.files import MAX_FILE_BYTES, parse_json
from grpogate.training.checkpoint import RNG_FILE, STATE_FILE, TRAINABLE_FILE, Checkpoint

WHOLE_NUMBERS = {"micro_batch_size": 1, "next_step": 0, "next_prompt": 0,
                 "trajectories_offset": 0, "verifier_errors": 0, "reward_errors": 0,
                 "oom_retries": 0}  # field -> its least value
STAGES = ("rollout", "verification", "update", "checkpoint")


def _seconds(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)


def _check_fields(state: dict, where: str) -> None:
    """Each field the resume reads: present, of its type, within its range."""
    for name, least in WHOLE_NUMBERS.items():
        value = state.get(name)
        if type(value) is not int or value < least:
            raise InputError(f"{where}: field \"{name}\" must be a whole number >= {least} "
                             f"(got {str(value)[:40]})")
    seconds = state.get("seconds")
    if not isinstance(seconds, dict) or not all(_seconds(seconds.get(s)) for s in STAGES):
        raise InputError(f"{where}: field \"seconds\" must hold {', '.join(STAGES)} as "
                         "finite numbers >= 0")
    if not _seconds(state.get("elapsed_seconds")):
        raise InputError(f"{where}: field \"elapsed_seconds\" must be a finite number >= 0")
    for name, kind in (("steps", list), ("resumes", list), ("inputs", dict), ("run_label", str)):
        if not isinstance(state.get(name), kind):
            raise InputError(f"{where}: field \"{name}\" must be a {kind.__name__}")
    if not all(isinstance(s, dict) for s in state["steps"] + state["resumes"]):
        raise InputError(f"{where}: fields \"steps\" and \"resumes\" must be lists of objects")
    _check_rng(state.get("rng"), where)


def _check_rng(rng, where: str) -> None:
    """The Python and NumPy generator states, tried on scratch generators (the process's own
    are restored only once the whole checkpoint is known good)."""
    try:
        version, internal, gauss = rng["python"]
        random.Random().setstate((version, tuple(internal), gauss))
        kind, keys, position, has_gauss, cached = rng["numpy"]
        np.random.RandomState().set_state(
            (kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))
    except (KeyError, TypeError, ValueError, OverflowError) as error:
        raise InputError(f"{where}: field \"rng\" is not a Python and NumPy generator state "
                         f"({type(error).__name__})") from None


def _logged_steps(path: Path, offset: int) -> set:
    """The steps of trajectories.jsonl's records before `offset`, read without following a
    link or blocking, the offset checked against the file's size and a line boundary."""
    if offset > MAX_FILE_BYTES:
        raise InputError(f"{path}: the recorded offset {offset} is over the {MAX_FILE_BYTES} "
                         "bytes a run file may hold")
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise InputError(f"{path}: cannot be opened ({error.strerror})") from None
    with os.fdopen(descriptor, "rb") as stream:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode) or status.st_size < offset:
            raise InputError(f"{path}: not a regular file of at least the {offset} bytes the "
                             "checkpoint records; the run cannot be resumed")
        data = stream.read(offset)
    if len(data) != offset or (offset and not data.endswith(b"\n")):
        raise InputError(f"{path}: the recorded offset {offset} is not the end of a line")
    steps = set()
    for number, line in enumerate(data.splitlines(), 1):
        try:
            record = parse_json(line, f"{path}:{number}")
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise InputError(f"{path}:{number}: not a JSON line") from None
        step = record.get("step") if isinstance(record, dict) else None
        steps.add(step if type(step) is int else None)  # a list or object is no step number
    return steps


def _check_tensors(directory: Path) -> None:
    """The adapter and RNG files parse as safetensors; the CPU generator state is the byte
    tensor torch.set_rng_state takes (the adapter's names and shapes are checked against the
    model when it is restored)."""
    loaded = {}
    for name in (TRAINABLE_FILE, RNG_FILE):
        try:
            loaded[name] = load_tensors((directory / name).read_bytes())
        except Exception as error:  # safetensors raises its own SafetensorError for any damage
            first = (str(error).strip().splitlines() or [""])[0][:120]
            raise InputError(f"{directory / name}: not a safetensors file "
                             f"({type(error).__name__}: {first})") from None
    rng, reference = loaded[RNG_FILE], torch.get_rng_state()
    cpu = rng.get("torch_cpu")
    if cpu is None or cpu.dtype != reference.dtype or cpu.shape != reference.shape:
        raise InputError(f"{directory / RNG_FILE}: no torch_cpu generator state of "
                         f"{tuple(reference.shape)} bytes")
    for key, tensor in rng.items():
        if key != "torch_cpu" and (not key.startswith("torch_cuda_") or tensor.dtype != torch.uint8):
            raise InputError(f"{directory / RNG_FILE}: unexpected tensor {key[:40]!r}")


def check_resume_point(checkpoint: Checkpoint, run_dir: str | Path, steps: int) -> None:
    """InputError unless the checkpoint's state is well formed and its step counter agrees with
    its step records, the trajectories up to its offset, its name and the config's `steps`."""
    state, where = checkpoint.state, f"{checkpoint.directory}/{STATE_FILE}"
    _check_fields(state, where)
    next_step = state["next_step"]
    if not 1 <= next_step <= steps:
        raise InputError(f"{where}: field \"next_step\" is {next_step}; a checkpoint follows a "
                         f"finished step of the run's {steps}")
    if checkpoint.directory.name != f"step-{next_step:06d}":
        raise InputError(f"{where}: field \"next_step\" is {next_step}, but the checkpoint is "
                         f"{checkpoint.directory.name}")
    numbers = [record.get("step") for record in state["steps"]]
    if numbers != list(range(next_step)):
        raise InputError(f"{where}: field \"next_step\" is {next_step}, but the checkpoint holds "
                         f"{len(numbers)} step record(s); the run would skip or repeat steps")
    path = Path(run_dir) / "trajectories.jsonl"
    logged = _logged_steps(path, state["trajectories_offset"])
    if logged != set(range(next_step)):
        raise InputError(f"{where}: field \"next_step\" is {next_step}, but {path.name} up to "
                         f"the recorded offset holds {len(logged)} step(s); the run would skip "
                         "or repeat steps")
    _check_tensors(checkpoint.directory)
