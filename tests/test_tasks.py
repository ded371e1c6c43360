"""Tests for grpogate.inputs.tasks: prompt ids, GSM8K and reasoning-gym loaders, set checks."""

from __future__ import annotations

import hashlib
import json
import sys
import time
import types
from pathlib import Path
from unittest import mock

import pytest

from grpogate.errors import InputError
from grpogate.inputs.tasks import (
    Problem,
    check_isolation,
    check_problem_set,
    load_gsm8k,
    load_reasoning_gym,
    problem_set_hash,
    prompt_id,
)

GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
TINY_CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}

needs_gsm8k = pytest.mark.skipif(not GSM8K_DIR.is_dir(), reason=f"GSM8K not found at {GSM8K_DIR}")


def _row(question: str = "What is 2 + 3?", answer: str = "2 + 3 = 5\n#### 5") -> str:
    return json.dumps({"question": question, "answer": answer})


# ---------------------------------------------------------------- prompt ids


def test_prompt_id_is_pinned_sha256_prefix():
    # Computed by hand: the normalized text is "what is 2 + 3?".
    assert prompt_id("What is 2 + 3?") == hashlib.sha256(b"what is 2 + 3?").hexdigest()[:16]
    assert len(prompt_id("x")) == 16


@pytest.mark.parametrize(
    "variant",
    ["  What is 2 + 3?  ", "WHAT IS 2 + 3?", "What\tis\n2  +   3?", "What is 2 + 3?",
     "What is 2 + 3？"],  # the last uses a full-width question mark, folded by NFKC
)
def test_prompt_id_ignores_case_whitespace_and_unicode_form(variant):
    assert prompt_id(variant) == prompt_id("What is 2 + 3?")


def test_prompt_id_distinguishes_different_questions():
    assert prompt_id("What is 2 + 3?") != prompt_id("What is 2 + 4?")


# ---------------------------------------------------------------- GSM8K, real data


@needs_gsm8k
def test_gsm8k_train_and_test_are_disjoint_and_hashed():
    train, train_id = load_gsm8k(GSM8K_DIR, "train", 24, seed=42)
    test, test_id = load_gsm8k(GSM8K_DIR, "test", 12, seed=42)
    assert len(train) == 24 and len(test) == 12
    check_isolation(train, test)
    assert not {p.prompt_id for p in train} & {p.prompt_id for p in test}
    train_file = GSM8K_DIR / "train.jsonl"
    assert train_id == {
        "kind": "gsm8k",
        "file": str(train_file.resolve()),
        "sha256": hashlib.sha256(train_file.read_bytes()).hexdigest(),
        "split": "train",
        "rows_in_file": 7473,
        "selected": 24,
        "seed": 42,
    }
    assert test_id["sha256"] == hashlib.sha256((GSM8K_DIR / "test.jsonl").read_bytes()).hexdigest()
    assert test_id["rows_in_file"] == 1319
    for problem in train + test:
        assert "####" in problem.reference
        assert problem.prompt_id == prompt_id(problem.question)


@needs_gsm8k
def test_gsm8k_first_rows_without_seed_match_the_file():
    problems, identity = load_gsm8k(GSM8K_DIR / "train.jsonl", "ignored", 2, seed=None)
    with open(GSM8K_DIR / "train.jsonl", encoding="utf-8") as f:
        first = [json.loads(next(f)) for _ in range(2)]
    assert [p.question for p in problems] == [r["question"] for r in first]
    assert problems[0].reference.endswith("#### 72")  # Natalia's clips, the file's first row
    assert problems[1].source == f"gsm8k:{(GSM8K_DIR / 'train.jsonl').resolve()}:2"
    assert identity["seed"] is None and identity["split"] == "ignored"


@needs_gsm8k
def test_gsm8k_seeded_sample_is_deterministic_and_in_file_order():
    a, _ = load_gsm8k(GSM8K_DIR, "train", 24, seed=7)
    b, _ = load_gsm8k(GSM8K_DIR, "train", 24, seed=7)
    c, _ = load_gsm8k(GSM8K_DIR, "train", 24, seed=8)
    assert a == b
    assert problem_set_hash(a) == problem_set_hash(b) != problem_set_hash(c)
    lines = [int(p.source.rsplit(":", 1)[1]) for p in a]
    assert lines == sorted(lines) and lines != list(range(1, 25))


