"""The native kernels' build: made by grpogate in a directory only this user can write, hashed
after the build and before every load (docs/design.md §15).

The library lives in `<cache>/native/` (cache: the configured `cache_dir`, else $GRPOGATE_CACHE
or ~/.cache/grpogate), named by a key over the source, the compiler and its version, the flags
and the CPU's identity (vendor, family, model, stepping and flags on x86; implementer,
architecture, variant, part, revision and features on ARM): -march=native builds for this very
CPU. Beside it an owner-only record (files/cache_dir.py) holds its sha256. A cache directory
or native/ that fails the ownership rule is refused for native code; a library that fails its
record (planted, truncated, copied from another user) is rebuilt, and the hash check catches a
truncated file before the dynamic loader maps it. The caller loads the library through the very
descriptor that was hashed.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from grpogate.files.cache_dir import open_verified, private_directory, read_record, write_record

SOURCE = Path(__file__).with_name("native_kernels.cpp")
# -fno-trapping-math: without it GCC keeps exp_f32's selects as branches and leaves the
# exponent loops scalar (native_kernels.cpp's header); no value changes.
FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC"]
CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags",
              "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "CPU revision",
              "Features")
BUILD_SECONDS = 600
LOG = logging.getLogger("grpogate")  # the CLI prints these lines (terminal.quiet_libraries)


def cpu_identity() -> str:
    """The machine's name and the first processor's identifying fields in /proc/cpuinfo."""
    fields = []
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if not line.strip():
                if fields:
                    break  # the first processor's block
                continue
            name, _, value = line.partition(":")
            if name.strip() in CPU_FIELDS:
                fields.append(f"{name.strip()}={value.strip()}")
    except OSError:
        pass
    return "\n".join([platform.machine(), platform.processor(), *fields])


def _compiler() -> tuple[str, str] | str:
    """(the C++ compiler, its --version text), or why there is none."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return "no C++ compiler (c++, g++ or $CXX) on this machine"
    try:
        return compiler, subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                        timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return f"the C++ compiler {compiler} does not run ({error})"


def library_path(root: Path) -> Path | None:
    """Where the library for this source, compiler and CPU lives under `root` (None: no
    compiler)."""
    found = _compiler()
    if isinstance(found, str):
        return None
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *found, " ".join(FLAGS),
                                    cpu_identity()]).encode()).hexdigest()[:24]
    return Path(os.path.realpath(root)) / "native" / f"kernels-{key}.so"


def _verified(target: Path) -> tuple[int | None, str]:
    """(fd of `target`, "") where its bytes hash as its record says; (None, why not)."""
    fields, problem = read_record(target.with_suffix(".sha256"))
    if fields is None:
        return None, problem
    if fields.get("library") != target.name:
        return None, "its record names another library"
    fd, digest, problem = open_verified(target)
    if fd is None:
        return None, problem
    if digest != fields.get("sha256"):
        os.close(fd)
        return None, "does not match the sha256 in its record (truncated, changed or not built here)"
    return fd, ""


def _compile(compiler: str, target: Path) -> str:
    """Build the library into a private scratch directory, move it to `target` and write its
    record; -> "" or why the build failed."""
    try:
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:  # made 0700
            built = Path(scratch) / target.name
            done = subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE)],
                                  capture_output=True, text=True, timeout=BUILD_SECONDS)
            if done.returncode != 0 or not built.is_file():
                lines = [line for line in done.stderr.splitlines() if line.strip()]
                said = next((line for line in lines if "error" in line), lines[0] if lines else "")
                return f"{Path(compiler).name} exited {done.returncode}: {said.strip()[:200]}"
            fd, digest, problem = open_verified(built)
            if fd is None:
                return f"the compiler's output {problem}"
            os.close(fd)
            os.replace(built, target)  # the library first, its record after: a reader in
            write_record(target.with_suffix(".sha256"),  # between sees a mismatch, not a lie
                         {"library": target.name, "sha256": digest})
    except subprocess.TimeoutExpired:
        return f"the compiler ran past {BUILD_SECONDS} s"
    except (OSError, subprocess.SubprocessError) as error:
        return f"the build failed ({error})"
    return ""


def build_library(root: Path) -> tuple[int | None, Path | None, str]:
    """(fd, path, "") of the kernels' library, verified against its record, built first where
    needed; (None, None, why no native code loads). The caller closes the fd."""
    found = _compiler()
    if isinstance(found, str):
        return None, None, found
    target = library_path(root)
    for directory in (target.parent.parent, target.parent):
        problem = private_directory(directory)
        if problem is not None:
            return None, None, f"the cache directory {directory} {problem}"
    try:
        lock = os.open(target.parent / ".build.lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW,
                       0o600)
    except OSError as error:
        return None, None, f"{target.parent}/.build.lock cannot be opened ({error.strerror})"
    try:
        # Processes started together (torchrun's ranks) build one at a time: the later ones
        # find the library built and recorded, never one's library beside another's record.
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _verified_or_built(found[0], target)
    finally:
        os.close(lock)


def _verified_or_built(compiler: str, target: Path) -> tuple[int | None, Path | None, str]:
    fd, problem = _verified(target)
    if fd is not None:
        return fd, target, ""
    if target.exists() or target.with_suffix(".sha256").exists():
        print(f"grpogate: the native library {target} is not loaded: {problem}; rebuilding it",
              file=sys.stderr)
    else:
        LOG.info(f"building the native kernels into {target.parent} (once per machine)")
    problem = _compile(compiler, target)
    if problem:
        return None, None, problem
    fd, problem = _verified(target)
    return (fd, target, "") if fd is not None else (None, None, f"{target} {problem}")
