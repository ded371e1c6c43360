"""What one audit may list: the mismatches stop at MAX_LISTED_MISMATCHES, the rest are counted
in one last entry, so a file of ten million bad lines costs a count, not ten million entries.
(How many records a file may hold is checked as it is read: `audit_files.numbered_jsonl`.)
Pure Python, no torch.
"""

from __future__ import annotations

from typing import Any

from grpogate.evidence.audit_files import Audit

MAX_LISTED_MISMATCHES = 1000


class BoundedAudit(Audit):
    """An Audit whose mismatch list stops at MAX_LISTED_MISMATCHES entries plus one counting
    the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.unlisted = 0

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
