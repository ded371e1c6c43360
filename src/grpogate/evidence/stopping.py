"""The sequential re-test's stopping rule: which looks it takes and where it stops.

Pure Python (no torch). The re-test samples the eval set in batches of prompts, in the set's
drawn order (a prompt is one observation: its mean reward and pass@group differences), and the
guard set in rounds: every guard problem answered `guard.group_size` more times by both policies
(a paired sample is one observation). After each look every gate's anytime-valid test
(evidence/anytime.py) is read on all the observations so far. Every round covers the whole
guard population evenly, so the guard's bound is on the mean over its problems exactly, however
their gains differ. A gate is decided when its test rejects one side:

- reward, pass_at_group: gain shown (H0 "gain <= minimum" rejected) or ruled out (H0
  "gain >= minimum" rejected: the gain lies below its minimum);
- guard: non-inferiority shown (H0 "guard gain <= -maximum_guard_reward_loss" rejected) or a
  loss shown (H0 "guard gain >= -maximum_guard_reward_loss" rejected).

A decided gate stays decided (the tests' crossings are what Ville's inequality bounds). The
re-test stops as soon as the decision is known: a gain ruled out or a loss shown (`tune`
whatever comes next), or every gate shown. A set whose gates are all shown, or whose maximum
is spent, takes no more batches while the other goes on. The run calls `walk_looks` after each
batch with what it has sampled; `decide` calls it on the stored records, and a re-test that holds
more or fewer prompts than the rule's stopping point is rejected.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from grpogate.config.schema import MAX_RETEST_LOOKS
from grpogate.evidence.anytime import betting_test, resolvable_difference

RULE = ("sequential: eval prompts in batches and guard samples in rounds; after each look, "
        "every gate's anytime-valid betting test at 2.5 % on all observations so far; stop when "
        "a gain is ruled out, a guard loss is shown, or every gate is shown; else at the maximum")


def _gate(deltas: list[float], margin: float, decided: str | None) -> tuple[str | None, dict]:
    """One gate at one look: its two one-sided tests at `margin` and its (sticky) status."""
    lower = betting_test(deltas, margin, "greater")
    upper = betting_test(deltas, margin, "less")
    if decided is None:
        decided = "shown" if lower["rejected"] else ("ruled_out" if upper["rejected"] else None)
    spread = float(np.std(deltas, ddof=1)) if len(deltas) > 1 else None
    return decided, {"observations": len(deltas), "mean": lower["mean"], "spread": spread,
                     "lower_bound": lower["bound"], "upper_bound": upper["bound"],
                     "log_capital_gain": lower["log_capital"],
                     "log_capital_loss": upper["log_capital"], "status": decided or "open"}


def walk_looks(reward: list[float], passed: list[float], guard: list[float] | None,
               design: dict, margins: dict) -> dict:
    """The looks the rule takes over the per-prompt differences available (each list in drawn
    order; `guard` None when the guard is off).

    design: {"eval_batch", "eval_max" (prompts), "guard_batch", "guard_max" (paired samples)};
    margins: {"reward", "pass_at_group", "guard"} (the gains' minimums; the guard's is -delta).
    Returns {"looks": [...], "complete": the rule stopped within the data, "eval_prompts",
    "guard_samples" (where it stopped, or how far the data reaches), "next": (eval, guard)
    observations the next look needs when not complete, "status": {gate: shown | ruled_out | open},
    "reason"}.
    """
    if design["eval_batch"] < 1 or (guard is not None and design["guard_batch"] < 1) \
            or looks_needed(design) > MAX_RETEST_LOOKS:
        raise ValueError(f"a re-test design needs batches of at least 1 and at most "
                         f"{MAX_RETEST_LOOKS} looks, got {design}")
    status: dict[str, str | None] = {"reward": None, "pass_at_group": None}
    if guard is not None:
        status["guard"] = None
    seen_eval = seen_guard = 0
    eval_open, guard_open = True, guard is not None and design["guard_max"] > 0
    looks: list[dict] = []
    while True:
        want_eval = min(seen_eval + design["eval_batch"], design["eval_max"]) if eval_open \
            else seen_eval
        want_guard = min(seen_guard + design["guard_batch"], design["guard_max"]) \
            if guard_open else seen_guard
        if want_eval > len(reward) or (guard is not None and want_guard > len(guard)):
            return _walked(looks, status, seen_eval, seen_guard, (want_eval, want_guard), None)
        seen_eval, seen_guard = want_eval, want_guard
        look = {"look": len(looks) + 1, "eval_prompts": seen_eval, "guard_samples": seen_guard}
        status["reward"], look["reward"] = _gate(reward[:seen_eval], margins["reward"],
                                                 status["reward"])
        status["pass_at_group"], look["pass_at_group"] = _gate(
            passed[:seen_eval], margins["pass_at_group"], status["pass_at_group"])
        if guard is not None:
            status["guard"], look["guard"] = _gate(guard[:seen_guard], margins["guard"],
                                                   status["guard"])
        looks.append(look)
        reason = _stop_reason(status, seen_eval, seen_guard, design, guard is not None)
        if reason is not None:
            return _walked(looks, status, seen_eval, seen_guard, None, reason)
        eval_open = seen_eval < design["eval_max"] and not (
            status["reward"] == "shown" and status["pass_at_group"] == "shown")
        guard_open = guard is not None and seen_guard < design["guard_max"] and \
            status["guard"] is None


def looks_needed(design: dict) -> int:
    """The most looks a design can take: every eval batch, then every guard round."""
    guard_rounds = -(-design["guard_max"] // design["guard_batch"]) if design["guard_batch"] > 0 \
        else 0
    return -(-design["eval_max"] // max(design["eval_batch"], 1)) + guard_rounds


def _stop_reason(status: dict, seen_eval: int, seen_guard: int, design: dict,
                 guarded: bool) -> str | None:
    """Why the re-test stops after this look, or None while a gate is open with room left."""
    if status["reward"] == "ruled_out" or status["pass_at_group"] == "ruled_out":
        return "a gain is ruled out at its minimum"
    if guarded and status["guard"] == "ruled_out":
        return "a guard loss beyond the margin is shown"
    if all(value == "shown" for value in status.values()):
        return "every gate is shown"
    eval_done = seen_eval >= design["eval_max"] or (
        status["reward"] == "shown" and status["pass_at_group"] == "shown")
    guard_done = not guarded or seen_guard >= design["guard_max"] or status["guard"] is not None
    if eval_done and guard_done:
        return "the maximum re-test is spent"
    return None


def _walked(looks: list[dict], status: dict, seen_eval: int, seen_guard: int,
            wanted: tuple[int, int] | None, reason: str | None) -> dict:
    return {"looks": looks, "complete": reason is not None, "eval_prompts": seen_eval,
            "guard_samples": seen_guard, "next": list(wanted) if wanted else None,
            "status": {name: value or "open" for name, value in status.items()},
            "reason": reason}


def design_of(config: Any) -> dict | None:
    """The rule's batch sizes and maxima from a run's config (a dict, as recorded), or None for
    a config that predates the sequential re-test; ValueError for counts that are not
    non-negative integers (a recorded config is untrusted). Eval: prompts (a batch larger than
    the set is the whole set). Guard: paired samples, a round of `group_size` per problem at
    each look. Under the point-estimate rule the re-test is one look: every eval prompt, one
    guard round."""
    if not isinstance(config, dict) or "eval_batch_prompts" not in config:
        return None
    guard = config.get("guard") if isinstance(config.get("guard"), dict) else {}
    counts = {"eval_prompts": config.get("eval_prompts"),
              "eval_batch_prompts": config.get("eval_batch_prompts"),
              "guard.prompts": guard.get("prompts", 0), "guard.group_size": guard.get(
                  "group_size", 0), "guard.rounds": guard.get("rounds", 1)}
    for name, value in counts.items():
        if type(value) is not int or value < 0:
            raise ValueError(f"config.{name} must be a non-negative integer, got {value!r}")
    sequential = (config.get("gates") or {}).get("require_significant_gain") is True
    eval_max = counts["eval_prompts"]
    guard_round = counts["guard.prompts"] * counts["guard.group_size"]
    return {"eval_batch": min(counts["eval_batch_prompts"], eval_max) if sequential
            else eval_max, "eval_max": eval_max, "guard_batch": guard_round,
            "guard_max": guard_round * (max(counts["guard.rounds"], 1) if sequential else 1)}


# The per-observation spreads the plan assumes before a run has its own: those of the default's
# re-test at seed 42 (docs/measurements.md, "The sequential re-test on the default"): eval
# per-prompt reward and pass@4 differences, guard per-sample differences.
PLANNING_SPREADS = {"reward": 0.36, "pass_at_group": 0.52, "guard": 0.58}


def margins_of(gates: dict) -> dict:
    """Each gate's margin for the tests, from a gates table: the gains' minimums and the
    guard's -maximum_guard_reward_loss."""
    return {"reward": float(gates["minimum_reward_gain"]),
            "pass_at_group": float(gates["minimum_pass_at_group_gain"]),
            "guard": 0.0 - float(gates["maximum_guard_reward_loss"])}