@needs_gsm8k
def test_gsm8k_full_train_file_validates_fast():
    start = time.perf_counter()
    problems, _ = load_gsm8k(GSM8K_DIR, "train", 7473, seed=None)
    assert len(problems) == 7473
    assert time.perf_counter() - start < 1.0


def test_gsm8k_directory_uses_split_file_name(tmp_path):
    (tmp_path / "validation.jsonl").write_text(_row() + "\n")
    problems, identity = load_gsm8k(tmp_path, "validation", 1, seed=None)
    assert problems[0].reference == "2 + 3 = 5\n#### 5"
    assert identity["file"] == str((tmp_path / "validation.jsonl").resolve())


def test_gsm8k_skips_blank_lines_and_counts_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n" + _row("A?") + "\n\n" + _row("B?") + "\n   \n")
    problems, identity = load_gsm8k(path, "train", 2, seed=None)
    assert [p.source.rsplit(":", 1)[1] for p in problems] == ["2", "4"]
    assert identity["rows_in_file"] == 2


def test_gsm8k_hub_id_goes_through_datasets(monkeypatch):
    calls = []

    def load_dataset(hub_id, config, split):
        calls.append((hub_id, config, split))
        return [{"question": "A?", "answer": "#### 1"}, {"question": "B?", "answer": "#### 2"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    problems, identity = load_gsm8k("openai/gsm8k", "test", 1, seed=None)
    assert calls == [("openai/gsm8k", "main", "test")]
    assert problems[0].source == "gsm8k:openai/gsm8k:test:1"
    assert (identity["file"], identity["sha256"], identity["rows_in_file"]) == ("openai/gsm8k", None, 2)


def test_gsm8k_hub_rows_are_validated(monkeypatch):
    rows = [{"question": "A?", "answer": "#### 1"}, {"question": "B?", "answer": "no marker"}]
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda *a, **k: rows))
    with pytest.raises(InputError, match='openai/gsm8k:test:2: field "answer": no "####"'):
        load_gsm8k("openai/gsm8k", "test", 1, seed=None)


# ---------------------------------------------------------------- problem-set hash and checks


def test_problem_set_hash_covers_order_and_references():
    a = Problem(prompt_id("A?"), "A?", "1", "s:1")
    b = Problem(prompt_id("B?"), "B?", "2", "s:2")
    b2 = Problem(prompt_id("B?"), "B?", "3", "s:2")
    expected = hashlib.sha256(json.dumps([[a.prompt_id, "1"], [b.prompt_id, "2"]]).encode()).hexdigest()
    assert problem_set_hash([a, b]) == expected
    assert problem_set_hash([b, a]) != expected
    assert problem_set_hash([a, b2]) != expected


# ---------------------------------------------------------------- reasoning-gym


def test_reasoning_gym_eval_then_train_are_disjoint_and_duplicate_free():
    eval_set, eval_id = load_reasoning_gym("chain_sum", CHAIN_SUM, 48, seed=2)
    exclude = frozenset(p.prompt_id for p in eval_set)
    train, train_id = load_reasoning_gym("chain_sum", CHAIN_SUM, 128, seed=1, exclude_ids=exclude)
    assert len(eval_set) == 48 and len(train) == 128
    check_problem_set(eval_set, "eval")
    check_problem_set(train, "train")
    check_isolation(train, eval_set)
    assert not exclude & {p.prompt_id for p in train}
    assert train_id["kind"] == "reasoning-gym" and train_id["params"] == CHAIN_SUM
    assert (train_id["seed"], train_id["size"], eval_id["seed"], eval_id["size"]) == (1, 128, 2, 48)
    assert train_id["library_version"].count(".") >= 2
    # chain_sum answers are the evaluated expression: check one by hand.
    expression = train[0].question.rsplit(":", 1)[1].rstrip("= ").strip()
    assert train[0].reference == str(eval(expression))  # noqa: S307 - digits and +/- only
    assert train[0].source.startswith("reasoning-gym/chain_sum:seed=1:index=")


def test_reasoning_gym_is_deterministic():
    exclude = frozenset({prompt_id("State the final answer to the following arithmetic problem: 4 - 1 =")})
    a, _ = load_reasoning_gym("chain_sum", CHAIN_SUM, 20, seed=1, exclude_ids=exclude)
    b, _ = load_reasoning_gym("chain_sum", CHAIN_SUM, 20, seed=1, exclude_ids=exclude)
    assert a == b
    assert all(p.prompt_id not in exclude for p in a)


