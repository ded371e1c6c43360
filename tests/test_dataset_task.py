"""`--task dataset:PATH`: a user's own problems in the formats trainers read, loaded by Hugging
Face `datasets` -- a parquet written by pyarrow with verl's schema, a TRL-style JSONL of chat
messages, a CSV, a save_to_disk folder -- each run end to end on the tiny model and re-decided
from its run directory; each kind of bad data is one error line naming file, row and field,
exit 2, with nothing written."""

from __future__ import annotations

import csv
import json
import random
import sys
from pathlib import Path

import pytest
from conftest import TINY_SIZES
from typer.testing import CliRunner

from grpogate.cli import app

pytest.importorskip("datasets", reason="needs the hf extra (pip install 'grpogate[hf]')")


def sums(count: int = 300, seed: int = 0) -> list[tuple[str, int]]:
    """`count` distinct two-term sums ("What is 12 + 7?", 19)."""
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < count:
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        if (a, b) not in seen:
            seen.add((a, b))
            rows.append((f"What is {a} + {b}?", a + b))
    return rows


def verl_rows(count: int = 300) -> list[dict]:
    """verl's RL parquet schema (examples/data_preprocess/gsm8k.py)."""
    return [{"data_source": "two_term_sums", "prompt": [{"role": "user", "content": question}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(total)},
             "extra_info": {"split": "train", "index": index}}
            for index, (question, total) in enumerate(sums(count))]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tables")
    trl = [{"prompt": [{"role": "user", "content": q}], "solution": str(t)} for q, t in sums(40)]
    plain = [{"prompt": q, "answer": t} for q, t in sums(40, seed=1)]
    from datasets import Dataset, DatasetDict

    folder = root / "saved"
    DatasetDict({"train": Dataset.from_list(plain[:30]), "test": Dataset.from_list(plain[30:])}
                ).save_to_disk(str(folder))
    return {"verl": write_parquet(root / "sums.parquet", verl_rows()),
            "trl": write_jsonl(root / "trl.jsonl", trl),
            "csv": write_csv(root / "sums.csv", plain), "saved": folder}


def tiny_args(*extra: str) -> list[str]:
    args = list(extra)
    for key, value in TINY_SIZES.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    return args


def run(tiny_model_dir, task: str, out: Path, *extra: str):
    return CliRunner().invoke(app, ["run", "--profile", "smoke", "--model", str(tiny_model_dir),
                                    "--task", f"dataset:{task}", "--out", str(out),
                                    *tiny_args(*extra)])


def test_each_format_loads_with_its_preset_columns(tables):
    from grpogate.config import load_config
    from grpogate.inputs import tasks

    for name, path in tables.items():
        config = load_config("smoke", task={"source": "dataset", "path": str(path)})
        train, train_id, eval_set, eval_id = tasks.load_problem_sets(config.task, 8, 4)
        assert len(train) == 8 and len(eval_set) == 4, name
        assert {p.prompt_id for p in train}.isdisjoint(p.prompt_id for p in eval_set)
        assert train[0].question.startswith("What is ") and train[0].reference.isdigit()
        expected = {"verl": "reward_model.ground_truth", "trl": "solution"}.get(name, "answer")
        assert train_id["reference_field"] == expected, name
        assert eval_id["held_out"] is (name != "saved"), name
        assert config.resolved_verifier() == "gsm8k-final-number-v1"
    # The eval set does not depend on the train set's size: gate and eval draw the run's.
    config = load_config("smoke", task={"source": "dataset", "path": str(tables["verl"])})
    alone, _ = tasks.load_eval_set(config.task, 4)
    assert alone == tasks.load_problem_sets(config.task, 100, 4)[2]


