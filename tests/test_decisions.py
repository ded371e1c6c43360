"""Decisions: the reference cases with hand-computed values, the decision matrices, gate
validation, and that junk evidence fails checks instead of crashing."""

import copy
import doctest
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import grpogate.evidence.decisions as decisions
from grpogate.evidence.decisions import (
    GATE_NAMES,
    check_rollout_contract,
    decide_grpo_delivery,
    decide_run,
    evaluate_grpo_candidate,
    run_checks,
    validate_gates,
)
from grpogate.errors import InputError

SHA = "0123456789abcdef" * 4

# The reference gates.
GATES = {
    "minimum_valid_group_ratio": 0.25,
    "minimum_effective_trajectories_per_second": 1.0,
    "minimum_update_count": 1,
    "minimum_reward_gain": 0.0,
    "minimum_pass_at_group_gain": 0.0,
    "maximum_max_length_hit_ratio": 0.10,
    "maximum_peak_allocated_bytes": 10000,
}


def reference_evidence():
    """The reference case, plus the whole-run fields (contract, eval truncation, artifact)."""
    return {
        "status": "ok",
        "contract": {"admitted": True, "failed_checks": []},
        "rollout": {
            "group_size": 4,
            "reward_groups": [[0, 1, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 1, 1]],
            "rollout_seconds": 4.0,
            "max_length_hit_ratio": 0.05,
        },
        "update": {"update_count": 2, "update_seconds": 2.0},
        "comparison": {
            "reward_mean_gain": 0.1,
            "pass_at_group_gain": 0.1,
            "baseline": {"max_length_hit_ratio": 0.02},
            "candidate": {"max_length_hit_ratio": 0.08},
        },
        "resources": {"peak_allocated_bytes": 8000},
        "artifact": {"path": "runs/r1/adapter", "sha256": SHA, "source_policy_version": "p0"},
    }


def group(prompt_id, trace_ids, policy="p1", verifier="v1"):
    return {"prompt_id": prompt_id, "source_policy_version": policy, "verifier_version": verifier,
            "trace_ids": list(trace_ids)}


def contract(groups, size=4):
    return check_rollout_contract(groups, "p1", "v1", size)


# --- rollout contract -----------------------------------------------------------------------

def test_contract_two_clean_groups_admitted():
    groups = [group("a", ["a0", "a1", "a2", "a3"]), group("b", ["b0", "b1", "b2", "b3"])]
    assert contract(groups) == {"admitted": True, "failed_checks": []}


def test_contract_wrong_policy_version():
    groups = [group("a", ["a0", "a1", "a2", "a3"], policy="p0"), group("b", ["b0", "b1", "b2", "b3"])]
    assert contract(groups) == {"admitted": False, "failed_checks": ["policy_version"]}


def test_contract_wrong_verifier_version():
    groups = [group("a", ["a0", "a1", "a2", "a3"], verifier="v0")]
    assert contract(groups) == {"admitted": False, "failed_checks": ["verifier_version"]}


def test_contract_trace_reused_across_groups_fails_only_unique_traces():
    groups = [group("a", ["t0", "t1", "t2", "t3"]), group("b", ["t3", "b1", "b2", "b3"])]
    assert contract(groups)["failed_checks"] == ["unique_traces"]
    assert contract(groups)["admitted"] is False


def test_contract_empty_group_list():
    assert contract([]) == {"admitted": False, "failed_checks": ["groups"]}
    assert contract(None) == {"admitted": False, "failed_checks": ["groups"]}


def test_contract_group_size_and_prompt_identity():
    assert contract([group("a", ["a0", "a1", "a2"])])["failed_checks"] == ["group_size"]
    assert contract([group("", ["a0", "a1", "a2", "a3"])])["failed_checks"] == ["prompt_identity"]
    assert contract([group("a", ["a0", "a1"])], size=0)["failed_checks"] == ["group_size"]
    assert contract([group("a", ["a0", "a1"])], size=2.0)["failed_checks"] == ["group_size"]


