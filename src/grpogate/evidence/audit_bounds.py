"""What one audit may cost, whatever the run directory holds.

A file with more records than a real run of the recorded config writes is refused as it is
read: every non-blank line counts (a line that is not a JSON object too), counted in one regex
pass over the text before any line is parsed, so ten million lines cost about a second and no
memory beyond the file's text, not ten million parsed records. The mismatches listed stop at
MAX_LISTED_MISMATCHES; the rest are counted in one last entry. Pure Python, no torch.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Callable

from grpogate.errors import InputError
from grpogate.evidence.audit_files import Audit
from grpogate.evidence.rescore import excess_records

MAX_LISTED_MISMATCHES = 1000
# A line as str.splitlines() splits it that str.strip() does not blank: its first
# non-whitespace character and the rest of the line (the boundaries are splitlines' own).
_NON_BLANK_LINE = re.compile(r"\S[^\n\r\x0b\x0c\x1c-\x1e\x85\u2028\u2029]*")


class ExcessRecords(Exception):
    """A file holds more records than its limit. Not an InputError, which the reader words as
    a mismatch of the file: `refusing_excess` turns it into one at the audit's top."""


def count_lines(data: bytes) -> int:
    """The non-blank lines of UTF-8 `data` (0 when it is not UTF-8: the reader names that)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return 0
    return sum(1 for _ in _NON_BLANK_LINE.finditer(text))  # constant memory, C-speed scan


class BoundedAudit(Audit):
    """An Audit whose reads of the limited files refuse excess records, and whose mismatch
    list stops at MAX_LISTED_MISMATCHES entries plus one counting the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.limits: dict[Path, int] = {}
        self.unlisted = 0

    def limit_records(self, run_dir: Path, limits: dict[str, int]) -> None:
        """At most limits[name] records in run_dir/name, checked when it is read."""
        self.limits = {run_dir / name: limit for name, limit in limits.items()}

    def read(self, path: Path) -> bytes:
        data = super().read(path)
        limit = self.limits.get(path)
        if limit is not None and (count := count_lines(data)) > limit:
            raise ExcessRecords(excess_records(path.name, count, limit))
        return data

    def mismatch(self, field: str, recorded: Any = None, recomputed: Any = None) -> None:
        if len(self.mismatches) < MAX_LISTED_MISMATCHES:
            super().mismatch(field, recorded, recomputed)
            return
        self.unlisted += 1
        self.mismatches[MAX_LISTED_MISMATCHES:] = [{
            "field": f"more mismatches, not listed (the audit lists the first "
                     f"{MAX_LISTED_MISMATCHES})", "recorded": self.unlisted, "recomputed": None,
            "unlisted": self.unlisted}]


def mismatches_found(mismatches: list[dict]) -> tuple[int, int]:
    """(mismatches found, mismatches listed) of an audit's list: the last entry may count the
    unlisted ones (its "unlisted" key, which no other entry has)."""
    last = mismatches[-1] if mismatches else {}
    unlisted = last.get("unlisted") if isinstance(last, dict) else None
    if isinstance(unlisted, int) and unlisted > 0:
        return len(mismatches) - 1 + unlisted, len(mismatches) - 1
    return len(mismatches), len(mismatches)


def refusing_excess(function: Callable) -> Callable:
    """`function`, with ExcessRecords raised anywhere in it refused as InputError."""
    @functools.wraps(function)
    def refusing(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except ExcessRecords as error:
            raise InputError(str(error)) from None
    return refusing
