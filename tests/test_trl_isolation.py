"""`grpogate gate --train-data`: isolation reads exactly what TRL trains on.

A stranger's training file can hide an eval prompt from a check that reads the wrong column or
compares whole prompts: a decoy "question" beside a "prompt" holding the eval prompt, the chat
template already rendered into the "prompt" string, an instruction appended to the eval prompt.
Each forged file ends in exit 2 with one error line naming the row and the eval prompt; the
clean file (TRL's own conversational rows) still gates. The forged gates run in a fresh
interpreter under a 2 GiB address-space cap and a timeout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_trl_gate import GROUP_SIZE, foreign_log, tiny_sets

from grpogate.errors import InputError
from grpogate.inputs import tasks
from grpogate.inputs.isolation import normalized, shared_prompts
from grpogate.inputs.training_prompts import checked_isolation, read_train_data

SRC = Path(__file__).resolve().parents[1] / "src"
MEMORY_CAP = 2 << 30


def render_plain(messages, where):
    """A stand-in chat template for the pure tests: role headers around each message."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def problem(question: str, source: str = "eval:1") -> tasks.Problem:
    return tasks.Problem(tasks.prompt_id(question), question, "3", source)


EVAL = problem("Tom has 2 apples and buys 1 more. How many apples does he have?")


@pytest.mark.parametrize("row", [
    {"question": "What is 7 + 8?", "prompt": [{"role": "user", "content": EVAL.question}]},
    {"prompt": f"<|im_start|>user\n{EVAL.question}<|im_end|>\n<|im_start|>assistant\n"},
    {"prompt": [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": EVAL.question + "\nThink step by step."}]},
    {"prompt": "Solve:" + EVAL.question.upper().replace(" ", "\u200b  \n")},  # case, ZWSP, spaces
    {"prompt": [{"role": "user", "content": [{"type": "text", "text": "Q: " + EVAL.question}]}]},
], ids=["decoy-question", "rendered-template", "appended-instruction", "normalization",
        "content-parts"])
def test_an_eval_prompt_inside_a_training_row_is_found(tmp_path, row):
    data = write_rows(tmp_path / "train.jsonl", [{"prompt": "What is 1 + 1?"}, row])
    train, searched = read_train_data(str(data), render_plain)
    with pytest.raises(InputError, match=rf"train.jsonl:2 holds eval prompt {EVAL.prompt_id}"):
        checked_isolation(train, searched, [EVAL], "--train-data")


def test_a_clean_file_is_isolated_and_each_row_is_what_trl_trains_on(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "1+2?"}],
             "reference": "3"}, {"prompt": "2+2?"}, {"prompt": "2+2?", "question": "ignored"}]
    train, searched = read_train_data(str(write_rows(tmp_path / "t.jsonl", rows)), render_plain)
    assert [p.question for p in train] == [render_plain(rows[0]["prompt"], ""), "2+2?"]
    assert train[0].reference == "3"
    isolation = checked_isolation(train, searched, [EVAL], "--train-data")
    assert isolation["checked"] is True and isolation["shared_prompts"] == 0
    assert isolation["train_prompts"] == 2


@pytest.mark.parametrize("row, message", [
    ({"question": "1+2?"}, r"t.jsonl:1: no \"prompt\" column"),
    ({"prompt": 7}, r"t.jsonl:1: field \"prompt\" is neither"),
    ({"prompt": []}, r"t.jsonl:1: field \"prompt\" is neither"),
    ({"prompt": [{"role": "user", "content": None}]}, r"t.jsonl:1: prompt\[0\]: \"content\""),
    ({"prompt": [{"role": "user"}, {"content": "x"}]}, r"t.jsonl:1: prompt\[0\]: \"content\""),
    ({"prompt": [{"role": "user", "content": [{"type": "audio"}]}]}, "neither text nor an image"),
    (["prompt", "x"], r"t.jsonl:1: not a JSON object"),
])
def test_a_row_whose_training_text_is_unknown_is_refused_not_skipped(tmp_path, row, message):
    data = write_rows(tmp_path / "t.jsonl", [row, {"prompt": "2+2?"}])
    with pytest.raises(InputError, match=message):
        read_train_data(str(data), render_plain)


def test_rows_render_with_the_baselines_template_and_a_failing_template_refuses(
        tmp_path, tiny_config, tiny_model_dir):
    from transformers import AutoTokenizer

    from grpogate.trl_gate import chat_renderer

    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "1+2?"}]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    render = chat_renderer(tiny_config(tmp_path))
    assert render(messages, "row") == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    strict = tmp_path / "strict-model"  # the same model, its template refusing system messages
    shutil.copytree(tiny_model_dir, strict)
    tokenizer.chat_template = ("{% if messages[0]['role'] == 'system' %}"
                               "{{ raise_exception('no system role') }}{% endif %}x")
    tokenizer.save_pretrained(strict)
    render = chat_renderer(dataclasses.replace(tiny_config(tmp_path), model=str(strict)))
    with pytest.raises(InputError, match="row: the baseline's chat template cannot render this "
                                         "row .*no system role"):
        render(messages, "row")


