"""A problem as every task source yields it, and its identity: the id that isolation, the
guard set, problems.jsonl and decide's re-scoring all key on."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import sys
import unicodedata
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt_id: str  # sha256 of the normalized question, first 16 hex chars
    question: str
    reference: str  # the reference answer as the verifier expects it
    source: str  # where it came from, e.g. "gsm8k:/abs/train.jsonl:17"
    # A dataset task's other columns as JSON text (sorted keys), which TRL-signature reward
    # functions receive as keyword arguments, as TRL passes a row's columns; "" for the rest.
    columns: str = ""


@functools.cache
def _invisible() -> re.Pattern:
    """The characters `normalized` drops: format characters (Cf) and control characters
    that are not whitespace (Cc), built once on first use (it scans the code space, about
    0.3 s)."""
    dropped = [chr(code) for code in range(sys.maxunicode + 1)
               if unicodedata.category(chr(code)) in ("Cf", "Cc") and not chr(code).isspace()]
    return re.compile("[" + "".join(re.escape(c) for c in dropped) + "]")


def normalized(text: str) -> str:
    """`text` as two prompts are compared, for ids and for the isolation check alike: Unicode
    NFKC; format characters (zero-width space and joiner, BOM, soft hyphen) and control
    characters other than whitespace dropped, since either can be slipped into a copy to
    break a match while the model reads the same words; case folded; every run of whitespace
    one space; stripped. Confusables (Cyrillic "а" for Latin "a") are not folded
    (docs/design.md §12)."""
    visible = _invisible().sub("", unicodedata.normalize("NFKC", text))
    return " ".join(visible.casefold().split())


def prompt_id(question: str) -> str:
    """Stable id of a question: the sha256 of its `normalized` text, first 16 hex chars, so
    two questions the isolation check calls the same share one id. A question with no
    control characters keeps the id it had before they were dropped too."""
    return hashlib.sha256(normalized(question).encode("utf-8")).hexdigest()[:16]


def columns_text(columns: dict) -> str:
    """A row's other columns as the JSON text a Problem carries (the run's and decide's alike);
    NaN and infinity are refused (ValueError): problems.jsonl is strict JSON."""
    return json.dumps(columns, sort_keys=True, ensure_ascii=False, allow_nan=False, default=str)
