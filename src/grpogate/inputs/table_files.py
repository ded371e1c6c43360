"""A table's files, confined, bounded, hashed and copied before Hugging Face datasets sees them.

A `dataset:` path or `--train-data` table is a stranger's file or folder. Left to itself,
`datasets` follows whatever a folder's `state.json` names (`../outside/x.arrow`,
`/etc/passwd`), blocks on a FIFO, reads a 1 TiB sparse file to its end, and writes what it
builds into the user's datasets cache. So a table is staged first (`staged_table`):

- the files read are exactly those `datasets` would read: the file named; or, of a
  `save_to_disk` folder, `dataset_dict.json` (when present), and of each split's folder its
  `state.json`, its `dataset_info.json` and the data files `state.json` names. Split and data
  file names are plain names (no `/`, no `..`, not absolute); every file is a regular file
  inside the named folder, links resolved (files/confine.py), opened without blocking and
  checked again on its descriptor, its size within `max_bytes` for the table in all. Other
  files beside them are never opened;
- each file is copied into a private folder (created owner-only, removed when the read ends,
  refused or not) while it is hashed, so the table identity covers exactly the bytes
  `datasets` reads, and a file changed after the check is not what is read;
- every data file is checked (inputs/table_checks.py: rows, longest cell, nesting, encoding)
  before `datasets` builds anything from the copy, with its cache inside the private folder.

The identity's sha256 is over the files' own sha256 digests in name order, each over the
file's relative name (a single file: its own name) then its bytes. `table_sha256` re-hashes
the recorded names under the same confinement and bounds: `grpogate decide` calls it
(evidence/audit.py), so a table changed after the run is a mismatch.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from grpogate.errors import InputError
from grpogate.files.confine import confined_path, open_confined
from grpogate.inputs.table_checks import CHECKS, RowCounter, TableLimits, json_value, over_limit

# File name endings -> the `datasets` builder (and the check) that reads them.
READERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv",
           ".arrow": "arrow"}
# A folder's metadata (dataset_dict.json, state.json, dataset_info.json): what datasets writes
# is under a few kilobytes (dataset_info.json lists the features); 1 MiB leaves room for a
# schema of thousands of columns.
MAX_METADATA_BYTES = 1 << 20
MAX_DATA_FILES = 4096  # data files a split's state.json may name (datasets shards by 500 MB)
COPY_BLOCK = 1 << 22
UNBOUNDED = 1 << 62  # the size is bounded by the caller, which knows what is left
WITHIN = "the dataset folder"


def reader_of(name: str) -> str | None:
    """The datasets builder of a file name, None when datasets reads no such file here."""
    return next((builder for ending, builder in READERS.items()
                 if name.lower().endswith(ending)), None)


@dataclass
class Staged:
    """A table copied into `folder`: the names of its files (relative to the named path),
    their hash, and the data files to read with their builder and shown name."""

    source: Path
    folder: Path
    names: list[str] = field(default_factory=list)
    data: list[tuple[Path, str, str]] = field(default_factory=list)  # (copy, builder, shown)
    is_folder: bool = False  # a save_to_disk folder (load_from_disk), else one file
    copied_bytes: int = 0
    _digests: dict[str, bytes] = field(default_factory=dict)

    def sha256(self) -> str:
        return table_digest(self._digests)


def table_digest(file_digests: dict[str, bytes]) -> str:
    """The table's identity: sha256 over its files' own sha256 digests (each over the file's
    relative name then its bytes), in name order."""
    digest = hashlib.sha256()
    for name in sorted(file_digests):
        digest.update(file_digests[name])
    return digest.hexdigest()


@contextlib.contextmanager
def _open(root: Path, name: str):
    """(stream, size) of root/name as files/confine.py opens it (inside `root`, links
    resolved; a regular file, checked again on the open descriptor, opened without blocking),
    every refusal naming root/name and the dataset folder. The size is the caller's to
    bound: no byte is read before it is checked."""
    with contextlib.ExitStack() as stack:
        try:
            confined_path(root, name, within=WITHIN)
            opened = stack.enter_context(open_confined(root, name, UNBOUNDED, "a table's files"))
        except InputError as error:
            raise InputError(f"{root / name}: {str(error).split(': ', 1)[-1]}") from None
        yield opened


def _copy(root: Path, name: str, staged: Staged, limits: TableLimits, target: str,
          largest: int | None = None) -> Path:
    """root/name copied to staged.folder/target while hashed: confined, regular, opened
    without blocking, its size (fstat, before a byte is read) within what is left of
    `limits.max_bytes`, and within `largest` (a metadata file's own bound) when given."""
    shown = root / name
    left = limits.max_bytes - staged.copied_bytes
    with _open(root, name) as (stream, size):
        if largest is not None and size > largest:
            raise InputError(f"{shown}: {size} bytes, over the {largest} a datasets metadata "
                             "file holds")
        if size > left:
            raise over_limit(str(shown), f"{size} bytes, which takes the table past "
                             f"{limits.max_bytes} bytes", limits, "max_bytes")
        copy = staged.folder / target
        copy.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(target.encode("utf-8"))
        with open(copy, "xb") as out:
            while size > 0 and (block := stream.read(min(COPY_BLOCK, size))):
                digest.update(block)
                out.write(block)
                size -= len(block)
    staged.copied_bytes += copy.stat().st_size
    staged.names.append(target)
    staged._digests[target] = digest.digest()  # the name's and the bytes' hash, per file
    return copy


def _plain_name(value, where: str, what: str) -> str:
    """A split or data file name that is one path component inside its folder."""
    if not isinstance(value, str) or not value or value in (".", "..") or "/" in value \
            or "\\" in value or "\x00" in value:
        raise InputError(f"{where}: {what} {value!r} is not a plain name inside {WITHIN} "
                         "(no '/', no '..', not absolute)")
    return value


def _metadata(root: Path, name: str, staged: Staged, limits: TableLimits):
    """A folder's JSON metadata file, copied, bounded and parsed."""
    copy = _copy(root, name, staged, limits, name, largest=MAX_METADATA_BYTES)
    try:
        text = copy.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{root / name}: not UTF-8 text") from None
    return json_value(text, str(root / name), limits)


def _stage_split(source: Path, split: str, staged: Staged, limits: TableLimits) -> None:
    """One split folder of a save_to_disk folder (`split` "" for a single Dataset)."""
    prefix = f"{split}/" if split else ""
    state = _metadata(source, f"{prefix}state.json", staged, limits)
    _metadata(source, f"{prefix}dataset_info.json", staged, limits)
    files = state.get("_data_files") if isinstance(state, dict) else None
    where = source / f"{prefix}state.json"
    if not isinstance(files, list) or not files or len(files) > MAX_DATA_FILES:
        raise InputError(f'{where}: field "_data_files": expected a list of 1 to '
                         f"{MAX_DATA_FILES} data files")
    for entry in files:
        name = entry.get("filename") if isinstance(entry, dict) else None
        name = _plain_name(name, f'{where}: field "_data_files"', "a data file")
        if reader_of(name) != "arrow":
            raise InputError(f'{where}: field "_data_files": {name!r} is not an .arrow file')
        copy = _copy(source, prefix + name, staged, limits, prefix + name)
        staged.data.append((copy, "arrow", str(source / prefix / name)))


def _stage_folder(source: Path, staged: Staged, limits: TableLimits) -> None:
    if (source / "dataset_dict.json").exists() or (source / "dataset_dict.json").is_symlink():
        splits = _metadata(source, "dataset_dict.json", staged, limits)
        names = splits.get("splits") if isinstance(splits, dict) else None
        if not isinstance(names, list) or not names:
            raise InputError(f'{source / "dataset_dict.json"}: field "splits": expected a '
                             "list of split names")
        for split in names:
            _plain_name(split, f'{source / "dataset_dict.json"}: field "splits"', "a split")
            _stage_split(source, split, staged, limits)
    else:
        _stage_split(source, "", staged, limits)


@contextlib.contextmanager
def staged_table(source: str | Path, limits: TableLimits):
    """The table at `source` (a file or a save_to_disk folder) staged in a private folder
    and checked (module docstring); the folder is removed when the block ends."""
    path = Path(source)
    folder = Path(tempfile.mkdtemp(prefix="grpogate-table-"))  # mode 0700
    try:
        resolved = path.resolve()
        staged = Staged(source=resolved, folder=folder / "table")
        staged.folder.mkdir()
        if resolved.is_dir():
            staged.is_folder = True
            _stage_folder(resolved, staged, limits)
        else:
            builder = reader_of(path.name)
            if builder is None:
                raise InputError(f"{source}: not a table datasets reads here (a file ending "
                                 f"in {', '.join(READERS)}, or a save_to_disk folder)")
            _copy(resolved.parent, resolved.name, staged, limits, resolved.name)
            # datasets takes data_files as a pattern: the copy is read under a plain name.
            plain = staged.folder / f"table{_ending(path.name)}"
            os.rename(staged.folder / resolved.name, plain)
            staged.data.append((plain, builder, str(source)))
        counter = RowCounter(limits, str(source))
        for copy, builder, shown in staged.data:
            CHECKS[builder](copy, shown, limits, counter)
        if counter.rows == 0:
            raise InputError(f"{source}: no rows (an empty table)")
        yield staged
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _ending(name: str) -> str:
    return next(ending for ending in READERS if name.lower().endswith(ending))


def table_sha256(source: str, names: list, limits: TableLimits) -> str:
    """The identity `staged_table` recorded, re-hashed from `names` (relative to the
    recorded folder, or the file's own name) under the same confinement and bounds."""
    path = Path(source)
    if not isinstance(names, list) or not names or len(names) > 3 + 3 * MAX_DATA_FILES:
        raise InputError(f"{source}: no list of the table's files recorded")
    root = path if path.is_dir() else path.parent
    digests, total = {}, 0
    for name in names:
        if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
            raise InputError(f"{source}: recorded file {name!r} is not inside the table")
        digest = hashlib.sha256(name.encode("utf-8"))
        with _open(root, name) as (stream, size):
            total += size
            if total > limits.max_bytes:
                raise over_limit(str(root / name), f"the table's files past {limits.max_bytes} "
                                 "bytes", limits, "max_bytes")
            while size > 0 and (block := stream.read(min(COPY_BLOCK, size))):
                digest.update(block)
                size -= len(block)
        digests[name] = digest.digest()
    return table_digest(digests)


def identity_names(staged: Staged) -> list[str]:
    """The recorded file names: relative to the folder, or the single file's own name."""
    return sorted(staged.names)


