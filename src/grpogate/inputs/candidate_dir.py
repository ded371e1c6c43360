"""A candidate from any trainer (`grpogate gate --candidate DIR`), read as untrusted data.

Two kinds, told apart by their config file:
- a PEFT adapter: `adapter_config.json` + `adapter_model.safetensors` (what TRL with a
  peft_config, Unsloth, axolotl and OpenRLHF's LoRA mode save), read by the rule a TRL
  directory's adapter is read by (inputs/trl_output.py);
- a full Hugging Face checkpoint: `config.json` + `model.safetensors`, or the shards that
  `model.safetensors.index.json` maps every tensor to (what verl and OpenRLHF save by default,
  and `merge_and_unload().save_pretrained(...)` writes).

Pickle weights (*.bin, *.pt, *.pth, *.pkl) are never opened: loading one can run code. A folder
whose only weights are pickles is refused. Every file is read through the confinement rule of
the folder (files/confine.py: a link out of it is refused), each safetensors file is checked by
its header alone, and the index must map each tensor to the shard that holds it.

What is re-tested is what is hashed (`stage_candidate`): each file is read once, through its
open descriptor, into a fresh folder of the run's own, hashed as it is copied; the copy is read
again by these same rules, checked for NaN and infinite values (`finite_weights`), loaded
(memory-mapped) and delivered as the run's `adapter/` or `candidate/`. A file changed at the
source while the run goes on changes nothing the run recorded. A full
checkpoint's identity is the files_digest of its config.json and weight files (the rule a base
model directory's identity follows: inputs/model_cache.py), so its policy version is the one a
run with `--model DIR` records as its baseline. Its tensors are loaded, and checked against the
baseline's architecture, by inputs/full_candidate.py.

Pure Python (no torch).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from grpogate.errors import InputError
from grpogate.files import (ADAPTER_WEIGHTS, MAX_CHECKPOINT_BYTES, MAX_CHECKPOINT_FILE_BYTES,
                            MAX_FILE_BYTES, confined_path, non_finite_counts, policy_version,
                            safetensors_names, safetensors_sha256, sha256_path)
from grpogate.files.confine import open_confined
from grpogate.files.tensors import MAX_SAFETENSORS_BYTES
from grpogate.inputs.model_cache import files_digest
from grpogate.inputs.trl_output import ADAPTER_CONFIG, read_adapter, read_json_file

PEFT_ADAPTER = "peft_adapter"
FULL_CHECKPOINT = "full_checkpoint"
MODEL_CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")
SHARD = re.compile(r"[\w.-]+\.safetensors", re.ASCII)
# A checkpoint's weight files are bounded by files/bounds.py (MAX_CHECKPOINT_FILE_BYTES each,
# MAX_CHECKPOINT_BYTES in all), which `decide` re-hashes at the same scale.
WITHIN = "the candidate directory"
# Tensors with NaN or infinite values the evidence names (the count covers every one).
LISTED_NON_FINITE = 5


@dataclass
class Candidate:
    """What `read_candidate` found; `files` are names inside `directory` (config first)."""

    kind: str  # PEFT_ADAPTER or FULL_CHECKPOINT
    directory: Path
    config: dict  # adapter_config.json or config.json, parsed
    files: list[str]  # what the candidate is: its config, the index if any, its weights
    weights: list[str]  # the safetensors files among them
    pickles_not_loaded: list[str] = field(default_factory=list)

    @property
    def base_model_name(self) -> str:
        return str(self.config.get("base_model_name_or_path") or "")

    @property
    def adapter_dir(self) -> Path:  # a PEFT adapter's folder (read_trl_output's field name)
        return self.directory


def _pickles(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()
                  if p.is_file() and p.suffix.lower() in PICKLE_SUFFIXES)


def _checked_file(directory: Path, name: str) -> Path:
    """A regular file inside the folder, within what `decide` hashes of one weight file."""
    try:
        path = confined_path(directory, name, within=WITHIN)
    except InputError as error:  # "NAME: missing", "NAME: escapes ...": named in the folder
        raise InputError(f"{directory}/{error}") from None
    if path.stat().st_size > MAX_CHECKPOINT_FILE_BYTES:
        raise InputError(f"{directory / name}: {path.stat().st_size} bytes, over the "
                         f"{MAX_CHECKPOINT_FILE_BYTES} a checkpoint file may hold (the Hub's "
                         "own limit); save the checkpoint in smaller shards (save_pretrained "
                         "max_shard_size)")
    return path


def _shards(directory: Path) -> list[str]:
    """The weight files of a sharded checkpoint, each holding exactly the tensors the index
    maps to it."""
    where = directory / INDEX
    index = read_json_file(where, directory, WITHIN)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(v, str) for v in weight_map.values()):
        raise InputError(f'{where}: field "weight_map" must map tensor names to shard files')
    by_file: dict[str, set[str]] = {}
    for tensor, name in weight_map.items():
        if not SHARD.fullmatch(name) or name.startswith("."):
            raise InputError(f'{where}: field "weight_map" names {name[:80]!r} for tensor '
                             f"{tensor[:80]!r}; a shard is a .safetensors file in this folder")
        by_file.setdefault(name, set()).add(tensor)
    for name, tensors in sorted(by_file.items()):
        held = safetensors_names(_checked_file(directory, name), MAX_CHECKPOINT_FILE_BYTES)
        if held != tensors:
            odd = sorted(held ^ tensors)[0]
            raise InputError(f"{directory / name}: tensor {odd[:80]!r} is "
                             f"{'in the file but not' if odd in held else 'not in the file but'}"
                             f" mapped to it by {INDEX}")
    return sorted(by_file)


def _full_checkpoint(directory: Path) -> Candidate:
    config = read_json_file(directory / MODEL_CONFIG, directory, WITHIN)
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise InputError(f'{directory / MODEL_CONFIG}: field "model_type" missing; not a '
                         "Hugging Face model config")
    pickles = _pickles(directory)
    if (directory / INDEX).exists():
        weights, files = _shards(directory), [MODEL_CONFIG, INDEX]
    elif (directory / SINGLE_FILE).exists():
        # a malformed header: here
        safetensors_names(_checked_file(directory, SINGLE_FILE), MAX_CHECKPOINT_FILE_BYTES)
        weights, files = [SINGLE_FILE], [MODEL_CONFIG]
    elif pickles:
        raise InputError(f"{directory}: only pickle weights ({', '.join(pickles[:3])}), which "
                         "are never loaded (loading one can run code); save the checkpoint "
                         "with save_pretrained(..., safe_serialization=True)")
    else:
        raise InputError(f"{directory}: a {MODEL_CONFIG} but no {SINGLE_FILE} or {INDEX}; "
                         "not a Hugging Face checkpoint in safetensors")
    total = sum((directory / name).stat().st_size for name in weights)
    if total > MAX_CHECKPOINT_BYTES:
        raise InputError(f"{directory}: {total} bytes of weights, over the "
                         f"{MAX_CHECKPOINT_BYTES} that grpogate copies, hashes and decide "
                         "re-hashes of a candidate")
    return Candidate(FULL_CHECKPOINT, directory, config, files + weights, weights, pickles)


def read_candidate(path: str | Path) -> Candidate:
    """The candidate in folder `path`: a PEFT adapter when it holds adapter_config.json, a
    full checkpoint when it holds config.json; InputError (one line naming the file and the
    field or tensor) otherwise. Opens no pickle."""
    directory = Path(path).resolve()
    if not directory.is_dir():
        raise InputError(f"{path}: no such directory (a candidate: a PEFT adapter folder or a "
                         "Hugging Face checkpoint)")
    if (directory / ADAPTER_CONFIG).is_file():
        config = read_adapter(directory, directory, WITHIN)
        return Candidate(PEFT_ADAPTER, directory, config, [ADAPTER_CONFIG, ADAPTER_WEIGHTS],
                         [ADAPTER_WEIGHTS], _pickles(directory))
    if (directory / MODEL_CONFIG).is_file():
        return _full_checkpoint(directory)
    pickles = _pickles(directory)
    raise InputError(f"{path}: neither {ADAPTER_CONFIG} (a PEFT adapter) nor {MODEL_CONFIG} "
                     "(a Hugging Face checkpoint)" + (
                         f"; its {', '.join(pickles[:3])} (pickles) are never loaded"
                         if pickles else ""))


def file_hashes(directory: Path, names: list[str]) -> dict[str, str]:
    """{name: sha256} of the candidate's files."""
    return {name: sha256_path(directory / name) for name in names}