def plan(design: dict, eval_group_size: int, margins: dict, spreads: dict) -> dict:
    """What the re-test can cost and resolve, before it runs: its looks, the most completions
    it samples (both policies), and the smallest reward gain, pass@group gain and guard margin
    it resolves at its maximum with probability 0.8 when the per-observation differences have
    the standard deviations `spreads` {"reward", "pass_at_group", "guard"}
    (anytime.resolvable_difference). A guard figure at or below the margin's size means a
    candidate as good as the baseline there is shown non-inferior with probability >= 0.8."""
    looks = math.ceil(design["eval_max"] / design["eval_batch"])
    rounds = design["guard_max"] // design["guard_batch"] if design["guard_batch"] else 0
    return {"eval_looks": looks, "guard_rounds": rounds,
            "max_completions": 2 * (design["eval_max"] * eval_group_size + design["guard_max"]),
            "spreads": dict(spreads),
            "resolvable_reward_gain": resolvable_difference(
                spreads["reward"], design["eval_max"], margins["reward"]),
            "resolvable_pass_at_group_gain": resolvable_difference(
                spreads["pass_at_group"], design["eval_max"], margins["pass_at_group"]),
            "resolvable_guard_gain_beyond_margin": resolvable_difference(
                spreads["guard"], design["guard_max"], margins["guard"])
            if design["guard_max"] else None,
            "eval_prompts_to_show_gain": {
                f"{gain:+.2f}": prompts_to_show(spreads["reward"], gain, margins["reward"],
                                                design["eval_batch"], design["eval_max"])
                for gain in PLANNED_GAINS}}


PLANNED_GAINS = (0.1, 0.2, 0.3)  # the reward gains a plan sizes the re-test for


def prompts_to_show(spread: float, gain: float, margin: float, batch: int, most: int,
                    power: float = 0.8) -> int | None:
    """The observations of the first look (a multiple of `batch`, at most `most`) by which a
    true gain of `gain` is shown above `margin` with probability about `power`; None when even
    the maximum does not resolve it (or there are no looks)."""
    for observations in range(batch, most + batch, batch) if batch > 0 else ():
        observations = min(observations, most)
        resolved = resolvable_difference(spread, observations, margin, power)
        if resolved is not None and resolved <= gain - margin:
            return observations
    return None
