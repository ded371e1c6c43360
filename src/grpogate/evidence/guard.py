"""The re-test's two safety readings, from plain records: the guard set and the drift.

Guard: baseline and candidate also answer a neighbouring task's problems (config `[guard]`),
in rounds (every problem `group_size` more times a round), and the pair is reduced as the eval
set is (`metrics.summarize_completions` over all rounds, then `metrics.paired_comparison` with
the run's bootstrap seed) for a reader, plus the paired sample differences the non-inferiority
test reads (retest_checks, stopping) against gates.maximum_guard_reward_loss.

Drift: every re-test completion carries its policy's mean per-token entropy, and every
candidate completion its mean per-token KL to the baseline (exact, over the vocabulary, at the
sampling temperature; sampling/drift.py measures them). Reduced here as token-weighted means, so
`decide` recomputes the run's numbers and its gate from the records; the per-token values
themselves are taken as recorded (re-deriving them needs the model).

Pure Python: the run and the audit share these functions.
"""

from __future__ import annotations

import math

from grpogate.evidence import metrics

DRIFT_MEASURE = ("exact per-token KL(candidate || baseline) = sum over the vocabulary of "
                 "p_candidate x (log p_candidate - log p_baseline), each position's "
                 "softmax(logits / temperature), on the candidate's fresh re-test completions; "
                 "entropy: each policy's own completions")
DRIFT_TRUST = ("each completion's mean per-token KL and entropy are taken as recorded "
               "(re-deriving them needs the model); the token-weighted means and the gate are "
               "recomputed from the records")
GUARD_RULE = ("non-inferiority: the guard passes only when the anytime-valid test over its "
              "paired samples shows the guard gain above -gates.maximum_guard_reward_loss (its "
              "lower bound at 97.5 %); a loss not seen is not enough (the point estimate >= "
              "-maximum_guard_reward_loss when gates.require_significant_gain is false)")


def guard_section(config: dict, guard_records: list[dict], bootstrap: dict,
                  skipped: bool = False) -> dict | None:
    """The evidence's `guard`: off, skipped, or both policies' guard summaries and the paired
    comparison. `bootstrap`: {resamples, seed, confidence} as the eval comparison uses them.
    None for a run recorded before the guard existed (its config has no `guard`)."""
    guard = config.get("guard")
    if not isinstance(guard, dict):
        return None
    task = {"source": "reasoning-gym", "name": guard["task"], "params": guard["params"],
            "seed": guard["seed"]}
    if guard["prompts"] <= 0:
        return {"enabled": False, "note": "off: guard.prompts = 0, no guard set was scored"}
    section = {"enabled": True, "task": task, "prompts": guard["prompts"],
               "group_size": guard["group_size"], "rule": GUARD_RULE}
    if skipped:
        return section | {"skipped": True}
    budget = config["max_new_tokens"]
    per_round = guard["prompts"] * guard["group_size"]
    answered = sum(r["policy"] == "baseline" for r in guard_records)
    if per_round <= 0 or answered % per_round:
        raise ValueError(f"the guard records hold {answered} baseline samples, not whole rounds "
                         f"of {guard['prompts']} problems x {guard['group_size']}")
    rounds = answered // per_round
    baseline, candidate = (metrics.summarize_completions(
        [r for r in guard_records if r["policy"] == name], rounds * guard["group_size"], budget)
        for name in ("baseline", "candidate"))
    paired = metrics.paired_comparison(baseline, candidate, **bootstrap)
    return section | {
        "rounds": rounds, "samples_per_problem": rounds * guard["group_size"],
        "reward_mean_gain": candidate["mean_reward"] - baseline["mean_reward"],
        "pass_at_group_gain": candidate["pass_at_group"] - baseline["pass_at_group"],
        "baseline": baseline, "candidate": candidate, "paired": paired,
        "sample_differences": sample_differences(guard_records),
        "identical_completions": metrics.identical_pairs(guard_records)}


NON_FINITE_NOTE = ("completions whose entropy or KL was NaN or infinite (the candidate's "
                   "logits were): recorded as null; the means are null and the finite_retest "
                   "check rejects the candidate")


def sample_differences(records: list[dict]) -> list[float]:
    """Candidate minus baseline reward of every paired guard sample (same prompt, same sample
    index: the same seed), in the baseline records' order (round by round): the observations
    the guard's test reads. A sample only one policy answered pairs with nothing and is left
    out (the audit's record checks catch it)."""
    candidate = {(str(r["prompt_id"]), r["sample_index"]): float(r["reward"])
                 for r in records if r["policy"] == "candidate"}
    return [candidate[key] - float(r["reward"]) for r in records
            if r["policy"] == "baseline"
            and (key := (str(r["prompt_id"]), r["sample_index"])) in candidate]


def _token_weighted(records: list[dict], key: str) -> tuple[float | None, int]:
    """(sum of value x completion tokens / tokens, tokens) over the records carrying `key`; the
    mean is None when a record holds null there (a NaN or infinite value, sampling/retest.py):
    no mean of a diverged model's values is a number."""
    weighted = [(None if r[key] is None else float(r[key]), int(r["completion_tokens"]))
                for r in records if key in r]
    tokens = sum(n for _, n in weighted)
    if not tokens or any(value is None for value, _ in weighted):
        return None, tokens
    return math.fsum(value * n for value, n in weighted) / tokens, tokens


def drift_section(eval_records: list[dict]) -> dict | None:
    """The re-test's drift: the candidate's token-weighted mean KL to the baseline and both
    policies' mean entropy. None when no record carries them (a run recorded before drift)."""
    if not any("entropy" in r or "kl_to_baseline" in r for r in eval_records):
        return None
    by_policy = {name: [r for r in eval_records if r.get("policy") == name]
                 for name in ("baseline", "candidate")}
    kl, kl_tokens = _token_weighted(by_policy["candidate"], "kl_to_baseline")
    entropy = {name: _token_weighted(records, "entropy") for name, records in by_policy.items()}
    non_finite = sum(1 for r in eval_records if r.get("non_finite"))
    return {"measure": DRIFT_MEASURE, "kl_to_baseline": kl, "kl_tokens": kl_tokens,
            **({"non_finite_completions": non_finite, "non_finite_note": NON_FINITE_NOTE}
               if non_finite else {}),
            "entropy": {name: value for name, (value, _) in entropy.items()},
            "entropy_tokens": {name: tokens for name, (_, tokens) in entropy.items()},
            "trust": DRIFT_TRUST}
