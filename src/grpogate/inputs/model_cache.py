"""The dequantized model cache: a GGUF becomes float32 safetensors once, verified on every load.

Dequantizing the bundled GGUF takes about 20 s; the entry under the cache directory (config
`cache_dir`, else $GRPOGATE_CACHE or ~/.cache/grpogate) then loads in under a second. The entry
is trusted by the cache rule (files/cache_dir.py), never by its own say: the entry's directory
is owner-only, and its record (owner-only, authenticated by the user's record key kept outside
the cache) pins every file by sha256. Each load hashes every file of the entry and compares;
the digest over those files is what the evidence records as the loaded model
(`loaded_sha256`). A damaged, truncated, forged or unrecorded entry is converted again; in a
cache directory other users can write, the GGUF is converted into a private temporary
directory for the process instead.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from grpogate.errors import InputError
from grpogate.files import (MAX_CHECKPOINT_BYTES, MAX_CHECKPOINT_FILE_BYTES, MAX_FILE_BYTES,
                            sha256_path)
from grpogate.files.confine import sha256_regular
from grpogate.files.cache_dir import open_verified, read_record, untrusted_reason, write_record

LOG = logging.getLogger("grpogate")  # the CLI prints these lines (terminal.quiet_libraries)
RECORD = "grpogate.record"  # the entry's record, beside the files it pins


def files_digest(files: dict[str, str]) -> str:
    """One sha256 over a directory's files, given each file's: "name:sha256" lines, sorted."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}:{files[name]}\n".encode())
    return digest.hexdigest()


def directory_weights_sha256(directory: Path) -> str:
    """files_digest of a model directory's weights and config.json: a local model's identity.
    Each file is hashed as `sha256_regular` reads it (a regular file, checked on the open
    descriptor; a weight file within MAX_CHECKPOINT_FILE_BYTES, config.json within
    MAX_FILE_BYTES) and all within MAX_CHECKPOINT_BYTES: a folder an adapter names as its base
    model is a stranger's path too (a model.safetensors linking to /dev/zero is refused)."""
    files = sorted(p for p in directory.iterdir()
                   if p.suffix in (".safetensors", ".bin") or p.name == "config.json")
    if not any(p.suffix == ".safetensors" for p in files):
        # Pickled *.bin weights can run code when loaded: a local model loads from safetensors.
        raise InputError(f"{directory}: no model weights (*.safetensors) in this directory; "
                         "pickled *.bin weights are not loaded")
    hashes, total = {}, 0
    for path in files:
        limit = MAX_FILE_BYTES if path.name == "config.json" else MAX_CHECKPOINT_FILE_BYTES
        hashes[path.name], size = sha256_regular(path, min(limit, MAX_CHECKPOINT_BYTES - total),
                                                 "a model folder's file (with those before it)")
        total += size
    return files_digest(hashes)


def dequantized_cache(gguf: Path, gguf_sha256: str, cache_root: Path) -> tuple[Path, str]:
    """-> (the directory holding the GGUF's float32 conversion, files_digest of its files as
    hashed now). Converts once (about 20 s); later loads hash the entry (well under a second)."""
    root = _made(Path(os.path.realpath(cache_root)))
    problem = untrusted_reason(root)
    if problem is not None:
        print(f"grpogate: the cache directory {root} {problem}: the model is not kept there; "
              f"converting {gguf.name} into a private directory for this process (about 20 s; "
              "set cache_dir or GRPOGATE_CACHE to a directory only you can write)",
              file=sys.stderr)
        scratch = Path(tempfile.mkdtemp(prefix="grpogate-model-"))  # made 0700
        atexit.register(shutil.rmtree, scratch, True)
        return scratch, files_digest(_convert(gguf, scratch))
    target = root / f"gguf-{gguf_sha256[:16]}"
    loaded, problem = _verified_entry(target, gguf_sha256)
    if loaded is not None:
        return target, loaded
    if os.path.lexists(target):
        print(f"grpogate: the model cache {target} is not used ({problem}); rebuilding it "
              "(about 20 s)", file=sys.stderr)
    else:
        # About 20 s of silence otherwise: say what is happening, and that it happens once.
        LOG.info(f"dequantizing {gguf.name} into {target} (first use only, about 20 s)")
    return target, _rebuild(root, target, gguf, gguf_sha256)


def _rebuild(root: Path, target: Path, gguf: Path, gguf_sha256: str) -> str:
    """Convert into a private staging directory, record it, and swap it in for `target`."""
    staging = _staging_in(root)
    try:
        files = _convert(gguf, staging)
        write_record(staging / RECORD, {"gguf": str(gguf), "gguf_sha256": gguf_sha256,
                                        "files": files})
        if _verified_entry(target, gguf_sha256)[0] is not None:
            shutil.rmtree(staging)  # another process finished first
        else:
            # Swap by renames, so a process still reading the damaged entry keeps its files.
            trash = root / f".trash-{os.getpid()}-{target.name}"
            if os.path.lexists(target):
                target.rename(trash)
            staging.rename(target)
            shutil.rmtree(trash, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return files_digest(files)


def _made(root: Path) -> Path:
    """The cache directory, made (0700) where missing; a path that cannot be a directory (a
    file, a path under /sys or /proc, no permission) is the user's setting to fix."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as error:
        raise InputError(f"{root}: cannot hold the model cache ({error.strerror}); set "
                         "GRPOGATE_CACHE (or cache_dir) to a writable directory") from None
    return root


def _staging_in(root: Path) -> Path:
    try:
        return Path(tempfile.mkdtemp(prefix=".staging-", dir=root))  # made 0700
    except OSError as error:
        raise InputError(f"{root}: cannot hold the model cache ({error.strerror}); set "
                         "GRPOGATE_CACHE (or cache_dir) to a writable directory") from None


def _verified_entry(entry: Path, gguf_sha256: str) -> tuple[str | None, str]:
    """(files_digest of the entry, "") where the cache rule holds and every file hashes as its
    record says; (None, why not) otherwise."""
    problem = untrusted_reason(entry)
    if problem is not None:
        return None, f"it {problem}"
    fields, problem = read_record(entry / RECORD)
    if fields is None:
        return None, problem
    files = fields.get("files")
    if fields.get("gguf_sha256") != gguf_sha256 or not isinstance(files, dict) or not files:
        return None, "its record is for another GGUF"
    present = {path.name for path in entry.iterdir()} - {RECORD}
    if present != set(files):
        stray = sorted(present - set(files))
        return None, (f"{stray[0]} is not in its record" if stray else
                      f"{sorted(set(files) - present)[0]} is missing")
    for name, expected in sorted(files.items()):
        fd, digest, problem = open_verified(entry / name)
        if fd is None:
            return None, f"{name} {problem}"
        os.close(fd)
        if digest != expected:
            return None, f"{name} does not match its recorded sha256 (corrupted or truncated)"
    return files_digest(files), ""


def _convert(gguf: Path, directory: Path) -> dict[str, str]:
    """Write the conversion into `directory`; -> {file name: sha256} of what it holds."""
    _write_cache_entry(gguf, directory)
    return {path.name: sha256_path(path) for path in sorted(directory.iterdir())
            if path.is_file()}


def _write_cache_entry(gguf: Path, directory: Path) -> None:
    """The dequantized model and its tokenizer, as save_pretrained writes them, into `directory`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # Clear the GGUF quantizer marker so save_pretrained writes plain float32 weights.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
