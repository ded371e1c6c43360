"""The `require_significant_gain` gate: on in the default profile (docs/design.md §6: `accept` on the
default means a gain its re-test resolves), off in the reference profile and in a gates table that
does not name it (the published gates keep their meaning); on, the reward and pass_at_group
checks pass only when the paired sign-flip test (evidence/significance.py) rejects "gain <=
minimum" at 2.5 %. A candidate whose re-test equals the baseline's is rejected under either rule.
The run's output, `decide` and the report say which rule decided."""

import dataclasses
import json

import numpy as np
import pytest
from synthetic_run import write_synthetic_run

from grpogate.evidence.audit import audit_run
from grpogate.config import Gates, load_config
from grpogate.evidence.decisions import (decide_run, evaluate_grpo_candidate, gain_rule,
                                         gain_rule_line, validate_gates)
from grpogate.evidence.significance import sign_flip_test, significant
from grpogate.errors import InputError

SHA = "0123456789abcdef" * 4
GATES = {"minimum_valid_group_ratio": 0.25, "minimum_effective_trajectories_per_second": 1.0,
         "minimum_update_count": 1, "minimum_reward_gain": 0.0, "minimum_pass_at_group_gain": 0.0,
         "maximum_max_length_hit_ratio": 0.10, "maximum_peak_allocated_bytes": 10000}
SIGNIFICANT = dict(GATES, require_significant_gain=True)


def per_prompt(rewards: list[float], passed: list[bool]) -> list[dict]:
    return [{"prompt_id": f"p{i}", "mean_reward": r, "passed": b, "pass_rate": float(b),
             "samples": 4} for i, (r, b) in enumerate(zip(rewards, passed))]


def evidence(reward_deltas=(0.25,) * 4 + (0.0,) * 4, pass_deltas=(1,) * 4 + (0,) * 4,
             paired=True, identical=0):
    """docs/design.md §5's reference case (eligible) with per-prompt re-test records: the
    baseline scores 0.25 and fails on every prompt, the candidate adds the deltas given."""
    n = len(reward_deltas)
    document = {
        "status": "ok", "contract": {"admitted": True, "failed_checks": []},
        "rollout": {"group_size": 4, "reward_groups": [[0, 1, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0],
                                                       [0, 0, 1, 1]],
                    "rollout_seconds": 4.0, "max_length_hit_ratio": 0.05},
        "update": {"update_count": 2, "update_seconds": 2.0},
        "comparison": {"reward_mean_gain": 0.1, "pass_at_group_gain": 0.1,
                       "baseline": {"max_length_hit_ratio": 0.02,
                                    "per_prompt": per_prompt([0.25] * n, [False] * n)},
                       "candidate": {"max_length_hit_ratio": 0.08, "per_prompt": per_prompt(
                           [0.25 + d for d in reward_deltas], [p > 0 for p in pass_deltas])},
                       "identical_completions": {"pairs": 4 * n, "identical": identical},
                       "drift": {"kl_to_baseline": 0.1}},
        "guard": {"enabled": False},  # the guard and KL gates pass: these tests are the gains'
        "resources": {"peak_allocated_bytes": 8000},
        "artifact": {"path": "adapter", "sha256": SHA, "source_policy_version": "p0"}}
    if paired:
        document["comparison"]["paired"] = {
            "reward_mean_gain": {"point": 0.1, "low": -0.05, "high": 0.3},
            "pass_at_group_gain": {"point": 0.1, "low": -0.25, "high": 0.5}}
    else:
        for policy in ("baseline", "candidate"):
            del document["comparison"][policy]["per_prompt"]
    return document


def rows(result):
    return {row["name"]: row for row in result["checks"]}


def test_off_reads_point_estimates():
    for gates in (GATES, dict(GATES, require_significant_gain=False)):
        result = decide_run(evidence(), gates)
        assert result["decision"] == "accept"
        assert rows(result)["reward"]["value"] == 0.1
        assert rows(result)["pass_at_group"]["value"] == 0.1
        assert gain_rule(gates) == "point estimate"
        assert "point estimate" in gain_rule_line(gates)


