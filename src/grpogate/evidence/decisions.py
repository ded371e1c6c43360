"""Decisions: the rollout contract, the candidate gates, and the delivery verdict.

Pure Python (no torch): plain dicts and numbers in, plain dicts out, so every verdict can be
re-derived from the stored evidence. Junk never crashes these functions: a missing key, a wrong
type, None or NaN fails the check that needed it (NaN never passes a gate).

Each check is computed in exactly one place (`_candidate_checks`, `_artifact_check`, ...);
`evaluate_grpo_candidate` and the whole-run `run_checks` / `decide_run` both read those rows.

>>> from grpogate.evidence.decisions import decide_grpo_delivery
>>> decide_grpo_delivery({"admitted": True}, {"eligible": False},
...                      {"path": "adapter/", "sha256": "ab" * 32})
{'decision': 'tune', 'failed_checks': ['candidate']}
"""

from __future__ import annotations

import re
from typing import Any

from grpogate.evidence.significance import (SIGNIFICANCE_LEVEL, per_prompt_deltas,
                                            sign_flip_test, significant)
from grpogate.evidence.step_checks import steps_rows
from grpogate.gates import (GATE_NAMES, SWITCH_GATE_NAMES, finite_number,  # noqa: F401
                            validate_gates)  # GATE_NAMES, validate_gates: re-exported

CONTRACT_CHECKS = ("prompt_identity", "policy_version", "verifier_version", "group_size",
                   "unique_traces")
# Reported when there is no group at all: none of the five checks can say anything about an
# empty or non-list rollout, yet it must not be admitted.
NO_GROUPS_CHECK = "groups"
FOREIGN_LOG = "trainer_log"  # rollout["source"] of a run gated from another trainer's log
_SHA256 = re.compile(r"[0-9a-f]{64}", re.ASCII | re.IGNORECASE)


def _get(mapping: Any, *keys: str) -> Any:
    """mapping[k1][k2]... or None when any level is missing or not a dict."""
    for key in keys:
        if not isinstance(mapping, dict):
            return None
        mapping = mapping.get(key)
    return mapping


def _non_empty_str(value: Any) -> bool:
    return isinstance(value, str) and value.strip() != ""


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _same_version(recorded: Any, expected: Any) -> bool:
    return _non_empty_str(expected) and isinstance(recorded, str) and recorded == expected


def _row(name: str, value: Any, threshold: Any, passed: bool, on_fail: str) -> dict[str, Any]:
    return {"name": name, "value": value, "threshold": threshold, "passed": bool(passed),
            "on_fail": on_fail}


def _gate_row(name: str, value: Any, gates: Any, gate_name: str) -> dict[str, Any]:
    """A `tune` check of a measured value against an inclusive minimum_/maximum_ gate."""
    measured, threshold = finite_number(value), finite_number(_get(gates, gate_name))
    passed = measured is not None and threshold is not None and (
        measured >= threshold if gate_name.startswith("minimum_") else measured <= threshold)
    return _row(name, measured, threshold, passed, "tune")


# --- trajectory contract -------------------------------------------------------------------

def check_rollout_contract(groups: Any, expected_policy_version: Any,
                           expected_verifier_version: Any,
                           expected_group_size: Any) -> dict[str, Any]:
    """Are the trajectory groups' identities consistent, the groups complete, the traces unique?

    Returns {"admitted", "failed_checks"} with failing names in the order of CONTRACT_CHECKS;
    an empty (or non-list) group list is not admitted and fails `NO_GROUPS_CHECK` ("groups").
    Prompt, policy, verifier and trace ids must be non-empty strings.
    """
    if not isinstance(groups, (list, tuple)) or not groups:
        return {"admitted": False, "failed_checks": [NO_GROUPS_CHECK]}
    group_size = expected_group_size if _is_positive_int(expected_group_size) else None
    seen_trace_ids: set[str] = set()
    traces_unique = True
    passed = dict.fromkeys(CONTRACT_CHECKS, True)
    for group in groups:
        if not isinstance(group, dict):
            group = {}
        passed["prompt_identity"] &= _non_empty_str(group.get("prompt_id"))
        passed["policy_version"] &= _same_version(group.get("source_policy_version"),
                                                  expected_policy_version)
        passed["verifier_version"] &= _same_version(group.get("verifier_version"),
                                                    expected_verifier_version)
        trace_ids = group.get("trace_ids")
        if not isinstance(trace_ids, (list, tuple)):
            passed["group_size"] = False
            continue
        passed["group_size"] &= group_size is not None and len(trace_ids) == group_size
        for trace_id in trace_ids:
            # A trace without a usable id cannot be shown unique, so it fails the same check.
            if not _non_empty_str(trace_id) or trace_id in seen_trace_ids:
                traces_unique = False
            else:
                seen_trace_ids.add(trace_id)
    passed["unique_traces"] = traces_unique
    failed = [name for name in CONTRACT_CHECKS if not passed[name]]
    return {"admitted": not failed, "failed_checks": failed}


