"""How large a file from a stranger may be: the size limits and their refusal, FileTooLarge.

A limit is checked on the size of the open descriptor (os.fstat) before the first byte is
read; a budget taken earlier from the path (the audit's hashing total) is a first check only,
each file's own limit is checked again on its descriptor, so a file swapped in between is
caught there. FileTooLarge is an InputError (exit 2, one line naming the file, its size and
the limit) that no reader turns into a mismatch (`tolerated`): a file past a size no real run
writes makes the directory not a run. The adapter weights have their own rule, their header's
(tensors.py).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from grpogate.errors import InputError

# Any file of a run directory but the adapter weights, and all the JSON and JSONL files an
# audit parses together. A fixed cap, not one derived from the recorded config: the config is
# the same stranger's claim, so a derived bound would still need this ceiling. The default
# run's largest file is 2.7 MB (trajectories.jsonl, 4096 records); a record grows about 25
# bytes a completion token (text and logprob), so 1 GiB holds some 100,000 records of 384 full
# tokens, 25x the default run's count at 8x its budget. Memory: an audit holds what it parsed,
# several times the file's bytes (docs/measurements.md, "Figures moved from code comments").
MAX_FILE_BYTES = 1 << 30
# Lines of a JSONL file, counted before any is split off (a list entry of ~60 bytes even when
# blank, a mismatch when not an object). A real record carries ids and versions (the default
# run's shortest line is 340 bytes), so a real file within MAX_FILE_BYTES has at most
# 2**30 / 340 = 3.16 million lines, under 2**22 = 4,194,304.
MAX_JSONL_LINES = 1 << 22
# A full checkpoint gated as a candidate (`gate --candidate`): each safetensors file, and all of
# them. transformers' save_pretrained shards at 5 GB by default (verl and OpenRLHF save with it)
# and the Hugging Face Hub takes no file over 50 GB, so a shard of the Hub's maximum is
# admitted; 256 GiB holds a 72B model in bfloat16 (about 145 GB) or a 7B in float32 (30 GB).
# Each byte costs time, not memory: it is copied, hashed and checked for NaN a 4 MiB block at a
# time, and the re-test maps the tensors from the copy (docs/design.md §12).
MAX_CHECKPOINT_FILE_BYTES = 50 << 30
MAX_CHECKPOINT_BYTES = 256 << 30


class FileTooLarge(InputError):
    """A file past its size limit: refused (exit 2), never read, never a mismatch."""


def refuse_larger(shown, size: int, limit: int, what: str, unit: str = "bytes") -> int:
    """`size`, when it is at most `limit`; FileTooLarge naming `shown` and `what` otherwise."""
    if size > limit:
        raise FileTooLarge(f"{shown}: {size} {unit}, over the limit of {limit} for {what}; "
                           "not what grpogate writes")
    return size


def descriptor_size(descriptor: int, shown, limit: int, what: str) -> int:
    """The size of the file open as `descriptor` (fstat), within `limit` (refuse_larger)."""
    return refuse_larger(shown, os.fstat(descriptor).st_size, limit, what)


@dataclass
class Caught:
    """What `tolerated` caught in its block: the error, None when the block ran through."""

    error: Exception | None = None


@contextlib.contextmanager
def tolerated(*kinds: type[Exception]):
    """Catch `kinds` (InputError when none are named) raised in the block into the yielded
    Caught, for the caller to name as a mismatch or read as absent; never FileTooLarge. The
    rule every reader of a stranger's file follows, written once: a file past its bounds is a
    refusal (exit 2), any other input error is the file's own fault."""
    caught = Caught()
    try:
        yield caught
    except FileTooLarge:
        raise
    except (kinds or (InputError,)) as error:
        caught.error = error
