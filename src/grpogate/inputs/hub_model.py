"""A base model named by hub id (`owner/name`): one commit of huggingface_hub's cache, found the
same way by the run and by the dry run.

`resolve_hub_model` pins the revision first: the files the checks read (config.json, the
tokenizer's files, the safetensors index) are fetched into the cache, or found there offline
(HF_HUB_OFFLINE=1, or no network: `snapshot_download` then reads the cache alone), and the
snapshot folder they land in is named by the commit they belong to. Every later file is read
at that commit, so the run loads the weights of the revision the dry run checked and the
evidence records. The weights are safetensors alone: `model.safetensors`, or the shards the
index maps tensors to; a repository whose only weights are pickles is refused, since loading
one can run code. The run fetches the weight files (`weights=True`); the dry run only asks
whether they are there: in the cache offline, in the hub's listing of the commit online
(`snapshot_download(..., dry_run=True)`, which downloads nothing).
huggingface_hub's reference: https://huggingface.co/docs/huggingface_hub/guides/download
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from grpogate.errors import InputError, first_line
from grpogate.files import read_json
from grpogate.inputs.candidate_dir import INDEX, SHARD, SINGLE_FILE

# What the checks and the loaders read besides the weights: the model's config, the tokenizer's
# files in each of their forms, the chat template, and the weights' index (a snapshot's
# weights are laid out as a checkpoint folder's: candidate_dir's names).
METADATA_FILES = ["config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                  "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                  "chat_template.jinja", "chat_template.json", INDEX]
COMMIT = re.compile(r"[0-9a-f]{40}", re.ASCII)
MAX_SHARDS = 4096  # the largest public checkpoints hold a few hundred


@dataclass(frozen=True)
class HubSnapshot:
    repo_id: str
    commit: str  # the 40-hex commit the revision resolved to
    directory: Path  # huggingface_hub's snapshot folder of that commit
    weight_files: tuple[str, ...]
    weight_bytes: int | None  # their total size where known (None: the hub gave no size)


def resolve_hub_model(repo_id: str, revision: str, weights: bool) -> HubSnapshot:
    """`repo_id` at `revision` (a branch, tag or commit; "" for main) -> its snapshot, with the
    metadata files in the cache, and the weight files too when `weights`; InputError naming
    the id when the model, the revision or its safetensors weights cannot be had."""
    from huggingface_hub import snapshot_download

    # The cache looks a branch or tag up as the file refs/<revision>: a path is no revision.
    if ".." in revision or revision.startswith("/") or "\\" in revision:
        raise InputError(f"model_revision {revision!r}: not a branch, tag or commit name")
    folder = Path(_hub_call(snapshot_download, repo_id, revision, revision=revision or None,
                            allow_patterns=METADATA_FILES))
    commit = folder.name  # huggingface_hub's layout: snapshots/<commit>/
    if not COMMIT.fullmatch(commit):
        raise InputError(f"{repo_id}: the cache's ref for revision {revision or 'main'!r} names "
                         f"{commit[:80]!r}, not a commit")
    where = f"{repo_id}@{commit}"
    if not (folder / "config.json").is_file():
        raise InputError(f"{where}: no config.json; not a Hugging Face model repository")
    names = _weight_files(folder, where)
    if weights:
        _hub_call(snapshot_download, repo_id, commit, revision=commit, allow_patterns=list(names))
        return HubSnapshot(repo_id, commit, folder, names, _cached_bytes(folder, names, where))
    return HubSnapshot(repo_id, commit, folder, names, _weights_listed(repo_id, commit, folder,
                                                                       names, where))


def _weight_files(folder: Path, where: str) -> tuple[str, ...]:
    """The safetensors files the model loads from: the shards its index names, else the single
    file. The index is read as untrusted data: bounded, each shard a plain file name."""
    if not (folder / INDEX).is_file():
        return (SINGLE_FILE,)
    index = read_json(folder / INDEX)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise InputError(f'{where}/{INDEX}: field "weight_map" must map tensor names to shard '
                         "files")
    shards = sorted({name for name in weight_map.values() if isinstance(name, str)})
    odd = next((name for name in weight_map.values() if not isinstance(name, str)
                or not SHARD.fullmatch(name) or name.startswith(".")), None)
    if odd is not None or len(shards) > MAX_SHARDS:
        raise InputError(f'{where}/{INDEX}: field "weight_map" names {str(odd)[:80]!r}; a shard '
                         f"is a .safetensors file beside the index (at most {MAX_SHARDS})"
                         if odd is not None else
                         f'{where}/{INDEX}: field "weight_map" names {len(shards):,} shards '
                         f"(at most {MAX_SHARDS})")
    return tuple(shards)


def _cached_bytes(folder: Path, names: tuple[str, ...], where: str) -> int:
    """The weight files' total size in the cache; InputError naming the first one missing."""
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise InputError(
            f"{where}: {missing[0]} is not in the Hugging Face cache ({folder}) and the hub "
            "cannot be reached; the weights load from safetensors alone (pickled *.bin weights "
            "are never loaded): download them with network access, or name a local folder")
    return sum((folder / name).stat().st_size for name in names)


