"""Problems for a run: GSM8K JSONL / Hugging Face datasets / reasoning-gym; prompt ids; isolation.

Every problem carries a stable prompt id (a hash of its normalized question) so that the train and
eval sets can be proven disjoint, and every loader returns an identity dict (file hash, seed,
library version) that goes into the run's evidence. Bad input raises `InputError` naming the
file, the 1-based line and the field. Pure Python: no torch import.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import random
import re
from pathlib import Path

from grpogate.errors import InputError
from grpogate.files import parse_json
from grpogate.inputs import dataset_task
from grpogate.inputs.problem import Problem, columns_text, prompt_id  # noqa: F401 (re-exported)

# The official GSM8K answer ends in "#### N"; N may carry thousands separators or a sign.
# ASCII digits only: the verifier reads 0-9 (its _NUMBER is re.ASCII), so a reference whose
# final answer is written "#### ٣" would score even its own gold answer 0.
_FINAL_ANSWER = re.compile(r"####\s*[-+]?\$?(?:\d[\d,]*(?:\.\d+)?|\.\d+)", re.ASCII)
_ANY_DIGIT_ANSWER = re.compile(r"####\s*[-+]?\$?\d")
# A hub id is `owner/name` (or the bare legacy id `gsm8k`); a missing local path is not one.
_HUB_ID = re.compile(r"^(?:gsm8k|[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)$")
# reasoning-gym: how many times the loader doubles the number of generated items before it
# concludes that the task's question space is too small for the size asked.
_MAX_GROWTH_ATTEMPTS = 6


def _problem(question: str, reference: str, source: str) -> Problem:
    return Problem(prompt_id(question), question, reference, source)


# ---------------------------------------------------------------- GSM8K


def _gsm8k_row(record: object, where: str) -> tuple[str, str]:
    """Validate one GSM8K record; `where` is "file:line" for messages."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for field in ("question", "answer"):
        value = record.get(field)
        if value is None:
            raise InputError(f'{where}: field "{field}": missing')
        if not isinstance(value, str):
            raise InputError(f'{where}: field "{field}": expected a string, got {type(value).__name__}')
        if not value.strip():
            raise InputError(f'{where}: field "{field}": empty')
    answer = record["answer"]
    if "####" not in answer:
        raise InputError(f'{where}: field "answer": no "####" final-answer marker')
    if not _FINAL_ANSWER.search(answer) and _ANY_DIGIT_ANSWER.search(answer):
        raise InputError(f'{where}: field "answer": the number after "####" uses non-ASCII '
                         "digits, which the verifier cannot score; write it with 0-9")
    if not _FINAL_ANSWER.search(answer):
        raise InputError(f'{where}: field "answer": "####" is not followed by a number')
    return record["question"], answer


def _read_jsonl(path: Path, shown: str) -> list[tuple[int, str, str]]:
    """All rows of a GSM8K JSONL file as (line number, question, answer), every line validated.

    The whole file is checked, not only the selected rows, so that a corrupt file fails at
    admission rather than in a later run that happens to sample the bad line.
    """
    rows = []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        where = f"{shown}:{number}"
        try:
            # utf-8-sig on the first line tolerates a byte-order mark written by some editors.
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8", errors="strict")
        except UnicodeDecodeError as exc:
            raise InputError(f"{where}: not valid UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})") from exc
        if not line.strip():
            continue
        try:
            record = parse_json(line, where)
        except json.JSONDecodeError as exc:
            # exc's own text says "line 1" (of this one line); name the column instead.
            raise InputError(f"{where}: malformed JSON: {exc.msg} (column {exc.colno})") from exc
        rows.append((number, *_gsm8k_row(record, where)))
    return rows