def test_contract_failures_are_reported_in_spec_order():
    groups = [group(None, ["x", "x", "y"], policy="p0", verifier="v0")]
    assert contract(groups)["failed_checks"] == [
        "prompt_identity", "policy_version", "verifier_version", "group_size", "unique_traces"]


def test_contract_malformed_groups_fail_instead_of_crashing():
    result = contract(["not a group", {}])
    assert result["admitted"] is False
    assert result["failed_checks"] == ["prompt_identity", "policy_version", "verifier_version",
                                       "group_size"]
    # a trace without a usable id cannot be shown unique
    assert contract([group("a", ["a0", None, "a2", "a3"])])["failed_checks"] == ["unique_traces"]
    # an unset expectation never matches, even a group that is unset too
    assert check_rollout_contract([group("a", ["a0"], policy=None)], None, "v1", 1)[
        "failed_checks"] == ["policy_version"]


# --- candidate gates ------------------------------------------------------------------------

def test_candidate_reference_case():
    result = evaluate_grpo_candidate(reference_evidence(), GATES)
    # valid groups: [0,1,0,1] and [0,0,1,1] -> 2 of 4; 2 x G=4 = 8 trajectories over 4 s + 2 s
    assert result == {
        "eligible": True,
        "valid_group_ratio": 0.5,
        "effective_trajectory_count": 8,
        "effective_trajectories_per_second": pytest.approx(8 / 6),
        "failed_checks": [],
    }


def test_candidate_no_effective_update():
    evidence = reference_evidence()
    evidence["status"] = "no_effective_update"
    evidence["rollout"]["reward_groups"] = [[0, 0, 0, 0]] * 4
    evidence["update"]["update_count"] = 0
    result = evaluate_grpo_candidate(evidence, GATES)
    assert result["eligible"] is False
    assert result["valid_group_ratio"] == 0.0
    assert result["effective_trajectory_count"] == 0
    assert result["effective_trajectories_per_second"] == 0.0
    # zero valid trajectories also miss the 1.0 traj/s gate
    assert result["failed_checks"] == ["execution", "effective_groups", "effective_throughput",
                                       "updates"]


def test_candidate_groups_of_wrong_length():
    evidence = reference_evidence()
    evidence["rollout"]["reward_groups"] = [[0, 1, 0], [1, 0], [0, 1, 1, 0, 1]]
    result = evaluate_grpo_candidate(evidence, GATES)
    assert result["valid_group_ratio"] == 0.0
    assert result["effective_trajectory_count"] == 0
    assert result["eligible"] is False


@pytest.mark.parametrize("section, key, value, failed", [
    ("rollout", "max_length_hit_ratio", 0.5, "truncation"),
    ("resources", "peak_allocated_bytes", 20000, "memory"),
    ("comparison", "reward_mean_gain", -0.01, "reward"),
    ("comparison", "pass_at_group_gain", -0.01, "pass_at_group"),
    ("update", "update_count", 0, "updates"),
])
def test_candidate_single_gate_failures(section, key, value, failed):
    evidence = reference_evidence()
    evidence[section][key] = value
    result = evaluate_grpo_candidate(evidence, GATES)
    assert result["eligible"] is False
    assert result["failed_checks"] == [failed]


def test_candidate_gates_are_inclusive():
    evidence = reference_evidence()
    evidence["rollout"]["reward_groups"][1] = [0, 1, 1, 1]  # 3 of 4 valid -> 12 trajectories
    evidence["rollout"]["rollout_seconds"] = 10.0  # 12 / (10 + 2) = exactly 1.0 per second
    evidence["rollout"]["max_length_hit_ratio"] = 0.10
    evidence["update"]["update_count"] = 1
    evidence["comparison"].update(reward_mean_gain=0.0, pass_at_group_gain=0.0)
    evidence["resources"]["peak_allocated_bytes"] = 10000
    gates = dict(GATES, minimum_valid_group_ratio=0.75)
    result = evaluate_grpo_candidate(evidence, gates)
    assert result["effective_trajectories_per_second"] == 1.0
    assert result["eligible"] is True, result["failed_checks"]


