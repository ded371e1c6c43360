"""The audit's reading of a run directory: the mismatch collector, the run's files parsed as
data (a malformed file is a mismatch, not a crash; only regular files inside the run directory
are read), every hash the manifest pins, and the policy versions recomputed from the adapters'
own tensors (docs/design.md §7). Pure Python, no torch.

What it reads is bounded before it is read (files/bounds.py): the files it parses total at most
MAX_FILE_BYTES, each file it hashes is hashed once within its own limit, all of them within
MAX_HASHED_BYTES, and a manifest lists at most MAX_MANIFEST_FILES names in normal form. A file
past a limit is FileTooLarge (exit 2), never a mismatch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from grpogate.errors import InputError
from grpogate.evidence import decisions
from grpogate.evidence.manifest import PROBLEMS_FILE, RUN_FILES, build_manifest, trace_ids_sha256
from grpogate.files import (ADAPTER_WEIGHTS, MAX_CHECKPOINT_BYTES, MAX_CHECKPOINT_FILE_BYTES,
                            MAX_FILE_BYTES, FileTooLarge, confined_file,
                            jsonl_lines, parse_json, policy_version, read_confined, refuse_larger,
                            safetensors_sha256, sha256_bytes, sha256_confined, tolerated)
from grpogate.files.tensors import MAX_SAFETENSORS_BYTES, lora_b_all_zero, safetensors_size
from grpogate.inputs.tasks import stored_sets

FLOAT_TOLERANCE = 1e-9
# A run's manifest (build_manifest) lists RUN_FILES (6) and its adapter folder's files (3 for
# grpogate's adapter; a gated TRL run's copies its adapter config and weights): under 20.
MAX_MANIFEST_FILES = 1000
# All the distinct files an audit hashes, each once: the adapter weights at their cap, and twice
# MAX_FILE_BYTES for the rest (a real run's are a few MB in all); a gated full checkpoint's
# weight files add their own cap, MAX_CHECKPOINT_BYTES (files/bounds.py), hashed a block at a
# time as the gate hashed them.
MAX_HASHED_BYTES = MAX_SAFETENSORS_BYTES + 2 * MAX_FILE_BYTES


class Audit:
    """Collects mismatches as {"field", "recorded", "recomputed"}; recorded first, as stored.

    Keeps the bytes of every file it parsed (`read`), so that a file's hash is taken of the
    bytes the audit read, never of a second read that a file swapped in between would change.
    """

    def __init__(self) -> None:
        self.mismatches: list[dict[str, Any]] = []
        self.parsed: dict[Path, bytes] = {}
        self.hashed: dict[Path, str] = {}  # by resolved path: a file named twice is hashed once
        self.parsed_hashes: dict[Path, str] = {}  # of the bytes parsed, by the path they came from
        self.limits: dict[Path, int] = {}  # the most records a JSONL file may hold
        self.shards: str | None = None  # "FOLDER/" of a gated full checkpoint's weight files

    def limit_records(self, run_dir: Path, limits: dict[str, int]) -> None:
        """At most limits[name] records in run_dir/name, checked as `numbered_jsonl` reads it."""
        self.limits = {run_dir / name: limit for name, limit in limits.items()}

    def read(self, path: Path) -> bytes:
        """The bytes of a run file (read_confined), kept for `sha256`. The audit holds every
        file it parses: together they may total MAX_FILE_BYTES (FileTooLarge before a parse)."""
        data = read_confined(path.parent, path.name)
        refuse_larger(path, len(data) + sum(len(kept) for other, kept in self.parsed.items()
                                            if other != path),
                      MAX_FILE_BYTES, "the files an audit parses", "bytes with those read before")
        self.parsed[path] = data
        return data

    def sha256(self, run_dir: Path, name: str, weights: str | None = None) -> str:
        """The hash of the bytes parsed from run_dir/name, or of the file (read_confined's
        rules, within hash_limit(name, weights)) when the audit does not parse it; each taken
        once (the parsed bytes' by the path parsed, a file's by its resolved path, apart: a
        file hashed from disk before it is parsed is hashed again, of the bytes parsed);
        InputError as confined_file raises it."""
        kept = self.parsed.get(run_dir / name)
        if kept is not None:
            if run_dir / name not in self.parsed_hashes:
                self.parsed_hashes[run_dir / name] = sha256_bytes(kept)
            return self.parsed_hashes[run_dir / name]
        path = confined_file(run_dir, name)
        if path not in self.hashed:
            self.hashed[path] = sha256_confined(run_dir, name,
                                                hash_limit(name, weights, self.shards))
        return self.hashed[path]

    def mismatch(self, field: str, recorded: Any = None, recomputed: Any = None) -> None:
        self.mismatches.append({"field": field, "recorded": recorded, "recomputed": recomputed})

    def compare(self, field: str, recorded: Any, recomputed: Any) -> None:
        """Walk dicts (and lists of dicts) so the deepest differing field is the one named;
        lists of numbers (reward groups, histogram counts) are named as a whole."""
        if isinstance(recomputed, dict):
            if not isinstance(recorded, dict):
                self.mismatch(field, recorded, "an object")
                return
            for key, value in recomputed.items():
                if key not in recorded:
                    self.mismatch(f"{field}.{key}", "missing", value)
                else:
                    self.compare(f"{field}.{key}", recorded[key], value)
        elif (isinstance(recomputed, list) and isinstance(recorded, list)
              and len(recomputed) == len(recorded) and any(isinstance(v, dict) for v in recomputed)):
            for index, (old, new) in enumerate(zip(recorded, recomputed)):
                self.compare(f"{field}[{index}]", old, new)
        elif not same_value(recorded, recomputed):
            self.mismatch(field, recorded, recomputed)


def hash_limit(name: str, weights: str | None, shards: str | None = None) -> int:
    """The most bytes of run file `name` the audit hashes: MAX_SAFETENSORS_BYTES for the
    adapter weights (named `weights`), MAX_CHECKPOINT_FILE_BYTES for a safetensors file in a
    gated full checkpoint's folder (`shards`, "FOLDER/"), MAX_FILE_BYTES for any other file.
    Chosen here alone, for the budget taken before anything is hashed (_bound_hashing) and for
    each hash."""
    if shards and name.startswith(shards) and name.endswith(".safetensors"):
        return MAX_CHECKPOINT_FILE_BYTES
    return MAX_SAFETENSORS_BYTES if name == weights else MAX_FILE_BYTES


def same_value(recorded: Any, recomputed: Any) -> bool:
    """Exact for counts, bools and strings; within FLOAT_TOLERANCE when a float is involved."""
    if isinstance(recorded, bool) or isinstance(recomputed, bool):
        return type(recorded) is type(recomputed) and recorded == recomputed
    if isinstance(recorded, (int, float)) and isinstance(recomputed, (int, float)):
        if isinstance(recorded, int) and isinstance(recomputed, int):
            return recorded == recomputed
        return math.isclose(recorded, recomputed, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE)
    if isinstance(recorded, list) and isinstance(recomputed, list):
        return len(recorded) == len(recomputed) and all(
            same_value(a, b) for a, b in zip(recorded, recomputed))
    return recorded == recomputed


# --- reading the run ---------------------------------------------------------------------------

def read_object(path: Path, audit: Audit) -> dict | None:
    """A JSON object file; unreadable content is a mismatch (a tampered file), not a crash.
    InputError when it is not a regular file inside the run directory or too large (bounds.py),
    and for JSON no reader may take one way (duplicate keys), nested past any grpogate file or
    holding an integer Python will not convert (parse_json)."""
    try:
        document = parse_json(audit.read(path), str(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        audit.mismatch(f"{path.name} (not valid JSON: {error})")
        return None
    if not isinstance(document, dict):
        audit.mismatch(f"{path.name} (not a JSON object)")
        return None
    return document


def excess_records(name: str, count: int, limit: int) -> str:
    """The refusal of a file holding more records than a run of the recorded config writes."""
    return (f"{name}: {count} records, more than a run of the recorded config writes "
            f"({limit}); not a grpogate run directory")


def numbered_jsonl(path: Path, audit: Audit) -> list[tuple[int, dict]]:
    """(1-based line number, record) for every non-blank line; bad lines become mismatches.
    FileTooLarge, before a line is parsed, for a file past its bytes or lines (bounds.py) or
    with more non-blank lines (each a record or a mismatch) than `audit.limits` allows it."""
    with tolerated(InputError, UnicodeDecodeError) as failed:
        lines = jsonl_lines(audit.read(path), str(path))
    if failed.error:
        reason = ("not UTF-8 text" if isinstance(failed.error, UnicodeDecodeError)
                  else str(failed.error).removeprefix(path.name + ": "))
        audit.mismatch(f"{path.name} ({reason})")
        return []
    limit = audit.limits.get(path)
    if limit is not None and (count := sum(1 for line in lines if line.strip())) > limit:
        raise FileTooLarge(excess_records(path.name, count, limit))
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = parse_json(line, f"{path}:{number}")
        except json.JSONDecodeError:
            audit.mismatch(f"{path.name}:{number} (malformed JSON)")
            continue
        if isinstance(record, dict):
            records.append((number, record))
        else:
            audit.mismatch(f"{path.name}:{number} (not a JSON object)")
    return records


def stored_problem_sets(run_dir: Path, audit: Audit) -> dict[str, list] | None:
    """The run's train, eval and guard problems as problems.jsonl stores them (None: unusable).

    The run directory alone is enough: no task generator or dataset is needed. The file is
    pinned by the manifest like every other; each prompt id is recomputed from its question
    and the sets' hashes are compared with the recorded identities (`_reload_references`).
    """
    numbered = numbered_jsonl(run_dir / PROBLEMS_FILE, audit)
    if not numbered:
        return None
    try:
        return stored_sets(numbered, PROBLEMS_FILE)
    except InputError as error:
        audit.mismatch(f"{PROBLEMS_FILE} ({error})")
        return None


# --- hashes and versions ---------------------------------------------------------------------------------

def check_hashes(audit: Audit, run_dir: Path, manifest: dict, evidence: dict,
                 trajectories: list[dict], adapter: bool = True) -> None:
    """Every file the manifest pins, the trace ids, the adapter, and the manifest's summary
    (`adapter=False`: the artifact is a full checkpoint, whose identity the caller checks).
    InputError for a manifest listing over MAX_MANIFEST_FILES names, FileTooLarge as
    `_bound_hashing` raises it, both before anything is hashed."""
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    if len(files) > MAX_MANIFEST_FILES:
        raise InputError(f"{run_dir}/manifest.json: field files: {len(files)} entries, more than "
                         f"the {MAX_MANIFEST_FILES} a run's manifest may list; not a grpogate "
                         "run directory")
    adapter_path = str((evidence.get("artifact") or {}).get("path") or "")
    on_disk = [name for name in RUN_FILES if confined(run_dir, name)]
    if adapter_path and (run_dir / adapter_path).is_dir():
        on_disk += [f"{adapter_path}/{p.name}" for p in sorted((run_dir / adapter_path).glob("*"))]
    weights = f"{adapter_path}/{ADAPTER_WEIGHTS}" if adapter_path and adapter else None
    _bound_hashing(run_dir, [weights, *on_disk, *files], weights, audit.shards)
    _check_listed(audit, run_dir, files, weights)
    for name in on_disk:
        if name not in files:
            audit.mismatch(f"files.{name} (not recorded in the manifest)")

    identity = manifest.get("trajectory_identity") or {}
    trace_ids = [str(record.get("trace_id")) for record in trajectories]
    audit.compare("manifest.trajectory_identity", identity, {
        "trace_count": len(trace_ids), "trace_ids_sha256": trace_ids_sha256(trace_ids),
        "trajectories_sha256": file_sha(audit, run_dir, "trajectories.jsonl"),
        "evidence_sha256": file_sha(audit, run_dir, "evidence.json")})

    if adapter:
        audit.compare("artifact.sha256", (evidence.get("artifact") or {}).get("sha256"),
                      file_sha(audit, run_dir, weights, weights) if weights else None)
    # The rest of the manifest is a summary of the evidence: rebuild it, listing the files
    # without hashing them again (each was hashed once above), and compare.
    try:
        rebuilt = build_manifest(evidence, run_dir, trajectories, hashed=False)
    except (KeyError, TypeError) as error:
        audit.mismatch(f"manifest (cannot be rebuilt from the evidence: missing {error})")
        return
    unknown_fields(audit, "manifest.json", manifest, rebuilt)
    for key in ("files", "trajectory_identity"):
        rebuilt.pop(key)
    audit.compare("manifest", manifest, rebuilt)


def normal_name(name: Any) -> bool:
    """Whether `name` is a relative path in normal form, as a run's manifest writes its names:
    not absolute, no ".", ".." or empty component, no NUL (one file has one name)."""
    return (isinstance(name, str) and "\0" not in name and not name.startswith("/")
            and all(part not in ("", ".", "..") for part in name.split("/")))


def _bound_hashing(run_dir: Path, names: list, weights: str | None,
                   shards: str | None = None) -> None:
    """FileTooLarge before anything is hashed: each distinct regular file inside the run that a
    name in normal form reaches, counted once, within its limit (the adapter weights: exactly
    the size their header declares, tensors.safetensors_size, or MAX_SAFETENSORS_BYTES when the
    header is malformed, named by anchored_versions; any other file `hash_limit`'s), and all
    of them within MAX_HASHED_BYTES, plus MAX_CHECKPOINT_BYTES with a full checkpoint's
    `shards`."""
    sizes: dict[Path, int] = {}
    for name in names:
        path = confined(run_dir, name) if normal_name(name) else None
        if path is None or path in sizes:
            continue
        size = None
        if name == weights:
            with tolerated(InputError, OSError):  # malformed: bounded by its size below,
                size = safetensors_size(path)  # named by anchored_versions
        if size is None:
            size = refuse_larger(f"{run_dir}/{name}", path.stat().st_size,
                                 hash_limit(name, weights, shards), "a run file")
        sizes[path] = size
    refuse_larger(run_dir, sum(sizes.values()),
                  MAX_HASHED_BYTES + (MAX_CHECKPOINT_BYTES if shards else 0),
                  "the files an audit hashes in all")


def _check_listed(audit: Audit, run_dir: Path, files: dict, weights: str | None) -> None:
    """Each listed file's hash (the adapter `weights` within their own limit); a name not in
    normal form, or that is not a regular file inside the run, is flagged and never read."""
    for name, recorded in files.items():
        if not normal_name(name):
            audit.mismatch(f"files.{name} (not a relative path in normal form; not read)",
                           recorded)
            continue
        with tolerated() as failed:
            digest = audit.sha256(run_dir, name, weights)
        if failed.error:  # flagged, and never read
            audit.mismatch(f"files.{name} ({str(failed.error).removeprefix(f'{name}: ')})",
                           recorded)
            continue
        if digest != recorded:
            audit.mismatch(f"files.{name} sha256", recorded, digest)


def unknown_fields(audit: Audit, name: str, recorded: dict, rebuilt: dict) -> None:
    """A top-level field the run's own writer never writes is named: a reader of the file
    must not meet a claim the audit did not check."""
    for key in recorded:
        if key not in rebuilt:
            audit.mismatch(f"{name}: unknown field {key!r}", recorded[key], "absent")


def anchored_versions(audit: Audit, run_dir: Path, evidence: dict,
                      candidate: str | None = None) -> dict[str, str]:
    """The policy versions recomputed from the artifacts themselves, not from the hash list.

    A forger who swaps adapter/ for another run's and recomputes every file hash still has to
    name the candidate's version; here it is recomputed from the adapter's own tensors (the
    rule of files.tensors_digest, read without torch) and the base model's recorded identity,
    and the evidence, the manifest and every candidate re-test record must carry it.

    The baseline adapter is an input of the run, not part of it: its recorded path is where
    it was on the training machine, usually outside the run directory. Its weights are read
    when a regular file is there (§7: both versions recomputed from the tensors), under the
    candidate's bounds, so a path the directory names costs at most one streamed read of a
    file on the auditor's own machine: opened without blocking and checked to be a regular
    file on the descriptor, exactly the size its header declares (longer, or declaring more
    than MAX_SAFETENSORS_DATA: FileTooLarge, exit 2; shorter: truncated, a mismatch), hashed
    a block at a time. Unreadable is a mismatch;
    absent, the recorded version is taken. `candidate`: the candidate's version as the caller
    recomputed it from a full checkpoint (no adapter to read)."""
    inputs, artifact = evidence["inputs"], evidence.get("artifact") or {}
    base = (inputs.get("model") or {}).get("sha256")
    versions = {"baseline": inputs.get("baseline_policy_version"),
                "candidate": artifact.get("new_policy_version")}
    weights = confined(run_dir, f"{artifact.get('path') or 'adapter'}/{ADAPTER_WEIGHTS}")
    if candidate is not None:
        versions["candidate"] = candidate
    elif weights is not None:
        versions["candidate"] = _version_of(audit, base, weights,
                                            "artifact (adapter weights unreadable",
                                            versions["candidate"])
    audit.compare("artifact.new_policy_version", artifact.get("new_policy_version"),
                  versions["candidate"])
    baseline_adapter = inputs.get("baseline_adapter")
    baseline_weights = (Path(str(baseline_adapter.get("path"))) / ADAPTER_WEIGHTS
                        if isinstance(baseline_adapter, dict) else None)
    if baseline_adapter is None:
        versions["baseline"] = policy_version(base, None)
    elif baseline_weights is not None and baseline_weights.is_file():
        versions["baseline"] = _version_of(audit, base, baseline_weights,
                                           "inputs.baseline_adapter (unreadable", versions["baseline"])
    # A baseline adapter that is not on this machine cannot be re-hashed: taken as recorded.
    audit.compare("inputs.baseline_policy_version", inputs.get("baseline_policy_version"),
                  versions["baseline"])
    return versions


def _version_of(audit: Audit, base: Any, weights: Path, field: str, recorded: Any) -> Any:
    """The policy version of `base` + the adapter tensors in `weights`; an unreadable file is a
    mismatch named `field` and the recorded version stands (so it is not reported twice)."""
    with tolerated() as failed:
        return policy_version(base, safetensors_sha256(weights))
    audit.mismatch(f"{field}: {failed.error})")
    return recorded


def file_sha(audit: Audit, run_dir: Path, name: str, weights: str | None = None) -> str | None:
    return audit.sha256(run_dir, name, weights) if confined(run_dir, name) else None


def confined(run_dir: Path, name: str) -> Path | None:
    """`run_dir/name` when it is a regular file inside the run directory, else None (not read)."""
    try:
        return confined_file(run_dir, name)
    except InputError:
        return None


def no_change_words(evidence: Any, run_dir: str | Path) -> str | None:
    """`decisions.no_change_reason`, and where the run's delivered adapter has all-zero LoRA B
    matrices, that it provably computes the baseline's function. The adapter is read as any
    run file is (inside the run directory, a regular file, bounded by its header)."""
    reason = decisions.no_change_reason(evidence)
    name = (evidence.get("artifact") or {}).get("path") if isinstance(evidence, dict) and \
        isinstance(evidence.get("artifact"), dict) else None
    if reason is None or not isinstance(name, str):
        return reason
    try:
        zero = lora_b_all_zero(confined_file(run_dir, f"{name}/{ADAPTER_WEIGHTS}"))
    except (InputError, OSError, ValueError):
        zero = False
    return reason + ("; the adapter's LoRA B matrices are all zero, so it computes the "
                     "baseline's function exactly" if zero else "")