def _read_hub(hub_id: str, split: str) -> list[tuple[int, str, str]]:
    try:
        import datasets  # optional: only users who name a hub id need it
    except ImportError as exc:
        raise InputError(
            f"gsm8k source {hub_id!r} is a Hugging Face dataset id, which needs the datasets "
            "package: pip install 'grpogate[hf]' (or pass a local JSONL file or directory)"
        ) from exc
    try:
        table = datasets.load_dataset(hub_id, "main", split=split)
    except Exception as exc:  # hub, network and config errors come in many types
        raise InputError(f"gsm8k source {hub_id!r} split {split!r}: cannot load: {exc}") from exc
    return [(i, *_gsm8k_row(record, f"{hub_id}:{split}:{i}")) for i, record in enumerate(table, start=1)]


def load_gsm8k(source: str | os.PathLike, split: str, size: int, seed: int | None) -> tuple[list[Problem], dict]:
    """Load `size` GSM8K problems from a directory, one JSONL file, or a Hugging Face dataset id.

    seed None takes the first `size` rows in file order; otherwise a seeded sample of row
    indexes, kept in file order so the set reads the same however it was drawn.
    """
    if size <= 0:
        raise InputError(f"gsm8k: size must be a positive number of problems, got {size}")
    shown = os.fspath(source)
    path = Path(shown)
    if path.is_dir():
        path = path / f"{split}.jsonl"
        shown = os.path.join(shown, f"{split}.jsonl")
        if not path.is_file():
            raise InputError(f"{shown}: no such file or directory (split {split!r} of gsm8k source {os.fspath(source)!r})")
    if path.exists():
        if not path.is_file():
            raise InputError(f"{shown}: not a regular file")
        file_id, file_sha256 = str(path.resolve()), hashlib.sha256(path.read_bytes()).hexdigest()
        origin = file_id
        rows = _read_jsonl(path, shown)
    elif _HUB_ID.match(shown) and not shown.endswith((".jsonl", ".json")):
        file_id, file_sha256 = shown, None  # a hub revision is not pinned by a file hash here
        origin = f"{shown}:{split}"  # one hub id holds every split; a file path names its own
        rows = _read_hub(shown, split)
    else:
        raise InputError(f"{shown}: no such file or directory (gsm8k source)")

    if not rows:
        raise InputError(f"{shown}: no problems (the file is empty)")
    if len(rows) < size:
        raise InputError(f"{shown}: has only {len(rows)} problems; asked for {size}")
    if seed is None:
        chosen = rows[:size]
    else:
        chosen = [rows[i] for i in sorted(random.Random(seed).sample(range(len(rows)), size))]
    problems = [_problem(q, a, f"gsm8k:{origin}:{line}") for line, q, a in chosen]
    check_problem_set(problems, f"gsm8k {split}")
    identity = {
        "kind": "gsm8k",
        "file": file_id,
        "sha256": file_sha256,
        "split": split,
        "rows_in_file": len(rows),
        "selected": size,
        "seed": seed,
    }
    return problems, identity


# ---------------------------------------------------------------- reasoning-gym


def _generate(name: str, params: dict, n: int, seed: int) -> list[tuple[str, str]]:
    import reasoning_gym  # imported lazily: ~0.7 s, and GSM8K-only runs never need it
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise InputError(f"task.name: unknown reasoning-gym dataset {name!r}; reasoning-gym "
                         f"knows {len(DATASETS)}, e.g. {', '.join(sorted(DATASETS)[:5])}")
    try:
        dataset = reasoning_gym.create_dataset(name, size=n, seed=seed, **params)
        items = [(item["question"], item["answer"]) for item in dataset]
    # reasoning-gym reports an unknown name as ValueError, an unknown param as TypeError and a
    # violated param constraint as AssertionError.
    except (ValueError, TypeError, AssertionError, KeyError) as exc:
        raise InputError(f"reasoning-gym task {name!r} with params {params!r}: {exc}") from exc
    for index, (question, answer) in enumerate(items):
        if not isinstance(question, str) or not isinstance(answer, str):
            raise InputError(
                f"reasoning-gym task {name!r}: item {index} has no string question/answer "
                "(this task cannot be scored by a reference answer)"
            )
    return items


