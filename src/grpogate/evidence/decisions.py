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

from grpogate.evidence.check_rows import (_gate_row, _get, _is_positive_int,  # noqa: F401
                                          _non_empty_str, _retest_skipped, _row, _same_version)
from grpogate.evidence.retest_checks import (_effective_update_row, _gain_row,  # noqa: F401
                                             _finite_retest_row, _guard_row, _retest_kl_row,
                                             gain_rule, gain_rule_line, identical_retest,
                                             no_change_reason, stopping_row)
from grpogate.evidence.step_checks import steps_rows
from grpogate.gates import (GATE_NAMES, SWITCH_GATE_NAMES, finite_number,  # noqa: F401
                            validate_gates)  # GATE_NAMES, validate_gates: re-exported

CONTRACT_CHECKS = ("prompt_identity", "policy_version", "verifier_version", "group_size",
                   "unique_traces")
# Reported when there is no group at all: none of the five checks can say anything about an
# empty or non-list rollout, yet it must not be admitted.
NO_GROUPS_CHECK = "groups"
FOREIGN_LOG = "trainer_log"  # rollout["source"] of a run gated from another trainer's log
NOT_RECORDED = "not_recorded"  # rollout["source"] of a candidate gated without a trainer's log
# What a candidate gated without its trainer's log cannot show: these rows say "not recorded"
# and pass, and the decision rests on the re-test, the guard and the re-test KL.
TRAINING_SIDE_CHECKS = ("effective_groups", "effective_throughput", "updates", "truncation")
_SHA256 = re.compile(r"[0-9a-f]{64}", re.ASCII | re.IGNORECASE)


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
    if _get(rollout, "source") == NOT_RECORDED:
        metrics = dict.fromkeys(metrics)  # unknown: None, never a made-up zero
        rows = [_row(row["name"], "not recorded", row["threshold"], True, "tune")
                if row["name"] in TRAINING_SIDE_CHECKS else row for row in rows]
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
    order: contract, (a gated foreign run: baseline_identity, finite_weights, isolation; a
    grpogate run: steps,)
    execution, effective_groups, effective_throughput, updates, reward, pass_at_group, truncation,
    length_budget, guard, retest_kl, finite_retest, memory, artifact (guard and retest_kl only
    when the gates hold theirs, finite_retest only when a re-test value was NaN or infinite)."""
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
    safety = [row for row in (_guard_row(evidence, gates), _retest_kl_row(evidence, gates),
                              _finite_retest_row(evidence)) if row]
    changed = [row for row in (_effective_update_row(evidence), stopping_row(evidence, gates))
               if row]
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
        *_finite_weights_row(admission),
        _row("isolation", shared if checked is True else "not checked", 0,
             checked is True and shared == 0, "tune"),
    ]


def _finite_weights_row(admission: Any) -> list[dict[str, Any]]:
    """No candidate tensor holds NaN or an infinite value (else `reject`: a diverged model's
    re-test measures nothing); the value is the count of tensors that do. No row for a run
    recorded before the check."""
    if not isinstance(admission, dict) or "finite_weights" not in admission:
        return []
    count = _get(admission, "finite_weights", "non_finite_tensors")
    usable = isinstance(count, int) and not isinstance(count, bool) and count >= 0
    return [_row("finite_weights", count if usable else None, 0, usable and count == 0,
                 "reject")]


def decide_run(evidence: Any, gates: Any) -> dict[str, Any]:
    """The whole-run decision: contract, execution or artifact failing -> reject; any other
    check failing -> tune; all passing -> accept."""
    rows = run_checks(evidence, gates)
    decision, failed = _verdict(rows)
    return {"decision": decision, "failed_checks": failed, "checks": rows}
