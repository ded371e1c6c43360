"""The `require_significant_gain` gate: on in the default profile (docs/design.md §6: `accept` on the
default means a gain its re-test resolves), off in the reference profile and in a gates table that
does not name it (the published gates keep their meaning); on, the reward and pass_at_group
checks pass only when the anytime-valid betting test (evidence/anytime.py) shows "gain >
minimum" at 2.5 %. A candidate whose re-test equals the baseline's is rejected under either rule.
The run's output, `decide` and the report say which rule decided."""

import dataclasses
import math
import json

import numpy as np
import pytest
from synthetic_run import write_synthetic_run

from grpogate.evidence.audit import audit_run
from grpogate.config import Gates, load_config
from grpogate.evidence.decisions import (decide_run, evaluate_grpo_candidate, gain_rule,
                                         gain_rule_line, validate_gates)
from grpogate.evidence.anytime import (THRESHOLD, betting_test, confidence_bound, log_capital,
                                       resolvable_difference)
from grpogate.evidence.retest_checks import SEQUENTIAL_RULE
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
    baseline scores 0 and fails on every prompt, the candidate adds the deltas given."""
    n = len(reward_deltas)
    document = {
        "status": "ok", "contract": {"admitted": True, "failed_checks": []},
        "rollout": {"group_size": 4, "reward_groups": [[0, 1, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0],
                                                       [0, 0, 1, 1]],
                    "rollout_seconds": 4.0, "max_length_hit_ratio": 0.05},
        "update": {"update_count": 2, "update_seconds": 2.0},
        "comparison": {"reward_mean_gain": 0.1, "pass_at_group_gain": 0.1,
                       "baseline": {"max_length_hit_ratio": 0.02,
                                    "per_prompt": per_prompt([0.0] * n, [False] * n)},
                       "candidate": {"max_length_hit_ratio": 0.08, "per_prompt": per_prompt(
                           list(reward_deltas), [p > 0 for p in pass_deltas])},
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
    # The same evidence (4 of 8 prompts better by 0.25) under each profile's gates.
    default_gates = dataclasses.asdict(load_config("default").gates)
    spec_gates = dataclasses.asdict(spec.gates)
    assert decide_run(evidence(), default_gates)["failed_checks"] == ["reward", "pass_at_group"]
    assert decide_run(evidence(), spec_gates)["decision"] == "accept"
    assert gain_rule(default_gates) == SEQUENTIAL_RULE
    assert "require_significant_gain = true" in gain_rule_line(default_gates)
    assert "accepts a candidate whose gain is zero" in gain_rule_line(spec_gates)


def test_ten_full_gains_pass_nine_do_not():
    """Every prompt gains 1: on the unit scale x = 1 against m0 = 0.5 each stake c multiplies
    the capital by 1 - c + c / 0.5 = 1 + c. Nine prompts give mean (1 + c)^9 = 29.48 < 40 (not
    shown), ten give 52.18 >= 40 (shown); the row's value is the lower bound, where the capital
    falls to 40: -0.0389 for nine, +0.0312 for ten (test_anytime checks these by hand)."""
    nine = decide_run(evidence((1.0,) * 9, (1,) * 9), SIGNIFICANT)
    assert nine["failed_checks"] == ["reward", "pass_at_group"]
    assert rows(nine)["reward"]["value"] == pytest.approx(-0.038918, abs=1e-6)
    ten = decide_run(evidence((1.0,) * 10, (1,) * 10), SIGNIFICANT)
    assert ten["decision"] == "accept"
    assert rows(ten)["reward"]["value"] == pytest.approx(0.031228, abs=1e-6)
    assert rows(ten)["pass_at_group"]["test"]["status"] == "shown"
    assert rows(ten)["reward"]["threshold"] == "lower bound > 0"
    assert evaluate_grpo_candidate(evidence(), SIGNIFICANT)["failed_checks"] == [
        "reward", "pass_at_group"]
    # No per-prompt records: the significant-gain checks cannot pass.
    assert decide_run(evidence(paired=False), SIGNIFICANT)["failed_checks"] == [
        "reward", "pass_at_group"]


def test_a_margin_is_tested_strictly():
    """minimum_reward_gain 0.1: m0 = (0.1 + 1) / 2 = 0.55, each full gain multiplies by
    1 - c + c / 0.55. Ten prompts give 23.20 < 40 (not shown; eleven give 37.63, twelve
    61.88), although the same ten against a margin of 0 are shown."""
    deltas, passes = (1.0,) * 10, (1,) * 10
    row = rows(decide_run(evidence(deltas, passes), dict(SIGNIFICANT, minimum_reward_gain=0.1)))[
        "reward"]
    assert row["passed"] is False and row["test"]["margin"] == 0.1
    assert row["threshold"] == "lower bound > 0.1"
    assert row["value"] == pytest.approx(0.031228, abs=1e-6)  # the bound does not move
    assert rows(decide_run(evidence(deltas, passes), SIGNIFICANT))["reward"]["passed"] is True
    twelve = rows(decide_run(evidence((1.0,) * 12, (1,) * 12),
                             dict(SIGNIFICANT, minimum_reward_gain=0.1)))["reward"]
    assert twelve["passed"] is True


def test_no_gain_is_never_shown_at_any_sparsity():
    """k of 128 prompts differ, each by 0.25 or 0.5 of random sign (true gain 0). A one-sided
    2.5 % test passes at most 0.025 of the trials, plus three binomial standard errors of 1,000
    trials (3 * sqrt(0.025 * 0.975 / 1000) = 0.0148)."""
    rng = np.random.default_rng(54)
    trials = 1000
    bound = 0.025 + 3 * (0.025 * 0.975 / trials) ** 0.5
    for k in (1, 4, 8, 16, 32):
        passes = 0
        for _ in range(trials):
            deltas = np.zeros(128)
            deltas[:k] = rng.choice([0.25, 0.5], k) * rng.choice([-1.0, 1.0], k)
            passes += log_capital(deltas, 0.0) >= math.log(THRESHOLD)  # betting_test's rule
        assert passes / trials <= bound, (k, passes)
    assert betting_test(np.zeros(128))["rejected"] is False


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
    (0.375); two prompts cannot show it to the betting test: its lower bound stays far below
    (the capital at 0.3 is mean (1 - c + c 0.75 / 0.65)(1 - c + c 0.625 / 0.65) < 40): tune."""
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
    assert rows(significant_run["decision"])["reward"]["value"] == pytest.approx(
        confidence_bound([0.5, 0.25]), abs=1e-12)
    # The audit re-derives the same decision, test included, from the stored completions.
    audit = audit_run(run_dir)
    assert audit["agrees"] is True and audit["decision"] == "tune"
    assert audit["gain_rule"] == SEQUENTIAL_RULE
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


