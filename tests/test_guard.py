"""The re-test's guard set and drift: paired guard statistics by hand, the guard and KL gates in
the decision, the audit recomputing both from the records, the report showing them.

Torch-free: the synthetic run (tests/synthetic_run.py) writes a real run directory without a
model; `sampling/drift.py` and a real run are tested in test_guard_run.py.
"""

from __future__ import annotations

import json

import pytest
from synthetic_run import write_synthetic_run

from grpogate.config import GuardConfig, load_config
from grpogate.errors import InputError
from grpogate.evidence import decisions
from grpogate.evidence.assemble import bootstrap_settings
from grpogate.evidence.audit import audit_run
from grpogate.evidence.guard import drift_section, guard_section
from grpogate.evidence.report import write_report
from grpogate.files import atomic_write_json, sha256_path
from grpogate.inputs.tasks import load_guard_set, load_reasoning_gym, stored_sets

# Four guard prompts x 2 samples. The candidate loses exactly one of two correct answers on
# every prompt: per-prompt reward differences -0.5, -0.5, -0.5, -0.5.
WORSE = {"baseline": [[1, 1], [1, 0], [1, 1], [1, 0]],
         "candidate": [[1, 0], [0, 0], [1, 0], [0, 0]]}
SAME = {"baseline": WORSE["baseline"], "candidate": WORSE["baseline"]}


def _config(prompts=4, group_size=2, seed=42) -> dict:
    return {"guard": {"prompts": prompts, "group_size": group_size, "task": "chain_sum",
                      "params": {}, "seed": 3},
            "max_new_tokens": 16, "seed": seed, "train_prompts": 4, "prompts_per_step": 2}


def _records(rewards: dict) -> list[dict]:
    return [{"policy": name, "prompt_id": f"p{index}", "sample_index": sample,
             "completion_tokens": 4, "hit_max_length": False, "reward": float(reward)}
            for name, groups in rewards.items() for index, group in enumerate(groups)
            for sample, reward in enumerate(group)]


def test_guard_paired_statistics_by_hand():
    section = guard_section(_config(), _records(WORSE), bootstrap_settings(_config()))
    # Means: baseline (2 + 1 + 2 + 1) / 8 = 0.75, candidate (1 + 0 + 1 + 0) / 8 = 0.25.
    assert section["baseline"]["mean_reward"] == 0.75
    assert section["candidate"]["mean_reward"] == 0.25
    assert section["reward_mean_gain"] == -0.5
    gain = section["paired"]["reward_mean_gain"]
    # Every prompt's difference is -0.5, so every bootstrap resample's mean is -0.5: the
    # interval is [-0.5, -0.5] exactly.
    assert (gain["point"], gain["low"], gain["high"]) == (-0.5, -0.5, -0.5)
    # Sign test: 0 positive, 4 negative -> p = 2 x C(4, 0) / 2^4 = 2 / 16 = 0.125.
    assert gain["sign_test"] == {"positive": 0, "negative": 4, "ties": 0, "p_value": 0.125}
    # pass@2: baseline passes all 4 prompts (1.0), candidate prompts 0 and 2 (0.5); McNemar:
    # 2 baseline-only, 0 candidate-only -> p = 2 x C(2, 0) / 2^2 = 0.5.
    assert section["pass_at_group_gain"] == -0.5
    assert section["paired"]["pass_at_group_gain"]["mcnemar"]["p_value"] == 0.5
    # The run's bootstrap: 2000 resamples, the run seed, 95 %.
    assert (section["paired"]["resamples"], section["paired"]["seed"],
            section["paired"]["confidence"]) == (2000, 42, 0.95)


def test_guard_interval_of_mixed_differences():
    # Differences +0.5, 0, -0.5, +1.0: point (0.5 + 0 - 0.5 + 1) / 4 = 0.25; sign test 2
    # positive, 1 negative, 1 tie -> p = 2 x (C(3,0) + C(3,1)) / 2^3 = 2 x 4 / 8 = 1.0.
    rewards = {"baseline": [[0, 0], [1, 0], [1, 1], [0, 0]],
               "candidate": [[1, 0], [1, 0], [1, 0], [1, 1]]}
    gain = guard_section(_config(), _records(rewards),
                         bootstrap_settings(_config()))["paired"]["reward_mean_gain"]
    assert gain["point"] == 0.25
    assert gain["sign_test"]["p_value"] == 1.0
    assert -0.5 <= gain["low"] < 0.25 < gain["high"] <= 1.0


