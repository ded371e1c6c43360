"""The decision study's resampler: re-tests drawn from cached completion pools, judged by the
product's own evidence assembly and gate code. Pure Python and numpy (no torch).

A pool holds, per policy and per set ("eval", "guard"), S scored completions for each of P
prompts; sample k of prompt p was drawn with the same seed for every policy (the re-test's
pairing). One draw is the default's re-test design: n of the P prompts without replacement,
and within each drawn prompt g of the S samples without replacement, the same sample indexes
for baseline and candidate (same seeds, as the real re-test pairs them). The draw's records
are reduced by `evidence.assemble.comparison_section` and `evidence.guard.guard_section` (the
run's own code) and judged by `evidence.decisions.decide_run`; the study reads its rows.

"Self" is a second null beside the null candidate: the baseline against itself on disjoint
sample indexes (the first g and the next g of a random order), so the true gain is exactly 0
while the two sides differ by sampling noise; the null candidate, identical completion for
completion, tests only the degenerate null (every difference 0).
"""

from __future__ import annotations

import math

import numpy as np

from grpogate.evidence import metrics
from grpogate.evidence.assemble import bootstrap_settings, comparison_section
from grpogate.evidence.decisions import decide_run
from grpogate.evidence.guard import guard_section

SETS = ("eval", "guard")
GATES = ("reward", "pass_at_group", "guard", "effective_update")  # the re-test's rows
SELF = "self (baseline, disjoint samples)"


def draw_design(rng: np.random.Generator, pool_prompts: int, pool_samples: int, prompts: int,
                samples: int, sides: int = 1) -> tuple[np.ndarray, list[np.ndarray]]:
    """(prompt indexes [n], [sample indexes [n, g]] per side): n of the pool's prompts without
    replacement, and per side g of its samples without replacement; two sides take disjoint
    samples (the first g and the next g of one random order of each prompt's samples)."""
    if prompts > pool_prompts or samples * sides > pool_samples:
        raise ValueError(f"the design ({prompts} prompts x {samples} x {sides} side(s)) does "
                         f"not fit the pool ({pool_prompts} prompts x {pool_samples})")
    chosen = rng.choice(pool_prompts, size=prompts, replace=False)
    order = np.argsort(rng.random((prompts, pool_samples)), axis=1)
    return chosen, [order[:, side * samples:(side + 1) * samples] for side in range(sides)]


def records(pool: dict, policy: str, chosen: np.ndarray, samples: np.ndarray) -> list[dict]:
    """One side's re-test records, shaped as the run's (sample_index: the position 0..g-1
    within the group, the pairing key of `metrics.identical_pairs`)."""
    rows = []
    for row, prompt in enumerate(chosen):
        for position, sample in enumerate(samples[row]):
            rows.append({"policy": policy, "prompt_id": pool["prompt_ids"][prompt],
                         "sample_index": position, "completion": pool["texts"][prompt][sample],
                         "completion_tokens": int(pool["tokens"][prompt][sample]),
                         "hit_max_length": bool(pool["hit"][prompt][sample]),
                         "reward": float(pool["rewards"][prompt][sample])})
    return rows


def draw_evidence(baseline: dict, candidate: dict, config: dict, rng: np.random.Generator,
                  disjoint: bool = False) -> dict:
    """One resampled re-test as the evidence holds it: {"comparison", "guard"} built from the
    drawn records by the run's own assembly. `disjoint`: the candidate side takes the other
    samples (the "self" null, where `candidate` is the baseline's own pool)."""
    evidence = {}
    for name in SETS:
        group = config["eval_group_size"] if name == "eval" else config["guard"]["group_size"]
        prompts = config["eval_prompts"] if name == "eval" else config["guard"]["prompts"]
        base, cand = baseline[name], candidate[name]
        chosen, sides = draw_design(rng, len(base["prompt_ids"]), len(base["rewards"][0]),
                                    prompts, group, 2 if disjoint else 1)
        drawn = (records(base, "baseline", chosen, sides[0])
                 + records(cand, "candidate", chosen, sides[-1]))
        if name == "eval":
            evidence["comparison"] = comparison_section(drawn, config, 0)
        else:
            evidence["guard"] = guard_section(config, drawn, bootstrap_settings(config))
    return evidence


