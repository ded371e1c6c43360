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
its header alone, and the index must map each tensor to the shard that holds it. A full
checkpoint's identity is the files_digest of its config.json and weight files (the rule a base
model directory's identity follows: inputs/model_cache.py), so its policy version is the one a
run with `--model DIR` records as its baseline. Its tensors are loaded, and checked against the
baseline's architecture, by inputs/full_candidate.py.

Pure Python (no torch).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from grpogate.errors import InputError
from grpogate.files import (ADAPTER_WEIGHTS, MAX_FILE_BYTES, confined_path, policy_version,
                            safetensors_names, safetensors_sha256, sha256_path)
from grpogate.inputs.model_cache import files_digest
from grpogate.inputs.trl_output import ADAPTER_CONFIG, read_adapter, read_json_file

PEFT_ADAPTER = "peft_adapter"
FULL_CHECKPOINT = "full_checkpoint"
MODEL_CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")
SHARD = re.compile(r"[\w.-]+\.safetensors", re.ASCII)
# What `decide` hashes of a run is bounded (evidence/audit_files.py): each file at most
# MAX_FILE_BYTES, and the candidate's weights within the share an adapter's weights may take.
MAX_CHECKPOINT_BYTES = 4 << 30
WITHIN = "the candidate directory"


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
    """A regular file inside the folder, within what `decide` hashes of one file."""
    try:
        path = confined_path(directory, name, within=WITHIN)
    except InputError as error:  # "NAME: missing", "NAME: escapes ...": named in the folder
        raise InputError(f"{directory}/{error}") from None
    if path.stat().st_size > MAX_FILE_BYTES:
        raise InputError(f"{directory / name}: {path.stat().st_size} bytes, over the "
                         f"{MAX_FILE_BYTES} a run file may hold (decide could not re-hash it); "
                         "save the checkpoint in smaller shards (save_pretrained max_shard_size)")
    return path


def _shards(directory: Path) -> list[str]:
    """The weight files of a sharded checkpoint, each holding exactly the tensors the index
    maps to it."""
    where = directory / INDEX
    index = read_json_file(where, directory)
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
        held = safetensors_names(_checked_file(directory, name))
        if held != tensors:
            odd = sorted(held ^ tensors)[0]
            raise InputError(f"{directory / name}: tensor {odd[:80]!r} is "
                             f"{'in the file but not' if odd in held else 'not in the file but'}"
                             f" mapped to it by {INDEX}")
    return sorted(by_file)


def _full_checkpoint(directory: Path) -> Candidate:
    config = read_json_file(directory / MODEL_CONFIG, directory)
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise InputError(f'{directory / MODEL_CONFIG}: field "model_type" missing; not a '
                         "Hugging Face model config")
    pickles = _pickles(directory)
    if (directory / INDEX).exists():
        weights, files = _shards(directory), [MODEL_CONFIG, INDEX]
    elif (directory / SINGLE_FILE).exists():
        safetensors_names(_checked_file(directory, SINGLE_FILE))  # a malformed header: here
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
                         f"{MAX_CHECKPOINT_BYTES} that decide re-hashes of a candidate")
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
        config = read_adapter(directory, directory)
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