def test_containment_is_one_find_per_eval_prompt_over_one_haystack():
    """1,000 eval prompts against 10,000 rows of ~600 characters (6.6 MB) in seconds; the
    planted ones are found with the row that holds them."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7)))
             for _ in range(3000)]

    def sentence(n):
        return " ".join(rng.choice(words) for _ in range(n))

    eval_set = [problem(sentence(30), f"eval:{i}") for i in range(1000)]
    rows = [(f"train:{i}", sentence(120)) for i in range(10_000)]
    rows[4321] = ("train:4321", "Answer this. " + eval_set[17].question.upper() + " Thanks")
    started = time.perf_counter()
    seen = shared_prompts(rows, eval_set)
    assert time.perf_counter() - started < 60  # 5.3 s measured on one core
    assert [(s.row, s.eval_source) for s in seen] == [("train:4321", "eval:17")]
    assert normalized("A\u00a0 B\u200b\x07C") == "a bc"


# --- the CLI on a foreign directory: three forged files refused, the clean one gated ----------

@pytest.fixture(scope="module")
def foreign(alternating_run, tmp_path_factory):
    """A TRL-style output directory (a real adapter of the tiny model and its log), the clean
    TRL training file (system + user messages over the config's train split), the eval set and
    the tiny model's tokenizer."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("foreign")
    config, _, ran = alternating_run  # conftest's run on the alternating reward
    directory = root / "out"
    directory.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(Path(ran["run_dir"]) / "adapter" / name, directory / name)
    (directory / "trainer_state.json").write_text(json.dumps(foreign_log(ran)))
    train, _, eval_set, _ = tasks.load_problem_sets(config.task, config.train_prompts,
                                                    config.eval_prompts)
    system = config.resolved_system_prompt()
    rows = [{"prompt": [{"role": "system", "content": system},
                        {"role": "user", "content": p.question}], "reference": p.reference}
            for p in train]
    return directory, rows, eval_set, AutoTokenizer.from_pretrained(config.model), system


def gate_capped(trl_dir: Path, data: Path, out: Path, model: str, timeout: float = 300):
    """`grpogate gate` in a fresh interpreter under a 2 GiB address-space cap."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))

    sets = sum((["--set", s] for s in tiny_sets()), [])
    args = ["gate", "--profile", "smoke", *sets, "--from-trl", trl_dir, "--num-generations",
            GROUP_SIZE, "--baseline", model, "--train-data", data, "--out", out]
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "400"}
    return subprocess.run([sys.executable, "-m", "grpogate", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout, preexec_fn=cap)


def forged_row(kind: str, question: str, tokenizer, system: str) -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    if kind == "decoy-question":
        return {"question": "What is 7 + 8?", "prompt": messages, "reference": "15"}
    if kind == "rendered-template":
        return {"prompt": tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                        tokenize=False)}
    messages[1]["content"] = question + "\nShow your work, then give the answer after ####."
    return {"prompt": messages}


@pytest.mark.parametrize("kind", ["decoy-question", "rendered-template", "appended-instruction"])
def test_a_forged_training_file_ends_in_an_isolation_failure(foreign, tiny_model_dir, tmp_path,
                                                              kind):
    directory, rows, eval_set, tokenizer, system = foreign
    planted = eval_set[1]
    forged = rows + [forged_row(kind, planted.question, tokenizer, system)]
    data = write_rows(tmp_path / "train.jsonl", forged)
    result = gate_capped(directory, data, tmp_path / "gated", str(tiny_model_dir))
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: isolation"), result.stderr
    assert result.stdout.strip() == "", result.stdout
    assert f"train.jsonl:{len(forged)} holds eval prompt {planted.prompt_id}" in lines[0]
    assert not (tmp_path / "gated").exists()


def test_the_clean_training_file_still_gates(foreign, tiny_model_dir, tmp_path):
    directory, rows, _, _, _ = foreign
    data = write_rows(tmp_path / "train.jsonl", rows)
    result = gate_capped(directory, data, tmp_path / "gated", str(tiny_model_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    evidence = json.loads((tmp_path / "gated" / "evidence.json").read_text())
    isolation = evidence["foreign"]["admission"]["isolation"]
    assert (isolation["checked"], isolation["shared_prompts"]) == (True, 0)
    assert isolation["train_prompts"] == len(rows)
    assert [r["name"] for r in evidence["decision"]["checks"]].count("isolation") == 1
