"""The `require_significant_gain` gate: on in the default profile (docs/design.md §6: `accept` on the
default means a gain its re-test resolves), off in the reference profile and in a gates table that
does not name it (the published gates keep their meaning); on, the reward and pass_at_group
checks read the paired bootstrap lower bound. The run's output, `decide` and the report say
which rule decided."""

import dataclasses
import json

import pytest
from synthetic_run import write_synthetic_run

from grpogate.evidence.audit import audit_run
from grpogate.config import Gates, load_config
from grpogate.evidence.decisions import (decide_run, evaluate_grpo_candidate, gain_rule,
                                         gain_rule_line, validate_gates)
from grpogate.errors import InputError

SHA = "0123456789abcdef" * 4
GATES = {"minimum_valid_group_ratio": 0.25, "minimum_effective_trajectories_per_second": 1.0,
         "minimum_update_count": 1, "minimum_reward_gain": 0.0, "minimum_pass_at_group_gain": 0.0,
         "maximum_max_length_hit_ratio": 0.10, "maximum_peak_allocated_bytes": 10000}


def evidence(reward_low=-0.05, pass_low=-0.25, paired=True):
    """docs/design.md §5's reference case (eligible) whose gains 0.1 / 0.1 have intervals reaching below 0."""
    document = {
        "status": "ok", "contract": {"admitted": True, "failed_checks": []},
        "rollout": {"group_size": 4, "reward_groups": [[0, 1, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0],
                                                       [0, 0, 1, 1]],
                    "rollout_seconds": 4.0, "max_length_hit_ratio": 0.05},
        "update": {"update_count": 2, "update_seconds": 2.0},
        "comparison": {"reward_mean_gain": 0.1, "pass_at_group_gain": 0.1,
                       "baseline": {"max_length_hit_ratio": 0.02},
                       "candidate": {"max_length_hit_ratio": 0.08},
                       "drift": {"kl_to_baseline": 0.1}},
        "guard": {"enabled": False},  # the guard and KL gates pass: these tests are the gains'
        "resources": {"peak_allocated_bytes": 8000},
        "artifact": {"path": "adapter", "sha256": SHA, "source_policy_version": "p0"}}
    if paired:
        document["comparison"]["paired"] = {
            "reward_mean_gain": {"point": 0.1, "low": reward_low, "high": 0.3},
            "pass_at_group_gain": {"point": 0.1, "low": pass_low, "high": 0.5}}
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
    # The same evidence (gains 0.1 / 0.1, intervals reaching below 0) under each profile's gates.
    default_gates = dataclasses.asdict(load_config("default").gates)
    spec_gates = dataclasses.asdict(spec.gates)
    assert decide_run(evidence(), default_gates)["failed_checks"] == ["reward", "pass_at_group"]
    assert decide_run(evidence(), spec_gates)["decision"] == "accept"
    assert gain_rule(default_gates) == "bootstrap lower bound"
    assert "require_significant_gain = true" in gain_rule_line(default_gates)


def test_on_reads_the_bootstrap_lower_bound():
    gates = dict(GATES, require_significant_gain=True)
    result = decide_run(evidence(), gates)
    assert result["decision"] == "tune"
    assert result["failed_checks"] == ["reward", "pass_at_group"]
    assert rows(result)["reward"]["value"] == -0.05
    assert rows(result)["pass_at_group"]["value"] == -0.25
    assert evaluate_grpo_candidate(evidence(), gates)["failed_checks"] == ["reward",
                                                                           "pass_at_group"]
    # Inclusive minimum: a lower bound exactly at the gate clears it.
    assert decide_run(evidence(reward_low=0.0, pass_low=0.0), gates)["decision"] == "accept"
    # No paired statistics: the significant-gain checks cannot pass.
    assert decide_run(evidence(paired=False), gates)["failed_checks"] == ["reward",
                                                                         "pass_at_group"]


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
    (0.375) but not by the lower bound (0.25)."""
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
    significant = json.loads((run_dir / "evidence.json").read_text())
    assert significant["config"]["gates"]["require_significant_gain"] is True
    assert significant["decision"]["decision"] == "tune"
    assert significant["decision"]["failed_checks"] == ["reward"]
    assert rows(significant["decision"])["reward"]["value"] == 0.25
    # The audit re-derives the same decision from the stored gates.
    audit = audit_run(run_dir)
    assert audit["agrees"] is True and audit["decision"] == "tune"
    assert audit["gain_rule"] == "bootstrap lower bound"
    assert audit_run(tmp_path / "plain" / "run")["gain_rule"] == "point estimate"
