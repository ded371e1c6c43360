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

import json
from pathlib import Path
from typing import Callable

from grpogate.errors import InputError
from grpogate.inputs import dataset_task, isolation, tasks

MAX_TRAIN_FILE_BYTES = 512 * 1024 * 1024
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


def _lines(path: str) -> list[str]:
    file = Path(path)
    if not file.is_file():
        raise InputError(f"--train-data {path}: no such file")
    if file.stat().st_size > MAX_TRAIN_FILE_BYTES:
        raise InputError(f"--train-data {path}: larger than {MAX_TRAIN_FILE_BYTES} bytes")
    try:
        return file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise InputError(f"--train-data {path}: not UTF-8 text ({error.reason})") from None


def _jsonl_rows(path: str):
    for number, line in enumerate(_lines(path), 1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{number}", json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            raise InputError(f"{path}:{number}: not a JSON object") from None


def _rows(path: str):
    """(where, row) of every training row: a .jsonl file line by line, any other table a
    dataset task reads (parquet, CSV, Arrow, a save_to_disk folder) through Hugging Face
    datasets, every split, so that the same rule reads verl's and TRL's files."""
    if path.lower().endswith(".jsonl") or not Path(path).exists():
        yield from _jsonl_rows(path)
        return
    if Path(path).is_file() and Path(path).stat().st_size > MAX_TRAIN_FILE_BYTES:
        raise InputError(f"--train-data {path}: larger than {MAX_TRAIN_FILE_BYTES} bytes")
    splits, _ = dataset_task.read_splits(path)
    for split, dataset in splits.items():
        shown = path if len(splits) == 1 else f"{path} split {split}"
        for number, row in enumerate(dataset, 1):
            yield f"{shown}: row {number}", row


def read_train_data(path: str, render: Render) -> tuple[list[tasks.Problem], list[tuple[str, str]]]:
    """(the training prompts of a JSONL file, each once: a problem's question is the text TRL
    trains on; the (row, text) pairs the isolation check searches)."""
    problems: dict[str, tasks.Problem] = {}
    searched: dict[str, str] = {}  # text -> its first row: a repeated text is searched once
    for where, row in _rows(path):
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
        train, searched = read_train_data(train_data, render)
        return train, {"data_file": str(Path(train_data).resolve()), "prompts": len(train),
                       "problem_set_sha256": tasks.problem_set_hash(train)}, "--train-data", searched
    return None, {"checked": False}, "", []
