"""Pure reductions: per-completion and per-trajectory records -> metrics and paired statistics.

Evaluation and rollout yield plain records; everything here turns them into JSON-serializable
dicts (Python floats / ints / bools / lists). No torch and no scipy at runtime: the binomial tail
is computed exactly with `math.comb`, and the bootstrap uses numpy's seeded `default_rng`, so the
same records and seed always give the same evidence numbers.

Paired statistics treat the eval PROMPT as the unit: baseline and candidate answer the same
prompts, so per-prompt differences remove between-prompt difficulty from the comparison.
"""

from __future__ import annotations

import math

import numpy as np

from grpogate.evidence.anytime import betting_test

SUCCESS_REWARD = 1.0  # a completion "passes" when its verifier reward reaches this value

_EVAL_FIELDS = ("prompt_id", "completion_tokens", "hit_max_length", "reward")
_ROLLOUT_FIELDS = ("step", "prompt_id", "completion_tokens", "hit_max_length", "reward")


def _require_fields(records: list[dict], fields: tuple[str, ...], kind: str) -> None:
    for index, record in enumerate(records):
        missing = [name for name in fields if name not in record]
        if missing:
            raise ValueError(f"{kind} record {index} lacks field(s) {', '.join(missing)}")


def _mean(values) -> float:
    # fsum is exact and order-independent, so two equal reward multisets give bit-equal means
    # and their paired difference is exactly 0 (a tie for the sign test, not noise).
    values = list(values)
    return math.fsum(values) / len(values) if values else 0.0


# ---- lengths ---------------------------------------------------------------------------------


def length_summary(token_counts: list[int]) -> dict:
    """Mean, median, p90 (numpy's default linear interpolation), min, max and count."""
    if len(token_counts) == 0:
        return {"count": 0, "mean": 0.0, "median": 0.0, "p90": 0.0, "min": 0.0, "max": 0.0}
    counts = np.asarray(token_counts, dtype=float)
    return {
        "count": int(counts.size),
        "mean": _mean(counts.tolist()),
        "median": float(np.median(counts)),
        "p90": float(np.percentile(counts, 90)),
        "min": float(counts.min()),
        "max": float(counts.max()),
    }


def shared_bin_edges(
    a_counts: list[int], b_counts: list[int], max_new_tokens: int, bins: int = 12
) -> list[float]:
    """Equal-width edges from 0 to the token budget, so two policies' histograms line up.

    The top edge is stretched past `max_new_tokens` only if some count exceeds it (a budget
    misreport), so that no completion ever falls outside the histogram.
    """
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    upper = max([max_new_tokens, *a_counts, *b_counts])
    upper = upper if upper > 0 else 1  # keep edges strictly increasing
    return [float(edge) for edge in np.linspace(0.0, float(upper), bins + 1)]


def length_histogram(token_counts: list[int], bin_edges: list[float]) -> dict:
    """Counts per bin (last bin closed, as numpy.histogram). Out-of-range counts raise."""
    edges = np.asarray(bin_edges, dtype=float)
    if edges.size < 2 or np.any(np.diff(edges) <= 0):
        raise ValueError("bin_edges must hold at least two strictly increasing values")
    counts = np.asarray(token_counts, dtype=float)
    outside = counts[(counts < edges[0]) | (counts > edges[-1])]
    if outside.size:
        # numpy would drop these silently; a histogram that loses completions misleads.
        raise ValueError(f"token count {outside[0]:g} lies outside [{edges[0]:g}, {edges[-1]:g}]")
    histogram, _ = np.histogram(counts, bins=edges)
    return {"bin_edges": edges.tolist(), "counts": [int(c) for c in histogram]}


# ---- one policy's evaluation -----------------------------------------------------------------