def test_the_default_profile_requires_significance_and_spec_5_does_not():
    assert Gates().require_significant_gain is True
    assert load_config("default").gates.require_significant_gain is True
    assert load_config("smoke").gates.require_significant_gain is True
    spec = load_config("gsm8k_qwen05b")
    assert spec.gates.require_significant_gain is False
    # The same evidence (4 of 8 prompts better, p = 1/16 > 0.025) under each profile's gates.
    default_gates = dataclasses.asdict(load_config("default").gates)
    spec_gates = dataclasses.asdict(spec.gates)
    assert decide_run(evidence(), default_gates)["failed_checks"] == ["reward", "pass_at_group"]
    assert decide_run(evidence(), spec_gates)["decision"] == "accept"
    assert gain_rule(default_gates) == "paired sign-flip test"
    assert "require_significant_gain = true" in gain_rule_line(default_gates)
    assert "accepts a candidate whose gain is zero" in gain_rule_line(spec_gates)


def test_four_of_four_differing_prompts_do_not_pass_six_of_six_do():
    """Under no gain each differing prompt's sign is a fair coin: 4 of 4 in the candidate's
    favour have probability 1/2^4 = 1/16 = 0.0625 > 0.025 (not significant), 6 of 6 have
    1/2^6 = 1/64 = 0.015625 <= 0.025 (significant). Zero differences carry no sign."""
    four = decide_run(evidence(), SIGNIFICANT)
    assert rows(four)["reward"]["value"] == 1 / 16
    assert rows(four)["reward"]["test"]["differing_prompts"] == 4
    assert rows(four)["reward"]["test"]["exact"] is True
    assert four["failed_checks"] == ["reward", "pass_at_group"]
    six = decide_run(evidence((0.25,) * 6 + (0.0,) * 2, (1,) * 6 + (0,) * 2), SIGNIFICANT)
    assert rows(six)["reward"]["value"] == 1 / 64
    assert rows(six)["pass_at_group"]["value"] == 1 / 64
    assert six["decision"] == "accept"
    assert rows(six)["reward"]["test"]["interval_95"] == [-0.05, 0.3]
    assert evaluate_grpo_candidate(evidence(), SIGNIFICANT)["failed_checks"] == [
        "reward", "pass_at_group"]
    # No per-prompt records: the significant-gain checks cannot pass.
    assert decide_run(evidence(paired=False), SIGNIFICANT)["failed_checks"] == [
        "reward", "pass_at_group"]


def test_pass_at_group_nine_to_one_is_the_exact_mcnemar_p():
    """10 discordant prompts split 9 : 1 for the candidate: the exact one-sided McNemar p is
    P(X >= 9 | Binomial(10, 1/2)) = (C(10,9) + C(10,10)) / 2^10 = (10 + 1) / 1024 = 0.0107421875.
    The sign-flip sum of ten +/-1 reaches the observed 9 - 1 = 8 when at most one is -1: the
    same 11 patterns of 1024."""
    result = sign_flip_test([1.0] * 9 + [-1.0] + [0.0] * 6)
    assert result["p_value"] == 11 / 1024
    document = evidence((0.0,) * 16, (1,) * 9 + (-1,) + (0,) * 6)
    document["comparison"]["baseline"]["per_prompt"][9]["passed"] = True
    document["comparison"]["candidate"]["per_prompt"][9]["passed"] = False
    assert rows(decide_run(document, SIGNIFICANT))["pass_at_group"]["value"] == 11 / 1024