def mixture(baseline: dict, candidate: dict, share: float, seed: int) -> dict:
    """The pool of a policy that answers each prompt's sample k as the candidate does with
    probability `share` and as the baseline does otherwise (one seeded coin per prompt and
    sample, the same coin for every field): every completion real, every true gain `share`
    times the candidate's in expectation (the pool's own figure is exact for its coins)."""
    rng = np.random.default_rng(seed)
    mixed = {}
    for name in SETS:
        base, cand = baseline[name], candidate[name]
        if base["prompt_ids"] != cand["prompt_ids"]:
            raise ValueError(f"{name}: the two pools hold different prompts")
        coins = rng.random(np.shape(base["rewards"])) < share
        mixed[name] = {"prompt_ids": base["prompt_ids"], **{
            field: [[(c if coin else b) for b, c, coin in zip(row_b, row_c, row_coins)]
                    for row_b, row_c, row_coins in zip(base[field], cand[field], coins)]
            for field in ("rewards", "texts", "tokens", "hit")}}
    return mixed


def expected_pass(rewards: np.ndarray, samples: int) -> np.ndarray:
    """Per prompt, the probability that g samples drawn without replacement from its S hold at
    least one success: 1 - C(S - k, g) / C(S, g), k its successes."""
    total = rewards.shape[1]
    successes = (rewards >= metrics.SUCCESS_REWARD).sum(axis=1)
    return np.array([1.0 - math.comb(total - int(k), samples) / math.comb(total, samples)
                     for k in successes])


def true_gains(baseline: dict, candidate: dict, config: dict) -> dict:
    """The candidate's gains on the whole pool, each the expectation of the design's estimate:
    the paired mean difference of per-prompt mean rewards (eval, guard) and of per-prompt
    pass@g probabilities, with the pool's own 95 % paired bootstrap interval."""
    def gain(deltas: np.ndarray) -> dict:
        interval = metrics.paired_bootstrap(deltas.tolist(), **bootstrap_settings(config))
        return {"point": float(deltas.mean()), "low": interval["low"], "high": interval["high"]}

    def rewards(pool: dict) -> np.ndarray:
        return np.asarray(pool["rewards"], dtype=float)

    eval_b, eval_c = rewards(baseline["eval"]), rewards(candidate["eval"])
    guard_b, guard_c = rewards(baseline["guard"]), rewards(candidate["guard"])
    group = config["eval_group_size"]
    return {"reward": gain(eval_c.mean(axis=1) - eval_b.mean(axis=1)),
            "pass_at_group": gain(expected_pass(eval_c, group) - expected_pass(eval_b, group)),
            "guard": gain(guard_c.mean(axis=1) - guard_b.mean(axis=1)),
            "baseline_reward": float(eval_b.mean()), "candidate_reward": float(eval_c.mean())}


class _Whole:
    """The "draw" that takes every prompt and every sample in order: a real re-test judged as
    it was sampled (draw_design's interface: `choice` and `random`)."""

    @staticmethod
    def choice(count: int, size: int, replace: bool = False) -> np.ndarray:
        return np.arange(size)

    @staticmethod
    def random(shape: tuple[int, int]) -> np.ndarray:
        return np.tile(np.arange(shape[1], dtype=float), (shape[0], 1))


WHOLE = _Whole()


def summarize_real(runs: list[dict]) -> dict:
    """Real re-tests' verdicts: P(accept), P(each gate fails), each with its binomial standard
    error, and every re-test's intervals (for coverage against a pool's truth)."""
    count = len(runs)
    accepted = sum(all(run["passed"].values()) for run in runs)
    se = lambda k: math.sqrt(max(k * (count - k), 1) / count) / count  # noqa: E731
    failed = {gate: sum(not run["passed"].get(gate, True) for run in runs) for gate in GATES}
    return {"count": count, "accepted": accepted, "p_accept": accepted / count,
            "p_accept_se": se(accepted),
            "p_fail": {gate: k / count for gate, k in failed.items()},
            "runs": runs}


def interval(evidence: dict, gate: str) -> dict | None:
    """The recorded 95 % paired interval each gate's truth is compared with."""
    section, field = {"reward": ("comparison", "reward_mean_gain"),
                      "pass_at_group": ("comparison", "pass_at_group_gain"),
                      "guard": ("guard", "reward_mean_gain")}[gate]
    paired = (evidence.get(section) or {}).get("paired") or {}
    return paired.get(field)


