"""Files: atomic writes, content hashes, the append-only trajectories log, run directories.
(tensors.py: the torch-free safetensors read and the policy-version rule; bounds.py: how large
a file from a stranger may be.)

Every JSON file is written to a temporary name, fsynced and renamed, so a reader never sees a
half-written file; directories (the adapter, checkpoints) are staged and renamed the same way.
Every wing writes or hashes files (the policy hashes weights, the loop checkpoints, the
evidence pins them), so this module sits below all of them and imports nothing of theirs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import sys
from pathlib import Path

from grpogate.errors import InputError
from grpogate.files.bounds import (  # noqa: F401  (the files API: bounds.py)
    MAX_CHECKPOINT_BYTES, MAX_CHECKPOINT_FILE_BYTES, MAX_FILE_BYTES, MAX_JSONL_LINES, FileTooLarge,
    descriptor_size, refuse_larger, tolerated)
from grpogate.files.confine import (  # noqa: F401  (the files API: confine.py)
    confined_file, confined_path, open_in_run_dir, read_confined, run_folder, sha256_confined,
    write_in_run_dir)
from grpogate.files.json_text import MAX_JSON_STRING_CHARS  # noqa: F401  (files API)
from grpogate.files.json_text import compact_text, scan as scan_json_text
from grpogate.files.tensors import (  # noqa: F401  (the files API: tensors.py)
    non_finite_counts, policy_version, read_safetensors, safetensors_names, safetensors_sha256,
    tensors_digest)

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # the LoRA weights file of every adapter directory


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_path(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def file_mode() -> int:
    """The mode `open()` gives a new file under the current umask (0644 under umask 022).

    os.umask can only be read by setting it, so it is set and put back at once."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Replace `path` by `data` atomically (confine.write_in_run_dir with the file's folder as
    the run directory: no symlink or FIFO at the temporary name is ever written through). The
    file gets the mode any other new file would (the user's umask decides): a run directory is
    meant to be shared and re-checked."""
    path = Path(path)
    write_in_run_dir(path.parent, path.name, data, file_mode())


def fsync_directory(path: str | Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def atomic_directory(path: str | Path, root: str | Path | None = None):
    """Yield a staging directory beside `path`; on success fsync its files and rename it to
    `path` (replacing a copy a killed attempt left there), so `path` is never half-written.

    `root` (default: `path`'s folder) is the run directory: the folders from it down to `path`
    are opened as confine.run_folder opens them (made when missing, a symlinked one refused),
    and a symlink or file planted at `path` is unlinked, its target untouched."""
    path = Path(path)
    root = Path(root) if root is not None else path.parent
    folder = run_folder(root, os.path.relpath(path.parent, root) if path.parent != root else "",
                        create=True)
    staging = path.parent / f".{path.name}.{secrets.token_hex(6)}"
    try:
        os.mkdir(staging.name, 0o777, dir_fd=folder)  # the umask decides, as for mkdir
        yield staging
        for file in staging.iterdir():
            with open(file, "rb") as stream:
                # Writers inside (safetensors writes its weights 0600) get the umask's mode.
                os.fchmod(stream.fileno(), file_mode())
                os.fsync(stream.fileno())
        fsync_directory(staging)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISDIR(os.lstat(path.name, dir_fd=folder).st_mode):
                shutil.rmtree(path)  # never follows a link inside
            else:
                os.unlink(path.name, dir_fd=folder)
        os.rename(staging.name, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        os.fsync(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        os.close(folder)


def remove_staging(directory: str | Path) -> None:
    """Delete the hidden temporaries (".name.XXXX") that a killed writer left in `directory`."""
    for leftover in Path(directory).glob(".*"):
        if leftover.name == LOCK_FILE:
            continue  # held by this very process
        if leftover.is_dir() and not leftover.is_symlink():  # a link is unlinked, not followed
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
        if not existing:  # created here, never reused: a file already there is refused
            os.close(open_in_run_dir(path.parent, path.name, "x"))

    def _open(self, mode: str):
        # Through confine.open_in_run_dir: a symlink, FIFO or device planted under the log's
        # name is refused, never truncated or appended to.
        return os.fdopen(open_in_run_dir(self.path.parent, self.path.name, mode),
                         "ab" if mode == "a" else "r+b")

    def append(self, records: list[dict]) -> int:
        with self._open("a") as stream:
            stream.write(jsonl_bytes(records))
            stream.flush()
            os.fsync(stream.fileno())
            return stream.tell()

    def truncate(self, offset: int) -> None:
        with self._open("r+") as stream:
            size = os.fstat(stream.fileno()).st_size
            if size < offset:
                raise InputError(f"{self.path}: {size} bytes, shorter than the recorded offset "
                                 f"{offset}; the file was modified after the checkpoint")
            stream.truncate(offset)
            stream.flush()
            os.fsync(stream.fileno())


class NullLog:
    """A JsonlLog that writes nothing: ranks other than 0 under torchrun. Its offsets count the
    bytes rank 0 writes for the same records, so every rank holds the same loop state."""

    def __init__(self, offset: int = 0):
        self.offset = offset

    def append(self, records: list[dict]) -> int:
        self.offset += len(jsonl_bytes(records))
        return self.offset

    def truncate(self, offset: int) -> None:
        self.offset = offset


# Untrusted JSON (every file of a run directory, an eval file, a problems line): nesting
# deeper than this is refused before parsing (grpogate's own files nest under 10 levels).
JSON_DEPTH_LIMIT = 64


def _check_json_text(text: str, where: str) -> None:
    """Refuse, before json.loads builds anything, a text nesting deeper than JSON_DEPTH_LIMIT
    (InputError) or holding a string longer than MAX_JSON_STRING_CHARS (FileTooLarge: a bound,
    never a mismatch). json_text.scan: linear time, O(1) memory, whatever the text holds."""
    bounds = scan_json_text(text, JSON_DEPTH_LIMIT, MAX_JSON_STRING_CHARS)
    if bounds.too_deep:
        raise InputError(f"{where}: JSON nested deeper than {JSON_DEPTH_LIMIT} levels; not a "
                         "file grpogate reads")
    if bounds.long_string is not None:
        length, offset, key = bounds.long_string
        field = f'field "{key}"' if key is not None else f"the string at character {offset}"
        raise FileTooLarge(f"{where}: {field}: a string of {length} characters, over the limit "
                           f"of {MAX_JSON_STRING_CHARS} for a string in a file grpogate reads; "
                           "not what grpogate writes")


def _unique_keys(where: str):
    def pairs_to_dict(pairs: list) -> dict:
        document = dict(pairs)
        if len(document) != len(pairs):
            seen: set = set()
            key = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise InputError(f"{where}: duplicate key {key!r} (a reader that keeps the first "
                             "and one that keeps the last would see different files)")
        return document
    return pairs_to_dict


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _lone_surrogate_at(value, path: str = "") -> str | None:
    """The path of a string (or key) holding a lone surrogate, None when there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "the value"
    elif isinstance(value, dict):
        for key, item in value.items():
            found = _lone_surrogate_at(key, f"{path}.key") or _lone_surrogate_at(
                item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if found := _lone_surrogate_at(item, f"{path}[{index}]"):
                return found
    return None


def parse_json(text: str | bytes, where: str):
    """JSON text (or a file's UTF-8 bytes: decoded by json_text.compact_text, at most 3 bytes
    of text a byte; UnicodeDecodeError when not UTF-8) from an untrusted file -> its value,
    bounded: nesting deeper than
    JSON_DEPTH_LIMIT, a string longer than MAX_JSON_STRING_CHARS, duplicate keys, an integer too
    long for Python to convert and a lone surrogate escape (\\ud800: valid JSON, not Unicode
    text; it breaks every later encode) raise InputError naming `where` (file, or file:line);
    malformed text raises json.JSONDecodeError for the caller to word."""
    if isinstance(text, bytes):
        text = compact_text(text)
    _check_json_text(text, where)
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys(where))
    except (InputError, json.JSONDecodeError):
        raise
    except ValueError:  # int("9" * 5000): Python refuses to convert so long a number
        raise InputError(f"{where}: an integer of more than {sys.get_int_max_str_digits()} "
                         "digits; not a number any grpogate file holds") from None
    # Only a "\ud8xx"-style escape can decode to a surrogate: one search skips the walk.
    if _SURROGATE_ESCAPE.search(text) and (field := _lone_surrogate_at(value)):
        raise InputError(f'{where}: field "{field}": a lone surrogate (\\udXXX escape without '
                         "its pair) is not Unicode text")
    return value


def read_json(path: str | Path):
    """A whole JSON file through `parse_json` (InputError for bad UTF-8 or malformed JSON,
    FileTooLarge past MAX_FILE_BYTES)."""
    try:
        with open(path, "rb") as stream:
            data = stream.read(descriptor_size(stream.fileno(), path, MAX_FILE_BYTES,
                                               "a JSON file"))
        return parse_json(data, str(path))
    except UnicodeDecodeError as error:
        raise InputError(f"{path}: not valid UTF-8 (byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise InputError(f"{path}: not valid JSON: {error}") from None


def read_jsonl(path: str | Path) -> list[dict]:
    records = []
    with open(path, encoding="utf-8") as stream:
        descriptor_size(stream.fileno(), path, MAX_FILE_BYTES, "a JSONL file")
        for number, line in enumerate(stream, 1):
            if line.strip():
                try:
                    records.append(parse_json(line, f"{path}:{number}"))
                except json.JSONDecodeError as error:
                    raise InputError(f"{path}:{number}: malformed JSON line: {error.msg}") from None
    return records


def refuse_existing_output(path: Path) -> None:
    """An earlier run's outputs are never overwritten: any existing path is refused."""
    if path.exists():
        raise InputError(f"{path}: output already exists; choose a new run label (--label) or --out")


LOCK_FILE = ".grpogate.lock"


class RunDirLock:
    """An exclusive lock on a run directory: one writer at a time (a run, a resume, a report).

    flock on RUN_DIR/.grpogate.lock, which holds the holder's pid for the refusal message. The
    kernel drops the lock when the holder dies, so a SIGKILLed run leaves no stale lock. On
    release the file is unlinked while still locked; an acquirer re-checks that the file it
    locked is the one at the path, so an unlinked one is never mistaken for the lock.
    """

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.descriptor: int | None = None

    def acquire(self) -> "RunDirLock":
        while True:
            # No-follow, non-blocking, a regular file only (confine.open_in_run_dir): a
            # symlink planted under the lock's name is refused, its target never written.
            descriptor = open_in_run_dir(self.path.parent, LOCK_FILE, "c")
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                holder = os.pread(descriptor, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(descriptor)
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                raise InputError(f"{self.path.parent}: in use by another grpogate process (pid "
                                 f"{holder}); wait for it to finish or stop it first") from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(descriptor).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(descriptor)  # locked a file its holder had just unlinked: try again
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
        self.descriptor = descriptor
        return self

    def release(self) -> None:
        if self.descriptor is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.descriptor)
            self.descriptor = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def lies_inside(path: str, run_dir: Path) -> bool:
    """Whether `path` exists (a link counts) and lies in `run_dir`, as written or with symlinks
    resolved: a model or adapter a run directory brings along, never to be loaded from it."""
    if not os.path.lexists(path):
        return False
    return (Path(os.path.abspath(path)).is_relative_to(os.path.abspath(run_dir))
            or Path(path).resolve().is_relative_to(Path(run_dir).resolve()))


RUN_MARKERS = ("evidence.json", "trajectories.jsonl", "checkpoints", "manifest.json")


def refuse_output_inside_a_run(path: Path) -> None:
    """A new run never writes inside another run's directory (its adapter/ or checkpoints/):
    that would break the other run's audit or resume. Any ancestor holding a run is refused."""
    for ancestor in Path(os.path.abspath(path)).parents:
        found = [marker for marker in RUN_MARKERS if (ancestor / marker).exists()]
        if found:
            raise InputError(f"{path}: inside the run directory {ancestor} (it holds {found[0]}); "
                             "choose an --out outside any run")


def create_run_dir(path: Path) -> Path:
    refuse_existing_output(path)  # checked again here: admission ran before the model loaded
    refuse_output_inside_a_run(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir()
    return path


# str.splitlines()'s line boundaries, as UTF-8: counted in the bytes at C speed ("\r\n" twice:
# an over-count only), before a list of the lines is built.
_LINE_BREAKS = [c.encode() for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"]


def jsonl_lines(data: bytes, where: str) -> list[str]:
    """The lines of JSONL `data`, as str.splitlines() splits its UTF-8 text (UnicodeDecodeError
    when it is not); FileTooLarge past MAX_JSONL_LINES, counted before anything is split."""
    breaks = sum(data.count(separator) for separator in _LINE_BREAKS)
    refuse_larger(where, breaks, MAX_JSONL_LINES, "a JSONL file", "line breaks")
    return data.decode("utf-8").splitlines()
