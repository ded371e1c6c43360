"""The texts a run trained elsewhere was trained on, and the eval prompts' isolation from them.

`grpogate gate` checks that the eval prompts are unseen in training, as a grpogate run does.
Only the user can say what the foreign trainer saw: its dataset file (`--train-data`, JSONL rows
as TRL's GRPOTrainer takes them, or any table a dataset task reads -- parquet as verl keeps it,
CSV, Arrow, a save_to_disk folder -- loaded by Hugging Face datasets), or the config's own
train split (a TRL run fed grpogate's train set, as bench/trl_side.py does). Neither given:
None, and the evidence says isolation was not checked.

A row's training text is exactly what TRL trains on (trl 1.16: GRPOTrainer reads each row's
`prompt` column; `trl.data_utils.is_conversational` calls it conversational when it is a list
whose first item is a dict with a "role"; `GRPOTrainer._tokenize_prompts` renders such a list
with the processing class's `apply_chat_template(..., add_generation_prompt=True)` and
tokenizes a string as it is). Any other column ("question", "answer", ...) is the reward
function's business, never read for isolation. A row whose training text cannot be determined
(no `prompt`, another type, a message without a role or with non-text content, a template
that fails on it) is refused, naming the row: skipping it would let an unread row hold an
eval prompt. The match is containment (inputs/isolation.py): an eval prompt inside a
training text, after normalization, is seen, whatever was put around it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

from grpogate.errors import InputError
from grpogate.files.bounds import FileTooLarge
from grpogate.files.confine import open_confined
from grpogate.inputs import dataset_task, isolation, tasks
from grpogate.inputs.table_checks import RowCounter, TableLimits, check_json_lines, over_limit
from grpogate.inputs.table_files import table_digest
# (chat messages, where) -> the text the trainer's chat template renders from them.
Render = Callable[[list, str], str]
NO_PROMPT = ("no \"prompt\" column; TRL's GRPOTrainer trains on a row's \"prompt\" (a string or "
             "a list of chat messages), so the text it trained on cannot be determined")


def _message_texts(messages: list, where: str) -> list[str]:
    """The text parts of chat messages, each message checked as a chat template takes it."""
    texts = []
    for index, message in enumerate(messages):
        shown = f"{where}: prompt[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InputError(f"{shown}: not a chat message (an object with a \"role\" string)")
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
            continue
        if not isinstance(content, list):
            raise InputError(f"{shown}: \"content\" must be a string or a list of parts")
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(
                    part.get("text"), str):
                texts.append(part["text"])
            elif not (isinstance(part, dict) and part.get("type") == "image"):
                raise InputError(f"{shown}: a content part that is neither text nor an image; "
                                 "the text it trains on cannot be determined")
    return texts


def training_text(row: object, where: str, render: Render) -> tuple[str, list[str]]:
    """(the text TRL trains on for `row`, the texts the isolation check searches: that text
    and, for chat messages, each message's own text, so that a chat template other than the
    baseline's cannot hide one)."""
    if not isinstance(row, dict):
        raise InputError(f"{where}: not a JSON object")
    if "prompt" not in row:
        raise InputError(f"{where}: {NO_PROMPT}")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return prompt, [prompt]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) and "role" in prompt[0]:
        texts = _message_texts(prompt, where)
        rendered = render(prompt, where)
        return rendered, [rendered, *(text for text in texts if text not in rendered)]
    raise InputError(f"{where}: field \"prompt\" is neither a string nor a non-empty list of "
                     "chat messages; the text TRL trains on cannot be determined")


def _reference(row: dict) -> str:
    for key in ("reference", "answer", "solution"):
        if isinstance(row.get(key), (str, int, float)) and not isinstance(row.get(key), bool):
            return str(row[key])
    return ""


class _HashedLines:
    """A binary stream's readline, hashing every byte it returns (the file's digest as
    table_files computes it: its name, then its bytes)."""

    def __init__(self, stream, name: str) -> None:
        self.stream, self.digest = stream, hashlib.sha256(name.encode("utf-8"))

    def readline(self, limit: int = -1) -> bytes:
        line = self.stream.readline(limit)
        self.digest.update(line)
        return line