def checkpoint_identity(hashes: dict[str, str]) -> str:
    """A full checkpoint's identity: files_digest of its config.json and weight files (the
    index, which only says where a tensor is, is pinned by the manifest, not by the identity)."""
    return files_digest({name: digest for name, digest in hashes.items() if name != INDEX})


def candidate_version(candidate: Candidate, base_sha256: str, hashes: dict[str, str]) -> str:
    """The candidate's policy version: the baseline's base identity and the adapter's tensors;
    for a full checkpoint, its own identity with no adapter."""
    if candidate.kind == FULL_CHECKPOINT:
        return policy_version(checkpoint_identity(hashes), None)
    return policy_version(base_sha256, safetensors_sha256(candidate.directory / ADAPTER_WEIGHTS))


def stage_candidate(found: Candidate, staging: Path) -> tuple[Candidate, dict[str, str]]:
    """The candidate's files copied into `staging` (an empty folder of the run's own, on the
    run's filesystem), each read once through its open descriptor (confined to the candidate's
    folder, a regular file, its size on the descriptor within the bound `read_candidate`
    held it to) and hashed as it is copied; then the copy read as a candidate again, by the
    same rules. Returns (the copy, {name: sha256 of the bytes copied}): what the re-test loads
    and the run records. InputError when the disk cannot hold the copy, or when the copy is not
    the candidate that was admitted (a file changed at the source meanwhile)."""
    sizes = {name: (found.directory / name).stat().st_size for name in found.files}
    free = shutil.disk_usage(staging).free
    if sum(sizes.values()) > free:
        raise InputError(f"{found.directory}: {sum(sizes.values())} bytes to copy into the run, "
                         f"{free} free on {staging.parent}; free space or choose another --out")
    hashes = {name: _copy_hashed(found.directory, name, staging / name) for name in found.files}
    try:
        copied = read_candidate(staging)
    except InputError as error:
        raise InputError(f"{found.directory}: changed while copied into the run ({error})"
                         ) from None
    if (copied.kind, copied.files) != (found.kind, found.files):
        raise InputError(f"{found.directory}: changed while copied into the run (its files "
                         "are no longer the ones admitted)")
    return dataclasses.replace(copied, pickles_not_loaded=found.pickles_not_loaded), hashes