def summarize_completions(records: list[dict], group_size: int, max_new_tokens: int) -> dict:
    """Reduce ONE policy's fresh eval completions to mean reward, pass@group and lengths.

    Every prompt must carry exactly `group_size` samples: an incomplete evaluation would bias
    pass@group downwards (fewer tries), so it raises instead of being reduced silently.
    """
    if not records:
        raise ValueError("no completion records to summarize")
    _require_fields(records, _EVAL_FIELDS, "completion")
    policies = sorted({str(r["policy"]) for r in records if "policy" in r})
    if len(policies) > 1:
        raise ValueError(f"records mix policies {policies}; summarize one policy at a time")

    rewards_by_prompt: dict[str, list[float]] = {}
    for record in records:
        rewards_by_prompt.setdefault(str(record["prompt_id"]), []).append(float(record["reward"]))

    per_prompt = []  # in the records' order: the re-test's drawn order, which its looks follow
    for prompt_id in rewards_by_prompt:
        rewards = rewards_by_prompt[prompt_id]
        if len(rewards) != group_size:
            raise ValueError(
                f"prompt {prompt_id!r} has {len(rewards)} samples, expected group_size={group_size}"
            )
        successes = sum(reward >= SUCCESS_REWARD for reward in rewards)
        per_prompt.append({
            "prompt_id": prompt_id,
            "mean_reward": _mean(rewards),
            "pass_rate": successes / len(rewards),
            "passed": successes > 0,
            "samples": len(rewards),
        })

    token_counts = [int(r["completion_tokens"]) for r in records]
    return {
        "prompt_count": len(per_prompt),
        "completion_count": len(records),
        "mean_reward": _mean(float(r["reward"]) for r in records),
        "pass_at_group": sum(p["passed"] for p in per_prompt) / len(per_prompt),
        "max_length_hit_ratio": sum(bool(r["hit_max_length"]) for r in records) / len(records),
        "length": length_summary(token_counts),
        "length_histogram": length_histogram(
            token_counts, shared_bin_edges(token_counts, [], max_new_tokens)
        ),
        "per_prompt": per_prompt,
    }


# ---- paired statistics -----------------------------------------------------------------------


def paired_bootstrap(
    deltas: list[float], resamples: int = 2000, seed: int = 0, confidence: float = 0.95
) -> dict:
    """Percentile bootstrap confidence interval for the MEAN of per-prompt paired differences.

    Method: draw `resamples` samples of the n prompts with replacement (one
    `numpy.random.default_rng(seed)` stream, an index matrix of shape [resamples, n]), take
    each resample's mean delta, and report the (1-confidence)/2 and (1+confidence)/2 quantiles
    of those means (numpy's linear interpolation). `point` is the mean of the observed deltas.
    Resampling prompts, not completions, keeps each prompt's baseline/candidate pair together.
    """
    if len(deltas) == 0:
        raise ValueError("paired_bootstrap needs at least one per-prompt difference")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence}")
    values = np.asarray(deltas, dtype=float)
    rng = np.random.default_rng(seed)
    resample_index = rng.integers(0, values.size, size=(resamples, values.size))  # [B, n]
    resample_means = values[resample_index].mean(axis=1)  # [B]
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(resample_means, [tail, 1.0 - tail])
    return {
        "point": _mean(values.tolist()),
        "low": float(low),
        "high": float(high),
        "resamples": int(resamples),
        "seed": int(seed),
        "confidence": float(confidence),
    }


def identical_pairs(records: list[dict]) -> dict:
    """{"pairs", "identical"}: how many (prompt, sample) pairs both policies answered, and in
    how many the candidate's completion text equals the baseline's. The re-test draws both with
    the same seeds, so a candidate that computes the baseline's function answers identically."""
    texts: dict[tuple, dict] = {}
    for record in records:
        if "completion" not in record:
            continue  # a record without its text cannot show the pair identical
        key = (str(record["prompt_id"]), record["sample_index"])
        texts.setdefault(key, {})[str(record["policy"])] = record["completion"]
    paired = [pair for pair in texts.values() if {"baseline", "candidate"} <= set(pair)]
    return {"pairs": len(paired),
            "identical": sum(pair["baseline"] == pair["candidate"] for pair in paired)}