# --- effective update and candidate quality ------------------------------------------------

def contract_groups(records: Any) -> list[dict[str, Any]]:
    """Trajectory records -> one contract group per prompt, in first-seen order.

    A group mixing policy or verifier versions reads as "mixed" and fails its check rather
    than being silently relabelled. Tolerant of damaged records (the audit feeds it stored
    lines): a missing field reads as None and fails the check it belongs to.
    """
    groups: dict[str, dict[str, Any]] = {}
    for record in records if isinstance(records, list) else []:
        record = record if isinstance(record, dict) else {}
        group = groups.setdefault(str(record.get("prompt_id")), {
            "prompt_id": record.get("prompt_id"),
            "source_policy_version": record.get("source_policy_version"),
            "verifier_version": record.get("verifier_version"), "trace_ids": []})
        for key in ("source_policy_version", "verifier_version"):
            if record.get(key) != group[key]:
                group[key] = "mixed"
        group["trace_ids"].append(record.get("trace_id"))
    return list(groups.values())


REWARD_VERSIONS_CHECK = "reward_versions"


def check_step_contract(records: Any, expected_policy_version: Any,
                        expected_verifier_version: Any, expected_group_size: Any,
                        expected_reward_versions: Any = None) -> dict[str, Any]:
    """`check_rollout_contract` on one step's trajectory records (the loop and the audit).

    With `expected_reward_versions` ({component: version}), every record must also carry
    exactly those reward components at those versions, else `reward_versions` fails: a total
    computed by another version of any component is not the reward the run claims.
    """
    result = check_rollout_contract(contract_groups(records), expected_policy_version,
                                    expected_verifier_version, expected_group_size)
    if expected_reward_versions is None:
        return result
    usable = isinstance(expected_reward_versions, dict) and bool(expected_reward_versions) and all(
        _non_empty_str(v) for v in expected_reward_versions.values())
    consistent = usable and isinstance(records, list) and all(
        isinstance(r, dict) and r.get("reward_versions") == expected_reward_versions
        and isinstance(r.get("rewards"), dict) and set(r["rewards"]) == set(expected_reward_versions)
        for r in records)
    if consistent:
        return result
    failed = result["failed_checks"] + [REWARD_VERSIONS_CHECK]
    return {"admitted": False, "failed_checks": failed}


def _group_statistics(rollout: Any) -> tuple[float, int, bool]:
    """(valid_group_ratio, effective_trajectory_count, well_formed) of the reward groups.

    A group is complete when it holds exactly G finite rewards, valid when complete and its
    rewards differ: a zero-variance group has zero group-relative advantage, so it adds nothing
    to the update however many trajectories it cost. The ratio divides by ALL groups.
    """
    group_size, reward_groups = _get(rollout, "group_size"), _get(rollout, "reward_groups")
    if _get(rollout, "source") == FOREIGN_LOG:
        return _logged_group_statistics(rollout)
    if not isinstance(reward_groups, (list, tuple)):
        return 0.0, 0, False
    well_formed = _is_positive_int(group_size)
    valid_groups = 0
    for rewards in reward_groups:
        if not well_formed or not isinstance(rewards, (list, tuple)) or len(rewards) != group_size:
            continue
        numbers = [finite_number(reward) for reward in rewards]
        if None not in numbers and max(numbers) > min(numbers):
            valid_groups += 1
    return _coverage(valid_groups, len(reward_groups), group_size, well_formed)