def _row(evidence: dict, gates: dict, name: str) -> dict:
    return next(r for r in decisions.decide_run(evidence, gates)["checks"] if r["name"] == name)


def _guard(deltas: list[float], point: float) -> dict:
    """A guard section whose paired sample differences are `deltas`, with the recorded point
    estimate `point`, beside a one-prompt eval comparison (the rule walks both sets)."""
    same = [{"prompt_id": "e0", "mean_reward": 0.5, "passed": True}]
    return {"guard": {"enabled": True, "reward_mean_gain": point,
                      "sample_differences": list(deltas)},
            "comparison": {"baseline": {"per_prompt": same}, "candidate": {"per_prompt": same}}}


def test_guard_rule_shows_non_inferiority_or_reads_the_point_estimate():
    significant = {"maximum_guard_reward_loss": 0.05, "require_significant_gain": True,
                   "minimum_reward_gain": 0.0, "minimum_pass_at_group_gain": 0.0}
    # No difference in any paired sample: on the unit scale x = 0.5 against m0 = (1 - 0.05) / 2
    # = 0.475, each stake c multiplies by 1 - c + c 0.5 / 0.475 = 1 + c / 19. The largest stake
    # (0.9) gives (1 + 0.9 / 19)^n / 16 at least: 200 samples reach 16,600 / 16 > 40 (shown),
    # 100 samples reach at most mean (1 + c / 19)^100 = 6.4 < 40 (not shown: no loss seen is not
    # enough).
    assert (1 + 0.9 / 19) ** 200 / 16 > 40
    assert sum((1 + 0.9 * 2 ** (-k / 2) / 19) ** 100 for k in range(16)) / 16 < 40
    shown = _row(_guard([0.0] * 200, 0.0), significant, "guard")
    assert shown["passed"] is True and shown["test"]["status"] == "shown"
    assert shown["threshold"] == "lower bound > -0.05" and -0.05 < shown["value"] < 0
    unseen = _row(_guard([0.0] * 100, 0.0), significant, "guard")
    assert unseen["passed"] is False and unseen["test"]["status"] == "open"
    assert unseen["value"] < -0.05
    # Fifteen samples each losing 1: on the flipped side x = 1 against 1 - 0.475 = 0.525, so
    # each stake multiplies by 1 - c + c / 0.525; the largest alone gives 1.8143^15 / 16 = 474
    # (ten would give 24 < 40): a loss beyond the margin is shown, the row fails as ruled out.
    assert (1 - 0.9 + 0.9 / 0.525) ** 15 / 16 > 40
    lost = _row(_guard([-1.0] * 15, -1.0), significant, "guard")
    assert lost["passed"] is False and lost["test"]["status"] == "ruled_out"
    # Point-estimate rule: -0.375 < -0.05 fails, -0.04 passes.
    point = {"maximum_guard_reward_loss": 0.05, "require_significant_gain": False}
    assert _row(_guard([-0.5] * 8, -0.375), point, "guard")["value"] == -0.375
    assert _row(_guard([-0.5] * 8, -0.375), point, "guard")["passed"] is False
    assert _row(_guard([0.0] * 8, -0.04), point, "guard")["passed"] is True
    # Off is recorded as off and passes; gates without the guard gate (older runs): no row.
    assert _row({"guard": {"enabled": False}}, significant, "guard")["value"] == "off"
    evidence = _guard([0.0] * 8, 0.0)
    assert "guard" not in [r["name"] for r in decisions.decide_run(evidence, {})["checks"]]
    # Missing or junk guard numbers never pass.
    for junk in ({}, {"guard": {"enabled": True}}, _guard([float("nan")] * 300, 0.0),
                 _guard([2.0] * 300, 0.0), _guard(["1"] * 300, 0.0)):
        assert _row(junk, significant, "guard")["passed"] is False


def test_retest_kl_gate():
    evidence = {"comparison": {"drift": {"kl_to_baseline": 0.4}}}
    assert _row(evidence, {"maximum_retest_kl": 0.5}, "retest_kl")["passed"] is True
    assert _row(evidence, {"maximum_retest_kl": 0.4}, "retest_kl")["passed"] is True  # inclusive
    assert _row(evidence, {"maximum_retest_kl": 0.3}, "retest_kl")["passed"] is False
    off = _row(evidence, {"maximum_retest_kl": 0.0}, "retest_kl")
    assert (off["value"], off["threshold"], off["passed"]) == (0.4, "off", True)
    assert _row({}, {"maximum_retest_kl": 0.5}, "retest_kl")["passed"] is False  # not measured


