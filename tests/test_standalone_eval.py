"""`grpogate eval` / `grpogate compare`: spec parsing, refusals, the paired comparison, and that a
standalone eval reproduces a run's own re-test record for record (tiny random model)."""

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from grpogate.evidence import metrics
from grpogate.cli import app
from grpogate.errors import InputError
from grpogate.files import read_jsonl
from grpogate.review.standalone_eval import (EVAL_FILE_KIND, compare_evaluations, evaluate_standalone,
                                      parse_policy_spec, parse_tasks_spec)


def eval_doc(rewards_by_prompt, *, seed=7, verifier="v1", group_size=4, max_new_tokens=16,
             policy="p"):
    records = [{"policy": "policy", "prompt_id": prompt_id, "sample_index": i, "seed": seed,
                "completion": "...", "completion_tokens": 5, "hit_max_length": False,
                "reward": float(reward)}
               for prompt_id, rewards in rewards_by_prompt.items() for i, reward in enumerate(rewards)]
    return {"kind": EVAL_FILE_KIND, "version": 1, "prompt_ids": list(rewards_by_prompt),
            "seed": seed, "group_size": group_size,
            "verifier": {"name": verifier, "version": verifier},
            "sampling": {"max_new_tokens": max_new_tokens, "temperature": 1.0},
            "policy": {"spec": policy, "policy_version": policy * 8}, "records": records}


A = eval_doc({"p1": [0, 0, 0, 0], "p2": [1, 0, 0, 0], "p3": [1, 1, 0, 0]}, policy="a")
B = eval_doc({"p1": [1, 0, 1, 0], "p2": [1, 1, 0, 0], "p3": [1, 1, 0, 0]}, policy="b")


def test_policy_and_task_specs():
    assert parse_policy_spec("bundled:SmolLM2-135M-Instruct") == ("bundled:SmolLM2-135M-Instruct", "")
    assert parse_policy_spec("Qwen/Qwen2.5-0.5B-Instruct+runs/a+b/adapter") == (
        "Qwen/Qwen2.5-0.5B-Instruct", "runs/a+b/adapter")
    assert parse_tasks_spec("reasoning-gym:chain_sum") == {"source": "reasoning-gym",
                                                           "name": "chain_sum"}
    assert parse_tasks_spec("gsm8k:data/gsm8k") == {"source": "gsm8k", "path": "data/gsm8k"}
    for bad in ("chain_sum", "gsm8k:", "hub:x"):
        with pytest.raises(InputError, match="--task "):
            parse_tasks_spec(bad)
    with pytest.raises(InputError, match="--policy"):
        parse_policy_spec("+adapter")


def test_compare_pairs_prompts_by_hand():
    result = compare_evaluations(A, B, bootstrap_seed=3)
    # Per-prompt mean reward deltas: p1 0 -> 0.5, p2 0.25 -> 0.5, p3 0.5 -> 0.5.
    assert result["reward_mean_gain"] == pytest.approx((0.5 + 0.25 + 0.0) / 3)
    # pass@4: p1 fails -> passes; p2, p3 pass in both: 2/3 -> 3/3.
    assert result["pass_at_group_gain"] == pytest.approx(1 / 3)
    paired = result["paired"]
    assert paired["reward_mean_gain"]["sign_test"] == {"positive": 2, "negative": 0, "ties": 1,
                                                       "p_value": 0.5}
    assert paired["pass_at_group_gain"]["mcnemar"]["candidate_only"] == 1
    assert paired["pass_at_group_gain"]["mcnemar"]["p_value"] == 1.0
    assert paired["seed"] == 3 and paired["resamples"] == 2000
    assert result["baseline"]["policy"] == "a" and result["candidate"]["policy"] == "b"
    assert result["warnings"] == []


@pytest.mark.parametrize("other, message", [
    (eval_doc({"p1": [0] * 4, "p2": [0] * 4, "p9": [0] * 4}), "prompt ids differ"),
    (eval_doc({"p1": [0] * 4, "p2": [0] * 4, "p3": [0] * 4}, seed=8), "seeds differ"),
    (eval_doc({"p1": [0] * 4, "p2": [0] * 4, "p3": [0] * 4}, verifier="v2"),
     "verifier versions differ"),
    (eval_doc({"p1": [0] * 2, "p2": [0] * 2, "p3": [0] * 2}, group_size=2), "group sizes differ"),
    ({"kind": "something else"}, "not a grpogate eval file"),
])
def test_compare_refuses(other, message):
    with pytest.raises(InputError, match=message):
        compare_evaluations(A, other)


def test_compare_warns_on_sampling_differences_and_ignores_stored_metrics():
    other = eval_doc({"p1": [1, 0, 1, 0], "p2": [1, 1, 0, 0], "p3": [1, 1, 0, 0]},
                     max_new_tokens=32)
    other["metrics"] = {"mean_reward": 1.0}  # edited: compare re-reduces the records
    result = compare_evaluations(A, other)
    assert result["warnings"] == ["sampling max_new_tokens differs: 16 vs 32"]
    assert result["candidate"]["mean_reward"] == 6 / 12


