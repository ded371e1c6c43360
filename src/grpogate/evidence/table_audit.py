"""`decide` re-hashes the table a dataset task read: a run whose data changed is a mismatch.

A dataset run records its table's identity (inputs.train_set and inputs.eval_set: `file`, the
`files` it read and their `sha256`, inputs/table_files.py). The stored problems.jsonl lets the
audit re-score without the table, but the evidence's claim is that the problems came from
those bytes: so the audit re-hashes the recorded files, under the same confinement and the
run's own bounds, and a table changed (a file's bytes, a file of a folder gone, or no longer
a regular file inside its folder) is a mismatch: decide says `reject`, naming the field. A
table no longer at its path at all is not re-hashed: decide judges a run directory that
travelled without its table from problems.jsonl alone (docs/design.md §7). A hub table
recorded no file hash and is not re-hashed either.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from grpogate.config import TaskConfig
from grpogate.errors import InputError
from grpogate.inputs.table_checks import TableLimits
from grpogate.inputs.table_files import table_sha256


def _limits(task: dict) -> TableLimits:
    """The run's recorded table bounds, each where it is a positive int, else the default."""
    default = TaskConfig()
    keys = ("max_table_bytes", "max_table_rows", "max_cell_chars", "max_nesting_depth")
    return TableLimits.of(SimpleNamespace(**{
        key: task[key] if type(task.get(key)) is int and task[key] >= 1 else getattr(default, key)
        for key in keys}))


def check_table_identity(audit, evidence: dict) -> None:
    """Each recorded dataset table (train and eval sets share one) re-hashed and compared."""
    task = (evidence.get("config") or {}).get("task") or {}
    if not isinstance(task, dict) or task.get("source") != "dataset":
        return
    checked = set()
    for split in ("train_set", "eval_set"):
        identity = (evidence.get("inputs") or {}).get(split)
        if not isinstance(identity, dict) or identity.get("kind") != "dataset":
            continue
        source, recorded = identity.get("file"), identity.get("sha256")
        if recorded is None and "files" not in identity:
            continue  # a hub table: no file hash recorded
        if (source, recorded) in checked or (isinstance(source, str)
                                             and not os.path.lexists(source)):
            continue
        checked.add((source, recorded))
        field = f"inputs.{split}.sha256 (the table {source}, re-hashed)"
        try:
            if not isinstance(source, str):
                raise InputError("no table path recorded")
            audit.compare(field, recorded, table_sha256(source, identity.get("files"),
                                                        _limits(task)))
        except InputError as error:
            audit.mismatch(field, recorded, f"not re-hashed: {error}")
