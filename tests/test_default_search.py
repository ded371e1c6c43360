"""bench/default_search.py: the development-set search of the default's settings.

The record line is checked against the synthetic run, whose numbers are worked out by hand in
tests/synthetic_run.py; the search itself runs two candidates end to end on the tiny model.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from grpogate.evidence.anytime import confidence_bound
from conftest import TINY_SIZES
from synthetic_run import write_synthetic_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import default_search  # noqa: E402


def _plan_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "plan.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_the_packaged_plan_loads_and_keeps_the_development_seed_far():
    plan = default_search.load_plan(default_search.DEFAULT_PLAN)
    # Train seed 1 and eval seed 2 draw items Random(1 + i) and Random(2 + i) for i below a few
    # hundred; the development seed must be far beyond that.
    assert plan["dev_seed"] >= 100_000
    assert plan["candidates"][0]["name"] == "today" and plan["candidates"][0]["set"] == {}


@pytest.mark.parametrize("text, fragment", [
    ("dev_seed = 5\n", "unique non-empty name"),
    ('dev_seed = 5\n[[candidate]]\nname = "a"\n[[candidate]]\nname = "a"\n', "unique"),
    ('dev_seed = "x"\n[[candidate]]\nname = "a"\n', "dev_seed must be an integer"),
    ('dev_seed = 5\nsteps = 3\n[[candidate]]\nname = "a"\n', "unknown key"),
])
def test_a_bad_plan_is_refused(tmp_path, text, fragment):
    with pytest.raises(SystemExit, match=fragment):
        default_search.load_plan(_plan_file(tmp_path, text))


def test_overrides_put_the_development_seed_first_and_the_caller_last():
    plan = {"dev_seed": 777, "scale": {"eval_prompts": 64}, "candidates": []}
    candidate = {"name": "c", "set": {"learning_rate": 2e-4, "dynamic_sampling": True,
                                      "loss_type": "dapo"}}
    assert default_search.candidate_overrides(plan, candidate, ["eval_prompts=4"]) == [
        "task.eval_seed=777", "eval_prompts=64", "learning_rate=0.0002",
        "dynamic_sampling=true", 'loss_type="dapo"', "eval_prompts=4"]


def test_record_row_reads_the_evidence_numbers(tmp_path):
    """synthetic_run: eval rewards baseline [0,0,0,0] [1,0,0,0] -> 1/8 = 0.125, candidate
    [1,0,1,0] [1,1,0,0] -> 4/8 = 0.5, gain 0.375, interval [0.25, 0.5] (test_significant_gain
    works it out); pass@4 0.5 -> 1.0, interval [0, 1]. Step KLs 0.001 and 0.002 -> the largest
    is 0.002 at step 1. The last of every 4 samples hits the budget: truncation 1/4 everywhere."""
    run_dir = write_synthetic_run(tmp_path)
    evidence = json.loads((run_dir / "evidence.json").read_text())
    row = default_search.record_row("c", {"learning_rate": 1e-4}, evidence, 12.5)
    assert row["reward"] == {"baseline": 0.125, "candidate": 0.5, "gain": 0.375, "low": 0.25,
                             "high": 0.5, "sign_test_p": row["reward"]["sign_test_p"],
                             "gain_lower_bound": confidence_bound([0.5, 0.25])}
    # Both prompts improve: a two-sided sign test on 2 of 2 gives p = 2 x (1/2)^2 = 0.5; the
    # anytime-valid lower bound of two prompts stays far below 0 (test_significant_gain).
    assert row["reward"]["sign_test_p"] == pytest.approx(0.5)
    assert row["pass_at_group"] == {"baseline": 0.5, "candidate": 1.0, "gain": 0.5, "low": 0.0,
                                    "high": 1.0}
    assert row["largest_kl"] == {"value": 0.002, "step": 1}
    assert row["truncation"] == {"train": 0.25, "eval_baseline": 0.25, "eval_candidate": 0.25}
    assert (row["decision"], row["steps"], row["wall_seconds"]) == ("accept", 2, 12.5)
    assert row["eval"] == {"seed": 2, "prompts": 2, "group_size": 4}
    assert row["valid_group_ratio"] == 0.5 and row["update_count"] == 2


def test_record_row_keeps_the_retest_drift_and_the_guard(tmp_path):
    """synthetic_run: re-test KL 10.8 / 37, entropies 26.2 / 37 -> 0.5; a guard where every
    prompt loses 0.5 (0.75 -> 0.25, interval [-0.5, -0.5]: test_guard.py works it out)."""
    worse = {"baseline": [[1, 1], [1, 0], [1, 1], [1, 0]],
             "candidate": [[1, 0], [0, 0], [1, 0], [0, 0]]}
    run_dir = write_synthetic_run(tmp_path, guard_rewards=worse)
    row = default_search.record_row("c", {}, json.loads((run_dir / "evidence.json").read_text()),
                                    1.0)
    assert row["retest_drift"]["kl_to_baseline"] == pytest.approx(10.8 / 37, abs=1e-12)
    assert row["retest_drift"]["entropy"]["candidate"] == pytest.approx(0.5, abs=1e-12)
    assert {key: row["guard"][key] for key in ("baseline", "candidate", "gain", "low", "high")} \
        == {"baseline": 0.75, "candidate": 0.25, "gain": -0.5, "low": -0.5, "high": -0.5}
    assert "re-test KL 0.2919, guard 0.750 -> 0.250 [-0.500, -0.500]" in \
        default_search.summary_line(row)


def test_largest_kl_is_not_measured_without_a_reference():
    evidence = {"config": {"beta": 0.0}, "steps": [{"step": 0, "mean_kl": 0.0}]}
    assert default_search.largest_kl(evidence)["value"] is None
    evidence = {"config": {"beta": 0.02}, "steps": [{"step": 0, "mean_kl": 0.03},
                                                    {"step": 1, "mean_kl": 0.01}]}
    assert default_search.largest_kl(evidence) == {"value": 0.03, "step": 0}


def test_seeds_give_one_run_per_seed_and_a_mean_gain():
    plan = {"dev_seed": 1000000, "scale": {"train_prompts": 16}, "candidates": []}
    candidate = {"name": "lr", "set": {"learning_rate": 2e-4}}
    base = ["task.eval_seed=1000000", "train_prompts=16", "learning_rate=0.0002", "x=1"]
    assert default_search.candidate_runs(plan, candidate, ["x=1"], []) == [("lr", base, None)]
    assert default_search.candidate_runs(plan, candidate, ["x=1"], [42, 43]) == [
        ("lr-seed42", base + ["seed=42"], 42), ("lr-seed43", base + ["seed=43"], 43)]
    rows = [{"name": "a", "status": "ok", "run_seed": 42, "reward": {"gain": 0.262}},
            {"name": "a", "status": "ok", "run_seed": 43, "reward": {"gain": 0.326}},
            {"name": "b", "status": "failed", "run_seed": 42},
            {"name": "b", "status": "ok", "run_seed": 43, "reward": {"gain": 0.3}}]
    means = default_search.seed_means(rows)
    # a: (0.262 + 0.326) / 2 = 0.294; b: its one finished run, 0.3.
    assert means["a"]["seeds"] == [42, 43] and means["a"]["mean_gain"] == pytest.approx(0.294)
    assert means["b"] == {"seeds": [43], "gains": [0.3], "mean_gain": 0.3}


def test_search_runs_each_candidate_on_the_development_set(tiny_model_dir, tmp_path, monkeypatch):
    """Two real `grpogate run` children on the tiny model: one good candidate and one whose
    setting the config refuses. Both are recorded; the good one was evaluated on the development
    seed's problems (its problems.jsonl eval split is that seed's set) and its admission kept
    them out of training."""
    from grpogate.config import load_config
    from grpogate.inputs.tasks import load_eval_set

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny kernels: threads only wait on each other
    scale = "\n".join(f"{key} = {default_search.toml_value(value)}"
                      for key, value in TINY_SIZES.items())
    plan = default_search.load_plan(_plan_file(tmp_path, (
        f"dev_seed = 1000000\n[scale]\n{scale}\n"
        '[[candidate]]\nname = "good"\nset = {learning_rate = 1e-4}\n'
        '[[candidate]]\nname = "bad"\nset = {learning_rate = -1.0}\n')))
    record = tmp_path / "record.jsonl"
    extra = [f"model={json.dumps(str(tiny_model_dir))}"]
    rows = default_search.search(plan, tmp_path / "search", record, [], extra)

    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [line["name"] for line in lines] == ["good", "bad"] and lines == rows
    good, bad = lines
    # The random tiny model earns no reward (no valid group): a finished run all the same.
    assert good["status"] != "failed" and good["decision"] in ("accept", "tune", "reject")
    assert good["eval"]["seed"] == 1_000_000
    assert good["settings"] == {"learning_rate": 1e-4} and good["steps"] == 2
    assert good["extra"] == extra  # the overrides every candidate ran with
    assert good["dev_vs_default_eval"]["shared_prompts"] == 0
    assert good["dev_vs_default_eval"]["default_eval_prompts"] == load_config().eval_prompts
    assert "--set" in good["command"] and "task.eval_seed=1000000" in good["command"]
    stored = [json.loads(line) for line in
              (Path(good["run_dir"]) / "problems.jsonl").read_text().splitlines()]
    development = load_config("default", overrides=[
        f"{key}={default_search.toml_value(value)}" for key, value in TINY_SIZES.items()]
        + ["task.eval_seed=1000000"])
    expected = [p.prompt_id for p in load_eval_set(development.task, development.eval_prompts)[0]]
    assert [r["prompt_id"] for r in stored if r["split"] == "eval"] == expected
    assert not {r["prompt_id"] for r in stored if r["split"] == "train"} & set(expected)
    assert "decision: " in Path(good["run_dir"] + ".log").read_text()  # the terminal output
    assert bad["status"] == "failed" and bad["exit_code"] == 2
    assert "learning_rate" in bad["output_tail"]
    # A second search never reuses the first one's run directories.
    with pytest.raises(FileExistsError):
        default_search.search(plan, tmp_path / "search", record, ["good"], extra)


def test_transfer_check_pairs_baseline_and_adapter_on_unseen_problems(tiny_config, tmp_path):
    """On a finished tiny run: the unseen-seed check evaluates exactly the problems of that seed
    (minus any the run trained on), the neighbouring task those of chain_sum with three terms,
    and the candidate evaluated is the run's delivered adapter (its version is checked)."""
    import transfer_check

    from grpogate.inputs.tasks import load_eval_set
    from grpogate.pipeline import run
    from grpogate.review.standalone_eval import trained_prompt_ids

    config = tiny_config(tmp_path)
    evidence = run(config)
    run_dir = Path(config.out)
    trained = frozenset(trained_prompt_ids(run_dir))
    row = transfer_check.transfer(run_dir, 2_000_000, transfer_check.NEIGHBOUR, None)

    unseen, neighbour = row["unseen_seed"], row["neighbouring_task"]
    expected = dataclasses.replace(config.task, eval_seed=2_000_000)
    assert unseen["eval_set_sha256"] == load_eval_set(
        expected, 4, exclude_ids=trained)[1]["problem_set_sha256"]
    three_terms = dataclasses.replace(config.task, params={**config.task.params, "min_terms": 3,
                                                           "max_terms": 3})
    assert neighbour["eval_set_sha256"] == load_eval_set(
        three_terms, 4, exclude_ids=trained)[1]["problem_set_sha256"]
    assert neighbour["task"]["params"]["max_terms"] == 3 and neighbour["task"]["eval_seed"] == 2
    for check in (unseen, neighbour):
        assert (check["prompts"], check["group_size"]) == (4, 2)
        assert check["seed"] == config.seed + 10_000  # the run's own re-test seed
        assert check["trained_prompts_checked"] == len(trained) == config.train_prompts
        assert check["reward"]["gain"] == pytest.approx(
            check["reward"]["candidate"] - check["reward"]["baseline"])
    assert row["own_retest"]["gain"] == evidence["comparison"]["reward_mean_gain"]

    # Seed 1 is the train seed: its first items include training problems. They are skipped
    # while drawing, so the set differs from the plain seed-1 set and holds none of them.
    at_train_seed = transfer_check.transfer(run_dir, 1, transfer_check.NEIGHBOUR, None)
    train_seed = dataclasses.replace(config.task, eval_seed=1)
    plain = load_eval_set(dataclasses.replace(train_seed, eval_pool=0), 4)[0]
    assert {p.prompt_id for p in plain} & trained  # the plain set would overlap
    skipped = load_eval_set(train_seed, 4, exclude_ids=trained)
    assert not {p.prompt_id for p in skipped[0]} & trained
    assert at_train_seed["unseen_seed"]["eval_set_sha256"] == skipped[1]["problem_set_sha256"]
