"""The re-test's checks: the gain gates (reward, pass_at_group), the guard, the stopping rule,
the re-test KL and the effective-update check, and the words the run, `decide` and the report
use for them.

Pure Python and numpy (no torch). Under `require_significant_gain` the gates read the
sequential re-test (evidence/stopping.py) recomputed from the per-prompt records the evidence
holds, so `decide` recomputes every look: a gain gate passes when its anytime-valid test showed
"gain > minimum" at some look, the guard when it showed "guard gain > -maximum_guard_reward_loss"
(non-inferiority). Each row's value is the bound it read and the row carries the gate's looks.
Otherwise the gates read point estimates.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from grpogate.errors import plain
from grpogate.evidence import stopping
from grpogate.evidence.metrics import per_prompt_deltas
from grpogate.evidence.anytime import SIGNIFICANCE_LEVEL, resolvable_difference
from grpogate.evidence.check_rows import _gate_row, _get, _retest_skipped, _row
from grpogate.gates import finite_number

SEQUENTIAL_RULE = "anytime-valid sequential test"


def gain_rule(gates: Any) -> str:
    """Which rule the reward, pass_at_group and guard gates read: the anytime-valid sequential
    test at 2.5 % when `require_significant_gain` is true, else the point estimate (a gates
    table without the switch: the reference profile's gates). The run's output, `decide` and the
    report state it with this one rule."""
    if _get(gates, "require_significant_gain") is True:
        return SEQUENTIAL_RULE
    return "point estimate"


def gain_rule_line(gates: Any) -> str:
    """One sentence for a reader: which rule decided the gain gates, and how to switch it."""
    if gain_rule(gates) == SEQUENTIAL_RULE:
        return ("gain gates (reward, pass_at_group) pass when an anytime-valid one-sided test "
                f"shows 'gain > minimum' at level {SIGNIFICANCE_LEVEL} (the lower confidence "
                "bound above the minimum); the guard passes when it shows the guard loss below "
                "gates.maximum_guard_reward_loss (gates.require_significant_gain = true)")
    return ("gain gates (reward, pass_at_group) read the point estimate "
            "(gates.require_significant_gain = false: the reference profile's published gates); "
            "this rule accepts a candidate whose gain is zero")


# The per-prompt field each gain gate tests.
_GAIN_FIELDS = {"reward_mean_gain": "mean_reward", "pass_at_group_gain": "passed"}


def section_deltas(section: Any, name: str) -> list[float] | None:
    """Candidate minus baseline per prompt of one gain in a re-test section (the evidence's
    comparison, or its guard), in the baseline records' (drawn) order; None when the section is
    skipped or its per-prompt records do not pair."""
    if _get(section, "skipped") is True:
        return None
    baseline, candidate = _get(section, "baseline", "per_prompt"), _get(
        section, "candidate", "per_prompt")
    if not isinstance(baseline, list) or not isinstance(candidate, list):
        return None
    return per_prompt_deltas(baseline, candidate, _GAIN_FIELDS[name])


def guard_samples(section: Any) -> list[float] | None:
    """The guard's paired sample differences (candidate minus baseline reward per prompt and
    sample, round by round) as its section records them; None when skipped or malformed."""
    values = _get(section, "sample_differences")
    if _get(section, "skipped") is True or not isinstance(values, list):
        return None
    numbers = [finite_number(value) for value in values]
    if any(n is None or not -1.0 <= n <= 1.0 for n in numbers):
        return None
    return [float(n) for n in numbers]


def _margin(gates: Any, gate_name: str, sign: float = 1.0) -> float | None:
    """A gate's margin for the tests (strictly inside (-1, 1), where a mean difference lies)."""
    value = finite_number(_get(gates, gate_name))
    if value is None or not -1.0 < sign * value < 1.0:
        return None
    return 0.0 - value if sign < 0 else float(value)  # 0.0 - 0.0 shows as 0, not -0


def guard_on(evidence: Any) -> bool:
    guard = _get(evidence, "guard")
    return isinstance(guard, dict) and guard.get("enabled") is not False


