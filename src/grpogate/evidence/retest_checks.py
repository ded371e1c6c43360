"""The re-test's checks: the gain gates (reward, pass_at_group), the guard, the re-test KL and
the effective-update check, and the words the run, `decide` and the report use for them.

Pure Python and numpy (no torch). Under `require_significant_gain` each gain gate, and the
guard's loss check in the other direction, is the paired sign-flip test of
`evidence/significance.py` run on the per-prompt records the evidence holds, so `decide`
recomputes it from the stored completions; the row's value is the test's p-value and the row
carries the whole test. Otherwise the gates read point estimates.
"""

from __future__ import annotations

from typing import Any

from grpogate.errors import plain
from grpogate.evidence.check_rows import _gate_row, _get, _retest_skipped, _row
from grpogate.evidence.significance import (SIGNIFICANCE_LEVEL, per_prompt_deltas,
                                            sign_flip_test, significant)
from grpogate.gates import finite_number


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


def _finite_retest_row(evidence: Any) -> dict[str, Any] | None:
    """The re-test's entropies and KL are finite numbers (else `reject`: a model whose logits
    are NaN or infinite samples noise). The drift section counts the completions that were not
    (guard.drift_section) only when there are any, so the row exists only to fail."""
    count = _get(evidence, "comparison", "drift", "non_finite_completions")
    if count is None:
        return None
    return _row("finite_retest", count, 0, False, "reject")


def test_lines(decision: dict) -> list[str]:
    """One line per gate that ran the paired sign-flip test: its p-value and what it saw."""
    lines = []
    for row in decision.get("checks") or []:
        test = row.get("test") if isinstance(row, dict) else None
        if isinstance(test, dict):
            how = "exact" if test.get("exact") else (
                f"{test.get('draws')} random flips, +/- {test.get('mc_standard_error'):.4f}")
            lines.append(f"{plain(row['name'])} test: p = {test.get('p_value'):.4g} ({how}; "
                         f"{test.get('differing_prompts')} of {test.get('prompts')} prompts "
                         f"differ; mean difference {test.get('statistic'):+.4f} beyond the "
                         f"margin {test.get('margin'):+g}); {detection_words(row['name'], test)}")
    return lines


def detection_words(name: str, test: dict) -> str:
    """What this re-test can resolve, from its own variance (significance.detectable_difference)."""
    detectable, power = test.get("detectable_difference"), test.get("detection_power")
    if not isinstance(detectable, (int, float)):
        return "too few differing prompts to estimate what this re-test detects"
    if test.get("alternative") == "less":
        return (f"this guard set detects a loss of {-detectable:.3f} or more with probability "
                f"{power} (raise guard.prompts to see a smaller one)")
    return (f"this re-test detects a {name} gain of {detectable:+.3f} or more with probability "
            f"{power} (raise eval_prompts to see a smaller one)")