def test_reasoning_gym_tiny_space_gets_all_it_can():
    # 2 one-digit terms and +/-: at most 10 * 10 * 2 = 200 distinct questions.
    problems, _ = load_reasoning_gym("chain_sum", TINY_CHAIN_SUM, 150, seed=3)
    assert len({p.prompt_id for p in problems}) == 150


# ---------------------------------------------------------------- catalogue of bad inputs


def _gsm8k_file(tmp_path, content: bytes | str, size: int = 1):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return load_gsm8k(str(path), "train", size, seed=None)


def _without_datasets(load):
    with mock.patch.dict(sys.modules, {"datasets": None}):  # None makes `import datasets` fail
        return load()


def _duplicates(tmp_path):
    return _gsm8k_file(tmp_path, _row("What is 2 + 3?") + "\n" + _row("what  is 2 + 3? ") + "\n", size=2)


def _overlap(tmp_path):
    (tmp_path / "train.jsonl").write_text(_row("A?") + "\n" + _row("B?") + "\n")
    (tmp_path / "test.jsonl").write_text(_row("C?") + "\n" + _row("b?") + "\n")
    train, _ = load_gsm8k(str(tmp_path), "train", 2, seed=None)
    test, _ = load_gsm8k(str(tmp_path), "test", 2, seed=None)
    check_isolation(train, test)


# Each row: case, action(tmp_path), fragments the message must contain ({p} is the bad file).
BAD_INPUTS = [
    ("malformed-json", lambda t: _gsm8k_file(t, _row() + '\n{"question": "x", \n'),
     ["{p}:2: malformed JSON"]),
    ("not-an-object", lambda t: _gsm8k_file(t, "[1, 2]\n"), ["{p}:1: expected a JSON object"]),
    ("missing-question", lambda t: _gsm8k_file(t, _row() + "\n" + json.dumps({"answer": "#### 1"})),
     ['{p}:2: field "question": missing']),
    ("missing-answer", lambda t: _gsm8k_file(t, json.dumps({"question": "Q?"})), ['{p}:1: field "answer": missing']),
    ("non-string-answer", lambda t: _gsm8k_file(t, json.dumps({"question": "Q?", "answer": 5})),
     ['{p}:1: field "answer": expected a string']),
    ("empty-question", lambda t: _gsm8k_file(t, _row(question="  ")), ['{p}:1: field "question": empty']),
    ("answer-without-marker", lambda t: _gsm8k_file(t, _row(answer="it is 5")),
     ['{p}:1: field "answer": no "####" final-answer marker']),
    ("marker-without-number", lambda t: _gsm8k_file(t, _row(answer="#### five")),
     ['{p}:1: field "answer": "####" is not followed by a number']),
    ("non-utf8", lambda t: _gsm8k_file(t, _row().encode() + b"\n" + b'{"question": "caf\xe9"}\n'),
     ["{p}:2: not valid UTF-8"]),
    ("empty-file", lambda t: _gsm8k_file(t, ""), ["{p}: no problems"]),
    ("zero-size", lambda t: _gsm8k_file(t, _row(), size=0), ["size must be a positive"]),
    ("size-larger-than-file", lambda t: _gsm8k_file(t, _row("A?") + "\n" + _row("B?"), size=3),
     ["{p}: has only 2 problems; asked for 3"]),
    ("missing-path", lambda t: load_gsm8k(str(t / "nope.jsonl"), "train", 1, None), ["no such file or directory"]),
    ("missing-split-in-dir", lambda t: load_gsm8k(str(t), "dev", 1, None), ["dev.jsonl: no such file or directory"]),
    ("hub-id-without-datasets", lambda t: _without_datasets(lambda: load_gsm8k("openai/gsm8k", "train", 1, None)),
     ["pip install 'grpogate[hf]'"]),
    ("empty-set", lambda t: check_problem_set([], "eval"), ["eval set: no problems"]),
    ("duplicate-prompts", _duplicates, ["duplicate prompt id", "{p}:1", "{p}:2"]),
    ("train-eval-overlap", _overlap,
     ["share 1 prompt(s)", prompt_id("B?"), "train.jsonl:2", "test.jsonl:2"]),
    ("unknown-reasoning-gym-task", lambda t: load_reasoning_gym("no_such_task", {}, 4, seed=1),
     ["task.name: unknown reasoning-gym dataset 'no_such_task'"]),
    ("bad-reasoning-gym-param", lambda t: load_reasoning_gym("chain_sum", {"bogus": 1}, 4, seed=1),
     ["'chain_sum'", "bogus"]),
    ("tiny-reasoning-gym-space", lambda t: load_reasoning_gym("chain_sum", TINY_CHAIN_SUM, 500, seed=1),
     ["could get only 200 distinct problems", "asked for 500"]),
]


