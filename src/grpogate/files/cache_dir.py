"""The cache directory, where grpogate keeps what it builds once (the dequantized model, the
native kernels), and the one rule by which it trusts what it finds there (docs/design.md §10).

A cache may be shared or handed over, so nothing in it vouches for itself. grpogate loads a
cached artifact only when
- its directory is owned by this user and writable by no one else, and every directory above
  it is owned by this user or root and, where others can write it, sticky (as /tmp is);
- the artifact is a regular file owned by this user that no one else can write, and its sha256
  equals the one in its record;
- the record is an owner-only (0600) file whose fields carry an HMAC under a key kept outside
  every cache (`$XDG_CONFIG_HOME/grpogate/record.key`, else ~/.config/grpogate/record.key,
  made once, 0600). A record copied from another user's cache, or rewritten beside a forged
  artifact, does not verify: the expected hash never comes from the cache alone.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

KEY_BYTES = 32
RECORD_LIMIT = 1 << 20  # a record lists a few files: anything larger is not one of ours
_SETTING = {"cache_dir": ""}


def cache_root() -> Path:
    """$GRPOGATE_CACHE, else ~/.cache/grpogate: where grpogate keeps what it builds once."""
    return Path(os.environ.get("GRPOGATE_CACHE") or Path.home() / ".cache" / "grpogate")


def use_cache_dir(setting: str) -> None:
    """Record the run's `cache_dir` setting (empty: cache_root()) for the native kernels, whose
    callers hold tensors, not a config."""
    _SETTING["cache_dir"] = setting


def configured_cache_root() -> Path:
    """The `cache_dir` a loaded policy's config names, else cache_root()."""
    return Path(_SETTING["cache_dir"]) if _SETTING["cache_dir"] else cache_root()


def _entry_problem(info: os.stat_result, uid: int) -> str | None:
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != uid:
        return f"is owned by uid {info.st_uid}, not by you (uid {uid})"
    if info.st_mode & 0o022:
        return f"is writable by other users (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def untrusted_reason(directory: Path) -> str | None:
    """Why `directory` cannot hold artifacts grpogate loads, or None when it can (the rule above;
    the directory itself is never followed as a link, the directories above it are)."""
    uid = os.getuid()
    try:
        problem = _entry_problem(os.lstat(directory), uid)
    except OSError as error:
        return f"cannot be read ({error.strerror})"
    if problem is not None:
        return problem
    for parent in Path(os.path.realpath(directory)).parents:
        try:
            info = os.stat(parent)
        except OSError as error:
            return f"lies under {parent}, which cannot be read ({error.strerror})"
        if info.st_uid not in (0, uid):
            return f"lies under {parent}, owned by uid {info.st_uid}"
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            return (f"lies under {parent}, which other users can write "
                    f"(mode {stat.S_IMODE(info.st_mode):04o})")
    return None


def private_directory(directory: Path) -> str | None:
    """Make `directory` (0700) where it is missing; -> why it cannot hold artifacts grpogate
    loads, or None."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as error:
        return f"cannot be made ({error.strerror})"
    return untrusted_reason(directory)


def _open_owned(path: Path, private: bool) -> tuple[int | None, str]:
    """(fd, "") for a regular file owned by this user that no one else can write (nor read,
    where `private`), opened without following a link or blocking; (None, why not) otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as error:
        return None, f"cannot be opened ({error.strerror})"
    info = os.fstat(fd)
    problem = ("is not a regular file" if not stat.S_ISREG(info.st_mode) else
               f"is owned by uid {info.st_uid}" if info.st_uid != os.getuid() else
               f"is not owner-only (mode {stat.S_IMODE(info.st_mode):04o})"
               if info.st_mode & (0o077 if private else 0o022) else "")
    if problem:
        os.close(fd)
        return None, problem
    return fd, ""


def open_verified(path: Path) -> tuple[int | None, str, str]:
    """(fd, sha256, "") of a regular file owned by this user that no one else can write; the
    digest is of the very file the fd holds, so what is checked is what is loaded through it.
    (None, "", why not) otherwise; the caller closes the fd."""
    fd, problem = _open_owned(path, private=False)
    if fd is None:
        return None, "", problem
    digest = hashlib.sha256()
    while block := os.read(fd, 1 << 22):
        digest.update(block)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd, digest.hexdigest(), ""


def write_private(path: Path, data: bytes) -> None:
    """Write an owner-only (0600) file by a temporary file and a rename: never through a link,
    never half-written."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


@lru_cache(maxsize=1)
def record_key() -> tuple[bytes, str]:
    """(this user's record key, "") made once outside every cache; where it cannot be kept,
    (a key for this process only, why): records then hold within the process, and a later
    run rebuilds what it finds."""
    home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "grpogate"
    path = home / "record.key"
    problem = private_directory(home)
    if problem is None:
        try:
            if not path.exists():
                fd, temporary = tempfile.mkstemp(dir=home, prefix=".record.key.")
                os.write(fd, os.urandom(KEY_BYTES).hex().encode())
                os.close(fd)
                try:
                    os.link(temporary, path)  # fails where a concurrent process made it first
                except FileExistsError:
                    pass
                finally:
                    os.unlink(temporary)
            fd, problem = _open_owned(path, private=True)
            if fd is not None:
                with os.fdopen(fd, "rb") as handle:
                    key = bytes.fromhex(handle.read(4 * KEY_BYTES).decode("ascii"))
                if len(key) == KEY_BYTES:
                    return key, ""
                problem = "holds no key"
        except (OSError, ValueError, UnicodeDecodeError) as error:
            problem = f"cannot be used ({error})"
        problem = f"{path} {problem}"
    else:
        problem = f"{home} {problem}"
    print(f"grpogate: {problem}; what the cache holds is trusted within this process only and "
          "rebuilt by the next", file=sys.stderr)
    return os.urandom(KEY_BYTES), problem


def _mac(fields: dict) -> str:
    body = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(record_key()[0], body, hashlib.sha256).hexdigest()


def write_record(path: Path, fields: dict) -> None:
    """An owner-only record of `fields` (JSON values), with their HMAC under the record key."""
    write_private(path, json.dumps({"fields": fields, "hmac": _mac(fields)},
                                   sort_keys=True).encode())


def read_record(path: Path) -> tuple[dict | None, str]:
    """(fields, "") of a record written by write_record under this user's key; (None, why not)
    for a missing, foreign, writable or forged one."""
    fd, problem = _open_owned(path, private=True)
    if fd is None:
        return None, f"its record {path.name} {problem}"
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(RECORD_LIMIT + 1)
    try:
        record = json.loads(data) if len(data) <= RECORD_LIMIT else None
        fields, mac = record["fields"], record["hmac"]
    except (ValueError, TypeError, KeyError, RecursionError):
        return None, f"its record {path.name} is not one grpogate wrote"
    if not (isinstance(fields, dict) and isinstance(mac, str)
            and hmac.compare_digest(mac, _mac(fields))):
        return None, f"its record {path.name} was not written by this user's grpogate"
    return fields, ""