def _two_sided_binomial_p(successes: int, trials: int) -> float:
    """Exact two-sided p under Binomial(trials, 0.5): min(1, 2 * P[X <= min(k, n - k)])."""
    if trials == 0:
        return 1.0
    smaller = min(successes, trials - successes)
    lower_tail = sum(math.comb(trials, i) for i in range(smaller + 1))
    return min(1.0, 2 * lower_tail / 2**trials)  # int / int true division: correctly rounded


def sign_test(deltas: list[float]) -> dict:
    """Exact two-sided sign test over the non-zero per-prompt differences (ties dropped)."""
    positive = sum(delta > 0 for delta in deltas)
    negative = sum(delta < 0 for delta in deltas)
    return {
        "positive": positive,
        "negative": negative,
        "ties": len(deltas) - positive - negative,
        "p_value": _two_sided_binomial_p(positive, positive + negative),
    }


def mcnemar_exact(baseline_passed: list[bool], candidate_passed: list[bool]) -> dict:
    """Exact McNemar test on paired pass/fail outcomes: binomial on the discordant pairs."""
    if len(baseline_passed) != len(candidate_passed):
        raise ValueError(
            f"paired outcomes differ in length: {len(baseline_passed)} vs {len(candidate_passed)}"
        )
    pairs = [(bool(b), bool(c)) for b, c in zip(baseline_passed, candidate_passed)]
    baseline_only = sum(b and not c for b, c in pairs)
    candidate_only = sum(c and not b for b, c in pairs)
    return {
        "baseline_only": baseline_only,
        "candidate_only": candidate_only,
        "both": sum(b and c for b, c in pairs),
        "neither": sum(not b and not c for b, c in pairs),
        "p_value": _two_sided_binomial_p(candidate_only, baseline_only + candidate_only),
    }