def sequential_outcome(evidence: Any, gates: Any) -> dict | None:
    """The stopping rule walked over the evidence's per-prompt records (stopping.walk_looks)
    with the run's design, or one look at every recorded prompt for a run recorded before the
    sequential re-test; None when a margin is unusable or the records do not pair."""
    margins = {"reward": _margin(gates, "minimum_reward_gain"),
               "pass_at_group": _margin(gates, "minimum_pass_at_group_gain"),
               "guard": _margin(gates, "maximum_guard_reward_loss", -1.0)}
    comparison = _get(evidence, "comparison")
    reward = section_deltas(comparison, "reward_mean_gain")
    passed = section_deltas(comparison, "pass_at_group_gain")
    guard = guard_samples(_get(evidence, "guard")) if guard_on(evidence) else None
    if reward is None or passed is None or (guard_on(evidence) and guard is None) \
            or None in (margins["reward"], margins["pass_at_group"]) \
            or (guard is not None and margins["guard"] is None):
        return None
    try:
        design = stopping.design_of(_get(evidence, "config"))
    except ValueError:
        return None
    design = design or {
        "eval_batch": len(reward), "eval_max": len(reward),
        "guard_batch": len(guard or []), "guard_max": len(guard or [])}
    try:
        walked = copy.deepcopy(_walked(tuple(reward), tuple(passed),
                                       None if guard is None else tuple(guard),
                                       tuple(sorted(design.items())),
                                       tuple(sorted(margins.items()))))
    except (ValueError, KeyError, TypeError):
        return None
    return walked | {"design": design, "margins": margins,
                     "recorded": {"eval_prompts": len(reward),
                                  "guard_samples": len(guard or [])}}


@functools.lru_cache(maxsize=8)
def _walked(reward: tuple, passed: tuple, guard: tuple | None, design: tuple,
            margins: tuple) -> dict:
    """stopping.walk_looks, once per evidence: a decision reads it in four rows and the
    evidence's `retest` section once more (each walk re-reads every test at every look)."""
    return stopping.walk_looks(list(reward), list(passed), None if guard is None else list(guard),
                               dict(design), dict(margins))


def _looks_of(outcome: dict, gate: str) -> dict:
    """What the gate's row carries: its status, the bounds at the last look, every look."""
    looks = [look[gate] | {"look": look["look"]} for look in outcome["looks"] if gate in look]
    last = looks[-1] if looks else {}
    return {"method": SEQUENTIAL_RULE, "status": outcome["status"].get(gate, "open"),
            "margin": outcome["margins"][gate], "observations": last.get("observations", 0),
            "lower_bound": last.get("lower_bound"), "upper_bound": last.get("upper_bound"),
            "mean": last.get("mean"), "spread": last.get("spread"), "level": SIGNIFICANCE_LEVEL,
            "looks": looks}


def _gain_row(evidence: Any, gates: Any, check: str, name: str, gate_name: str) -> dict:
    """A gain gate: the point estimate >= the minimum, or (sequential rule) the gain shown
    above its minimum at some look of the re-test; its row carries the gate's looks."""
    if gain_rule(gates) != SEQUENTIAL_RULE:
        value = None if _retest_skipped(evidence) else _get(evidence, "comparison", name)
        return _gate_row(check, value, gates, gate_name)
    margin = finite_number(_get(gates, gate_name))
    outcome = None if _retest_skipped(evidence) else sequential_outcome(evidence, gates)
    test = None if outcome is None else _looks_of(outcome, check)
    threshold = f"lower bound > {margin:g}" if margin is not None else None
    row = _row(check, None if test is None else test["lower_bound"], threshold,
               test is not None and test["status"] == "shown", "tune")
    if test is not None:
        row["test"] = test
    return row


def _guard_row(evidence: Any, gates: Any) -> dict[str, Any] | None:
    """Non-inferiority on the guard set: under the sequential rule the guard passes only when
    its test showed "guard gain > -maximum_guard_reward_loss" (the lower bound above -delta);
    not seeing a loss is not enough. Under the point-estimate rule the guard gain itself
    >= -loss. None (no row) when the gates predate the guard; a guard recorded off passes as
    "off"."""
    if not isinstance(gates, dict) or "maximum_guard_reward_loss" not in gates:
        return None
    guard, loss = _get(evidence, "guard"), finite_number(gates["maximum_guard_reward_loss"])
    threshold = None if loss is None else 0.0 - loss  # 0.0 - 0.0 shows as 0, not -0
    if isinstance(guard, dict) and guard.get("enabled") is False and not _retest_skipped(evidence):
        return _row("guard", "off", threshold, True, "tune")
    usable = isinstance(guard, dict) and guard.get("skipped") is not True
    if gain_rule(gates) != SEQUENTIAL_RULE:
        value = finite_number(guard.get("reward_mean_gain")) if usable else None
        return _row("guard", value, threshold,
                    value is not None and threshold is not None and value >= threshold, "tune")
    outcome = sequential_outcome(evidence, gates) if usable else None
    test = None if outcome is None else _looks_of(outcome, "guard")
    row = _row("guard", None if test is None else test["lower_bound"],
               None if threshold is None else f"lower bound > {threshold:g}",
               test is not None and test["status"] == "shown", "tune")
    if test is not None:
        row["test"] = test
    return row


