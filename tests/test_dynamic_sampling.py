"""DAPO dynamic sampling on the tiny model with a scripted verifier: refills, the cap, the cursor.

The script makes a group valid exactly when its prompt is train prompt 0, 4, 5 or 6 (rewards
alternate 1 / 0 by sample), so with 12 train prompts, 4 prompts per step and at most 3
generation rounds, worked by hand (cursor = prompts drawn so far, prompt = cursor mod 12):

  step 0: round 0 [0 1 2 3] -> 1 valid; round 1 draws the shortfall 3: [4 5 6] -> 3; 4 reached.
  step 1: round 0 [7 8 9 10] -> 0; round 1 [11 0 1 2] -> 1 (prompt 0, next epoch);
          round 2 [3 4 5] -> 2; 3 valid and the cap of 3 rounds stops it.
  step 2: round 0 [6 7 8 9] -> 1; round 1 [10 11 0] -> 1; round 2 [1 2] -> 0; capped at 2.
  The cursor after the steps: 7, 18, 27.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import sha256
from test_resume import strip_volatile

from grpogate import admission, pipeline
from grpogate.evidence.audit import audit_run
from grpogate.files import read_jsonl
from grpogate.training import loop as training
from grpogate.training.checkpoint import checkpoint_to_resume

VALID_PROMPTS = {0, 4, 5, 6}
SIZES = dict(train_prompts=12, prompts_per_step=4, group_size=4, eval_prompts=2,
             dynamic_sampling=True, max_generation_rounds=3, seed=5)


def scripted(config, monkeypatch):
    train, _, _, _ = admission.load_problem_sets(config)
    position = {problem.prompt_id: index for index, problem in enumerate(train)}

    def score(completions, problems, verifier):
        return [float(position[problems[c.prompt_index].prompt_id] in VALID_PROMPTS
                      and c.sample_index % 2 == 0) for c in completions]

    monkeypatch.setattr(training, "score_completions", score)
    return position


def test_refills_up_to_prompts_per_step_and_stops_at_the_cap(tiny_config, tmp_path, monkeypatch):
    config = tiny_config(tmp_path, **SIZES)
    position = scripted(config, monkeypatch)
    evidence = pipeline.run(config)
    steps = evidence["steps"]
    assert [[r["prompts"] for r in s["generation_rounds"]] for s in steps] == [
        [4, 3], [4, 4, 3], [4, 3, 2]]
    assert [[r["valid_groups"] for r in s["generation_rounds"]] for s in steps] == [
        [1, 3], [0, 1, 2], [1, 1, 0]]
    assert [s["prompts_drawn"] for s in steps] == [7, 11, 9]
    assert [s["groups_generated"] for s in steps] == [7, 11, 9]
    assert [s["groups_kept"] for s in steps] == [4, 3, 2]
    assert [s["refill_prompts"] for s in steps] == [3, 7, 5]
    assert all(s["refill_generation_seconds"] > 0 for s in steps)
    # Seeds: step s round r samples with seed + s + 1,000,000 r.
    assert [r["seed"] for r in steps[1]["generation_rounds"]] == [6, 1_000_006, 2_000_006]
    # The prompts each step drew, in cursor order, and never one twice within a step.
    trajectories = read_jsonl(evidence["run_dir"] + "/trajectories.jsonl")
    drawn = [[position[r["prompt_id"]] for r in trajectories
              if r["step"] == step and r["sample_index"] == 0] for step in range(3)]
    assert drawn == [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 0, 1, 2, 3, 4, 5],
                     [6, 7, 8, 9, 10, 11, 0, 1, 2]]
    # Every generated group counts in the coverage; the refill's generation is in the
    # throughput's denominator (rollout seconds hold every round).
    rollout = evidence["rollout"]
    assert rollout["group_count"] == 27 and rollout["valid_group_count"] == 9
    assert rollout["dynamic_sampling"]["groups_kept"] == 9
    assert rollout["dynamic_sampling"]["refill_prompts"] == 15
    assert rollout["rollout_seconds"] >= rollout["dynamic_sampling"]["refill_generation_seconds"]
    assert evidence["update"]["trained_sequences"] == 9 * 4
    mismatches = [m["field"] for m in audit_run(evidence["run_dir"])["mismatches"]
                  if not re.fullmatch(r"trajectories\.jsonl:\d+ rewards?(\.correctness)?",
                                      m["field"])]
    assert mismatches == []  # the scripted correctness aside, the audit agrees


def test_without_dynamic_sampling_a_step_draws_its_prompts_once(tiny_config, tmp_path,
                                                                monkeypatch):
    config = tiny_config(tmp_path, **{**SIZES, "dynamic_sampling": False})
    scripted(config, monkeypatch)
    evidence = pipeline.run(config)
    assert [s["prompts_drawn"] for s in evidence["steps"]] == [4, 4, 4]
    # prompts [0 1 2 3] -> 1 valid, [4 5 6 7] -> 3, [8 9 10 11] -> 0
    assert [s["groups_kept"] for s in evidence["steps"]] == [1, 3, 0]
    assert [len(s["generation_rounds"]) for s in evidence["steps"]] == [1, 1, 1]


def test_a_crashed_run_resumes_at_the_prompt_cursor(tiny_config, tmp_path, monkeypatch):
    scripted(tiny_config(tmp_path, **SIZES), monkeypatch)
    reference = pipeline.run(tiny_config(tmp_path / "reference", **SIZES))
    config = tiny_config(tmp_path / "crashed", **SIZES)
    real_round = training._generation_round

    def crash_in_step_2(loop, state, step, *args):
        if step == 2:
            raise RuntimeError("simulated crash")
        return real_round(loop, state, step, *args)

    monkeypatch.setattr(training, "_generation_round", crash_in_step_2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        pipeline.run(config)
    checkpoint = checkpoint_to_resume(config.out)
    assert checkpoint.state["next_step"] == 2 and checkpoint.state["next_prompt"] == 18
    monkeypatch.setattr(training, "_generation_round", real_round)
    resumed = pipeline.resume(config.out)
    assert resumed["resumes"][0]["from_step"] == 2
    assert [s["prompts_drawn"] for s in resumed["steps"]] == [7, 11, 9]
    assert strip_volatile(resumed) == strip_volatile(reference)
    # Both runs are labelled "run" (their directory's name), so even the trace ids agree.
    for name in ("trajectories.jsonl", "adapter/adapter_model.safetensors"):
        assert sha256(Path(config.out) / name) == sha256(Path(reference["run_dir"]) / name)
