"""A problem as every task source yields it, and its identity: the id that isolation, the
guard set, problems.jsonl and decide's re-scoring all key on."""

from __future__ import annotations

import hashlib
import json
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


def prompt_id(question: str) -> str:
    """Stable id of a question: insensitive to Unicode form, case, whitespace layout and
    invisible format characters (zero-width space / joiner, BOM, soft hyphen: category Cf),
    which would otherwise hide a train/eval overlap. A question without format characters
    keeps the id it had before they were dropped."""
    visible = "".join(c for c in unicodedata.normalize("NFKC", question)
                      if unicodedata.category(c) != "Cf")
    normalized = " ".join(visible.split()).casefold()
    return hashlib.sha256(normalized.encode("utf-8")).hexdigest()[:16]


def columns_text(columns: dict) -> str:
    """A row's other columns as the JSON text a Problem carries (the run's and decide's alike);
    NaN and infinity are refused (ValueError): problems.jsonl is strict JSON."""
    return json.dumps(columns, sort_keys=True, ensure_ascii=False, allow_nan=False, default=str)