def test_a_margin_is_tested_strictly():
    """minimum_reward_gain 0.1 on deltas 0.25 x 6 and 0 x 2: the test flips x = delta - 0.1,
    i.e. 0.15 x 6 and -0.1 x 2, observed sum 0.9 - 0.2 = 0.7. With a of the six 0.15 flipped
    negative the sum is 0.9 - 0.3a plus one of -0.2, 0, 0, +0.2 from the two -0.1: a = 0 reaches
    0.7 in all 4 patterns, a = 1 (6 ways) only with +0.2 (0.8), a >= 2 never (at most 0.5).
    p = (4 + 6) / 2^8 = 10 / 256 = 0.0390625 > 0.025: not significant, although the same
    deltas against a margin of 0 give p = 1/64 and pass."""
    deltas, passes = (0.25,) * 6 + (0.0,) * 2, (1,) * 6 + (0,) * 2
    row = rows(decide_run(evidence(deltas, passes), dict(SIGNIFICANT, minimum_reward_gain=0.1)))[
        "reward"]
    assert row["value"] == pytest.approx(10 / 256, abs=1e-12)
    assert row["passed"] is False
    assert row["test"]["margin"] == 0.1
    assert row["threshold"] == "p <= 0.025 (H0: gain <= 0.1)"
    assert rows(decide_run(evidence(deltas, passes), SIGNIFICANT))["reward"]["passed"] is True


def test_no_gain_is_never_significant_at_any_sparsity():
    """The issue's table, under the new rule: k of 128 prompts differ, each by 0.25 or 0.5 of
    random sign (true gain 0). A one-sided 2.5 % test passes at most 0.025 of the trials, plus
    three binomial standard errors of 1,000 trials (3 * sqrt(0.025 * 0.975 / 1000) = 0.0148).
    The bootstrap's inclusive lower bound passed 0.500 at k = 1 and 0.065 at k = 4."""
    rng = np.random.default_rng(54)
    trials = 1000
    bound = 0.025 + 3 * (0.025 * 0.975 / trials) ** 0.5
    for k in (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32):
        passes = 0
        for trial in range(trials):
            deltas = np.zeros(128)
            deltas[:k] = rng.choice([0.25, 0.5], k) * rng.choice([-1.0, 1.0], k)
            passes += significant(sign_flip_test(deltas, seed=trial))
        assert passes / trials <= bound, (k, passes)
    assert sign_flip_test(np.zeros(128))["p_value"] == 1.0


def test_an_identical_retest_is_no_effective_update_under_either_rule():
    for gates in (SIGNIFICANT, GATES):
        document = evidence((0.0,) * 8, (0,) * 8, identical=32)
        result = decide_run(document, gates)
        assert result["decision"] == "reject"
        assert "effective_update" in result["failed_checks"]
        assert rows(result)["effective_update"]["value"] == 0
    assert decide_run(evidence(identical=31), GATES)["decision"] == "accept"


def test_validate_gates_accepts_only_a_boolean_switch():
    assert validate_gates(dict(GATES, require_significant_gain=True))[
        "require_significant_gain"] is True
    assert "require_significant_gain" not in validate_gates(GATES)  # optional: absent means off
    for bad in (1, "true", None):
        with pytest.raises(InputError, match="must be true or false"):
            validate_gates(dict(GATES, require_significant_gain=bad))


def test_config_switch_from_the_command_line():
    config = load_config("smoke", overrides=["gates.require_significant_gain=true"])
    assert config.gates.require_significant_gain is True
    with pytest.raises(InputError, match="require_significant_gain"):
        load_config("smoke", overrides=["gates.require_significant_gain=1"])


