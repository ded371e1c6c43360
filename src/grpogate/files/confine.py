"""One rule for the paths grpogate reads from and writes into a directory it did not build.

A run directory, a checkpoint and a TRL output directory may come from a stranger, who can
plant a symlink, a FIFO, a device or a huge sparse file under any name grpogate uses.

Reading (`confined_path`, `read_confined`, `sha256_confined`): a path is taken when, symlinks
resolved, it lies inside the root it was read from (a link within the root is followed, one
out of it is refused) and is a regular file, or a directory where a directory is wanted. A
file is opened non-blocking, checked again on the open descriptor (fstat) and its size held
against a limit before the first byte is read, so a FIFO never blocks and /dev/zero or a 2 GiB
sparse file is refused unread.

Writing (`open_in_run_dir`, `write_in_run_dir`): every file grpogate creates, appends to,
truncates or replaces inside a run directory is reached from the resolved run directory down
through folder descriptors opened with O_NOFOLLOW, and opened itself with O_NOFOLLOW (O_EXCL
when it is created, a fresh temporary name when it is replaced by rename). A symlink, FIFO,
socket or device in the file's place, or a symlinked folder on the way, is refused with an
InputError; no file outside the run directory is ever opened for writing. Both rules as the
docs state them: docs/design.md §10.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
from pathlib import Path

from grpogate.errors import InputError
from grpogate.files.bounds import MAX_FILE_BYTES, descriptor_size

NOT_REGULAR = "not a regular file (a folder, FIFO, socket or device)"


# --- reading -----------------------------------------------------------------------------------

def confined_path(root: str | Path, name: str, *, directory: bool = False,
                  within: str = "the run directory") -> Path:
    """`root/name` resolved, when it lies inside `root` (resolved) and is a regular file (a
    directory with `directory=True`); InputError naming `name`, why, and `within` (what `root`
    is) otherwise. Checked with stat before anything opens it: a FIFO, a device or a folder is
    refused, never read."""
    base = Path(root).resolve()
    if not isinstance(name, str) or not name or Path(name).is_absolute():
        raise InputError(f"{name!r}: not a relative path inside {within}")
    path = (base / name).resolve()
    if not path.is_relative_to(base):
        raise InputError(f"{name}: escapes {within}")
    try:
        mode = os.stat(path).st_mode
    except OSError:
        raise InputError(f"{name}: missing") from None
    if directory and not stat.S_ISDIR(mode):
        raise InputError(f"{Path(root) / name}: not a folder")
    if not directory and not stat.S_ISREG(mode):
        raise InputError(f"{name}: {NOT_REGULAR}")
    return path


def confined_file(root: str | Path, name: str, within: str = "the run directory") -> Path:
    """`confined_path` of a regular file."""
    return confined_path(root, name, within=within)


@contextlib.contextmanager
def open_confined(root: str | Path, name: str, limit: int, what: str,
                  within: str = "the run directory"):
    """(stream, size) of `confined_file(root, name)` opened without blocking and checked again
    on the open descriptor (a file swapped for a FIFO after the check is refused, not waited
    on), its size within `limit` (FileTooLarge, naming root/name and `what`)."""
    path = confined_file(root, name, within)
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(descriptor, "rb") as stream:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise InputError(f"{name}: {NOT_REGULAR}")
        yield stream, descriptor_size(descriptor, os.path.join(root, name), limit, what)


def read_confined(root: str | Path, name: str, limit: int = MAX_FILE_BYTES,
                  what: str = "a run file grpogate parses", within: str = "the run directory"
                  ) -> bytes:
    """The bytes of `confined_file(root, name)`, read as `open_confined` opens it: its size
    then, at most `limit` (a file growing while read is read no further; `what` names the
    file's kind in the refusal, `within` the folder's)."""
    with open_confined(root, name, limit, what, within) as (stream, size):
        return stream.read(size)


def sha256_confined(root: str | Path, name: str, limit: int = MAX_FILE_BYTES) -> str:
    """The sha256 of `confined_file(root, name)`, streamed as `open_confined` opens it (its
    size then, at most `limit`)."""
    digest = hashlib.sha256()
    with open_confined(root, name, limit, "a run file grpogate hashes") as (stream, size):
        while size > 0 and (block := stream.read(min(1 << 22, size))):
            digest.update(block)
            size -= len(block)
    return digest.hexdigest()


def sha256_regular(path: str | Path, limit: int, what: str) -> tuple[str, int]:
    """(sha256, size) of a file outside any run directory that grpogate only hashes (a model
    folder the user or a candidate names): opened without blocking, following links (a Hugging
    Face snapshot links each file into its blobs) but only to a regular file, checked on the
    open descriptor, its size then within `limit` (FileTooLarge naming `what`), streamed a block
    at a time; a link to /dev/zero or a FIFO is refused, never read."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise InputError(f"{path}: unreadable ({error.strerror})") from None
    digest = hashlib.sha256()
    with os.fdopen(descriptor, "rb") as stream:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise InputError(f"{path}: {NOT_REGULAR}")
        size = remaining = descriptor_size(descriptor, path, limit, what)
        while remaining > 0 and (block := stream.read(min(1 << 22, remaining))):
            digest.update(block)
            remaining -= len(block)
    return digest.hexdigest(), size