def recorded_design(evidence: Any) -> dict | None:
    """The sequential design of the evidence's config; None before the design existed, and an
    empty design (which no re-test meets) for unreadable counts."""
    try:
        return stopping.design_of(_get(evidence, "config"))
    except ValueError:
        return {}


def stopping_row(evidence: Any, gates: Any) -> dict[str, Any] | None:
    """The re-test holds exactly the prompts its stopping rule takes (else `reject`: a re-test
    stopped early or run past its stop is a decision chosen by looking). None for the
    point-estimate rule, a skipped re-test, or a run recorded before the sequential design."""
    if gain_rule(gates) != SEQUENTIAL_RULE or _retest_skipped(evidence) \
            or recorded_design(evidence) is None:
        return None
    outcome = sequential_outcome(evidence, gates)
    if outcome is None:
        return _row("retest_stopping", None, "the rule's stopping point", False, "reject")
    recorded = outcome["recorded"]
    held = (f"{recorded['eval_prompts']} eval prompts + {recorded['guard_samples']} guard "
            "samples")
    if not outcome["complete"]:
        return _row("retest_stopping", f"{held}: the rule had not stopped (its next look "
                    f"needs {outcome['next'][0]} + {outcome['next'][1]})",
                    "the rule's stopping point", False, "reject")
    stop = f"{outcome['eval_prompts']} + {outcome['guard_samples']} at look " \
        f"{len(outcome['looks'])}"
    exact = (recorded["eval_prompts"], recorded["guard_samples"]) == (
        outcome["eval_prompts"], outcome["guard_samples"])
    return _row("retest_stopping", held if exact else f"{held}, but the rule stops at {stop}",
                stop, exact, "reject")


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
    """One line per gate the sequential test decided: its bounds, its status and its looks."""
    lines = []
    for row in decision.get("checks") or []:
        test = row.get("test") if isinstance(row, dict) else None
        if not isinstance(test, dict) or not isinstance(test.get("lower_bound"), (int, float)):
            continue
        looks = test.get("looks") or []
        lines.append(f"{plain(row['name'])} test: {_status_words(row['name'], test)}; "
                     f"{int(test.get('observations') or 0)} {_unit(row['name'])} over "
                     f"{len(looks)} look(s), mean "
                     f"difference {test.get('mean') or 0.0:+.4f}, {1 - SIGNIFICANCE_LEVEL:.1%} "
                     f"bounds [{test['lower_bound']:+.4f}, {test['upper_bound']:+.4f}] "
                     f"(margin {test.get('margin'):+g}); "
                     f"{detection_words(row['name'], test, test.get('spread'))}")
    return lines


def _status_words(name: str, test: dict) -> str:
    """What the gate's test concluded, in the words a reader acts on."""
    status, guard = test.get("status"), name == "guard"
    if status == "shown":
        return "non-inferiority shown" if guard else "gain shown"
    if status == "ruled_out":
        return "loss beyond the margin shown" if guard else "gain ruled out at its minimum"
    return ("non-inferiority not shown (raise guard.rounds: the test stays valid when a re-test "
            "is extended)" if guard else
            "gain not shown (raise eval_prompts: the test stays valid when a re-test is extended)")


def detection_words(name: str, test: dict, spread: float | None = None) -> str:
    """The smallest difference beyond the margin this re-test resolves with probability 0.8,
    from its own per-prompt spread and prompt count (anytime.resolvable_difference)."""
    observations = int(test.get("observations") or 0)
    resolvable = resolvable_difference(spread, observations, test.get("margin") or 0.0) \
        if spread is not None else None
    if resolvable is None:
        return "too few differing prompts to state what this re-test resolves"
    what = "guard loss" if name == "guard" else f"{name} gain"
    return (f"this re-test resolves a {what} of {resolvable:.3f} beyond the margin with "
            f"probability 0.8 at {observations} {_unit(name)}")


def _unit(name: str) -> str:
    """What one observation of a gate's test is: a prompt (eval) or a paired sample (guard)."""
    return "paired samples" if name == "guard" else "prompts"