_BLOCK = 1 << 22
_ZEROS = bytes(_BLOCK)


def _copy_hashed(directory: Path, name: str, target: Path) -> str:
    """Copy directory/name to `target` a 4 MiB block at a time, as `open_confined` opens it
    (its size then, at most the largest file a candidate may hold); the sha256 of the bytes
    written. A block of zeros is skipped over, not written, so the copy of a sparse file stays
    sparse. A file shorter than its size at opening is InputError (truncated while copied)."""
    digest = hashlib.sha256()
    limit = max(MAX_CHECKPOINT_FILE_BYTES, MAX_SAFETENSORS_BYTES, MAX_FILE_BYTES)
    with (open_confined(directory, name, limit, "a candidate's file", WITHIN) as (stream, size),
          open(target, "xb") as copy):
        while copy.tell() < size:
            block = stream.read(min(_BLOCK, size - copy.tell()))
            if not block:
                raise InputError(f"{directory / name}: truncated while copied into the run")
            digest.update(block)
            if block == _ZEROS[:len(block)]:
                copy.seek(len(block), os.SEEK_CUR)
            else:
                copy.write(block)
        copy.truncate(size)  # the length a skipped last block leaves unwritten
        copy.flush()
        os.fsync(copy.fileno())
    return digest.hexdigest()


def finite_weights(directory: Path, weights: list[str]) -> dict:
    """Whether every floating-point value of the weight files is finite, read a block at a time
    (tensors.non_finite_counts). A diverged training run leaves NaN or infinite weights; a
    re-test of them measures nothing, so the gate decides `reject` (check `finite_weights`)
    without one. The same function re-reads the run's copy in `decide`."""
    tensors, found = 0, []
    for name in weights:
        read, counts = non_finite_counts(directory / name, MAX_CHECKPOINT_FILE_BYTES)
        tensors += read
        found += [{"file": name, "tensor": tensor, "non_finite_values": count}
                  for tensor, count in sorted(counts.items())]
    return {"tensors_checked": tensors, "non_finite_tensors": len(found),
            "non_finite_values": sum(entry["non_finite_values"] for entry in found),
            "listed": found[:LISTED_NON_FINITE]}


def finite_weights_line(summary: dict) -> str:
    """The admission's one line on the weights' values."""
    if not summary["non_finite_tensors"]:
        return (f"finite weights: every value of {summary['tensors_checked']} floating-point "
                "tensors is finite (checked before the re-test)")
    first = summary["listed"][0]
    return (f"finite weights: {summary['non_finite_tensors']} of {summary['tensors_checked']} "
            f"tensors hold NaN or infinite values ({summary['non_finite_values']} values; first "
            f"{first['tensor']!r} in {first['file']}): not re-tested, rejected")