def _jsonl_rows(path: str, limits: TableLimits, identity: dict):
    """(where, row) of a JSONL file, read from one descriptor: a regular file (no FIFO is
    waited on), within `limits.max_bytes`, each line bounded, decoded and depth-checked before
    it is parsed (inputs/table_checks.py), every line named in a refusal. `identity` receives
    the bytes' hash and the file's name once every line is read."""
    file = Path(path)
    if not os.path.lexists(file):
        raise InputError(f"--train-data {path}: no such file")
    resolved = file.resolve()
    try:
        with open_confined(resolved.parent, resolved.name, limits.max_bytes,
                           "a --train-data file") as (stream, size):
            hashed = _HashedLines(stream, resolved.name)
            yield from check_json_lines(hashed, path, limits, RowCounter(limits, path), size)
    except FileTooLarge:
        raise over_limit(f"--train-data {path}", f"larger than {limits.max_bytes} bytes",
                         limits, "max_bytes") from None
    except InputError as error:
        if str(error).startswith((path, "--train-data")):
            raise
        raise InputError(f"--train-data {path}: {str(error).split(': ', 1)[-1]}") from None
    identity |= {"sha256": table_digest({resolved.name: hashed.digest.digest()}),
                 "files": [resolved.name]}


def _rows(path: str, limits: TableLimits, identity: dict):
    """(where, row) of every training row: a .jsonl file line by line, any other table a
    dataset task reads (parquet, CSV, Arrow, a save_to_disk folder) through Hugging Face
    datasets, every split, so that the same rule reads verl's and TRL's files; both under
    the same bounds (config task.max_table_bytes, ...). `identity` receives the hash of the
    bytes read and the files' names (inputs/table_files.py), as a dataset task records them."""
    if path.lower().endswith(".jsonl") or not os.path.lexists(path):
        yield from _jsonl_rows(path, limits, identity)
        return
    splits, table = dataset_task.read_splits(path, limits)
    identity |= {"sha256": table["sha256"], "files": table["files"]}
    for split, dataset in splits.items():
        shown = path if len(splits) == 1 else f"{path} split {split}"
        for number, row in enumerate(dataset, 1):
            yield f"{shown}: row {number}", row


def read_train_data(path: str, render: Render, limits: TableLimits | None = None,
                    identity: dict | None = None
                    ) -> tuple[list[tasks.Problem], list[tuple[str, str]]]:
    """(the training prompts of a JSONL file, each once: a problem's question is the text TRL
    trains on; the (row, text) pairs the isolation check searches). `identity`, when given,
    receives the hash of the bytes read ("sha256") and the files' names ("files")."""
    problems: dict[str, tasks.Problem] = {}
    searched: dict[str, str] = {}  # text -> its first row: a repeated text is searched once
    for where, row in _rows(path, limits or TableLimits.of(), {} if identity is None
                            else identity):
        text, texts = training_text(row, where, render)
        problem = tasks.Problem(tasks.prompt_id(text), text, _reference(row), where)
        problems.setdefault(problem.prompt_id, problem)
        for each in texts:
            searched.setdefault(each, where)
    if not problems:
        raise InputError(f"--train-data {path}: no rows")
    return list(problems.values()), [(where, text) for text, where in searched.items()]


ISOLATION_RULE = ("an eval prompt is seen when its text (NFKC, case, whitespace, format and "
                  "control characters folded) lies inside a training text as the trainer saw it")


def checked_isolation(train: list | None, searched: list[tuple[str, str]], eval_set: list,
                      source: str) -> dict:
    """The evidence's isolation row; InputError naming rows and eval prompts on an overlap
    (bad input, as for a grpogate run)."""
    if train is None:
        return {"checked": False, "train_prompts": 0, "shared_prompts": None,
                "note": "isolation not checked: the training prompts were not given "
                        "(--train-data FILE or --train-from-config)"}
    seen = isolation.shared_prompts(searched, eval_set)
    if seen:
        raise InputError(isolation.describe(seen, source))
    return {"checked": True, "train_prompts": len(train), "shared_prompts": 0, "source": source,
            "rule": ISOLATION_RULE}


def training_problems(config, train_data: str, from_config: bool, render: Render
                      ) -> tuple[list[tasks.Problem] | None, dict, str, list[tuple[str, str]]]:
    """(training problems or None, their identity, where they came from, the (row, text) pairs
    the isolation check searches)."""
    if train_data and from_config:
        raise InputError("--train-data and --train-from-config name the training prompts twice; "
                         "give one")
    if from_config:
        train, identity, _, _ = tasks.load_problem_sets(config.task, config.train_prompts,
                                                        config.eval_prompts)
        return train, identity, "the config's train split", [(p.source, p.question)
                                                              for p in train]
    if train_data:
        table: dict = {}
        train, searched = read_train_data(train_data, render, TableLimits.of(config.task), table)
        return train, {"data_file": str(Path(train_data).resolve()), "prompts": len(train),
                       "problem_set_sha256": tasks.problem_set_hash(train), **table
                       }, "--train-data", searched
    return None, {"checked": False}, "", []
