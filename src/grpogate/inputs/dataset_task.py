"""Problems from a user's own table (`--task dataset:PATH`), read by Hugging Face `datasets`.

The file formats are `datasets`' own readers: parquet, JSONL / JSON, CSV and Arrow files
(`load_dataset(BUILDER, data_files=PATH)`), a `save_to_disk` folder (`load_from_disk`), or a
hub id where the network allows. No format is parsed here.

Columns follow the trainers' conventions (datasets, TRL, verl, in that order):
- the prompt (`task.prompt_field`, default "prompt"): a string (TRL's standard format), or a
  list of chat messages (TRL's conversational format, verl's `prompt` column) holding one user
  message, whose text is the problem's question; the run renders it with the model's chat
  template as TRL does. A system or assistant message is refused: grpogate sends the run's own
  `system_prompt` with every prompt, and samples single-turn prompts;
- the reference (`task.reference_field`, a dotted path; default "answer"): with the default,
  a table without an "answer" column is read at TRL's "solution" or verl's
  "reward_model.ground_truth" instead, so those presets need no extra keys.

Splits: when the table has both `task.train_split` and `task.eval_split` (a DatasetDict, a hub
dataset), each set is drawn from its split; a table with one split (any single file) holds out
`eval_prompts` rows drawn with `task.eval_seed`, and the train set is drawn from the rest with
`task.train_seed`. The eval set never depends on the train set's size, so `gate` and `eval`
draw the same eval set as the run.

Bad data is one InputError naming the file, the row (1-based, in the split) and the field:
a missing field, an empty prompt, a reference the verifier cannot read, two rows with the same
problem, a split too small for the sets asked. Every row of a split is checked, not only the
drawn ones, so a corrupt table fails at admission. Nothing is written by this module.
"""

from __future__ import annotations

import os
import random
import re
import tempfile
from pathlib import Path

from grpogate.errors import InputError, first_line
from grpogate.inputs.problem import Problem, columns_text, prompt_id
from grpogate.inputs.table_checks import TableLimits, over_limit
from grpogate.inputs.table_files import identity_names, reader_of, staged_table
from grpogate.inputs.verifiers import reference_number

# The default reference column, then the columns the TRL and verl presets keep it in.
DEFAULT_REFERENCE = "answer"
REFERENCE_PRESETS = (DEFAULT_REFERENCE, "solution", "reward_model.ground_truth")
NUMBER_VERIFIER = "number"
# A hub dataset id: `owner/name` or a bare canonical name; a path that exists is never one.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?", re.ASCII)
INSTALL_HINT = "pip install 'grpogate[hf]'"


def _datasets():
    """The `datasets` package, imported on first use."""
    try:
        import datasets
    except ImportError:
        raise InputError("a dataset: task is read with Hugging Face datasets, which is not "
                         f"installed: {INSTALL_HINT}") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _innermost(error: BaseException) -> BaseException:
    """The error a library's wrapper was raised from (datasets wraps pyarrow's and pandas'
    errors in "An error occurred while generating the dataset")."""
    seen = 0
    while (error.__cause__ or error.__context__) is not None and seen < 16:
        error, seen = error.__cause__ or error.__context__, seen + 1
    return error


def _cannot_build(source: str, error: Exception, staged_folder: str = "") -> InputError:
    """A datasets failure in one line: the wrapped cause, the staged copy's path as the
    user's own."""
    cause = _innermost(error)
    text = first_line(cause)[:200]
    if staged_folder:
        text = text.replace(staged_folder, str(source))
    return InputError(f"{source}: datasets cannot build a table from it "
                      f"({type(cause).__name__}: {text})")


def _build(datasets, staged, source: str):
    """The staged copy read by datasets, in memory, its cache inside the private folder."""
    try:
        if not staged.is_folder:
            (copy, builder, _), = staged.data
            return datasets.load_dataset(builder, data_files=str(copy), keep_in_memory=True,
                                         cache_dir=str(staged.folder.parent / "cache"))
        return datasets.load_from_disk(str(staged.folder), keep_in_memory=True)
    except Exception as error:  # each reader raises its own types for a file it cannot read
        raise _cannot_build(source, error, str(staged.folder)) from None