def test_candidate_throughput_counts_verification_seconds():
    evidence = reference_evidence()
    evidence["rollout"]["verification_seconds"] = 2.0
    result = evaluate_grpo_candidate(evidence, GATES)
    assert result["effective_trajectories_per_second"] == 1.0  # 8 / (4 + 2 + 2)
    evidence["rollout"]["verification_seconds"] = 3.0
    assert evaluate_grpo_candidate(evidence, GATES)["failed_checks"] == ["effective_throughput"]


def test_candidate_zero_seconds_gives_zero_throughput():
    evidence = reference_evidence()
    evidence["rollout"]["rollout_seconds"] = 0.0
    evidence["update"]["update_seconds"] = 0
    result = evaluate_grpo_candidate(evidence, dict(GATES, minimum_effective_trajectories_per_second=0))
    assert result["effective_trajectories_per_second"] == 0.0
    assert result["eligible"] is True


@pytest.mark.parametrize("mutate, failed", [
    (lambda e: e["comparison"].pop("reward_mean_gain"), ["reward"]),
    (lambda e: e["comparison"].update(pass_at_group_gain=float("nan")), ["pass_at_group"]),
    (lambda e: e["resources"].update(peak_allocated_bytes=None), ["memory"]),
    (lambda e: e["rollout"].update(max_length_hit_ratio="0.05"), ["truncation"]),
    (lambda e: e["update"].update(update_count=True), ["updates"]),
    (lambda e: e["rollout"].pop("rollout_seconds"), ["effective_throughput"]),
    (lambda e: e["rollout"].update(verification_seconds=None), ["effective_throughput"]),
    (lambda e: e["rollout"].update(reward_groups=None), ["effective_groups", "effective_throughput"]),
    (lambda e: e["rollout"].update(group_size="4"), ["effective_groups", "effective_throughput"]),
    (lambda e: e.pop("status"), ["execution"]),
])
def test_candidate_missing_or_nan_fails_the_check(mutate, failed):
    evidence = reference_evidence()
    mutate(evidence)
    # zero gates: only an unreadable value can fail, never the measured one
    zero_gates = dict.fromkeys(GATE_NAMES, 0.0) | {"maximum_max_length_hit_ratio": 1.0,
                                                    "maximum_peak_allocated_bytes": 1e12}
    assert evaluate_grpo_candidate(evidence, zero_gates)["failed_checks"] == failed


def test_candidate_missing_gate_fails_its_check():
    gates = {k: v for k, v in GATES.items() if k != "maximum_peak_allocated_bytes"}
    assert evaluate_grpo_candidate(reference_evidence(), gates)["failed_checks"] == ["memory"]
    gates = dict(GATES, minimum_update_count=float("nan"))
    assert evaluate_grpo_candidate(reference_evidence(), gates)["failed_checks"] == ["updates"]


# --- delivery ---------------------------------------------------------------------------------

ADMITTED, NOT_ADMITTED = {"admitted": True}, {"admitted": False}
ELIGIBLE, NOT_ELIGIBLE = {"eligible": True}, {"eligible": False}
ARTIFACT, NO_ARTIFACT = {"path": "adapter/", "sha256": SHA}, {"path": "", "sha256": SHA}