def test_drift_is_token_weighted_by_hand():
    records = [{"policy": "candidate", "completion_tokens": n, "entropy": e, "kl_to_baseline": k}
               for n, e, k in ((2, 0.5, 1.0), (6, 0.1, 0.2))]
    records += [{"policy": "baseline", "completion_tokens": 4, "entropy": 0.9}]
    drift = drift_section(records)
    # KL (1.0 x 2 + 0.2 x 6) / 8 = 3.2 / 8 = 0.4; entropy (0.5 x 2 + 0.1 x 6) / 8 = 1.6 / 8 = 0.2.
    assert drift["kl_to_baseline"] == pytest.approx(0.4, abs=1e-12)
    assert drift["entropy"]["candidate"] == pytest.approx(0.2, abs=1e-12)
    assert drift["entropy"]["baseline"] == 0.9
    assert (drift["kl_tokens"], drift["entropy_tokens"]) == (8, {"baseline": 4, "candidate": 8})
    assert drift_section([{"policy": "baseline", "completion_tokens": 3}]) is None


def test_a_candidate_worse_on_the_guard_ends_tune_naming_the_gate(tmp_path):
    run_dir = write_synthetic_run(tmp_path, guard_rewards=WORSE)
    evidence = json.loads((run_dir / "evidence.json").read_text())
    assert evidence["decision"]["decision"] == "tune"
    assert evidence["decision"]["failed_checks"] == ["guard"]
    row = _row(evidence, evidence["config"]["gates"], "guard")
    assert (row["value"], row["threshold"]) == (-0.5, -0.05)
    assert evidence["guard"]["rule"].startswith("non-inferiority")
    # 4 problems x 2 samples, one round: the paired sample differences, baseline order.
    assert evidence["guard"]["sample_differences"] == [0, -1, -1, 0, 0, -1, -1, 0]
    assert evidence["guard"]["rounds"] == 1
    audit = audit_run(run_dir)
    assert audit["mismatches"] == [] and audit["agrees"] and audit["decision"] == "tune"


def test_a_guard_as_good_as_the_baseline_accepts(tmp_path):
    run_dir = write_synthetic_run(tmp_path, guard_rewards=SAME)
    audit = audit_run(run_dir)
    assert audit["mismatches"] == [] and audit["decision"] == "accept"
    row = next(r for r in audit["checks"] if r["name"] == "guard")
    assert (row["value"], row["passed"]) == (0.0, True)


def test_the_synthetic_drift_and_its_gate(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "a", maximum_retest_kl=0.25)
    evidence = json.loads((run_dir / "evidence.json").read_text())
    drift = evidence["comparison"]["drift"]
    # synthetic_run.py: KL 10.8 / 37, baseline entropy 26.2 / 37, candidate entropy 0.5.
    assert drift["kl_to_baseline"] == pytest.approx(10.8 / 37, abs=1e-12)
    assert drift["entropy"]["baseline"] == pytest.approx(26.2 / 37, abs=1e-12)
    assert drift["entropy"]["candidate"] == pytest.approx(0.5, abs=1e-12)
    assert evidence["decision"]["failed_checks"] == ["retest_kl"]  # 0.2919 > 0.25
    assert audit_run(run_dir)["agrees"]
    passing = write_synthetic_run(tmp_path / "b", maximum_retest_kl=0.3)
    assert json.loads((passing / "evidence.json").read_text())["decision"]["decision"] == "accept"


def _rehash(run_dir) -> None:
    """Re-pin every file in the manifest, as a forger who edits files would."""
    manifest = json.loads((run_dir / "manifest.json").read_text())
    for name in manifest["files"]:
        manifest["files"][name] = sha256_path(run_dir / name)
    atomic_write_json(run_dir / "manifest.json", manifest)


def _fields(audit: dict) -> list[str]:
    return [m["field"] for m in audit["mismatches"]]


def test_the_audit_recomputes_the_guard(tmp_path):
    run_dir = write_synthetic_run(tmp_path, guard_rewards=WORSE)
    path = run_dir / "evidence.json"
    evidence = json.loads(path.read_text())
    # A forged guard gain (and decision) that would pass the point-estimate gate.
    evidence["guard"]["reward_mean_gain"] = 0.1
    evidence["decision"] = decisions.decide_run(evidence, evidence["config"]["gates"])
    assert evidence["decision"]["decision"] == "accept"
    atomic_write_json(path, evidence)
    _rehash(run_dir)
    audit = audit_run(run_dir)
    assert "guard.reward_mean_gain" in _fields(audit)
    assert audit["decision"] == "reject"