def _coverage(valid_groups: int, group_count: int, group_size: Any,
              well_formed: bool) -> tuple[float, int, bool]:
    ratio = valid_groups / group_count if group_count else 0.0
    return ratio, valid_groups * group_size if well_formed else 0, well_formed


def _logged_group_statistics(rollout: Any) -> tuple[float, int, bool]:
    """The same statistics for a run trained elsewhere, whose only record of its groups is the
    trainer's log: valid and total group counts (evidence/trainer_log.py reads them) instead of
    reward groups; the ratio and the effective count are the same arithmetic."""
    group_size = _get(rollout, "group_size")
    valid, total = _get(rollout, "valid_group_count"), _get(rollout, "group_count")
    counts = [value for value in (valid, total)
              if isinstance(value, int) and not isinstance(value, bool) and value >= 0]
    well_formed = _is_positive_int(group_size) and len(counts) == 2 and valid <= total
    return _coverage(valid if well_formed else 0, total if well_formed else 0, group_size,
                     well_formed)


def _stage_seconds(rollout: Any, update: Any) -> float | None:
    """rollout + verification (when recorded) + update seconds; None when any is unusable.

    Throughput counts every stage the trajectories cost (docs/design.md §3), not generation alone.
    """
    parts = [_get(rollout, "rollout_seconds"), _get(update, "update_seconds")]
    if isinstance(rollout, dict) and "verification_seconds" in rollout:
        parts.append(rollout["verification_seconds"])
    seconds = [finite_number(part) for part in parts]
    if any(part is None or part < 0 for part in seconds):
        return None
    return float(sum(float(part) for part in seconds))


def _retest_skipped(evidence: Any) -> bool:
    """An interrupted run records a skipped re-test as zeros with `"skipped": true`; zeros that
    were never measured must not pass a quality gate."""
    return _get(evidence, "comparison", "skipped") is True


def gain_rule(gates: Any) -> str:
    """Which rule the reward and pass_at_group gates read: the one-sided paired sign-flip test
    of "gain <= minimum" at 2.5 % when `require_significant_gain` is true, else the point
    estimate (a gates table without the switch: the reference profile's gates). The run's
    output, `decide` and the report state it with this one rule."""
    if _get(gates, "require_significant_gain") is True:
        return "paired sign-flip test"
    return "point estimate"


def gain_rule_line(gates: Any) -> str:
    """One sentence for a reader: which rule decided the gain gates, and how to switch it."""
    if gain_rule(gates) == "paired sign-flip test":
        return ("gain gates (reward, pass_at_group) pass when a one-sided paired sign-flip test "
                f"rejects 'gain <= minimum' at p <= {SIGNIFICANCE_LEVEL} "
                "(gates.require_significant_gain = true)")
    return ("gain gates (reward, pass_at_group) read the point estimate "
            "(gates.require_significant_gain = false: the reference profile's published gates); "
            "this rule accepts a candidate whose gain is zero")


# The per-prompt field each gain gate tests, with its summary-level gain and paired interval.
_GAIN_FIELDS = {"reward_mean_gain": "mean_reward", "pass_at_group_gain": "passed"}


def gain_test(section: Any, name: str, margin: Any, alternative: str = "greater") -> dict | None:
    """The paired sign-flip test of one gain in a re-test section (the evidence's comparison,
    or its guard), from the per-prompt records it holds, with the recorded 95 % interval
    beside it; None when the section is skipped or its per-prompt records do not pair."""
    margin = finite_number(margin)
    if margin is None or _get(section, "skipped") is True:
        return None
    baseline, candidate = _get(section, "baseline", "per_prompt"), _get(
        section, "candidate", "per_prompt")
    if not isinstance(baseline, list) or not isinstance(candidate, list):
        return None
    deltas = per_prompt_deltas(baseline, candidate, _GAIN_FIELDS[name])
    if deltas is None:
        return None
    test = sign_flip_test(deltas, margin=margin, alternative=alternative)
    interval = _get(section, "paired", name)
    if isinstance(interval, dict):
        test["interval_95"] = [interval.get("low"), interval.get("high")]
    return test