@pytest.mark.parametrize("rollout, candidate, artifact, decision, failed", [
    (ADMITTED, ELIGIBLE, ARTIFACT, "accept", []),
    (ADMITTED, NOT_ELIGIBLE, ARTIFACT, "tune", ["candidate"]),
    (NOT_ADMITTED, ELIGIBLE, ARTIFACT, "reject", ["rollout"]),
    (ADMITTED, ELIGIBLE, NO_ARTIFACT, "reject", ["artifact"]),
    (NOT_ADMITTED, NOT_ELIGIBLE, ARTIFACT, "reject", ["rollout", "candidate"]),
    (ADMITTED, NOT_ELIGIBLE, NO_ARTIFACT, "reject", ["candidate", "artifact"]),
    (NOT_ADMITTED, NOT_ELIGIBLE, NO_ARTIFACT, "reject", ["rollout", "candidate", "artifact"]),
    (ADMITTED, ELIGIBLE, {"path": "adapter/"}, "reject", ["artifact"]),
    (ADMITTED, ELIGIBLE, None, "reject", ["artifact"]),
    ({"admitted": "yes"}, {"eligible": 1}, ARTIFACT, "reject", ["rollout", "candidate"]),
])
def test_delivery_matrix(rollout, candidate, artifact, decision, failed):
    assert decide_grpo_delivery(rollout, candidate, artifact) == {"decision": decision,
                                                                  "failed_checks": failed}


def test_delivery_from_real_results():
    groups = [group("a", ["a0", "a1", "a2", "a3"]), group("b", ["b0", "b1", "b2", "b3"])]
    rollout = contract(groups)
    candidate = evaluate_grpo_candidate(reference_evidence(), GATES)
    assert decide_grpo_delivery(rollout, candidate, ARTIFACT)["decision"] == "accept"


# --- whole run --------------------------------------------------------------------------------

RUN_CHECKS = ["contract", "execution", "effective_groups", "effective_throughput", "updates",
              "reward", "pass_at_group", "truncation", "length_budget", "memory", "artifact"]


def test_run_accepts_reference_evidence():
    result = decide_run(reference_evidence(), GATES)
    assert result["decision"] == "accept"
    assert result["failed_checks"] == []
    assert [row["name"] for row in result["checks"]] == RUN_CHECKS
    assert [row["on_fail"] for row in result["checks"]] == (
        ["reject", "reject"] + ["tune"] * 8 + ["reject"])
    rows = {row["name"]: row for row in result["checks"]}
    assert rows["effective_groups"]["value"] == 0.5
    assert rows["effective_groups"]["threshold"] == 0.25
    assert rows["effective_throughput"]["value"] == pytest.approx(8 / 6)
    assert rows["length_budget"]["value"] == 0.08  # the larger of 0.02 and 0.08
    assert rows["memory"] == {"name": "memory", "value": 8000, "threshold": 10000,
                              "passed": True, "on_fail": "tune"}
    json.dumps(result, allow_nan=False)  # the gates table is strict JSON
    assert run_checks(reference_evidence(), GATES) == result["checks"]


def _set(path, value):
    def mutate(evidence):
        *parents, key = path
        target = evidence
        for parent in parents:
            target = target[parent]
        target[key] = value
    return mutate


@pytest.mark.parametrize("mutations, decision, failed", [
    ([_set(["contract", "admitted"], False)], "reject", ["contract"]),
    ([_set(["status"], "no_effective_update")], "reject", ["execution"]),
    ([_set(["artifact", "sha256"], "abc")], "reject", ["artifact"]),
    ([_set(["artifact", "source_policy_version"], "")], "reject", ["artifact"]),
    ([_set(["artifact", "path"], None)], "reject", ["artifact"]),
    ([_set(["comparison", "reward_mean_gain"], -0.2)], "tune", ["reward"]),
    ([_set(["comparison", "candidate", "max_length_hit_ratio"], 0.2)], "tune", ["length_budget"]),
    ([_set(["comparison", "baseline", "max_length_hit_ratio"], 0.2)], "tune", ["length_budget"]),
    ([_set(["rollout", "max_length_hit_ratio"], 0.5)], "tune", ["truncation"]),
    ([_set(["resources", "peak_allocated_bytes"], 20000)], "tune", ["memory"]),
    ([_set(["comparison", "baseline"], None)], "tune", ["length_budget"]),
    # reject beats tune, and every failing name is listed in check order
    ([_set(["resources", "peak_allocated_bytes"], 20000), _set(["artifact", "sha256"], "")],
     "reject", ["memory", "artifact"]),
    ([_set(["comparison", "pass_at_group_gain"], -1.0), _set(["contract", "admitted"], None)],
     "reject", ["contract", "pass_at_group"]),
])
def test_run_decision_matrix(mutations, decision, failed):
    evidence = reference_evidence()
    for mutate in mutations:
        mutate(evidence)
    result = decide_run(evidence, GATES)
    assert (result["decision"], result["failed_checks"]) == (decision, failed)


