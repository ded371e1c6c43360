"""`decide` re-hashes the table a dataset task read: a run whose data changed is a mismatch.

A dataset run records its table's identity (inputs.train_set and inputs.eval_set: `file`, the
`files` it read and their `sha256`, inputs/table_files.py). The stored problems.jsonl lets the
audit re-score without the table, but the evidence's claim is that the problems came from
those bytes: so the audit re-hashes the recorded files, under the same confinement and the
run's own bounds, and a table changed (a file's bytes, a file of a folder gone, or no longer
a regular file inside its folder) is a mismatch: decide says `reject`, naming the field. A
table no longer at its path at all is not re-hashed: decide judges a run directory that
travelled without its table from problems.jsonl alone (docs/design.md §7). A hub table
recorded no file hash and is not re-hashed either. A gate's `--train-data` file (the
isolation check's input, inputs.train_set.data_file) is re-hashed the same way.
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


def _recorded_tables(evidence: dict):
    """(split key, table path, recorded sha256, recorded files) of each table the evidence
    says was read: a dataset task's (its `file`), and a gate's --train-data (`data_file`)."""
    task = (evidence.get("config") or {}).get("task") or {}
    for split in ("train_set", "eval_set"):
        identity = (evidence.get("inputs") or {}).get(split)
        if not isinstance(identity, dict):
            continue
        if identity.get("kind") == "dataset" and task.get("source") == "dataset":
            if identity.get("sha256") is not None or "files" in identity:  # hub: no hash
                yield split, identity.get("file"), identity.get("sha256"), identity.get("files")
        elif "data_file" in identity and "files" in identity:
            yield split, identity["data_file"], identity.get("sha256"), identity["files"]


def check_table_identity(audit, evidence: dict) -> None:
    """Each recorded table (train and eval sets may share one) re-hashed and compared."""
    task = (evidence.get("config") or {}).get("task")
    limits = _limits(task if isinstance(task, dict) else {})
    checked = set()
    for split, source, recorded, files in _recorded_tables(evidence):
        if (source, recorded) in checked or (isinstance(source, str)
                                             and not os.path.lexists(source)):
            continue
        checked.add((source, recorded))
        field = f"inputs.{split}.sha256 (the table {source}, re-hashed)"
        try:
            if not isinstance(source, str):
                raise InputError("no table path recorded")
            audit.compare(field, recorded, table_sha256(source, files, limits))
        except InputError as error:
            audit.mismatch(field, recorded, f"not re-hashed: {error}")