def read_splits(source: str, limits: TableLimits | None = None) -> tuple[dict, dict]:
    """({split name: datasets.Dataset, in memory}, the table's identity: where, which files
    and their hash). A local table is staged first (inputs/table_files.py): confined,
    bounded, hashed and checked before datasets builds anything, in a private folder removed
    when the read ends, so nothing is left in the user's datasets cache."""
    datasets = _datasets()
    limits = limits or TableLimits.of()
    path = Path(source)
    local = os.path.lexists(path)  # a FIFO or a dangling link is a local name too
    if not local and not (HUB_ID.fullmatch(source) and reader_of(source) is None):
        raise InputError(f"{source}: no such file or directory (dataset task)")
    if local:
        with staged_table(path, limits) as staged:
            loaded = _build(datasets, staged, source)
            identity = {"file": str(staged.source), "sha256": staged.sha256(),
                        "files": identity_names(staged)}
    else:
        try:
            with tempfile.TemporaryDirectory(prefix="grpogate-hub-") as cache:
                loaded = datasets.load_dataset(source, cache_dir=cache, keep_in_memory=True)
        except Exception as error:  # network, missing id, a builder's own error
            raise _cannot_build(source, error) from None
        identity = {"file": source, "sha256": None}  # a hub revision is not pinned here
    splits = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    rows = sum(len(split) for split in splits.values())
    if rows > limits.max_rows:  # a hub table, counted once built
        raise over_limit(source, f"{rows} rows", limits, "max_rows")
    return splits, identity


def _field(row: dict, dotted: str, where: str):
    """The value at a dotted path (`reward_model.ground_truth`); InputError when absent."""
    value = row
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value or value[key] is None:
            raise InputError(f'{where}: field "{dotted}": missing')
        value = value[key]
    return value


def _question(prompt, where: str, field: str) -> str:
    """The question text of a prompt cell: a string, or one user message."""
    if isinstance(prompt, list):
        roles = [m.get("role") if isinstance(m, dict) else None for m in prompt]
        if roles == ["user"] and isinstance(prompt[0].get("content"), list):
            raise InputError(
                f'{where}: field "{field}": the user message\'s content is a list of parts; '
                "grpogate samples text prompts: give the content as one string")
        if roles != ["user"] or not isinstance(prompt[0].get("content"), str):
            raise InputError(
                f'{where}: field "{field}": chat messages with roles {roles}; grpogate samples '
                "single-turn prompts: one user message with text content (a system message "
                "goes in the config key system_prompt, sent with every prompt)")
        prompt = prompt[0]["content"]
    if not isinstance(prompt, str):
        raise InputError(f'{where}: field "{field}": expected a string or chat messages, got '
                         f"{type(prompt).__name__}")
    if not prompt.strip():
        raise InputError(f'{where}: field "{field}": empty prompt')
    return prompt