def test_a_verl_parquet_runs_to_a_decision_that_decide_recomputes(tables, tiny_model_dir,
                                                                   tmp_path):
    out = tmp_path / "run"
    reward = "dataset_rewards:reads_verl_columns"
    result = run(tiny_model_dir, str(tables["verl"]), out, "--set",
                 f'rewards=[{{name="correctness", weight=1.0}}, {{name="{reward}", weight=0.5}}]')
    assert result.exit_code == 0, result.output
    # verl's other columns reached the TRL-signature reward as keyword arguments, every time.
    trajectories = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert trajectories and all(t["rewards"][reward] == 1.0 for t in trajectories)
    records = [json.loads(line) for line in (out / "problems.jsonl").read_text().splitlines()]
    task = records[0]["task"]
    assert task["source"] == "dataset" and task["path"] == str(tables["verl"])
    assert {r["split"] for r in records} == {"train", "eval", "guard"}
    assert all(r["question"].startswith("What is ") for r in records if r["split"] != "guard")
    evidence = json.loads((out / "evidence.json").read_text())
    assert evidence["inputs"]["train_set"]["kind"] == "dataset"
    # decide trusts the run directory: the table may be gone, the re-score reads problems.jsonl.
    moved = tables["verl"].rename(tmp_path / "elsewhere.parquet")
    try:
        decided = CliRunner().invoke(app, ["decide", str(out), "--json",
                                           "--trust-reward-code", reward])
        from grpogate.review.replay import replay_retest

        replayed = replay_retest(out, 1)  # --replay's eval set: problems.jsonl's, not the table
    finally:
        moved.rename(tables["verl"])
    assert decided.exit_code == 0, decided.output
    text = decided.stdout  # after the line announcing the re-scoring's cost
    audit = json.loads(text[text.index("\n{") + 1:] if not text.startswith("{") else text)
    assert audit["mismatches"] == []
    assert audit["decision"] == evidence["decision"]["decision"]
    assert replayed["compared"] == replayed["equal"] > 0
    # A table still at its path but changed since the run is a mismatch: decide re-hashes the
    # files the run read (inputs.*_set.files) and rejects.
    original = tables["verl"].read_bytes()
    try:
        write_parquet(tables["verl"], verl_rows(301))
        changed = CliRunner().invoke(app, ["decide", str(out), "--json",
                                           "--trust-reward-code", reward])
    finally:
        tables["verl"].write_bytes(original)
    text = changed.stdout
    verdict = json.loads(text[text.index("\n{") + 1:] if not text.startswith("{") else text)
    assert verdict["decision"] == "reject", verdict
    assert [m["field"] for m in verdict["mismatches"]] == [
        f"inputs.train_set.sha256 (the table {tables['verl']}, re-hashed)"]


