"""The dequantized model cache: a GGUF becomes float32 safetensors once, verified on every load.

Dequantizing the bundled GGUF takes about 20 s; the entry under the cache root
(`$GRPOGATE_CACHE` or ~/.cache/grpogate) then loads in under a second. The entry is the model's
identity in every later run (its sha256 is the GGUF's), so a corrupted block in it would be
trained and delivered under the clean model's name: every file is pinned by sha256 in
source.json and checked before use; a damaged, truncated or unpinned entry is rebuilt.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from grpogate.errors import InputError
from grpogate.files import sha256_path

LOG = logging.getLogger("grpogate")  # the CLI prints these lines (terminal.quiet_libraries)


def dequantized_cache(gguf: Path, gguf_sha256: str, cache_root: Path) -> Path:
    """Dequantize a GGUF once (about 20 s) into float32 safetensors; later loads take < 1 s.

    source.json (written last: its presence means the entry is complete) pins every file of
    the entry by sha256, checked on every load: a corrupted block or a truncated file would
    otherwise load as garbage under the clean model's identity. A damaged entry is rebuilt."""
    target = cache_root / f"gguf-{gguf_sha256[:16]}"
    if (target / "source.json").is_file():
        problem = _cache_problem(target)
        if problem is None:
            return target
        print(f"grpogate: the model cache {target} is damaged ({problem}); rebuilding it "
              "(about 20 s)", file=sys.stderr)
    else:
        # About 20 s of silence otherwise: say what is happening, and that it happens once.
        LOG.info(f"dequantizing {gguf.name} into {target} (first use only, about 20 s)")
    staging = _staging_in(cache_root)
    try:
        _write_cache_entry(gguf, staging)
        files = {p.name: sha256_path(p) for p in sorted(staging.iterdir()) if p.is_file()}
        (staging / "source.json").write_text(json.dumps(
            {"gguf": str(gguf), "sha256": gguf_sha256, "files": files}))
        if (target / "source.json").is_file() and _cache_problem(target) is None:
            shutil.rmtree(staging)  # another process finished first
        else:
            # Swap by renames, so a process still reading the damaged entry keeps its files.
            trash = cache_root / f".trash-{os.getpid()}-{target.name}"
            if target.exists():
                target.rename(trash)
            staging.rename(target)
            shutil.rmtree(trash, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _staging_in(cache_root: Path) -> Path:
    """A fresh staging directory in the cache root, made if needed; a root that cannot be a
    directory (a file, a path under /sys or /proc, no permission) is the user's setting to fix."""
    try:
        cache_root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=".staging-", dir=cache_root))
    except OSError as error:
        raise InputError(f"{cache_root}: cannot hold the model cache ({error.strerror}); set "
                         "GRPOGATE_CACHE (or cache_dir) to a writable directory") from None


def _cache_problem(entry: Path) -> str | None:
    """Why a cache entry cannot be trusted, or None when every pinned file hashes as recorded."""
    try:
        files = json.loads((entry / "source.json").read_text(encoding="utf-8")).get("files")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return "unreadable source.json"
    if not isinstance(files, dict) or not files:
        return "no checksums: written by an older grpogate"
    for name, digest in files.items():
        path = entry / name
        if not path.is_file():
            return f"{name} is missing"
        if sha256_path(path) != digest:
            return f"{name} does not match its recorded sha256 (corrupted or truncated)"
    return None


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
