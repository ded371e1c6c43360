"""Checkpoints: after every update step, everything a killed run needs to continue bit-identically.

A checkpoint is a directory `RUN_DIR/checkpoints/step-NNNNNN` (NNNNNN = the next step to run)
holding the trainable adapter tensors (`trainable.safetensors`), the optimizer state
(`optimizer.pt`, read back with `torch.load(weights_only=True)`), the torch RNG states
(`rng.safetensors`) and `state.json`: the run's config, the data cursor, the per-step records,
the accumulated stage seconds, the Python / NumPy RNG states and the byte offset of
trajectories.jsonl after that step. It is written into a temporary directory, every file
fsynced, then renamed into place, so a `step-*` directory is always complete; `state.json`
also pins the other files by sha256, so a damaged checkpoint is refused rather than trusted.
The previous checkpoint is removed only after the new one is in place.

Rollout seeds torch with `config.seed + step` at every step, so determinism mostly comes from
that; the RNG states are saved all the same, for any consumer that does not reseed.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from grpogate.errors import InputError
from grpogate.files import (MAX_FILE_BYTES, atomic_directory, confined_path, parse_json,
                            read_confined, sha256_bytes, sha256_confined, to_json)

CHECKPOINT_FORMAT = 1
CHECKPOINTS = "checkpoints"
TRAINABLE_FILE = "trainable.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.safetensors"
STATE_FILE = "state.json"
# The tensor files a checkpoint pins, hashed as read_confined reads them: the adapter (at most
# 4 GiB of tensors, files/tensors.py) and AdamW's two moments of it, with room to spare.
MAX_CHECKPOINT_FILE_BYTES = 12 << 30


@dataclass
class Checkpoint:
    directory: Path
    state: dict  # state.json: config, next_step, steps, seconds, trajectories_offset, ...


# --- writing -----------------------------------------------------------------------------------


def _rng_state() -> tuple[dict, dict[str, torch.Tensor]]:
    """(JSON-ready Python and NumPy states, torch generator states as uint8 tensors)."""
    version, internal, gauss = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state()
    states = {"python": [version, list(internal), gauss],
              "numpy": [kind, keys.tolist(), int(position), int(has_gauss), float(cached)]}
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{index}"] = state
    return states, tensors


def _restore_rng(states: dict, tensors: dict[str, torch.Tensor]) -> None:
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = sorted(k for k in tensors if k.startswith("torch_cuda_"))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> bytes:
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    return buffer.getvalue()


def save_checkpoint(run_dir: Path, state: dict, trainable: dict[str, torch.Tensor],
                    optimizer: torch.optim.Optimizer) -> Path:
    """Write `state` (JSON-ready, must hold "next_step") with the tensors; returns its directory."""
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step-{state['next_step']:06d}"
    rng_json, rng_tensors = _rng_state()
    blobs = {
        TRAINABLE_FILE: save_tensors({n: t.detach().to("cpu").contiguous()
                                      for n, t in trainable.items()}),
        OPTIMIZER_FILE: optimizer_bytes(optimizer),
        RNG_FILE: save_tensors({n: t.contiguous() for n, t in rng_tensors.items()}),
    }
    document = {"checkpoint_format": CHECKPOINT_FORMAT, **state, "rng": rng_json,
                "files": {name: sha256_bytes(data) for name, data in blobs.items()}}
    # fsync every file, then rename into place; checkpoints/ is made here, a symlink refused
    with atomic_directory(final, root=run_dir) as staging:
        for name, data in blobs.items():
            (staging / name).write_bytes(data)
        (staging / STATE_FILE).write_text(to_json(document), encoding="utf-8")
    # Only now is the older checkpoint redundant; a kill before this line leaves two complete ones.
    for older in root.glob("step-*"):
        if older != final:
            shutil.rmtree(older, ignore_errors=True)
    return final


@dataclass
class CheckpointWriter:
    """Saves the loop's state after every finished step, with what stays fixed over the run
    (`header`: config, run label, input identities, resumes) and the run's elapsed seconds."""

    run_dir: Path
    header: dict
    trainable: dict[str, torch.Tensor]
    optimizer: torch.optim.Optimizer
    started: float  # time.perf_counter() when this process started the run
    earlier_seconds: float = 0.0  # what earlier processes of a resumed run spent
    writes: bool = True  # False on ranks other than 0: one writer per run directory

    def elapsed(self) -> float:
        return self.earlier_seconds + time.perf_counter() - self.started

    def save(self, loop_state: dict) -> Path | None:
        if not self.writes:
            return None
        return save_checkpoint(self.run_dir, {**self.header, "elapsed_seconds": self.elapsed(),
                                              **loop_state}, self.trainable, self.optimizer)


def remove_checkpoints(run_dir: Path) -> None:
    """Called after the manifest: a finished run cannot be resumed, its checkpoints are waste."""
    shutil.rmtree(Path(run_dir) / CHECKPOINTS, ignore_errors=True)