def test_synthetic_run_hand_computed_intervals(tmp_path):
    """Per-prompt reward deltas are 0.5 and 0.25, so each bootstrap mean is 0.5, 0.375 or 0.25
    with probabilities 1/4, 1/2, 1/4: the 95 % interval is [0.25, 0.5]. pass@group deltas are
    1 and 0: interval [0, 1] around 0.5. A reward gate of 0.3 is cleared by the point estimate
    (0.375); the sign-flip test of "gain <= 0.3" flips x = 0.2 and -0.05, whose signed sums
    0.15, 0.25, -0.25, -0.15 reach the observed 0.15 in 2 of 4 patterns: p = 0.5, tune."""
    run_dir = write_synthetic_run(tmp_path / "plain", minimum_reward_gain=0.3,
                                  require_significant_gain=False)
    plain = json.loads((run_dir / "evidence.json").read_text())
    paired = plain["comparison"]["paired"]
    assert (paired["reward_mean_gain"]["point"], paired["reward_mean_gain"]["low"],
            paired["reward_mean_gain"]["high"]) == (0.375, 0.25, 0.5)
    assert (paired["pass_at_group_gain"]["point"], paired["pass_at_group_gain"]["low"],
            paired["pass_at_group_gain"]["high"]) == (0.5, 0.0, 1.0)
    assert plain["decision"]["decision"] == "accept"

    run_dir = write_synthetic_run(tmp_path / "significant", minimum_reward_gain=0.3,
                                  require_significant_gain=True)
    significant_run = json.loads((run_dir / "evidence.json").read_text())
    assert significant_run["config"]["gates"]["require_significant_gain"] is True
    assert significant_run["decision"]["decision"] == "tune"
    assert "reward" in significant_run["decision"]["failed_checks"]
    assert rows(significant_run["decision"])["reward"]["value"] == 0.5
    # The audit re-derives the same decision, test included, from the stored completions.
    audit = audit_run(run_dir)
    assert audit["agrees"] is True and audit["decision"] == "tune"
    assert audit["gain_rule"] == "paired sign-flip test"
    assert audit_run(tmp_path / "plain" / "run")["gain_rule"] == "point estimate"


def test_lora_b_all_zero_reads_the_adapter_weights(tmp_path):
    """A LoRA with every B = 0 (either zero sign) adds B A = 0 to each weight: the baseline's
    function exactly. One B entry of 1e-30 (not zero in float32) makes it a change."""
    from synthetic_run import safetensors_bytes

    from grpogate.files.tensors import lora_b_all_zero

    cases = {"zero": ({"q.lora_A.weight": [0.5, -1.0], "q.lora_B.weight": [0.0, -0.0]}, True),
             "tiny": ({"q.lora_A.weight": [0.5, -1.0], "q.lora_B.weight": [0.0, 1e-30]}, False),
             "no B": ({"q.lora_A.weight": [0.0, 0.0]}, False)}
    for name, (tensors, expected) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(safetensors_bytes(tensors))
        assert lora_b_all_zero(path) is expected, name


def test_the_detectable_gain_by_hand_and_recomputed_by_decide(tmp_path):
    """Deltas 1, 0, 0, 1: mean 0.5, sample sd sqrt(4 * 0.25 / 3) = 0.577350; the gain this
    re-test detects with probability 0.8 at one-sided 2.5 % is (z_0.975 + z_0.8) * sd / sqrt(n)
    = (1.959964 + 0.841621) * 0.577350 / 2 = 0.808748 (normal approximation). With a margin
    of 0.1 it is 0.1 higher; for the guard's `less` side it is the margin minus the same."""
    from grpogate.evidence.significance import detectable_difference

    assert sign_flip_test([1, 0, 0, 1])["detectable_difference"] == pytest.approx(0.808748,
                                                                                  abs=1e-6)
    assert detectable_difference([1, 0, 0, 1], 0.1) == pytest.approx(0.908748, abs=1e-6)
    assert detectable_difference([1, 0, 0, 1], -0.1, "less") == pytest.approx(-0.908748, abs=1e-6)
    assert detectable_difference([0.0] * 8) is None  # no spread: nothing to estimate it from
    # The synthetic run's reward deltas 0.5, 0.25: sd sqrt(2 * 0.125^2) = 0.176777, and
    # 2.801585 * 0.176777 / sqrt(2) = 0.350198; decide recomputes it with the decision.
    run_dir = write_synthetic_run(tmp_path, require_significant_gain=True)
    row = rows(json.loads((run_dir / "evidence.json").read_text())["decision"])["reward"]
    assert row["test"]["detectable_difference"] == pytest.approx(0.350198, abs=1e-6)
    audit = audit_run(run_dir)
    assert audit["agrees"] is True
    assert rows(audit)["reward"]["test"]["detectable_difference"] == pytest.approx(0.350198,
                                                                                   abs=1e-6)