def _reference(value, where: str, field: str, verifier: str) -> str:
    """The reference as text; the number verifier must find a number in it."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise InputError(f'{where}: field "{field}": expected a string or number, got '
                         f"{type(value).__name__}")
    text = str(value).strip()
    if not text:
        raise InputError(f'{where}: field "{field}": empty reference')
    if verifier == NUMBER_VERIFIER and reference_number(text) is None:
        raise InputError(f'{where}: field "{field}": the number verifier finds no number in '
                         f"{text[-80:]!r}; fix it, or set task.verifier = \"math\"")
    return text


def reference_column(task, columns: list[str]) -> str:
    """The column the references are read from: the configured one, or with the default the
    first preset column the table has (TRL's "solution", verl's reward_model.ground_truth)."""
    if task.reference_field != DEFAULT_REFERENCE:
        return task.reference_field
    for preset in REFERENCE_PRESETS:
        if preset.split(".")[0] in columns:
            return preset
    return DEFAULT_REFERENCE  # absent: the first row names it as missing


def split_rows(dataset, task, shown: str) -> list[tuple[int, str, str, str]]:
    """Every row of one split as (1-based row, question, reference, the other columns as JSON
    text), each row checked, and no question twice (a repeated problem would be weighted twice,
    or sit in both sets)."""

    reference_field = reference_column(task, list(dataset.column_names))
    rows, first = [], {}
    for number, row in enumerate(dataset, start=1):
        where = f"{shown}: row {number}"
        question = _question(_field(row, task.prompt_field, where), where, task.prompt_field)
        reference = _reference(_field(row, reference_field, where), where, reference_field,
                               task.verifier or NUMBER_VERIFIER)
        pid = prompt_id(question)
        if pid in first:
            raise InputError(f'{where}: field "{task.prompt_field}": the same problem as row '
                             f"{first[pid]} (prompt id {pid}); remove one of them")
        first[pid] = number
        try:  # every column but the prompt, as TRL hands a row to its reward functions
            columns = columns_text({k: v for k, v in row.items() if k != task.prompt_field})
        except ValueError:
            raise InputError(f"{where}: a column holds NaN or infinity, which problems.jsonl "
                             "(strict JSON) cannot store; fix or drop it") from None
        rows.append((number, question, reference, columns))
    if not rows:
        raise InputError(f"{shown}: no rows")
    return rows


def _draw(count: int, indexes: list[int], seed: int, what: str, shown: str,
          total: int) -> list[int]:
    if len(indexes) < count:
        raise InputError(f"{shown}: {total} rows, too few for {what}; give a larger table or "
                         "ask for fewer problems (train_prompts / steps, eval_prompts)")
    return sorted(random.Random(seed).sample(indexes, count))


def _problems(rows, chosen: list[int], origin: str) -> list:

    return [Problem(prompt_id(rows[i][1]), rows[i][1], rows[i][2], f"dataset:{origin}:{rows[i][0]}",
                    rows[i][3]) for i in chosen]


def load_sets(task, train_prompts: int, eval_prompts: int) -> tuple[list, dict, list, dict]:
    """(train problems, their identity, eval problems, theirs) of a dataset task; with
    train_prompts 0 the train set is not drawn (the eval set alone: `gate`, `eval`)."""
    splits, table = read_splits(task.path, TableLimits.of(task))
    base = {"kind": "dataset", **table, "prompt_field": task.prompt_field}
    if len(splits) == 1:
        (name, dataset), = splits.items()
        rows = split_rows(dataset, task, task.path)
        total, every = len(rows), list(range(len(rows)))
        eval_chosen = _draw(eval_prompts, every, task.eval_seed,
                            f"{eval_prompts} eval problems", task.path, total)
        held = set(eval_chosen)
        train_chosen = _draw(train_prompts, [i for i in every if i not in held], task.train_seed,
                             f"{train_prompts} train + {eval_prompts} held-out eval problems "
                             "(the guard set comes from its own task)", task.path, total)
        field = reference_column(task, list(dataset.column_names))
        common = base | {"split": name, "rows_in_split": total, "held_out": True,
                         "reference_field": field}
        return (_problems(rows, train_chosen, f"{common['file']}:{name}"),
                common | {"selected": train_prompts, "seed": task.train_seed},
                _problems(rows, eval_chosen, f"{common['file']}:{name}"),
                common | {"selected": eval_prompts, "seed": task.eval_seed})
    if task.train_split not in splits or task.eval_split not in splits:
        raise InputError(f"{task.path}: splits {sorted(splits)}; set task.train_split and "
                         "task.eval_split to two of them")
    sets = []
    for split, size, seed in ((task.train_split, train_prompts, task.train_seed),
                              (task.eval_split, eval_prompts, task.eval_seed)):
        dataset, shown = splits[split], f"{task.path} split {split}"
        rows = split_rows(dataset, task, shown) if size else []
        chosen = _draw(size, list(range(len(rows))), seed, f"{size} problems", shown,
                       len(rows)) if size else []
        sets += [_problems(rows, chosen, f"{table['file']}:{split}"),
                 base | {"split": split, "rows_in_split": len(rows), "held_out": False,
                         "reference_field": reference_column(task, list(dataset.column_names)),
                         "selected": size, "seed": seed}]
    return tuple(sets)