# --- writing -----------------------------------------------------------------------------------

# How a file is opened for writing: created new, appended to, rewritten in place, or (the lock)
# rewritten in place and created when missing. Every mode adds O_NOFOLLOW and O_NONBLOCK.
WRITE_MODES = {"x": os.O_WRONLY | os.O_CREAT | os.O_EXCL, "a": os.O_WRONLY | os.O_APPEND,
               "r+": os.O_RDWR, "c": os.O_RDWR | os.O_CREAT}
_NO_FOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _refusal(shown: Path, error: OSError, folder: bool = False) -> InputError:
    if folder and error.errno in (errno.ENOTDIR, errno.ELOOP):
        return InputError(f"{shown}: not a real folder (a symbolic link or a file); grpogate "
                          "writes nothing through a link in a run directory")
    if error.errno in (errno.ELOOP, errno.EMLINK):
        return InputError(f"{shown}: a symbolic link; grpogate writes nothing through a link "
                          "in a run directory")
    if error.errno in (errno.ENXIO, errno.EISDIR, errno.ENOTDIR, errno.EOPNOTSUPP):
        return InputError(f"{shown}: {NOT_REGULAR}; grpogate writes only regular files in a "
                          "run directory")
    if error.errno == errno.EEXIST:
        return InputError(f"{shown}: already exists; grpogate creates it, never reuses it")
    if error.errno == errno.ENOENT:
        return InputError(f"{shown}: missing")
    return InputError(f"{shown}: cannot be written ({error.strerror})")


def run_folder(run_dir: str | Path, folder: str = "", *, create: bool = False) -> int:
    """A descriptor of `run_dir/folder`, opened from the resolved run directory down one
    component at a time with O_NOFOLLOW: a symlink or a non-folder on the way is refused. With
    `create`, missing folders are made (mode 0777 less the umask)."""
    descriptor = os.open(Path(run_dir).resolve(), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    shown = Path(run_dir)
    try:
        for part in Path(folder).parts:
            shown = shown / part
            if part in ("..", "/"):
                raise InputError(f"{shown}: not a folder inside the run directory")
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=descriptor)
            try:
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | _NO_FOLLOW, dir_fd=descriptor)
            except OSError as error:
                raise _refusal(shown, error, folder=True) from None
            os.close(descriptor)
            descriptor = inner
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def open_in_run_dir(run_dir: str | Path, name: str, mode: str) -> int:
    """A descriptor of the regular file `run_dir/name` opened for writing (`WRITE_MODES`):
    its folders through `run_folder`, the file with O_NOFOLLOW and O_NONBLOCK, then checked with
    fstat. A symlink, FIFO, socket or device there is refused (InputError) without opening
    anything outside the run directory; a FIFO is never waited on."""
    folder, base = os.path.split(name)
    shown = Path(run_dir) / name
    parent = run_folder(run_dir, folder)
    try:
        descriptor = os.open(base, WRITE_MODES[mode] | _NO_FOLLOW, 0o666, dir_fd=parent)
    except OSError as error:
        raise _refusal(shown, error) from None
    finally:
        os.close(parent)
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise InputError(f"{shown}: {NOT_REGULAR}; grpogate writes only regular files in a run "
                         "directory")
    return descriptor


def write_in_run_dir(run_dir: str | Path, name: str, data: bytes, mode: int) -> None:
    """Replace `run_dir/name` by `data` atomically: a fresh temporary (O_EXCL, O_NOFOLLOW) in
    the same folder, reached as `run_folder` reaches it, written, fsynced, given `mode`, then
    renamed over the name (a symlink there is replaced, its target untouched) and the folder
    fsynced. A reader sees the old file or the new one, never half of one."""
    folder, base = os.path.split(name)
    parent = run_folder(run_dir, folder)
    temporary = f".{base}.{secrets.token_hex(6)}"
    try:
        try:
            descriptor = os.open(temporary, WRITE_MODES["x"] | _NO_FOLLOW, 0o600, dir_fd=parent)
        except OSError as error:
            raise _refusal(Path(run_dir) / folder / temporary, error) from None
        try:
            with os.fdopen(descriptor, "wb") as stream:
                os.fchmod(descriptor, mode)
                stream.write(data)
                stream.flush()
                os.fsync(descriptor)
            os.replace(temporary, base, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=parent)
            raise
        os.fsync(parent)
    finally:
        os.close(parent)