@pytest.mark.parametrize("name", ["trl", "csv", "saved"])
def test_trl_jsonl_csv_and_a_saved_folder_run_end_to_end(name, tables, tiny_model_dir, tmp_path):
    result = run(tiny_model_dir, str(tables[name]), tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert "decision" in result.output.lower()


def bad(rows: list[dict], index: int, **changes) -> list[dict]:
    rows = [dict(row) for row in rows]
    rows[index] = {k: v for k, v in {**rows[index], **changes}.items() if v is not None}
    return rows


BAD_CASES = {
    "missing field": (lambda r: bad(r, 6, reward_model={"style": "rule"}),
                      'row 7: field "reward_model.ground_truth": missing'),
    "empty prompt": (lambda r: bad(r, 2, prompt=[{"role": "user", "content": "  "}]),
                     'row 3: field "prompt": empty prompt'),
    "unparseable reference": (
        lambda r: bad(r, 9, reward_model={"style": "rule", "ground_truth": "seven"}),
        'row 10: field "reward_model.ground_truth": the number verifier finds no number'),
    "duplicate problem": (lambda r: bad(r, 11, prompt=r[4]["prompt"]),
                          'row 12: field "prompt": the same problem as row 5'),
    "system message": (lambda r: bad(r, 0, prompt=[{"role": "system", "content": "Be brief."},
                                                   *r[0]["prompt"]]),
                       "row 1: field \"prompt\": chat messages with roles ['system', 'user']"),
    "too small": (lambda r: r[:5], "5 rows, too few for 4 train + 4 held-out eval problems"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_data_is_one_error_line_naming_file_row_and_field(case, tiny_model_dir, tmp_path):
    make, expected = BAD_CASES[case]
    path = write_parquet(tmp_path / "bad.parquet", make(verl_rows(40)))
    out = tmp_path / "run"
    result = run(tiny_model_dir, str(path), out)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert text.startswith("error:") and str(path) in text and expected in text, text
    assert not out.exists()


def test_a_missing_datasets_package_is_one_line_saying_what_to_install(tables, tiny_model_dir,
                                                                     tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    result = run(tiny_model_dir, str(tables["csv"]), tmp_path / "run")
    assert result.exit_code == 2, result.output
    assert "pip install 'grpogate[hf]'" in " ".join(result.output.split())


def test_train_data_in_a_table_format_goes_through_the_same_isolation_rule(tables, tmp_path):
    """`gate --train-data` reads a verl parquet or a CSV with `datasets` and hands its rows to
    the isolation rule TRL's JSONL goes through: an eval prompt inside a row is refused."""
    from grpogate.config import load_config
    from grpogate.errors import InputError
    from grpogate.inputs import tasks
    from grpogate.inputs.training_prompts import checked_isolation, training_problems

    def render(messages, where):  # the chat template, as the baseline's would render it
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)

    config = load_config("smoke", task={"source": "dataset", "path": str(tables["verl"])})
    _, _, eval_set, _ = tasks.load_problem_sets(config.task, 8, 4)
    wrapped = [{"prompt": [{"role": "user", "content": f"Solve: {eval_set[0].question} Think."}],
                "reward_model": {"ground_truth": "0"}},
               {"prompt": [{"role": "user", "content": "What is 1 + 1?"}],
                "reward_model": {"ground_truth": "2"}}]
    leaking = write_parquet(tmp_path / "train.parquet", wrapped)
    train, identity, source, searched = training_problems(config, str(leaking), False, render)
    assert len(train) == 2 and identity["prompts"] == 2
    with pytest.raises(InputError, match=r"train.parquet: row 1 holds eval prompt"):
        checked_isolation(train, searched, eval_set, source)
    clean = write_csv(tmp_path / "train.csv", [{"prompt": "What is 1 + 1?", "answer": 2}])
    train, _, source, searched = training_problems(config, str(clean), False, render)
    assert checked_isolation(train, searched, eval_set, source)["checked"] is True


def test_the_exact_verifier_compares_the_final_answer_as_text(tmp_path):
    """task.verifier = "exact": the final answer (the line after the last "Answer:", else the
    last number) equals the reference once both are stripped of surrounding whitespace."""
    from grpogate.config import load_config
    from grpogate.inputs import tasks
    from grpogate.inputs.verifiers import get_verifier

    exact = get_verifier("exact-answer-v1")
    cases = [("Answer: Paris", "Paris", 1.0), ("answer:\tParis  \nbye", " Paris\n", 1.0),
             ("Answer: paris", "Paris", 0.0),        # no case folding
             ("Answer: 19.0", "19", 0.0),            # no number parsing
             ("12 + 7 = 19", "19", 1.0),             # no "Answer:": the last number
             ("The capital is Paris", "Paris", 0.0),  # no marker, no number: no answer
             (None, "Paris", 0.0), ("Answer: Paris", None, 0.0)]
    assert [exact.score(c, r) for c, r, _ in cases] == [want for _, _, want in cases]
    assert exact.error_count == 0
    rows = [{"prompt": f"Capital number {k}?", "answer": f"City {k}"} for k in range(12)]
    config = load_config("smoke", task={"source": "dataset", "verifier": "exact",
                                        "path": str(write_jsonl(tmp_path / "cities.jsonl", rows))})
    assert config.resolved_verifier() == "exact-answer-v1"
    train, _, eval_set, _ = tasks.load_problem_sets(config.task, 4, 4)
    assert all(p.reference.startswith("City ") for p in train + eval_set)