def test_run_no_effective_update_is_rejected():
    evidence = reference_evidence()
    evidence["status"] = "no_effective_update"
    evidence["rollout"]["reward_groups"] = [[0, 0, 0, 0]] * 4
    evidence["update"]["update_count"] = 0
    result = decide_run(evidence, GATES)
    assert result["decision"] == "reject"
    assert result["failed_checks"] == ["execution", "effective_groups", "effective_throughput",
                                       "updates"]


def test_run_on_empty_evidence_rejects_with_every_check_failing():
    result = decide_run({}, {})
    assert result["decision"] == "reject"
    assert result["failed_checks"] == RUN_CHECKS
    json.dumps(result, allow_nan=False)


# --- gates ------------------------------------------------------------------------------------

def test_validate_gates_returns_floats():
    validated = validate_gates(GATES)
    assert validated == {name: float(GATES[name]) for name in GATE_NAMES}
    assert all(type(value) is float for value in validated.values())
    assert validate_gates(dict(GATES, minimum_reward_gain=-0.02))["minimum_reward_gain"] == -0.02


@pytest.mark.parametrize("gates, message", [
    (dict(GATES, minimum_valid_ratio=0.2), "unknown gate 'minimum_valid_ratio'"),
    ({k: v for k, v in GATES.items() if k != "minimum_update_count"}, "minimum_update_count"),
    (dict(GATES, minimum_update_count="1"), "must be a number"),
    (dict(GATES, minimum_update_count=True), "must be a number"),
    (dict(GATES, maximum_peak_allocated_bytes=None), "must be a number"),
    (dict(GATES, maximum_max_length_hit_ratio=float("nan")), "finite"),
    (dict(GATES, maximum_peak_allocated_bytes=math.inf), "finite"),
    (dict(GATES, minimum_valid_group_ratio=-0.1), ">= 0"),
    (dict(GATES, maximum_peak_allocated_bytes=-1), ">= 0"),
    ([], "gates must be a table"),
])
def test_validate_gates_rejects(gates, message):
    with pytest.raises(InputError, match=message):
        validate_gates(gates)


def test_unknown_gate_message_lists_the_known():
    with pytest.raises(InputError) as error:
        validate_gates(dict(GATES, bogus=1))
    assert all(name in str(error.value) for name in GATE_NAMES)


# --- properties -------------------------------------------------------------------------------

KEYS = ["status", "contract", "rollout", "update", "comparison", "resources", "artifact",
        "admitted", "group_size", "reward_groups", "rollout_seconds", "verification_seconds",
        "max_length_hit_ratio", "update_count", "update_seconds", "reward_mean_gain",
        "pass_at_group_gain", "baseline", "candidate", "peak_allocated_bytes", "path", "sha256",
        "source_policy_version", "prompt_id", "trace_ids", "eligible", *GATE_NAMES]
scalars = (st.none() | st.booleans() | st.integers(min_value=-10**400, max_value=10**400)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
           | st.sampled_from(["ok", "p1", "v1", SHA]))
junk = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4), children, max_size=6),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(evidence=junk, gates=junk)
def test_decisions_never_crash_on_junk(evidence, gates):
    before = copy.deepcopy((evidence, gates))
    candidate = evaluate_grpo_candidate(evidence, gates)
    assert isinstance(candidate["eligible"], bool)
    run = decide_run(evidence, gates)
    assert run["decision"] in ("accept", "tune", "reject")
    assert [row["name"] for row in run["checks"]] == RUN_CHECKS
    json.dumps(run, allow_nan=False)
    assert decide_run(evidence, gates) == run  # deterministic
    contract_result = check_rollout_contract(evidence, gates, evidence, gates)
    assert isinstance(contract_result["admitted"], bool)
    delivery = decide_grpo_delivery(evidence, gates, evidence)
    assert delivery["decision"] in ("accept", "tune", "reject")
    assert repr((evidence, gates)) == repr(before)  # inputs are not mutated