def test_the_audit_rescores_guard_records_and_recomputes_the_drift(tmp_path):
    run_dir = write_synthetic_run(tmp_path, guard_rewards=WORSE)
    lines = (run_dir / "guard_completions.jsonl").read_text().splitlines()
    record = json.loads(lines[2])  # baseline, prompt 1, sample 0: reward 1
    record["reward"] = 0.0
    lines[2] = json.dumps(record)
    (run_dir / "guard_completions.jsonl").write_text("\n".join(lines) + "\n")
    evals = (run_dir / "eval_completions.jsonl").read_text().splitlines()
    record = json.loads(evals[-1])
    record["kl_to_baseline"] = 0.0  # a forged per-completion KL
    evals[-1] = json.dumps(record)
    (run_dir / "eval_completions.jsonl").write_text("\n".join(evals) + "\n")
    _rehash(run_dir)
    fields = _fields(audit_run(run_dir))
    assert "guard_completions.jsonl:3 reward" in fields
    assert "comparison.drift.kl_to_baseline" in fields


def test_guard_off_is_recorded_as_off(tmp_path):
    run_dir = write_synthetic_run(tmp_path)  # guard_rewards None: guard.prompts = 0
    evidence = json.loads((run_dir / "evidence.json").read_text())
    assert evidence["guard"]["enabled"] is False
    assert "guard.prompts = 0" in evidence["guard"]["note"]
    assert _row(evidence, evidence["config"]["gates"], "guard")["value"] == "off"
    assert not (run_dir / "guard_completions.jsonl").exists()
    assert audit_run(run_dir)["agrees"]


def test_a_missing_guard_file_is_a_mismatch(tmp_path):
    run_dir = write_synthetic_run(tmp_path, guard_rewards=SAME)
    (run_dir / "guard_completions.jsonl").unlink()
    assert "guard_completions.jsonl (missing)" in _fields(audit_run(run_dir))


def test_the_report_shows_the_guard_and_the_drift(tmp_path):
    run_dir = write_synthetic_run(tmp_path, guard_rewards=WORSE)
    page = write_report(run_dir).read_text()
    assert 'id="guard-drift"' in page
    assert "-0.5 [-0.5, -0.5]" in page  # the guard reward gain and its interval
    assert "0.2919" in page  # KL 10.8 / 37
    assert "0.7081 -&gt; 0.5" in page  # entropy baseline -> candidate
    assert "<b>guard</b>" in page  # what to try, for the failed guard gate


def test_guard_prompts_are_disjoint_from_train_and_eval():
    first = load_reasoning_gym("products", GuardConfig().params, 1, GuardConfig().seed)[0]
    guard, identity = load_guard_set(GuardConfig(prompts=8), first, [])
    assert first[0].prompt_id not in {p.prompt_id for p in guard} and len(guard) == 8
    assert identity["enabled"] is True and identity["seed"] == 3
    assert load_guard_set(GuardConfig(prompts=0), [], []) == ([], {"enabled": False})
    record = {"prompt_id": first[0].prompt_id, "question": first[0].question, "reference": "1"}
    other = {"prompt_id": guard[0].prompt_id, "question": guard[0].question, "reference": "1"}
    rows = [(1, record | {"split": "train"}), (2, other | {"split": "eval"}),
            (3, record | {"split": "guard"})]
    with pytest.raises(InputError, match="guard and train \\+ eval sets share 1 prompt"):
        stored_sets(rows, "problems.jsonl")


def test_guard_config_keys_and_their_bounds():
    config = load_config("default")
    assert (config.guard.prompts, config.guard.task) == (100, "products")
    assert (config.guard.group_size, config.guard.rounds) == (2, 16)
    with pytest.raises(InputError, match="guard.rounds must be >= 1"):
        load_config("default", overrides=["guard.rounds=0"])
    with pytest.raises(InputError, match="maximum_guard_reward_loss must be in \\(0, 1\\)"):
        load_config("default", overrides=["gates.maximum_guard_reward_loss=0"])
    assert load_config("default", overrides=["guard.prompts=0"]).guard.enabled is False
    assert load_config("gsm8k_qwen05b").guard.enabled is False
    with pytest.raises(InputError, match="guard.prompts must be >= 0"):
        load_config("default", overrides=["guard.prompts=-1"])
    with pytest.raises(InputError, match="maximum_retest_kl"):
        load_config("default", overrides=["gates.maximum_retest_kl=-1"])
