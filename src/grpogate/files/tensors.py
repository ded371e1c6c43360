"""Tensor files read without torch, and the policy-version rule built on them.

The audit recomputes a policy version from the adapter file itself, so it must read the tensors
without torch. The format (huggingface/safetensors): an 8-byte little-endian header length, a
JSON header {name: {dtype, shape, data_offsets}}, then the tensors' raw bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from grpogate.errors import InputError

SAFETENSORS_DTYPES = {  # safetensors dtype -> (torch's name for it, bytes per element)
    "F64": ("torch.float64", 8), "F32": ("torch.float32", 4), "F16": ("torch.float16", 2),
    "BF16": ("torch.bfloat16", 2), "I64": ("torch.int64", 8), "I32": ("torch.int32", 4),
    "I16": ("torch.int16", 2), "I8": ("torch.int8", 1), "U8": ("torch.uint8", 1),
    "BOOL": ("torch.bool", 1), "F8_E4M3": ("torch.float8_e4m3fn", 1),
    "F8_E5M2": ("torch.float8_e5m2", 1)}
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the reference implementation's own limit


def tensors_digest(entries) -> str:
    """THE adapter-identity rule: sha256 over (name, dtype, shape, bytes) sorted by name.

    `entries` yields (name, torch dtype name, shape tuple, raw little-endian bytes). Both the
    in-memory hash (inputs/policy.tensors_sha256) and the file hash below go through here, so
    a file and the model it was saved from have one identity, and the rule exists once."""
    digest = hashlib.sha256()
    for name, dtype, shape, data in sorted(entries, key=lambda entry: entry[0]):
        digest.update(f"{name}|{dtype}|{tuple(shape)}\n".encode())
        digest.update(data)
    return digest.hexdigest()


def read_safetensors(path: str | Path) -> dict[str, tuple[str, tuple[int, ...], memoryview]]:
    """{name: (torch dtype name, shape, bytes)} of a safetensors file; InputError (naming the
    file and what is wrong) for an empty, truncated or malformed one. The messages quote no
    byte of the file: a file that is not safetensors may be anything (a key, /etc/passwd)."""
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise InputError(f"{path}: not a safetensors file ({len(data)} bytes; truncated or empty)")
    header_size = int.from_bytes(data[:8], "little")
    if header_size > min(MAX_SAFETENSORS_HEADER, len(data) - 8):
        raise InputError(f"{path}: truncated or not a safetensors file (its header length "
                         f"field exceeds the file of {len(data)} bytes)")
    try:
        header = json.loads(data[8:8 + header_size].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise InputError(f"{path}: malformed safetensors header "
                         f"({type(error).__name__})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: malformed safetensors header (not a JSON object)")
    buffer = memoryview(data)[8 + header_size:]
    tensors, spans = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _safetensors_entry(path, name, entry)
        count = math.prod(shape)
        if end - begin != count * SAFETENSORS_DTYPES[dtype][1] or end > len(buffer):
            raise InputError(f"{path}: tensor {name!r} ({dtype} {list(shape)}) has data offsets "
                             f"[{begin}, {end}] that do not fit the file (truncated?)")
        tensors[name] = (SAFETENSORS_DTYPES[dtype][0], shape, buffer[begin:end])
        spans.append((begin, end))
    position = 0
    for begin, end in sorted(spans):  # the format packs tensors back to back, no overlaps
        if begin != position:
            raise InputError(f"{path}: tensors overlap or leave gaps in the data (offset {begin}, "
                             f"expected {position})")
        position = end
    if position != len(buffer):
        raise InputError(f"{path}: {len(buffer) - position} bytes after the last tensor")
    return tensors


def _safetensors_entry(path, name, entry) -> tuple[str, tuple[int, ...], int, int]:
    ok = (isinstance(entry, dict) and entry.get("dtype") in SAFETENSORS_DTYPES
          and isinstance(entry.get("shape"), list)
          and all(type(d) is int and d >= 0 for d in entry["shape"])
          and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
          and all(type(o) is int and o >= 0 for o in entry["data_offsets"])
          and entry["data_offsets"][0] <= entry["data_offsets"][1])
    if not ok:
        raise InputError(f"{path}: malformed safetensors header entry for tensor {name!r}")
    return entry["dtype"], tuple(entry["shape"]), *entry["data_offsets"]


def safetensors_sha256(path: str | Path) -> str:
    """The adapter-identity hash (tensors_digest) of a safetensors file, without torch."""
    return tensors_digest((name, dtype, shape, bytes(data))
                          for name, (dtype, shape, data) in read_safetensors(path).items())


def policy_version(base_sha256: str, adapter_sha256: str | None) -> str:
    """A policy's identity: its base weights' identity and its adapter tensors' hash."""
    return hashlib.sha256(f"{base_sha256}\n{adapter_sha256 or 'none'}".encode()).hexdigest()