def load_reasoning_gym(
    name: str, params: dict, size: int, seed: int, exclude_ids: frozenset[str] = frozenset(),
    pool: int = 0,
) -> tuple[list[Problem], dict]:
    """`size` distinct reasoning-gym problems, none of them in `exclude_ids`: the first `size`
    in generation order, or (`pool` > 0) a seeded random order of the first `pool` distinct
    problems (all of them when the task has fewer), cut to `size`.

    Generators repeat questions, and a train set must not overlap the eval set, so we draw more
    items than asked (2x, 4x, ...) and skip repeats and excluded ids. Generate the eval set
    first and pass its ids here when loading the train set. A pool makes every prefix of the
    set a uniform draw from one population: a generator's later distinct problems are not like
    its early ones (easy questions repeat and are skipped), so a set in generation order gets
    harder as it grows, and a sequential re-test's batches would not share a mean.
    """
    if pool > size:
        problems, identity = _distinct_problems(name, params, pool, seed, exclude_ids,
                                                at_least=size)
        random.Random(seed).shuffle(problems)
        return problems[:size], identity | {"size": size, "pool": len(problems),
                                            "order": "seeded shuffle of the pool"}
    problems, identity = _distinct_problems(name, params, size, seed, exclude_ids)
    return problems, identity


def _distinct_problems(name: str, params: dict, size: int, seed: int,
                       exclude_ids: frozenset[str], at_least: int | None = None
                       ) -> tuple[list[Problem], dict]:
    """Up to `size` distinct problems in generation order; fewer only when the task's space
    is exhausted with at least `at_least` (default: `size`) found, else InputError."""
    at_least = size if at_least is None else at_least
    if size <= 0:
        raise InputError(f"reasoning-gym task {name!r}: size must be a positive number of problems, got {size}")
    if not isinstance(params, dict):
        raise InputError(f"reasoning-gym task {name!r}: params must be a table of keyword arguments, got {params!r}")
    seen_distinct = -1
    for attempt in range(1, _MAX_GROWTH_ATTEMPTS + 1):
        generated = size * 2**attempt
        items = _generate(name, params, generated, seed)
        problems, seen = [], set()
        for index, (question, answer) in enumerate(items):
            pid = prompt_id(question)
            if pid in seen:
                continue
            seen.add(pid)
            if pid not in exclude_ids:
                problems.append(_problem(question, answer, f"reasoning-gym/{name}:seed={seed}:index={index}"))
            if len(problems) == size:
                break
        if len(problems) == size:
            break
        # Doubling found no new question: the task's space is exhausted, more attempts are waste.
        if len(seen) == seen_distinct:
            break
        seen_distinct = len(seen)
    if len(problems) < at_least:
        raise InputError(
            f"reasoning-gym task {name!r} with params {params!r} (seed {seed}): could get only "
            f"{len(problems)} distinct problems from {generated} generated items "
            f"({len(exclude_ids)} ids excluded); asked for {at_least}. Widen the params or ask for fewer."
        )
    identity = {
        "kind": "reasoning-gym",
        "name": name,
        "params": dict(params),
        "seed": seed,
        "size": size,
        # The distribution's version, not reasoning_gym.__version__, which lags behind releases.
        "library_version": importlib.metadata.version("reasoning-gym"),
    }
    return problems, identity


# ---------------------------------------------------------------- set checks


def check_problem_set(problems: list[Problem], set_name: str) -> None:
    """A set must be non-empty and hold each prompt once (a repeat would be weighted twice)."""
    if not problems:
        raise InputError(f"{set_name} set: no problems")
    first_source: dict[str, str] = {}
    for problem in problems:
        if problem.prompt_id in first_source:
            raise InputError(
                f"{set_name} set: duplicate prompt id {problem.prompt_id}: "
                f"{first_source[problem.prompt_id]} and {problem.source}"
            )
        first_source[problem.prompt_id] = problem.source


