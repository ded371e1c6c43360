"""Evidence as files: atomic writes, the trajectories log, library versions, the manifest.

Every JSON file is written to a temporary name, fsynced and renamed, so a reader never sees a
half-written file; directories (the adapter, checkpoints) are staged and renamed the same way.
The manifest is written last: its existence means the run completed. A manifest is also a valid
baseline for the next run (`--baseline-manifest`), which is why its adapter path is relative
and may not escape the manifest's directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import secrets
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

from grpogate.errors import InputError

MANIFEST_VERSION = 1
RUN_FILES = ("evidence.json", "trajectories.jsonl", "eval_completions.jsonl")


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


def library_versions() -> dict:
    versions = {"python": platform.python_version(), "platform": platform.platform()}
    for package in ("grpogate", "torch", "transformers", "peft", "safetensors", "gguf",
                    "reasoning-gym", "numpy"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def trace_ids_sha256(trace_ids: list[str]) -> str:
    return sha256_bytes("\n".join(trace_ids).encode())


def refuse_existing_output(path: Path) -> None:
    """An earlier run's outputs are never overwritten: any existing path is refused."""
    if path.exists():
        raise InputError(f"{path}: output already exists; choose a new run label (--label) or --out")


def create_run_dir(path: Path) -> Path:
    refuse_existing_output(path)  # checked again here: admission ran before the model loaded
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir()
    return path


def build_manifest(evidence: dict, run_dir: Path, trajectories: list[dict]) -> dict:
    """Summarize the run and pin every file by hash; call after all other files are final."""
    files = {name: sha256_path(run_dir / name) for name in RUN_FILES if (run_dir / name).is_file()}
    adapter_dir = run_dir / evidence["artifact"]["path"]
    for file in sorted(adapter_dir.glob("*")) if adapter_dir.is_dir() else []:
        files[f"{evidence['artifact']['path']}/{file.name}"] = sha256_path(file)
    comparison = evidence["comparison"]
    rollout = evidence["rollout"]
    trace_ids = [record["trace_id"] for record in trajectories]
    return {
        "manifest_version": MANIFEST_VERSION,
        "run_label": evidence["run_label"],
        "created": evidence["created"],
        "decision": evidence["decision"]["decision"],
        "failed_checks": evidence["decision"]["failed_checks"],
        "status": evidence["status"],
        "model": evidence["inputs"]["model"],
        "source_policy_version": evidence["inputs"]["baseline_policy_version"],
        "new_policy_version": evidence["artifact"]["new_policy_version"],
        "verifier_version": evidence["inputs"]["verifier"]["version"],
        "adapter": {"path": evidence["artifact"]["path"], "sha256": evidence["artifact"]["sha256"]},
        "rollback_source": {
            "policy_version": evidence["inputs"]["baseline_policy_version"],
            "model": evidence["inputs"]["model"],
            "adapter": evidence["inputs"]["baseline_adapter"],
        },
        "quality": {
            "baseline": {k: comparison["baseline"][k] for k in ("mean_reward", "pass_at_group")},
            "candidate": {k: comparison["candidate"][k] for k in ("mean_reward", "pass_at_group")},
            "reward_mean_gain": comparison["reward_mean_gain"],
            "pass_at_group_gain": comparison["pass_at_group_gain"],
        },
        "rollout": {k: rollout[k] for k in ("group_count", "valid_group_count", "valid_group_ratio",
                                             "total_trajectories", "effective_trajectory_count",
                                             "max_length_hit_ratio")},
        "trajectory_identity": {
            "group_count": rollout["group_count"],
            "trace_count": len(trace_ids),
            "trace_ids_sha256": trace_ids_sha256(trace_ids),
            "trajectories_sha256": files.get("trajectories.jsonl"),
            "evidence_sha256": files.get("evidence.json"),
        },
        "files": files,
    }


def read_baseline_manifest(path: str) -> dict:
    """Admit a baseline manifest: decision accept, adapter inside its directory, hash matching.

    Returns {"model", "revision", "adapter"} (adapter = absolute directory or "").
    """
    file = Path(path)
    if not file.is_file():
        raise InputError(f"{path}: no such baseline manifest")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"{path}: not valid JSON: {error}") from None
    if not isinstance(manifest, dict):
        raise InputError(f"{path}: a baseline manifest is a JSON object")
    if manifest.get("decision") != "accept":
        raise InputError(f"{path}: field \"decision\" is {manifest.get('decision')!r}; "
                         "only an accepted policy can be a baseline")
    model = manifest.get("model")
    location = (model.get("spec") or model.get("location")) if isinstance(model, dict) else model
    if not isinstance(location, str) or not location:
        raise InputError(f"{path}: field \"model\" must name the base model (model.location)")
    revision = model.get("revision", "") if isinstance(model, dict) else ""
    adapter = manifest.get("adapter") or {}
    if not isinstance(adapter, dict):
        raise InputError(f"{path}: field \"adapter\" must be an object with path and sha256")
    adapter_dir = ""
    if adapter.get("path"):
        root = file.parent.resolve()
        candidate = (root / adapter["path"]).resolve()
        if not candidate.is_relative_to(root):
            raise InputError(f"{path}: field \"adapter.path\" escapes the manifest's directory")
        weights = candidate / "adapter_model.safetensors"
        if not weights.is_file():
            raise InputError(f"{path}: field \"adapter.path\": {weights} does not exist")
        actual = sha256_path(weights)
        if actual != adapter.get("sha256"):
            raise InputError(f"{path}: field \"adapter.sha256\" is {adapter.get('sha256')!r} but "
                             f"the adapter file hashes to {actual}")
        adapter_dir = str(candidate)
    return {"model": location, "revision": revision or "", "adapter": adapter_dir}
