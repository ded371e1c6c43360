"""Which eval prompts a trainer's training texts contain: the isolation check of `grpogate gate`.

A row of another trainer's dataset can wrap an eval problem in anything: a system prompt, a chat
template already rendered into the string, an instruction before or after it. Equal prompt ids
(tasks.check_isolation) catch none of these, so an eval prompt counts as seen when its
normalized text lies anywhere inside a normalized training text.

`normalized` (inputs/problem.py, the rule prompt ids are made by too): Unicode NFKC; format
characters (category Cf: zero-width space and joiner, BOM, soft hyphen) and control characters
other than whitespace (Cc) dropped, since either could be slipped into a copy to break a match
while the model reads the same words; case folded; every run of whitespace one space;
stripped.

Cost (`shared_prompts`): normalizing is linear in the text. The normalized training texts are
joined into one string (the haystack, H characters, rows separated by NUL, which no
normalized text holds, so no match spans two rows) and each of the E eval prompts is looked
up with one `str.find`. CPython's find is linear in H for any needle (a Boyer-Moore-Horspool
skip loop that falls back to the Two-Way algorithm when it stops skipping), so the whole check
is O(E x H) character steps in C plus one bisect per eval prompt found, and it holds the
haystack and one offset per row in memory; the 512 MiB bound on a --train-data file caps one
lookup at well under a second (docs/measurements.md, "Figures moved from code comments").
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from grpogate.inputs.problem import normalized

SEPARATOR = "\x00"


@dataclass(frozen=True)
class Seen:
    """An eval prompt found inside a training text."""

    row: str  # where the training text came from, e.g. "train.jsonl:7"
    eval_prompt_id: str
    eval_source: str


def shared_prompts(texts: list[tuple[str, str]], eval_set: list) -> list[Seen]:
    """Every eval problem (a tasks.Problem) whose normalized question lies inside one of the
    normalized training `texts` ((where, text) pairs), with the first row that holds it."""
    starts, position, parts = [], 0, []
    for _, text in texts:
        part = normalized(text)
        starts.append(position)
        parts.append(part)
        position += len(part) + len(SEPARATOR)
    haystack = SEPARATOR.join(parts)
    del parts
    seen = []
    for problem in eval_set:
        needle = normalized(problem.question)
        at = haystack.find(needle) if needle else -1
        if at >= 0:
            row = texts[bisect.bisect_right(starts, at) - 1][0]
            seen.append(Seen(row, problem.prompt_id, problem.source))
    return seen


def describe(seen: list[Seen], source: str, kind: str = "eval", shown: int = 3) -> str:
    """One line naming how many `kind` prompts the training data holds and the first `shown`
    (training row, prompt) pairs."""
    pairs = "; ".join(f"{s.row} holds {kind} prompt {s.eval_prompt_id} ({s.eval_source})"
                      for s in seen[:shown])
    more = f"; and {len(seen) - shown} more" if len(seen) > shown else ""
    return (f"isolation: {len(seen)} {kind} prompt(s) appear inside the training data "
            f"({source}), so the re-test would score prompts the model trained on: "
            f"{pairs}{more}")