def _weights_listed(repo_id: str, commit: str, folder: Path, names: tuple[str, ...],
                    where: str) -> int | None:
    """The weight files' total size, as the hub lists the commit (nothing downloaded), or as
    the cache holds them when the hub cannot be reached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import DryRunError

    try:
        listed = snapshot_download(repo_id, revision=commit, allow_patterns=list(names),
                                   dry_run=True)
    except DryRunError:  # offline, or no network: the cache is what the run would load
        return _cached_bytes(folder, names, where)
    except Exception as error:  # noqa: BLE001 -- the hub's refusals, worded; others raised
        worded = _hub_error(repo_id, commit, error)
        if worded is None:
            raise
        raise worded from None
    found = {info.filename: info.file_size for info in listed}
    missing = [name for name in names if name not in found]
    if missing:
        raise InputError(f"{where}: the hub lists no {missing[0]}; the weights load from "
                         "safetensors alone (pickled *.bin weights are never loaded)")
    sizes = [found[name] for name in names]
    return None if None in sizes else sum(sizes)


def _hub_call(call, repo_id: str, asked: str, **kwargs):
    """`call(repo_id, **kwargs)` with huggingface_hub's refusals as one InputError line naming
    the id and the revision `asked` for."""
    try:
        return call(repo_id, **kwargs)
    except Exception as error:  # noqa: BLE001 -- the hub's refusals, worded; others raised
        worded = _hub_error(repo_id, asked, error)
        if worded is None:
            raise
        raise worded from None


def _hub_error(repo_id: str, revision: str, error: Exception) -> InputError | None:
    """huggingface_hub's exception -> the InputError a user acts on (one line, the id named);
    None for an exception that is not the hub's (a bug to report, raised as it is)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (HFValidationError, HfHubHTTPError,
                                        IncompleteSnapshotError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    at = f" at revision {revision!r}" if revision else ""
    why = "HF_HUB_OFFLINE=1" if constants.is_offline_mode() else "no network"
    if isinstance(error, (LocalEntryNotFoundError, IncompleteSnapshotError)):
        return InputError(
            f"{repo_id}: not in the Hugging Face cache{at} ({constants.HF_HUB_CACHE}) and the "
            f"hub cannot be reached ({why}); "
            f"download it once with network access (`hf download {repo_id}`), or name a local "
            "model folder")
    if isinstance(error, RevisionNotFoundError):
        return InputError(f"{repo_id}: the hub has no revision {revision!r} (model_revision)")
    if isinstance(error, RepositoryNotFoundError):
        return InputError(f"{repo_id}: no such model on the Hugging Face hub (or it is private "
                          "or gated: log in with `hf auth login`)")
    if isinstance(error, HFValidationError):
        return InputError(f"{repo_id}: not a Hugging Face model id ({first_line(error)})")
    if isinstance(error, HfHubHTTPError):
        return InputError(f"{repo_id}: the hub refused the request ({first_line(error)})")
    return None