def judge(evidence: dict, gates: dict) -> dict:
    """The re-test's rows of `decide_run` on one draw: {gate: passed}, and each row's test."""
    rows = {row["name"]: row for row in decide_run(evidence, gates)["checks"]}
    return {"passed": {gate: rows[gate]["passed"] for gate in GATES if gate in rows},
            "tests": {gate: rows[gate].get("test") for gate in GATES if gate in rows}}


def study_policy(baseline: dict, candidate: dict, config: dict, draws: int, seed: int,
                 disjoint: bool = False) -> dict:
    """`draws` resampled re-tests of one candidate: P(accept on the re-test's gates), P(each
    gate fails), coverage of the true gains by the recorded 95 % intervals, mean widths."""
    gates = config["gates"]
    truth = true_gains(baseline, candidate, config)
    if disjoint:  # the baseline against itself: every true gain is 0 by construction
        truth = {**truth, **{key: {"point": 0.0, "low": 0.0, "high": 0.0}
                             for key in ("reward", "pass_at_group", "guard")}}
    rng = np.random.default_rng(seed)
    failed = dict.fromkeys(GATES, 0)
    accepted, covered, widths = 0, dict.fromkeys(truth, 0), {}
    detectable: dict[str, list] = {}
    for _ in range(draws):
        evidence = draw_evidence(baseline, candidate, config, rng, disjoint)
        verdict = judge(evidence, gates)
        accepted += all(verdict["passed"].values())
        for gate, passed in verdict["passed"].items():
            failed[gate] += not passed
        for gate in ("reward", "pass_at_group", "guard"):
            bounds, true = interval(evidence, gate), truth[gate]["point"]
            covered[gate] += bounds["low"] <= true <= bounds["high"]
            widths.setdefault(gate, []).append(bounds["high"] - bounds["low"])
            test = verdict["tests"].get(gate) or {}
            if isinstance(test.get("detectable_difference"), float):
                detectable.setdefault(gate, []).append(test["detectable_difference"])
    share = lambda count: count / draws  # noqa: E731
    return {"draws": draws, "seed": seed, "truth": truth,
            "p_accept": share(accepted),
            "p_fail": {gate: share(count) for gate, count in failed.items()},
            "coverage": {gate: share(covered[gate]) for gate in widths},
            "mean_width": {gate: float(np.mean(values)) for gate, values in widths.items()},
            "mean_detectable": {gate: float(np.mean(values)) for gate, values in
                                detectable.items()},
            "binomial_se_at_half": math.sqrt(0.25 / draws)}


def markdown(results: list[dict], design: dict) -> str:
    """The study's table: one row per policy."""
    def gain(value: dict) -> str:
        return f"{value['point']:+.3f} [{value['low']:+.3f}, {value['high']:+.3f}]"

    lines = [f"Design: {design['eval_prompts']} eval prompts x {design['eval_group_size']} and "
             f"{design['guard_prompts']} guard prompts x {design['guard_group_size']}, drawn "
             f"from pools of {design['eval_pool']} x {design['eval_samples']} and "
             f"{design['guard_pool']} x {design['guard_samples']}; {design['draws']} draws per "
             "policy. Coverage and width: the recorded 95 % paired bootstrap intervals.", "",
             "| policy | true reward gain [pool 95 %] | true pass@g gain | true guard gain | "
             "P(accept) | P(fail) reward / pass@g / guard / effective update | "
             "coverage reward / pass@g / guard | mean width reward / pass@g / guard |",
             "|---|---|---|---|---|---|---|---|"]
    for result in results:
        truth, fail = result["truth"], result["p_fail"]
        coverage, width = result["coverage"], result["mean_width"]
        lines.append(
            f"| {result['policy']} | {gain(truth['reward'])} | {gain(truth['pass_at_group'])} | "
            f"{gain(truth['guard'])} | {result['p_accept']:.3f} | "
            + " / ".join(f"{fail.get(g, float('nan')):.3f}" for g in GATES) + " | "
            + " / ".join(f"{coverage[g]:.3f}" for g in ("reward", "pass_at_group", "guard"))
            + " | " + " / ".join(f"{width[g]:.3f}" for g in ("reward", "pass_at_group", "guard"))
            + " |")
    return "\n".join(lines) + "\n"