@pytest.mark.parametrize("case, action, fragments", BAD_INPUTS, ids=[row[0] for row in BAD_INPUTS])
def test_bad_input_raises_input_error_naming_the_place(tmp_path, case, action, fragments):
    with pytest.raises(InputError) as raised:
        action(tmp_path)
    message = str(raised.value)
    assert "\n" not in message, "the CLI prints the message on one line"
    for fragment in fragments:
        assert fragment.format(p=tmp_path / "bad.jsonl") in message


@pytest.mark.parametrize("hidden", ["\u200b", "\u200d", "\ufeff", "\u00ad", "\u2060"])
def test_a_zero_width_character_does_not_change_the_prompt_id(hidden):
    # The pinned id of the plain question (above) is unchanged: nothing visible was dropped.
    assert prompt_id(f"What is 2{hidden} + 3?") == hashlib.sha256(b"what is 2 + 3?").hexdigest()[:16]
    assert prompt_id(f"{hidden}What is 2 + 3?{hidden}") == prompt_id("What is 2 + 3?")


def test_seeds_far_apart_still_share_one_digit_chain_sums_and_exclusion_removes_them():
    """chain_sum with 1-2 digit terms: a one-digit item is one of 10 x 10 x 2 = 200 questions,
    so two 64-prompt sets at seeds 2 and 1,000,000 share some (7 measured) whatever the seeds'
    distance; drawing with the other set's ids excluded shares none and is still 64 distinct."""
    from grpogate.config import TaskConfig
    from grpogate.inputs.tasks import load_eval_set

    default_eval, _ = load_eval_set(TaskConfig(eval_seed=2, eval_pool=0), 64)
    development, _ = load_eval_set(TaskConfig(eval_seed=1_000_000, eval_pool=0), 64)
    ids = {p.prompt_id for p in default_eval}
    assert len({p.prompt_id for p in development} & ids) == 7
    disjoint, identity = load_eval_set(TaskConfig(eval_seed=1_000_000, eval_pool=0), 64,
                                       exclude_ids=frozenset(ids))
    assert len({p.prompt_id for p in disjoint}) == 64 and not {p.prompt_id for p in disjoint} & ids
    assert identity["excluded_prompts"] == 64
    with pytest.raises(InputError, match="needs a reasoning-gym task"):
        load_eval_set(TaskConfig(source="gsm8k", path="x"), 4, exclude_ids=frozenset({"a"}))


def test_a_pooled_eval_set_is_a_seeded_draw_whose_prefixes_extend():
    """With task.eval_pool the eval prompts are a seeded random order of the first `pool`
    distinct problems: a larger eval set starts with the smaller one (so extending a re-test
    keeps its prompts and seeds), every prompt lies in the pool, and the order is not the
    generation order (later distinct chain_sum problems are harder than early ones)."""
    from grpogate.config import TaskConfig
    from grpogate.inputs.tasks import load_eval_set

    small, identity = load_eval_set(TaskConfig(eval_seed=2, eval_pool=256), 32)
    large, _ = load_eval_set(TaskConfig(eval_seed=2, eval_pool=256), 128)
    in_order, _ = load_eval_set(TaskConfig(eval_seed=2, eval_pool=0), 256)
    assert [p.prompt_id for p in large[:32]] == [p.prompt_id for p in small]
    assert {p.prompt_id for p in large} <= {p.prompt_id for p in in_order}
    assert [p.prompt_id for p in large] != [p.prompt_id for p in in_order[:128]]
    assert (identity["pool"], identity["size"], identity["order"]) == (
        256, 32, "seeded shuffle of the pool")
