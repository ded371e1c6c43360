"""Tensor files read without torch, and the policy-version rule built on them.

The audit recomputes a policy version from the adapter file itself, so it must read the tensors
without torch. The format (huggingface/safetensors): an 8-byte little-endian header length, a
JSON header {name: {dtype, shape, data_offsets}}, then the tensors' raw bytes.

A file is bounded by its own header before a tensor byte is read: the tensors it declares must
be packed back to back, total at most MAX_SAFETENSORS_DATA bytes, and the file must be exactly
8 + header + tensors bytes long; more is FileTooLarge (bounds.py), less is a truncated file.
The hash streams the tensors, one block at a time.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from pathlib import Path

import numpy as np

from grpogate.errors import InputError
from grpogate.files.bounds import FileTooLarge, refuse_larger

SAFETENSORS_DTYPES = {  # safetensors dtype -> (torch's name for it, bytes per element)
    "F64": ("torch.float64", 8), "F32": ("torch.float32", 4), "F16": ("torch.float16", 2),
    "BF16": ("torch.bfloat16", 2), "I64": ("torch.int64", 8), "I32": ("torch.int32", 4),
    "I16": ("torch.int16", 2), "I8": ("torch.int8", 1), "U8": ("torch.uint8", 1),
    "BOOL": ("torch.bool", 1), "F8_E4M3": ("torch.float8_e4m3fn", 1),
    "F8_E5M2": ("torch.float8_e5m2", 1)}
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the reference implementation's own limit
# The tensor bytes a header may declare. grpogate's LoRA (rank 16 on every linear layer, float32)
# is 19.6 MB on SmolLM2-135M, about 161 MB on a 7B model (28 layers x 90,112 x 16 x 4 bytes)
# and 842 MB on a 72B one; rank 64 on a 32B model is 2.15 GB. 4 GiB holds each, and costs time,
# not memory, to hash (streamed); read_safetensors holds the tensors of a caller's own adapter.
MAX_SAFETENSORS_DATA = 4 << 30
MAX_SAFETENSORS_BYTES = 8 + MAX_SAFETENSORS_HEADER + MAX_SAFETENSORS_DATA
_BLOCK = 1 << 22


def tensors_digest(entries) -> str:
    """THE adapter-identity rule: sha256 over (name, dtype, shape, bytes) sorted by name.

    `entries` yields (name, torch dtype name, shape tuple, raw little-endian bytes, or an
    iterable of their blocks). Both the in-memory hash (inputs/policy.tensors_sha256) and the
    file hash below go through here, so a file and the model it was saved from have one
    identity, and the rule exists once."""
    digest = hashlib.sha256()
    for name, dtype, shape, data in sorted(entries, key=lambda entry: entry[0]):
        digest.update(f"{name}|{dtype}|{tuple(shape)}\n".encode())
        for block in (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data:
            digest.update(block)
    return digest.hexdigest()


def _open_regular(path: str | Path):
    """`path` opened without blocking; InputError unless the open descriptor is a regular file
    (a FIFO swapped in after a caller's check is refused, not waited on)."""
    try:
        stream = os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb")
    except OSError as error:  # a path the run directory names may be unreadable or vanish
        raise InputError(f"{path}: unreadable ({error.strerror})") from None
    if not stat.S_ISREG(os.fstat(stream.fileno()).st_mode):
        stream.close()
        raise InputError(f"{path}: not a regular file (a folder, FIFO, socket or device)")
    return stream


def _layout(stream, path, limit: int = MAX_SAFETENSORS_DATA
            ) -> tuple[int, int, dict[str, tuple[str, tuple[int, ...], int, int]]]:
    """(offset of the tensor bytes, their count, {name: (dtype, shape, begin, end)}) of an open
    safetensors file, read from its header alone; InputError (naming the file and what is
    wrong) for an empty, truncated or malformed one, FileTooLarge for one longer than its
    header declares or declaring over `limit` tensor bytes (default MAX_SAFETENSORS_DATA, an
    adapter's; a checkpoint shard's is bounds.MAX_CHECKPOINT_FILE_BYTES). The messages quote no
    byte of the file: a file that is not safetensors may be anything (a key, /etc/passwd)."""
    size = os.fstat(stream.fileno()).st_size
    if size < 8:
        raise InputError(f"{path}: not a safetensors file ({size} bytes; truncated or empty)")
    header_size = int.from_bytes(stream.read(8), "little")
    if header_size > min(MAX_SAFETENSORS_HEADER, size - 8):
        raise InputError(f"{path}: truncated or not a safetensors file (its header length "
                         f"field exceeds the file of {size} bytes)")
    try:
        header = json.loads(stream.read(header_size).decode("utf-8"))
    except (ValueError, RecursionError) as error:  # bad UTF-8 or JSON, a 5000-digit integer
        raise InputError(f"{path}: malformed safetensors header "
                         f"({type(error).__name__})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: malformed safetensors header (not a JSON object)")
    available, tensors = size - 8 - header_size, {}
    for name, entry in header.items():
        if name != "__metadata__":
            tensors[name] = _safetensors_entry(path, name, entry, available, limit)
    position = 0
    for _, _, begin, end in sorted(tensors.values(), key=lambda t: t[2:]):
        if begin != position:  # the format packs tensors back to back, no overlaps
            raise InputError(f"{path}: tensors overlap or leave gaps in the data (offset {begin}, "
                             f"expected {position})")
        position = end
    refuse_larger(path, position, limit, "the tensors of a safetensors file")
    refuse_larger(path, size, 8 + header_size + position,
                  f"this safetensors file (8 + {header_size} header + {position} tensor bytes, "
                  "as its header declares)")
    return 8 + header_size, position, tensors


def _safetensors_entry(path, name, entry, available, limit: int
                       ) -> tuple[str, tuple[int, ...], int, int]:
    ok = (isinstance(entry, dict) and entry.get("dtype") in SAFETENSORS_DTYPES
          and isinstance(entry.get("shape"), list)
          and all(type(d) is int and d >= 0 for d in entry["shape"])
          and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
          and all(type(o) is int and o >= 0 for o in entry["data_offsets"])
          and entry["data_offsets"][0] <= entry["data_offsets"][1])
    if not ok:
        raise InputError(f"{path}: malformed safetensors header entry for tensor {name!r}")
    dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    count = 0 if 0 in shape else SAFETENSORS_DTYPES[dtype][1]
    for dim in shape:  # stops past the cap: a product of many huge dims is never computed
        count *= dim
        if count > limit:
            raise FileTooLarge(f"{path}: tensor {name!r} ({dtype}, {len(shape)} dims) holds "
                               f"over {limit} bytes, the limit of the tensors of a "
                               "safetensors file; not what grpogate writes")
    if end - begin != count or end > available:
        raise InputError(f"{path}: tensor {name!r} ({dtype}, {count} bytes) has data offsets "
                         f"[{begin}, {end}] that do not fit the file (truncated?)")
    return dtype, shape, begin, end


def read_safetensors(path: str | Path) -> dict[str, tuple[str, tuple[int, ...], memoryview]]:
    """{name: (torch dtype name, shape, bytes)} of a safetensors file, bounded by its header
    (`_layout`: InputError or FileTooLarge before a tensor byte is read)."""
    with _open_regular(path) as stream:
        _, length, tensors = _layout(stream, path)  # the stream is at the tensor bytes
        buffer = memoryview(stream.read(length))
    if len(buffer) != length:
        raise InputError(f"{path}: shorter than its header declares (truncated while read?)")
    return {name: (SAFETENSORS_DTYPES[dtype][0], shape, buffer[begin:end])
            for name, (dtype, shape, begin, end) in tensors.items()}


def _header(path: str | Path, limit: int = MAX_SAFETENSORS_DATA
            ) -> tuple[int, int, dict[str, tuple[str, tuple[int, ...], int, int]]]:
    """`_layout` of the safetensors file at `path`, read from its header alone."""
    with _open_regular(path) as stream:
        return _layout(stream, path, limit)


def safetensors_size(path: str | Path) -> int:
    """The size of a safetensors file, which its header declares (`_layout`'s errors)."""
    start, length, _ = _header(path)
    return start + length


def safetensors_names(path: str | Path, limit: int = MAX_SAFETENSORS_DATA) -> set[str]:
    """The tensor names of a safetensors file, from its header alone (`_layout`'s errors, its
    tensors within `limit` bytes): no tensor byte is read, so listing an adapter or a shard
    costs its header, not its weights."""
    return set(_header(path, limit)[2])


def _blocks(stream, path, begin: int, end: int):
    """The bytes [begin, end) of `stream`, a block at a time (read when iterated)."""
    stream.seek(begin)
    while begin < end:
        block = stream.read(min(_BLOCK, end - begin))
        if not block:
            raise InputError(f"{path}: shorter than its header declares (truncated while read?)")
        begin += len(block)
        yield block


def safetensors_sha256(path: str | Path) -> str:
    """The adapter-identity hash (tensors_digest) of a safetensors file, without torch: bounded
    by its header (`_layout`) and streamed, so memory stays at one block whatever its size."""
    with _open_regular(path) as stream:
        start, _, tensors = _layout(stream, path)
        return tensors_digest(
            (name, SAFETENSORS_DTYPES[dtype][0], shape, _blocks(stream, path, start + begin,
                                                                start + end))
            for name, (dtype, shape, begin, end) in tensors.items())


def lora_b_all_zero(path: str | Path) -> bool:
    """Whether a LoRA adapter's weights file has at least one `lora_B` tensor and every one is
    zero (+0 or -0, any IEEE float width): then W + B A = W, and the adapter computes its base
    model's function exactly. Bounded by the header like `read_safetensors`."""
    tensors = [entry for name, entry in read_safetensors(path).items() if "lora_B" in name]
    for _, shape, data in tensors:
        elements = math.prod(shape)
        width = len(data) // elements if elements else 0
        if width not in (2, 4, 8) or width * elements != len(data):
            return False  # not a float tensor grpogate can read as one
        # Little-endian words with the sign bit cleared: zero exactly when the value is +-0.
        words = np.frombuffer(data, dtype=f"<u{width}")
        if np.any(words & np.array((1 << (8 * width - 1)) - 1, dtype=f"<u{width}")):
            return False
    return bool(tensors)


# A floating-point value is NaN or infinite exactly when its exponent bits are all ones (IEEE
# 754; float8 E4M3FN has no infinity and one NaN pattern per sign, S.1111.111): the mask of
# those bits per dtype, and the little-endian word that holds one value.
_NON_FINITE_BITS = {"F64": ("<u8", 0x7FF0000000000000), "F32": ("<u4", 0x7F800000),
                    "F16": ("<u2", 0x7C00), "BF16": ("<u2", 0x7F80), "F8_E5M2": ("u1", 0x7C),
                    "F8_E4M3": ("u1", 0x7F)}


def non_finite_counts(path: str | Path, limit: int = MAX_SAFETENSORS_DATA
                      ) -> tuple[int, dict[str, int]]:
    """(floating-point tensors read, {tensor name: its NaN and infinite values} for those that
    hold any) of a safetensors file, bounded by its header (`_layout`) and streamed a block at a
    time: memory stays at one block whatever the file's size. Integer and bool tensors hold no
    NaN and are not counted."""
    read, counts = 0, {}
    with _open_regular(path) as stream:
        start, _, tensors = _layout(stream, path, limit)
        for name, (dtype, _, begin, end) in sorted(tensors.items(), key=lambda t: t[1][2]):
            if dtype not in _NON_FINITE_BITS:
                continue
            word, bits = _NON_FINITE_BITS[dtype]
            mask, found = np.array(bits, dtype=word), 0
            for block in _blocks(stream, path, start + begin, start + end):
                found += int(np.count_nonzero((np.frombuffer(block, dtype=word) & mask) == mask))
            read += 1
            if found:
                counts[name] = found
    return read, counts


def policy_version(base_sha256: str, adapter_sha256: str | None) -> str:
    """A policy's identity: its base weights' identity and its adapter tensors' hash."""
    return hashlib.sha256(f"{base_sha256}\n{adapter_sha256 or 'none'}".encode()).hexdigest()