def paired_comparison(
    baseline_summary: dict,
    candidate_summary: dict,
    resamples: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict:
    """Candidate minus baseline on the same eval prompts, with intervals and exact tests.

    All three bootstraps use the same seed, hence the same prompt resamples: the intervals
    describe one joint resampling of the eval set rather than three unrelated ones.
    """
    baseline = {p["prompt_id"]: p for p in baseline_summary["per_prompt"]}
    candidate = {p["prompt_id"]: p for p in candidate_summary["per_prompt"]}
    mismatched = sorted(set(baseline) ^ set(candidate))
    if mismatched:
        first = mismatched[0]
        where = "baseline" if first in baseline else "candidate"
        raise ValueError(f"prompt {first!r} appears only in the {where} evaluation")
    prompt_ids = sorted(baseline)
    if not prompt_ids:
        raise ValueError("no eval prompts to compare")
    for prompt_id in prompt_ids:
        if baseline[prompt_id]["samples"] != candidate[prompt_id]["samples"]:
            # pass@group is only comparable between groups of the same size
            raise ValueError(f"prompt {prompt_id!r} has different sample counts per policy")

    def gains(field: str) -> list[float]:
        return [float(candidate[i][field]) - float(baseline[i][field]) for i in prompt_ids]

    def interval(deltas: list[float]) -> dict:
        result = paired_bootstrap(deltas, resamples=resamples, seed=seed, confidence=confidence)
        return {key: result[key] for key in ("point", "low", "high")}

    reward_deltas = gains("mean_reward")
    pass_rate_deltas = gains("pass_rate")
    passed_deltas = [float(candidate[i]["passed"]) - float(baseline[i]["passed"]) for i in prompt_ids]
    return {
        "prompt_count": len(prompt_ids),
        # gain_test: the anytime-valid one-sided test of "no gain" on every prompt
        # (evidence/anytime.py), the test the gain gates read at their margins.
        "reward_mean_gain": {**interval(reward_deltas), "sign_test": sign_test(reward_deltas),
                             "gain_test": betting_test(reward_deltas)},
        "pass_at_group_gain": {
            **interval(passed_deltas), "gain_test": betting_test(passed_deltas),
            "mcnemar": mcnemar_exact(
                [baseline[i]["passed"] for i in prompt_ids],
                [candidate[i]["passed"] for i in prompt_ids],
            ),
        },
        "pass_rate_gain": {**interval(pass_rate_deltas), "sign_test": sign_test(pass_rate_deltas)},
        "length_mean_change": float(candidate_summary["length"]["mean"])
        - float(baseline_summary["length"]["mean"]),
        "max_length_hit_ratio_change": float(candidate_summary["max_length_hit_ratio"])
        - float(baseline_summary["max_length_hit_ratio"]),
        "resamples": int(resamples),
        "seed": int(seed),
        "confidence": float(confidence),
    }


def per_prompt_deltas(baseline: list, candidate: list, field: str) -> list[float] | None:
    """candidate - baseline of `field` per prompt id (float(True) = 1 for `passed`), in the
    baseline's order; None when the two lists do not pair (ids differ, a value is not a finite
    number): the decision fails the gate rather than guess."""
    try:
        base = {str(p["prompt_id"]): p[field] for p in baseline}
        cand = {str(p["prompt_id"]): p[field] for p in candidate}
    except (TypeError, KeyError):
        return None
    if not all(isinstance(v, (int, float)) for v in [*base.values(), *cand.values()]):
        return None
    if not base or set(base) != set(cand) or len(base) != len(baseline) or len(cand) != len(
            candidate):
        return None
    deltas = [float(cand[key]) - float(base[key]) for key in base]
    return deltas if all(math.isfinite(d) for d in deltas) else None


# ---- training rollouts (docs/design.md §3) -------------------------------------------------------------


def component_means(trajectories: list[dict]) -> dict:
    """Mean of every reward component over the records that carry it, by component name."""
    values: dict[str, list[float]] = {}
    for record in trajectories:
        for name, value in (record.get("rewards") or {}).items():
            if value is not None:  # a TRL-style component that does not apply to this one
                values.setdefault(str(name), []).append(float(value))
    return {name: _mean(items) for name, items in values.items()}


def rollout_summary(trajectories: list[dict], group_size: int) -> dict:
    """Reduce training trajectory records to the coverage quantities of docs/design.md §3.

    A group is one (step, prompt_id); groups keep first-seen order so the result depends only
    on the records. Only complete groups whose rewards differ carry a group-relative advantage:
    a zero-variance group has all-zero advantages and contributes no gradient, so counting it
    as coverage would overstate the update (hence valid vs. total).
    """
    _require_fields(trajectories, _ROLLOUT_FIELDS, "trajectory")
    rewards_by_group: dict[tuple, list[float]] = {}
    for record in trajectories:
        key = (record["step"], str(record["prompt_id"]))
        rewards_by_group.setdefault(key, []).append(float(record["reward"]))

    reward_groups = list(rewards_by_group.values())
    complete_groups = [rewards for rewards in reward_groups if len(rewards) == group_size]
    valid_group_count = sum(max(rewards) > min(rewards) for rewards in complete_groups)
    total = len(trajectories)
    return {
        "reward_groups": reward_groups,
        "group_count": len(reward_groups),
        "complete_group_count": len(complete_groups),
        "valid_group_count": valid_group_count,
        "valid_group_ratio": valid_group_count / len(reward_groups) if reward_groups else 0.0,
        "total_trajectories": total,
        "effective_trajectory_count": valid_group_count * group_size,
        "max_length_hit_ratio": (
            sum(bool(r["hit_max_length"]) for r in trajectories) / total if total else 0.0
        ),
        "mean_reward": _mean(float(r["reward"]) for r in trajectories),
        "length": length_summary([int(r["completion_tokens"]) for r in trajectories]),
    }
