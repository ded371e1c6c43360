"""Files: atomic writes, content hashes, the append-only trajectories log, run directories.

Every JSON file is written to a temporary name, fsynced and renamed, so a reader never sees a
half-written file; directories (the adapter, checkpoints) are staged and renamed the same way.
Every wing writes or hashes files (the policy hashes weights, the loop checkpoints, the
evidence pins them), so this module sits below all of them and imports nothing of theirs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path

from grpogate.errors import InputError

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # the LoRA weights file of every adapter directory


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_path(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def fsync_directory(path: str | Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def atomic_directory(path: str | Path):
    """Yield a staging directory beside `path`; on success fsync its files and rename it to
    `path` (replacing a copy a killed attempt left there), so `path` is never half-written."""
    path = Path(path)
    staging = path.parent / f".{path.name}.{secrets.token_hex(6)}"
    staging.mkdir(mode=0o777)  # mkdtemp would make it 0700; this honours the umask like mkdir
    try:
        yield staging
        for file in staging.iterdir():
            with open(file, "rb") as stream:
                os.fsync(stream.fileno())
        fsync_directory(staging)
        if path.exists():
            shutil.rmtree(path)
        staging.rename(path)
        fsync_directory(path.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def remove_staging(directory: str | Path) -> None:
    """Delete the hidden temporaries (".name.XXXX") that a killed writer left in `directory`."""
    for leftover in Path(directory).glob(".*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def to_json(document) -> str:
    # allow_nan=False: a NaN in evidence is a bug to surface, not a value to store.
    return json.dumps(document, indent=2, sort_keys=False, allow_nan=False) + "\n"


def atomic_write_json(path: str | Path, document) -> None:
    atomic_write_bytes(path, to_json(document).encode())


def jsonl_bytes(records: list[dict]) -> bytes:
    return "".join(json.dumps(r, allow_nan=False) + "\n" for r in records).encode()


class JsonlLog:
    """Append-only JSONL whose lines reach the disk (fsync) at every `append` call.

    `append` returns the byte offset after the new lines; a checkpoint records it, and
    `truncate` cuts the file back to it (lines of a step that was never checkpointed).
    """

    def __init__(self, path: Path, *, existing: bool = False):
        self.path = path
        if not existing:
            self.path.touch(exist_ok=False)

    def append(self, records: list[dict]) -> int:
        with open(self.path, "ab") as stream:
            stream.write(jsonl_bytes(records))
            stream.flush()
            os.fsync(stream.fileno())
            return stream.tell()

    def truncate(self, offset: int) -> None:
        size = self.path.stat().st_size
        if size < offset:
            raise InputError(f"{self.path}: {size} bytes, shorter than the recorded offset "
                             f"{offset}; the file was modified after the checkpoint")
        with open(self.path, "r+b") as stream:
            stream.truncate(offset)
            stream.flush()
            os.fsync(stream.fileno())


def read_jsonl(path: str | Path) -> list[dict]:
    records = []
    with open(path, encoding="utf-8") as stream:
        for number, line in enumerate(stream, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise InputError(f"{path}:{number}: malformed JSON line: {error.msg}") from None
    return records


def refuse_existing_output(path: Path) -> None:
    """An earlier run's outputs are never overwritten: any existing path is refused."""
    if path.exists():
        raise InputError(f"{path}: output already exists; choose a new run label (--label) or --out")


def create_run_dir(path: Path) -> Path:
    refuse_existing_output(path)  # checked again here: admission ran before the model loaded
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir()
    return path