# --- reading -----------------------------------------------------------------------------------


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    """The complete checkpoint with the highest step, verified against its recorded hashes."""
    root = Path(run_dir) / CHECKPOINTS
    if not os.path.lexists(root):
        return None
    # Every path below goes through the confinement rule (files/confine.py): inside the run
    # directory once resolved, a folder or a regular file, read non-blocking within a limit.
    confined_path(run_dir, CHECKPOINTS, directory=True)
    candidates = sorted(root.glob("step-*"))
    if not candidates:
        return None
    directory = candidates[-1]
    inside = f"{CHECKPOINTS}/{directory.name}"
    confined_path(run_dir, inside, directory=True)
    where = f"{directory}/{STATE_FILE}"
    try:
        state = parse_json(read_confined(run_dir, f"{inside}/{STATE_FILE}", MAX_FILE_BYTES),
                           where)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputError(f"{where}: unreadable checkpoint state ({error})") from None
    if not isinstance(state, dict) or state.get("checkpoint_format") != CHECKPOINT_FORMAT:
        raise InputError(f"{where}: field \"checkpoint_format\" is not {CHECKPOINT_FORMAT}")
    files = state.get("files")
    if not isinstance(files, dict) or set(files) != {TRAINABLE_FILE, OPTIMIZER_FILE, RNG_FILE}:
        raise InputError(f"{where}: field \"files\" must pin {TRAINABLE_FILE}, {OPTIMIZER_FILE} "
                         f"and {RNG_FILE} by sha256")
    for name, digest in files.items():
        try:
            actual = sha256_confined(run_dir, f"{inside}/{name}", MAX_CHECKPOINT_FILE_BYTES)
        except InputError:
            actual = None
        if actual != digest:
            raise InputError(f"{directory}/{name}: missing or does not match the sha256 recorded "
                             f"in {STATE_FILE}; the checkpoint is damaged")
    return Checkpoint(directory, state)


def never_checkpointed(run_dir: Path) -> bool:
    """A directory a run created and was killed in before its first checkpoint: its lock file
    (left by a killed holder), its trajectories log and at most a checkpoints/ folder with no
    step-* checkpoint, nothing else. There is nothing in it to resume or audit, so a new run
    with the same --out may replace it (pipeline.open_run), once no process holds its lock."""
    from grpogate.files import LOCK_FILE

    if not run_dir.is_dir() or run_dir.is_symlink():
        return False
    names = {entry.name for entry in run_dir.iterdir()}
    if not {"trajectories.jsonl", LOCK_FILE} <= names <= {"trajectories.jsonl", LOCK_FILE,
                                                          CHECKPOINTS}:
        return False
    root = run_dir / CHECKPOINTS
    return not root.exists() or (root.is_dir() and not root.is_symlink()
                                 and not any(root.glob("step-*")))


def checkpoint_to_resume(run_dir: str | Path) -> Checkpoint:
    """The checkpoint a `--resume RUN_DIR` continues from; InputError when there is none."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: no such run directory to resume")
    if (run_dir / "manifest.json").exists() and not _interrupted(run_dir / "manifest.json"):
        raise InputError(f"{run_dir}: the run is complete (manifest.json exists); nothing to "
                         "resume. Start a new run with a new --label to train again")
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise InputError(f"{run_dir}: no complete checkpoint (the run stopped before its first "
                         "update step finished); start a new run with a new --label"
                         + (", or the same --out: it replaces this one"
                            if never_checkpointed(run_dir) else ""))
    log = run_dir / "trajectories.jsonl"
    if not os.path.lexists(log):
        raise InputError(f"{log}: missing; the run cannot be resumed")
    if not stat.S_ISREG(os.lstat(log).st_mode):  # the resume truncates and appends to it
        raise InputError(f"{log}: a symbolic link, FIFO or device, not a regular file; grpogate "
                         "writes nothing through it, and the run cannot be resumed")
    return checkpoint


def _interrupted(manifest: Path) -> bool:
    """An interim manifest: the run was stopped by a signal and may be continued."""
    try:
        document = parse_json(read_confined(manifest.parent, manifest.name),
                              str(manifest))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, InputError):
        return False
    return isinstance(document, dict) and document.get("status") == "interrupted"


def restore_training_state(checkpoint: Checkpoint, trainable: dict[str, torch.nn.Parameter],
                           optimizer: torch.optim.Optimizer) -> None:
    """Copy the adapter tensors into the model, load the optimizer state, restore the RNGs."""
    directory = checkpoint.directory
    saved = load_tensors((directory / TRAINABLE_FILE).read_bytes())
    if set(saved) != set(trainable):
        missing = sorted(set(trainable) ^ set(saved))[:3]
        raise InputError(f"{directory}/{TRAINABLE_FILE}: tensors do not match the model's "
                         f"trainable parameters (e.g. {', '.join(missing)})")
    with torch.no_grad():
        for name, parameter in trainable.items():
            tensor = saved[name]
            if tensor.shape != parameter.shape or tensor.dtype != parameter.dtype:
                raise InputError(f"{directory}/{TRAINABLE_FILE}: tensor {name} is "
                                 f"{tuple(tensor.shape)} {tensor.dtype}, the model's is "
                                 f"{tuple(parameter.shape)} {parameter.dtype}")
            parameter.copy_(tensor.to(parameter.device))
    # weights_only=True: an optimizer file is data, never code to unpickle.
    try:
        optimizer_state = torch.load(directory / OPTIMIZER_FILE, map_location="cpu",
                                     weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as error:
        first_line = (str(error).strip().splitlines() or [""])[0]
        raise InputError(f"{directory}/{OPTIMIZER_FILE}: refused, not plain tensor data "
                         f"({first_line})") from None
    try:
        optimizer.load_state_dict(optimizer_state)
    except (KeyError, ValueError, TypeError, IndexError, AttributeError) as error:
        # Plain tensor data of the wrong structure (another optimizer, a hand-made file).
        raise InputError(f"{directory}/{OPTIMIZER_FILE}: not this run's optimizer state "
                         f"({type(error).__name__}: {str(error)[:120]})") from None
    _restore_rng(checkpoint.state["rng"], load_tensors((directory / RNG_FILE).read_bytes()))