def test_compare_cli(tmp_path):
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps(A))
    b.write_text(json.dumps(B))
    c.write_text(json.dumps(eval_doc({"p1": [0] * 4, "p2": [0] * 4, "p3": [0] * 4}, seed=1)))
    result = CliRunner().invoke(app, ["compare", str(a), str(b), "--out", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert "mean_reward" in result.output and "+0.2500" in result.output
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["paired"] == compare_evaluations(A, B)["paired"]
    refused = CliRunner().invoke(app, ["compare", str(a), str(c)])
    assert refused.exit_code == 2 and "seeds differ" in refused.output


@pytest.mark.parametrize("target", ["b.json", "r.json"], ids=["one of its inputs", "another file"])
def test_compare_never_overwrites_its_out(tmp_path, target):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(A))
    b.write_text(json.dumps(B))
    (tmp_path / "r.json").write_text("kept")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    result = CliRunner().invoke(app, ["compare", str(a), str(b), "--out", str(tmp_path / target)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "already exists" in lines[0]
    assert result.stdout.strip() == ""
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_eval_reproduces_the_runs_retest(tiny_config, tmp_path):
    """Same config and seed: a standalone eval of the baseline and of the delivered adapter
    gives exactly the run's own re-test completions, rewards and policy versions."""
    from grpogate.pipeline import run

    config = tiny_config(tmp_path)
    evidence = run(config)
    run_dir = tmp_path / "run"
    stored = read_jsonl(run_dir / "eval_completions.jsonl")
    seed = evidence["seeds"]["eval"]

    def key(record):
        return (record["prompt_id"], record["sample_index"], record["completion"],
                record["completion_tokens"], record["hit_max_length"], record["reward"],
                record["policy_version"], record["seed"])

    for name, adapter in (("baseline", ""), ("candidate", str(run_dir / "adapter"))):
        document = evaluate_standalone(dataclasses.replace(config, adapter=adapter), "tiny", seed)
        assert [key(r) for r in document["records"]] == [
            key(r) for r in stored if r["policy"] == name]
        assert document["metrics"] == {**evidence["comparison"][name]}
        assert document["eval_set"] == evidence["inputs"]["eval_set"]
        if name == "baseline":
            baseline_document = document
    assert document["policy"]["policy_version"] == evidence["artifact"]["new_policy_version"]
    assert baseline_document["policy"]["policy_version"] == evidence["inputs"]["baseline_policy_version"]
    paired = compare_evaluations(baseline_document, document, bootstrap_seed=config.seed)["paired"]
    assert paired == evidence["comparison"]["paired"]
    # The same real (tiny) run, re-checked from its files: the audit agrees with it.
    from grpogate.evidence.audit import audit_run

    assert audit_run(run_dir)["mismatches"] == []


def test_eval_cli_writes_a_file_and_never_overwrites(tiny_model_dir, tmp_path):
    data = tmp_path / "gsm8k"
    data.mkdir()
    data.joinpath("test.jsonl").write_text("".join(
        json.dumps({"question": f"What is {i} plus {i}?", "answer": f"{i}+{i}\n#### {2 * i}"}) + "\n"
        for i in range(1, 6)))
    out = tmp_path / "eval.json"
    arguments = ["eval", "--policy", str(tiny_model_dir), "--tasks", f"gsm8k:{data}",
                 "--eval-prompts", "3", "--group-size", "2", "--seed", "5", "--out", str(out),
                 "--set", "max_new_tokens=4", "--device", "cpu"]
    result = CliRunner().invoke(app, arguments)
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert document["kind"] == EVAL_FILE_KIND and document["seed"] == 5
    assert document["verifier"]["version"] == "gsm8k-final-number-v1"
    assert len(document["records"]) == 6 and len(document["prompt_ids"]) == 3
    assert document["metrics"] == metrics.summarize_completions(document["records"], 2, 4)
    again = CliRunner().invoke(app, arguments)
    assert again.exit_code == 2 and "already exists" in again.output


def test_exclude_run_refuses_eval_prompts_the_run_trained_on(tmp_path, monkeypatch):
    """A run whose training set holds 2 of the 4 eval prompts: eval refuses before loading."""
    import json as json_module

    from typer.testing import CliRunner

    from grpogate.cli import app
    from grpogate.config import load_config
    from grpogate.inputs.tasks import load_eval_set
    from grpogate.review.standalone_eval import refuse_trained_prompts

    config = load_config("default", eval_prompts=4)
    eval_set, _ = load_eval_set(config.task, 4)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [{"prompt_id": p.prompt_id, "split": "train"} for p in eval_set[:2]]
    lines.append({"prompt_id": eval_set[3].prompt_id, "split": "eval"})  # eval split: allowed
    (run_dir / "problems.jsonl").write_text("".join(json_module.dumps(r) + "\n" for r in lines))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["eval", "--policy", "bundled:SmolLM2-135M-Instruct",
                                      "--eval-prompts", "4", "--exclude-run", str(run_dir),
                                      "--out", "eval.json"])
    assert result.exit_code == 2, result.output
    assert "2 of 4 eval prompts were trained on" in result.output
    assert not (tmp_path / "eval.json").exists()
    # The run's eval split does not count; a disjoint training set passes (2 ids checked).
    (run_dir / "problems.jsonl").write_text(
        "".join(json_module.dumps({"prompt_id": f"other{i}", "split": "train"}) + "\n"
                for i in range(2)))
    assert refuse_trained_prompts(eval_set, run_dir) == 2
    with pytest.raises(InputError, match="not a run directory"):
        refuse_trained_prompts(eval_set, tmp_path / "nothing")