def check_isolation(train: list[Problem], eval: list[Problem],
                    names: tuple[str, str] = ("train", "eval")) -> None:
    """Eval prompts must be unseen in training, or the re-test measures memorization (and a
    guard prompt must be neither: `names` then says which sets were compared)."""
    eval_sources = {p.prompt_id: p.source for p in eval}
    overlap = [p for p in train if p.prompt_id in eval_sources]
    if overlap:
        first = overlap[0]
        raise InputError(
            f"{names[0]} and {names[1]} sets share {len(overlap)} prompt(s); first: prompt id "
            f"{first.prompt_id} ({names[0]} {first.source}, {names[1]} "
            f"{eval_sources[first.prompt_id]})"
        )


def problem_set_hash(problems: list[Problem]) -> str:
    """sha256 over the ordered (prompt id, reference) pairs: the set's identity in the evidence."""
    payload = json.dumps([[p.prompt_id, p.reference] for p in problems], ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def load_eval_set(task, eval_prompts: int, source: str = "",
                  exclude_ids: frozenset[str] = frozenset()) -> tuple[list[Problem], dict]:
    """The eval set alone, exactly as a run draws it (`grpogate eval` and the run share it).

    `exclude_ids` (reasoning-gym only): skip these prompts while drawing, as the train set
    skips the eval set's. Seeds far apart do not make two sets disjoint: chain_sum's one-digit
    half has only 200 distinct questions, so any two 64-prompt sets share a few."""
    if task.source == "dataset":
        if exclude_ids:
            raise InputError("skipping given prompts while drawing needs a reasoning-gym task; "
                             "for a dataset choose another split or task.eval_seed")
        _, _, problems, identity = dataset_task.load_sets(task, 0, eval_prompts)
    elif task.source == "gsm8k":
        if exclude_ids:
            raise InputError("skipping given prompts while drawing needs a reasoning-gym task; "
                             "for GSM8K choose another split or seed")
        problems, identity = load_gsm8k(source or task.path, task.eval_split, eval_prompts,
                                        task.eval_seed)
    else:
        problems, identity = load_reasoning_gym(task.name, task.params, eval_prompts,
                                                task.eval_seed, exclude_ids,
                                                pool=getattr(task, "eval_pool", 0))
        if exclude_ids:
            identity["excluded_prompts"] = len(exclude_ids)
    check_problem_set(problems, "eval")
    identity["problem_set_sha256"] = problem_set_hash(problems)
    return problems, identity


def load_problem_sets(task, train_prompts: int, eval_prompts: int, train_source: str = "",
                      eval_source: str = "") -> tuple[list[Problem], dict, list[Problem], dict]:
    """The run's train and eval sets, checked and hashed.

    `task` has the fields of `config.TaskConfig`. For reasoning-gym the eval set is generated
    first, so the train generator skips its prompts instead of leaking them. `train_source` /
    `eval_source` replace `task.path` for GSM8K (the audit re-reads the files a run recorded).
    """
    if task.source == "dataset":  # one read of the table draws both sets
        train, train_id, eval_set, eval_id = dataset_task.load_sets(task, train_prompts,
                                                                    eval_prompts)
        check_problem_set(eval_set, "eval")
        eval_id["problem_set_sha256"] = problem_set_hash(eval_set)
    else:
        eval_set, eval_id = load_eval_set(task, eval_prompts, eval_source)
    if task.source == "gsm8k":
        train, train_id = load_gsm8k(train_source or task.path, task.train_split, train_prompts,
                                     task.train_seed)
    elif task.source == "reasoning-gym":
        train, train_id = load_reasoning_gym(task.name, task.params, train_prompts,
                                             task.train_seed,
                                             frozenset(p.prompt_id for p in eval_set))
    check_problem_set(train, "train")
    check_isolation(train, eval_set)
    train_id["problem_set_sha256"] = problem_set_hash(train)
    return train, train_id, eval_set, eval_id


def load_guard_set(guard, train: list[Problem], eval_set: list[Problem]
                   ) -> tuple[list[Problem], dict]:
    """The re-test's guard problems (`guard` has the fields of `config.GuardConfig`): drawn from
    its reasoning-gym task, skipping every train and eval prompt id, so a guard prompt is never
    one the update saw or the eval set scores. ([], {"enabled": False}) when the guard is off."""
    if guard.prompts <= 0:
        return [], {"enabled": False}
    problems, identity = load_reasoning_gym(guard.task, guard.params, guard.prompts, guard.seed,
                                            frozenset(p.prompt_id for p in train + eval_set))
    check_problem_set(problems, "guard")
    check_isolation(problems, train + eval_set, ("guard", "train + eval"))
    identity["problem_set_sha256"] = problem_set_hash(problems)
    return problems, {"enabled": True, **identity}


# ---------------------------------------------------------------- the stored problems


def problem_records(task, train: list[Problem], eval_set: list[Problem],
                    guard=None, guard_set: list[Problem] = ()) -> list[dict]:
    """problems.jsonl: every problem of the run with its split, question, reference answer and
    task, so a reader (and `grpogate decide`) can re-score every completion with no task
    generator or dataset at hand. `task` has the fields of `config.TaskConfig`; the guard
    problems (split "guard") carry their own task (`guard`: `config.GuardConfig`)."""
    origin = {"source": task.source}
    if task.source == "gsm8k":
        origin |= {"path": task.path}
    elif task.source == "dataset":
        origin |= {"path": task.path, "prompt_field": task.prompt_field,
                   "reference_field": task.reference_field}
    else:
        origin |= {"name": task.name, "params": dict(task.params)}
    records = [{"prompt_id": problem.prompt_id, "split": split, "question": problem.question,
                "reference": problem.reference, "origin": problem.source, "task": origin,
                **({"columns": json.loads(problem.columns)} if problem.columns else {})}
               for split, problems in (("train", train), ("eval", eval_set))
               for problem in problems]
    if guard_set:
        guard_origin = {"source": "reasoning-gym", "name": guard.task, "params": dict(guard.params)}
        records += [{"prompt_id": problem.prompt_id, "split": "guard",
                     "question": problem.question, "reference": problem.reference,
                     "origin": problem.source, "task": guard_origin} for problem in guard_set]
    return records


def problems_from_records(records: list[tuple[int, dict]], where: str,
                          allow_empty_train: bool = False) -> tuple[list[Problem], list[Problem]]:
    """The train and eval sets back from (line number, record) pairs of problems.jsonl.

    Each prompt id is recomputed from its question: a stored id that is not the question's hash
    is refused (InputError naming the line), as is a set that fails the run's own set checks.
    `allow_empty_train`: a run gated from another trainer whose training prompts were not given.
    """
    sets = stored_sets(records, where, allow_empty_train)
    return sets["train"], sets["eval"]


def stored_sets(records: list[tuple[int, dict]], where: str,
                allow_empty_train: bool = False) -> dict[str, list[Problem]]:
    """{"train", "eval", "guard"} problem lists from problems.jsonl's records, checked as the
    run checks them: ids recomputed, no repeats, and no guard or train prompt in the eval set
    nor a guard prompt in the train set (an empty guard list: the guard was off)."""
    sets: dict[str, list[Problem]] = {"train": [], "eval": [], "guard": []}
    for number, record in records:
        question, reference = record.get("question"), record.get("reference")
        split = record.get("split")
        if not isinstance(question, str) or not isinstance(reference, str) or split not in sets:
            raise InputError(f"{where}:{number}: needs string question and reference and split "
                             "train, eval or guard")
        if record.get("prompt_id") != prompt_id(question):
            raise InputError(f"{where}:{number}: prompt_id {record.get('prompt_id')!r} is not "
                             f"the hash of its question ({prompt_id(question)})")
        columns = record.get("columns")
        sets[split].append(Problem(prompt_id(question), question, reference,
                                   str(record.get("origin", "")),
                                   columns_text(columns) if isinstance(columns, dict) else ""))
    for split, problems in sets.items():
        # The guard list is empty when the guard was off; the train list when a run gated from
        # another trainer was not given its training prompts (`allow_empty_train`).
        if problems or split == "eval" or (split == "train" and not allow_empty_train):
            check_problem_set(problems, split)
    check_isolation(sets["train"], sets["eval"])
    check_isolation(sets["guard"], sets["train"] + sets["eval"], ("guard", "train + eval"))
    return sets
