"""The prompts a run trained elsewhere was trained on, as the user names them, by prompt id.

`grpogate gate` checks that the eval prompts are unseen in training, as a grpogate run does
(tasks.check_isolation, by the same stable prompt id). Only the user can say what the foreign
trainer saw: its dataset file (JSONL rows as TRL takes them: a `prompt` string or list of chat
messages, whose last user message is the question; or a `question` field), or the config's own
train split (a TRL run fed grpogate's train set, as bench/trl_side.py does). Neither given:
None, and the evidence says isolation was not checked.
"""

from __future__ import annotations

import json
from pathlib import Path

from grpogate.errors import InputError
from grpogate.inputs import tasks

MAX_TRAIN_FILE_BYTES = 512 * 1024 * 1024


def _question(row: object, where: str) -> str:
    if isinstance(row, dict) and isinstance(row.get("question"), str):
        return row["question"]
    prompt = row.get("prompt") if isinstance(row, dict) else None
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    raise InputError(f"{where}: needs a \"prompt\" (a string or chat messages with a user "
                     "message) or a \"question\" string")


def _reference(row: dict) -> str:
    for key in ("reference", "answer", "solution"):
        if isinstance(row.get(key), (str, int, float)) and not isinstance(row.get(key), bool):
            return str(row[key])
    return ""


def read_train_data(path: str) -> list[tasks.Problem]:
    """The training prompts of a JSONL file, each once (a dataset may repeat a prompt)."""
    file = Path(path)
    if not file.is_file():
        raise InputError(f"--train-data {path}: no such file")
    if file.stat().st_size > MAX_TRAIN_FILE_BYTES:
        raise InputError(f"--train-data {path}: larger than {MAX_TRAIN_FILE_BYTES} bytes")
    problems: dict[str, tasks.Problem] = {}
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise InputError(f"--train-data {path}: not UTF-8 text ({error.reason})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            raise InputError(f"{path}:{number}: not a JSON object") from None
        question = _question(row, f"{path}:{number}")
        problem = tasks.Problem(tasks.prompt_id(question), question, _reference(row),
                                f"{path}:{number}")
        problems.setdefault(problem.prompt_id, problem)
    if not problems:
        raise InputError(f"--train-data {path}: no rows")
    return list(problems.values())


def training_problems(config, train_data: str, from_config: bool
                      ) -> tuple[list[tasks.Problem] | None, dict, str]:
    """(training problems or None, their identity, where they came from)."""
    if train_data and from_config:
        raise InputError("--train-data and --train-from-config name the training prompts twice; "
                         "give one")
    if from_config:
        train, identity, _, _ = tasks.load_problem_sets(config.task, config.train_prompts,
                                                        config.eval_prompts)
        return train, identity, "the config's train split"
    if train_data:
        train = read_train_data(train_data)
        return train, {"data_file": str(Path(train_data).resolve()), "prompts": len(train),
                       "problem_set_sha256": tasks.problem_set_hash(train)}, "--train-data"
    return None, {"checked": False}, ""