@settings(max_examples=200, deadline=None)
@given(groups=st.lists(junk | st.fixed_dictionaries({
    "prompt_id": scalars, "source_policy_version": scalars, "verifier_version": scalars,
    "trace_ids": st.lists(scalars, max_size=5)}), max_size=5),
    size=scalars)
def test_contract_never_crashes_and_admits_only_clean_groups(groups, size):
    result = check_rollout_contract(groups, "p1", "v1", size)
    assert result == check_rollout_contract(groups, "p1", "v1", size)
    if result["admitted"]:
        assert result["failed_checks"] == []
        trace_ids = [t for g in groups for t in g["trace_ids"]]
        assert len(set(trace_ids)) == len(trace_ids)
        assert all(len(g["trace_ids"]) == size and g["source_policy_version"] == "p1"
                   for g in groups)


@settings(max_examples=200, deadline=None)
@given(reward_groups=st.lists(st.lists(st.sampled_from([0.0, 1.0]), min_size=1, max_size=6),
                              max_size=8),
       group_size=st.integers(min_value=1, max_value=6))
def test_valid_group_ratio_matches_a_direct_count(reward_groups, group_size):
    evidence = reference_evidence()
    evidence["rollout"]["reward_groups"] = reward_groups
    evidence["rollout"]["group_size"] = group_size
    result = evaluate_grpo_candidate(evidence, GATES)
    valid = sum(1 for g in reward_groups if len(g) == group_size and len(set(g)) > 1)
    assert result["effective_trajectory_count"] == valid * group_size
    assert result["valid_group_ratio"] == (valid / len(reward_groups) if reward_groups else 0.0)


@settings(max_examples=300, deadline=None)
@given(gates=junk | st.dictionaries(st.sampled_from(GATE_NAMES + decisions.SWITCH_GATE_NAMES),
                                    scalars, max_size=9))
def test_validate_gates_accepts_only_finite_gates_and_fails_only_with_input_error(gates):
    try:
        validated = validate_gates(gates)
    except InputError as error:
        assert "\n" not in str(error)  # one line for the CLI
        return
    assert set(GATE_NAMES) <= set(validated)
    for name in GATE_NAMES:
        assert isinstance(validated[name], float) and math.isfinite(validated[name])
        assert validated[name] >= 0 or name in ("minimum_reward_gain", "minimum_pass_at_group_gain")
    assert validate_gates(gates) == validated  # deterministic


def test_a_skipped_retest_passes_no_quality_gate():
    """An interrupted run records zero gains with "skipped": zeros never measured fail."""
    evidence = reference_evidence()
    evidence["status"] = "interrupted"
    evidence["comparison"] = {"skipped": True, "reward_mean_gain": 0.0, "pass_at_group_gain": 0.0,
                              "baseline": {"max_length_hit_ratio": 0.0},
                              "candidate": {"max_length_hit_ratio": 0.0}, "paired": {}}
    result = decide_run(evidence, GATES)
    assert result["decision"] == "reject"
    assert {"execution", "reward", "pass_at_group", "length_budget"} <= set(result["failed_checks"])
    evidence["status"] = "ok"
    assert decide_run(evidence, GATES)["decision"] == "tune"  # the quality checks still fail


@pytest.mark.parametrize("status", ["interrupted", "non_finite_update", "update_failed",
                                    "contract_failed", "no_effective_update"])
def test_every_unfinished_status_is_rejected_through_execution(status):
    evidence = reference_evidence()
    evidence["status"] = status
    result = decide_run(evidence, GATES)
    assert result["decision"] == "reject" and result["failed_checks"] == ["execution"]


def test_doctests():
    assert doctest.testmod(decisions).failed == 0