def test_the_resolvable_gain_by_a_scan_and_stated_by_decide(tmp_path):
    """The smallest gain a re-test resolves with probability 0.8: the least D for which some
    stake c (lam = c / 0.5 at margin 0) gets n (lam D' - lam^2 (s'^2 + D'^2) / 2) - 0.8416
    sqrt(n) lam s' past log 40 + log 16 = 6.461 (D' = D / 2, s' = s / 2 on the unit scale).
    A scan of D in steps of 1e-4 at s = 0.5, n = 100 finds it between 0.2417 and 0.2418."""
    def reached(gain):
        for fraction in [0.9 * 2 ** (-k / 2) for k in range(16)]:
            stake, unit_gain, unit_spread = fraction / 0.5, gain / 2, 0.25
            growth = stake * unit_gain - stake ** 2 * (unit_spread ** 2 + unit_gain ** 2) / 2
            if 100 * growth - 0.841621 * 10 * stake * unit_spread >= 6.461132:
                return True
        return False

    first = next(k / 10000 for k in range(1, 10000) if reached(k / 10000))
    assert first == pytest.approx(0.2418, abs=1e-4)
    assert resolvable_difference(0.5, 100) == pytest.approx(first, abs=1.5e-4)
    assert resolvable_difference(0.0, 100) is None  # no spread: nothing to plan from
    run_dir = write_synthetic_run(tmp_path, require_significant_gain=True)
    audit = audit_run(run_dir)
    assert audit["agrees"] is True
    test = rows(audit)["reward"]["test"]
    assert test["spread"] == pytest.approx(0.176777, abs=1e-6)  # deltas 0.5, 0.25