def _gain_row(evidence: Any, gates: Any, check: str, name: str, gate_name: str) -> dict:
    """A gain gate: the point estimate >= the minimum, or (significant rule) the test of
    "gain <= minimum" rejecting at SIGNIFICANCE_LEVEL; its row carries the test."""
    if gain_rule(gates) != "paired sign-flip test":
        value = None if _retest_skipped(evidence) else _get(evidence, "comparison", name)
        return _gate_row(check, value, gates, gate_name)
    margin = finite_number(_get(gates, gate_name))
    test = None if _retest_skipped(evidence) else gain_test(
        _get(evidence, "comparison"), name, margin)
    threshold = (f"p <= {SIGNIFICANCE_LEVEL} (H0: gain <= {margin:g})" if margin is not None
                 else None)
    row = _row(check, None if test is None else test["p_value"], threshold,
               test is not None and significant(test), "tune")
    if test is not None:
        row["test"] = test
    return row


def _candidate_checks(evidence: Any, gates: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The metrics and the eight candidate check rows, in the order of docs/design.md §5."""
    rollout, update = _get(evidence, "rollout"), _get(evidence, "update")
    ratio, effective_trajectories, groups_well_formed = _group_statistics(rollout)
    seconds = _stage_seconds(rollout, update)
    per_second = effective_trajectories / seconds if seconds is not None and seconds > 0 else 0.0
    metrics = {"valid_group_ratio": ratio, "effective_trajectory_count": effective_trajectories,
               "effective_trajectories_per_second": per_second}
    status = _get(evidence, "status")
    rows = [
        _row("execution", status if isinstance(status, str) else None, "ok", status == "ok",
             "reject"),
        # Unreadable groups or stage times give value None, so even a zero gate fails.
        _gate_row("effective_groups", ratio if groups_well_formed else None, gates,
                  "minimum_valid_group_ratio"),
        _gate_row("effective_throughput",
                  per_second if groups_well_formed and seconds is not None else None, gates,
                  "minimum_effective_trajectories_per_second"),
        _gate_row("updates", _get(update, "update_count"), gates, "minimum_update_count"),
        _gain_row(evidence, gates, "reward", "reward_mean_gain", "minimum_reward_gain"),
        _gain_row(evidence, gates, "pass_at_group", "pass_at_group_gain",
                  "minimum_pass_at_group_gain"),
        _gate_row("truncation", _get(rollout, "max_length_hit_ratio"), gates,
                  "maximum_max_length_hit_ratio"),
        _gate_row("memory", _get(evidence, "resources", "peak_allocated_bytes"), gates,
                  "maximum_peak_allocated_bytes"),
    ]
    return metrics, rows


def evaluate_grpo_candidate(evidence: Any, gates: Any) -> dict[str, Any]:
    """Did the run make a real, effective update, and does the candidate pass the gates?

    Returns {"eligible", "valid_group_ratio", "effective_trajectory_count",
    "effective_trajectories_per_second", "failed_checks"}; a gate missing from `gates` fails
    its check (validate gates up front with `validate_gates`).
    """
    metrics, rows = _candidate_checks(evidence, gates)
    failed = [row["name"] for row in rows if not row["passed"]]
    return {"eligible": not failed, **metrics, "failed_checks": failed}


# --- artifact and delivery -----------------------------------------------------------------

def _artifact_check(artifact: Any) -> dict[str, Any]:
    """Whole-run artifact check: path, a real sha256 digest, and the rollback source."""
    complete = (_non_empty_str(_get(artifact, "path"))
                and isinstance(_get(artifact, "sha256"), str)
                and _SHA256.fullmatch(artifact["sha256"]) is not None
                and _non_empty_str(_get(artifact, "source_policy_version")))
    return _row("artifact", complete, "path, 64-hex sha256 and source_policy_version present",
                complete, "reject")


def _verdict(rows: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """reject beats tune beats accept."""
    failed = [row for row in rows if not row["passed"]]
    if any(row["on_fail"] == "reject" for row in failed):
        decision = "reject"
    else:
        decision = "tune" if failed else "accept"
    return decision, [row["name"] for row in failed]


def decide_grpo_delivery(rollout: Any, candidate: Any, artifact: Any) -> dict[str, Any]:
    """accept / tune / reject from the contract result, the candidate result and the artifact.

    The artifact needs a non-empty path and sha256 (docs/design.md §5); the whole-run `artifact` check
    is stricter (64 hex digits and a source policy version).
    """
    artifact_present = (_non_empty_str(_get(artifact, "path"))
                        and _non_empty_str(_get(artifact, "sha256")))
    rows = [
        _row("rollout", None, True, _get(rollout, "admitted") is True, "reject"),
        _row("candidate", None, True, _get(candidate, "eligible") is True, "tune"),
        _row("artifact", None, True, artifact_present, "reject"),
    ]
    decision, failed = _verdict(rows)
    return {"decision": decision, "failed_checks": failed}


# --- whole run -----------------------------------------------------------------------------

def run_checks(evidence: Any, gates: Any) -> list[dict[str, Any]]:
    """One row per whole-run check {"name", "value", "threshold", "passed", "on_fail"}, in
    order: contract, (a gated foreign run: baseline_identity, isolation; a grpogate run: steps,)
    execution, effective_groups, effective_throughput, updates, reward, pass_at_group, truncation,
    length_budget, guard, retest_kl, memory, artifact (guard and retest_kl only when the gates
    hold theirs)."""
    admitted = _get(evidence, "contract", "admitted")
    contract = _row("contract", admitted if isinstance(admitted, bool) else None, True,
                    admitted is True, "reject")
    _, candidate_rows = _candidate_checks(evidence, gates)
    # Eval-time truncation: a gain measured on cut-off answers is not a gain, so the worse of
    # the two policies' fresh-completion hit ratios must fit the same budget.
    eval_ratios = [None if _retest_skipped(evidence) else
                   finite_number(_get(evidence, "comparison", policy, "max_length_hit_ratio"))
                   for policy in ("baseline", "candidate")]
    length_budget = _gate_row("length_budget", None if None in eval_ratios else max(eval_ratios),
                              gates, "maximum_max_length_hit_ratio")
    memory = candidate_rows.pop()  # docs/design.md §5's order: length_budget before memory
    # What the update cost: the guard set and the drift (absent rows: gates that predate them).
    safety = [row for row in (_guard_row(evidence, gates), _retest_kl_row(evidence, gates)) if row]
    changed = [row for row in (_effective_update_row(evidence),) if row]
    return [contract, *_foreign_admission_rows(evidence), *steps_rows(evidence),
            *candidate_rows[:3], *changed,
            *candidate_rows[3:], length_budget, *safety, memory,
            _artifact_check(_get(evidence, "artifact"))]


def _foreign_admission_rows(evidence: Any) -> list[dict[str, Any]]:
    """A run trained elsewhere (`grpogate gate`) is admitted by two more checks: its adapter
    names the baseline's base model (else `reject`: the re-test would compare policies of two
    different models), and its eval prompts are disjoint from the training prompts, which only
    the user can name (not checked -> `tune`: a gain on possibly seen prompts is no `accept`)."""
    admission = _get(evidence, "foreign", "admission")
    if admission is None:
        return []
    identity = _get(admission, "baseline_identity", "matches")
    checked = _get(admission, "isolation", "checked")
    shared = _get(admission, "isolation", "shared_prompts")
    return [
        _row("baseline_identity", identity if isinstance(identity, bool) else None, True,
             identity is True, "reject"),
        _row("isolation", shared if checked is True else "not checked", 0,
             checked is True and shared == 0, "tune"),
    ]


def _guard_row(evidence: Any, gates: Any) -> dict[str, Any] | None:
    """The guard set must not be significantly worse than -maximum_guard_reward_loss: under the
    significant rule the same paired sign-flip test as the gains, of "guard gain >= -loss"
    (the row fails when it rejects at SIGNIFICANCE_LEVEL); under the point-estimate rule the
    guard gain itself >= -loss. None (no row) when the gates predate the guard; a guard
    recorded off passes as "off"."""
    if not isinstance(gates, dict) or "maximum_guard_reward_loss" not in gates:
        return None
    guard, loss = _get(evidence, "guard"), finite_number(gates["maximum_guard_reward_loss"])
    threshold = None if loss is None else 0.0 - loss  # 0.0 - 0.0 shows as 0, not -0
    if isinstance(guard, dict) and guard.get("enabled") is False and not _retest_skipped(evidence):
        return _row("guard", "off", threshold, True, "tune")
    usable = isinstance(guard, dict) and guard.get("skipped") is not True
    if gain_rule(gates) != "paired sign-flip test":
        value = finite_number(guard.get("reward_mean_gain")) if usable else None
        return _row("guard", value, threshold,
                    value is not None and threshold is not None and value >= threshold, "tune")
    test = gain_test(guard, "reward_mean_gain", threshold, "less") if usable else None
    row = _row("guard", None if test is None else test["p_value"],
               None if threshold is None else
               f"p > {SIGNIFICANCE_LEVEL} (H0: guard gain >= {threshold:g})",
               test is not None and not significant(test), "tune")
    if test is not None:
        row["test"] = test
    return row


def identical_retest(evidence: Any) -> dict[str, int] | None:
    """{"pairs", "identical"} over the re-test's eval and guard completion pairs (baseline and
    candidate on the same prompt and sample seed), when the evidence records them; None for a
    skipped re-test or an evidence without the counts."""
    if _retest_skipped(evidence):
        return None
    counts = [_get(evidence, "comparison", "identical_completions")]
    guard = _get(evidence, "guard")
    if isinstance(guard, dict) and guard.get("enabled") is not False and not guard.get("skipped"):
        counts.append(guard.get("identical_completions"))
    if not isinstance(counts[0], dict):
        return None
    totals = {"pairs": 0, "identical": 0}
    for count in counts:
        for key in totals:
            value = _get(count, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                return None
            totals[key] += value
    return totals if totals["identical"] <= totals["pairs"] else None


def no_change_reason(evidence: Any) -> str | None:
    """The words for a candidate whose re-test is the baseline's, completion for completion;
    None when anything differs (or nothing is recorded)."""
    counts = identical_retest(evidence)
    if counts is None or counts["pairs"] == 0 or counts["identical"] != counts["pairs"]:
        return None
    eval_pairs = _get(evidence, "comparison", "identical_completions", "pairs")
    guard_pairs = counts["pairs"] - eval_pairs
    detail = f"{eval_pairs} of {eval_pairs} eval pairs" + (
        f", {guard_pairs} of {guard_pairs} guard pairs" if guard_pairs else "")
    return (f"the candidate's re-test completions are identical to the baseline's ({detail}): "
            "no effective update")


def _effective_update_row(evidence: Any) -> dict[str, Any] | None:
    """At least one re-test completion of the candidate differs from the baseline's (else
    `reject`: a candidate that changed nothing is not an update, whatever the gates read).
    None when the evidence does not record the counts (a skipped re-test)."""
    counts = identical_retest(evidence)
    if counts is None:
        return None
    differing = counts["pairs"] - counts["identical"]
    return _row("effective_update", differing, "> 0 pairs differ",
                differing > 0, "reject")


def _retest_kl_row(evidence: Any, gates: Any) -> dict[str, Any] | None:
    """The candidate's mean per-token KL to the baseline on the re-test <= maximum_retest_kl;
    0 turns the gate off (the KL is still recorded). None when the gates predate it."""
    if not isinstance(gates, dict) or "maximum_retest_kl" not in gates:
        return None
    kl = None if _retest_skipped(evidence) else finite_number(
        _get(evidence, "comparison", "drift", "kl_to_baseline"))
    if finite_number(gates["maximum_retest_kl"]) == 0:
        return _row("retest_kl", kl, "off", True, "tune")
    return _gate_row("retest_kl", kl, gates, "maximum_retest_kl")


def decide_run(evidence: Any, gates: Any) -> dict[str, Any]:
    """The whole-run decision: contract, execution or artifact failing -> reject; any other
    check failing -> tune; all passing -> accept."""
    rows = run_checks(evidence, gates)
    decision, failed = _verdict(rows)
    return {"decision": decision, "failed_checks": failed, "checks": rows}
