"""The decision study's resampler: sequential re-tests drawn from cached completion pools,
judged by the product's own evidence assembly, stopping rule and gate code. Pure Python and
numpy (no torch).

A pool holds, per policy and per set ("eval", "guard"), S scored completions for each of P
prompts; sample k of prompt p was drawn with the same seed for every policy (the re-test's
pairing). One draw follows the default's sequential re-test (evidence/stopping.py) exactly:

- eval: the pool's prompts in a random order without replacement (the run's seeded shuffle of
  its eval pool), each with `eval_group_size` of its S samples without replacement, the same
  sample indexes for baseline and candidate (same seeds); looks take `eval_batch_prompts` more
  prompts, up to `eval_prompts`;
- guard: rounds over the first `guard.prompts` problems of the guard pool (the guard's whole
  population, as the run's every round covers it); in each round every problem gets
  `guard.group_size` more samples, the same indexes for both policies, up to `guard.rounds`.
  A problem's samples are taken in a random order and not reused across rounds while the pool
  has fresh ones; past S / group_size rounds a new random order of the same S begins. What the
  pool's finite samples imply: the draws sample each problem's S pool completions without
  replacement, so the truth the guard's bound is judged against is the pool's mean over its S
  samples, and a draw that uses all S of a problem measures that problem's pool mean with no
  sampling error at all (the real re-test draws every round fresh from the model). With
  S >= rounds x group_size the resampled guard is the real design up to this finite-population
  effect, which makes late looks less noisy than the real ones; with fewer, samples repeat and
  the guard's figures are optimistic (the study says so in its design line). The eval side has
  the same effect at the scale of eval_prompts / eval pool (256 of 1,024: small).

Each draw's per-prompt (eval) and per-sample (guard) differences go through
`stopping.walk_looks` with the run's design and margins; the draw keeps the records up to the
look where the rule stops, the run's `assemble.comparison_section`, `guard.guard_section` and
`assemble.retest_looks` build its evidence, and `decide_run` judges it (its `retest_stopping`
row checks that the draw stopped where the rule stops). The rule's walk is recomputed by
`decide_run` for every row that reads it; the study caches that pure function per draw
(`_walk_cache`), the same inputs giving the same looks.

"Self" is a second null beside the null candidate: the baseline against itself on disjoint
sample indexes (the first and second half of each random order of a prompt's samples), so the
true gain is exactly 0 while the two sides differ by sampling noise; the null candidate,
identical completion for completion, tests only the degenerate null (every difference 0).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from grpogate.evidence import metrics, stopping
from grpogate.evidence.assemble import bootstrap_settings, comparison_section, retest_looks
from grpogate.evidence.decisions import decide_run
from grpogate.evidence.guard import guard_section

SETS = ("eval", "guard")
TESTED = ("reward", "pass_at_group", "guard")  # the gates the anytime-valid tests decide
# decide_run's rows a re-test decides (retest_kl is not here: pools keep no per-token KL).
GATES = ("reward", "pass_at_group", "guard", "length_budget", "effective_update",
         "retest_stopping")
SELF = "self (baseline, disjoint samples)"
# The design before the sequential rule: 128 eval prompts x 4 and 64 guard prompts x 4, one look.
FIXED_COMPLETIONS_PER_POLICY = 128 * 4 + 64 * 4


def draw_design(rng: np.random.Generator, pool_prompts: int, pool_samples: int, prompts: int,
                samples: int, sides: int = 1) -> tuple[np.ndarray, list[np.ndarray]]:
    """(prompt indexes [n] in drawn order, [sample indexes [n, g]] per side): n of the pool's
    prompts without replacement, and per side g of its samples without replacement; two sides
    take disjoint samples (the first g and the next g of one random order of each prompt's)."""
    if prompts > pool_prompts or samples * sides > pool_samples:
        raise ValueError(f"the design ({prompts} prompts x {samples} x {sides} side(s)) does "
                         f"not fit the pool ({pool_prompts} prompts x {pool_samples})")
    chosen = rng.choice(pool_prompts, size=prompts, replace=False)
    order = np.argsort(rng.random((prompts, pool_samples)), axis=1)
    return chosen, [order[:, side * samples:(side + 1) * samples] for side in range(sides)]


def guard_schedule(rng: np.random.Generator, problems: int, pool_samples: int, rounds: int,
                   samples: int, sides: int = 1) -> list[np.ndarray]:
    """Per side, the sample indexes [rounds, problems, g] of every guard round: each problem's
    samples in one random order (per side its own share of it: the first or second half for
    two sides), taken g a round without reuse; when a side's share is spent a new random order
    of the pool's samples begins (the module docstring says what that implies)."""
    share = pool_samples // sides
    if samples > share:
        raise ValueError(f"the guard design ({samples} samples a round x {sides} side(s)) does "
                         f"not fit the pool ({pool_samples} samples a problem)")
    cycles = math.ceil(rounds * samples / share)
    orders = [np.argsort(rng.random((problems, pool_samples)), axis=1) for _ in range(cycles)]
    schedules = []
    for side in range(sides):
        taken = np.concatenate([order[:, side * share:(side + 1) * share] for order in orders],
                               axis=1)[:, :rounds * samples]  # [problems, rounds x g]
        schedules.append(taken.reshape(problems, rounds, samples).transpose(1, 0, 2))
    return schedules


def records(pool: dict, policy: str, chosen, samples, first_index: int = 0) -> list[dict]:
    """One side's re-test records, shaped as the run's (sample_index: `first_index` + the
    position within the group, the pairing key of `metrics.identical_pairs`)."""
    rows = []
    for row, prompt in enumerate(chosen):
        for position, sample in enumerate(samples[row]):
            rows.append({"policy": policy, "prompt_id": pool["prompt_ids"][prompt],
                         "sample_index": first_index + position,
                         "completion": pool["texts"][prompt][sample],
                         "completion_tokens": int(pool["tokens"][prompt][sample]),
                         "hit_max_length": bool(pool["hit"][prompt][sample]),
                         "reward": float(pool["rewards"][prompt][sample])})
    return rows


def _plan(baseline: dict, config: dict, rng, disjoint: bool) -> dict:
    """A draw's whole schedule up to the design's maxima: eval order and samples, guard rounds."""
    design, sides = stopping.design_of(config), 2 if disjoint else 1
    base = baseline["eval"]
    chosen, eval_sides = draw_design(rng, len(base["prompt_ids"]), len(base["rewards"][0]),
                                     design["eval_max"], config["eval_group_size"], sides)
    guard = config["guard"]
    if guard["prompts"] > len(baseline["guard"]["prompt_ids"]):
        raise ValueError(f"the guard pool holds {len(baseline['guard']['prompt_ids'])} problems, "
                         f"fewer than guard.prompts = {guard['prompts']}")
    rounds = design["guard_max"] // max(design["guard_batch"], 1)
    guard_sides = guard_schedule(rng, guard["prompts"], len(baseline["guard"]["rewards"][0]),
                                 rounds, guard["group_size"], sides) if rounds else None
    return {"design": design, "chosen": chosen, "eval": eval_sides, "guard": guard_sides}


def _differences(baseline: dict, candidate: dict, plan: dict) -> tuple[list, list, list | None]:
    """The walk's observations in drawn order: per eval prompt the reward and pass@g
    differences, per guard sample (round by round, problem by problem) the reward difference."""
    rewards = {name: np.asarray(pool["eval"]["rewards"], dtype=float)
               for name, pool in (("b", baseline), ("c", candidate))}
    chosen = plan["chosen"][:, None]
    base = rewards["b"][chosen, plan["eval"][0]]  # [n, g]
    cand = rewards["c"][chosen, plan["eval"][-1]]
    reward = (cand.mean(axis=1) - base.mean(axis=1)).tolist()
    success = metrics.SUCCESS_REWARD
    passed = ((cand >= success).any(axis=1).astype(float)
              - (base >= success).any(axis=1).astype(float)).tolist()
    if plan["guard"] is None:
        return reward, passed, None
    problems = np.arange(plan["guard"][0].shape[1])[None, :, None]
    guard_b = np.asarray(baseline["guard"]["rewards"], dtype=float)[problems, plan["guard"][0]]
    guard_c = np.asarray(candidate["guard"]["rewards"], dtype=float)[problems, plan["guard"][-1]]
    return reward, passed, (guard_c - guard_b).reshape(-1).tolist()


def margins_of(gates: dict) -> dict:
    """The walk's margins from the gates (sampling/sequential.margins_of, on the dict)."""
    return {"reward": gates["minimum_reward_gain"],
            "pass_at_group": gates["minimum_pass_at_group_gain"],
            "guard": 0.0 - gates["maximum_guard_reward_loss"]}


@contextlib.contextmanager
def _walk_cache():
    """Within the block, `stopping.walk_looks` answers repeated calls on equal inputs from a
    cache: decide_run's rows and retest_looks each walk the same draw's looks, and the walk is
    a pure function of its inputs (the same inputs, the same looks)."""
    original, cache = stopping.walk_looks, {}

    def cached(reward, passed, guard, design, margins):
        key = (tuple(reward), tuple(passed), None if guard is None else tuple(guard),
               tuple(sorted(design.items())), tuple(sorted(margins.items())))
        if key not in cache:
            cache[key] = original(reward, passed, guard, design, margins)
        return cache[key]

    stopping.walk_looks = cached
    try:
        yield
    finally:
        stopping.walk_looks = original


def draw_evidence(baseline: dict, candidate: dict, config: dict, rng,
                  disjoint: bool = False) -> dict:
    """One resampled sequential re-test as the evidence holds it: {"config", "comparison",
    "guard", "retest"}, the records up to the look where `stopping.walk_looks` stops, built by
    the run's own assembly. `disjoint`: the candidate side takes the other samples (the "self"
    null, where `candidate` is the baseline's own pool)."""
    plan = _plan(baseline, config, rng, disjoint)
    reward, passed, guard = _differences(baseline, candidate, plan)
    walked = stopping.walk_looks(reward, passed, guard, plan["design"],
                                 margins_of(config["gates"]))
    if not walked["complete"]:  # the plan reaches the maxima, where the rule always stops
        raise RuntimeError("the stopping rule did not stop within the design's maxima")
    used = walked["eval_prompts"]
    chosen = plan["chosen"][:used]
    drawn = (records(baseline["eval"], "baseline", chosen, plan["eval"][0][:used])
             + records(candidate["eval"], "candidate", chosen, plan["eval"][-1][:used]))
    evidence = {"config": config, "comparison": comparison_section(drawn, config, 0)}
    if plan["guard"] is not None:
        rounds = walked["guard_samples"] // plan["design"]["guard_batch"]
        group, problems = config["guard"]["group_size"], range(config["guard"]["prompts"])
        guard_records = [
            row for name, pool, side in (("baseline", baseline, 0), ("candidate", candidate, -1))
            for r in range(rounds)
            for row in records(pool["guard"], name, problems, plan["guard"][side][r], r * group)]
        evidence["guard"] = guard_section(config, guard_records, bootstrap_settings(config))
    else:
        evidence["guard"] = guard_section(config, [], bootstrap_settings(config))
    looks = retest_looks(evidence, config)
    if looks is not None:
        evidence["retest"] = looks
    return evidence


def expected_pass(rewards: np.ndarray, samples: int) -> np.ndarray:
    """Per prompt, the probability that g samples drawn without replacement from its S hold at
    least one success: 1 - C(S - k, g) / C(S, g), k its successes."""
    total = rewards.shape[1]
    successes = (rewards >= metrics.SUCCESS_REWARD).sum(axis=1)
    return np.array([1.0 - math.comb(total - int(k), samples) / math.comb(total, samples)
                     for k in successes])


def true_gains(baseline: dict, candidate: dict, config: dict) -> dict:
    """The candidate's gains on the whole pool, each the expectation of the design's estimate:
    the paired mean difference of per-prompt mean rewards (eval; guard: over its first
    guard.prompts problems, the guard's population) and of per-prompt pass@g probabilities,
    with the pool's own 95 % paired bootstrap interval; and the skewness of the per-prompt
    reward differences (a weak null's is far from 0)."""
    def gain(deltas: np.ndarray) -> dict:
        interval = metrics.paired_bootstrap(deltas.tolist(), **bootstrap_settings(config))
        return {"point": float(deltas.mean()), "low": interval["low"], "high": interval["high"]}

    def rewards(pool: dict, count: int | None = None) -> np.ndarray:
        return np.asarray(pool["rewards"][:count], dtype=float)

    problems = config["guard"]["prompts"] or None
    eval_b, eval_c = rewards(baseline["eval"]), rewards(candidate["eval"])
    guard_b, guard_c = rewards(baseline["guard"], problems), rewards(candidate["guard"], problems)
    group = config["eval_group_size"]
    deltas = eval_c.mean(axis=1) - eval_b.mean(axis=1)
    spread = float(deltas.std())
    return {"reward": gain(deltas),
            "pass_at_group": gain(expected_pass(eval_c, group) - expected_pass(eval_b, group)),
            "guard": gain(guard_c.mean(axis=1) - guard_b.mean(axis=1)),
            "reward_skewness": float(((deltas - deltas.mean()) ** 3).mean() / spread ** 3)
            if spread > 0 else None,
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


def summarize_real(runs: list[dict], gates=GATES) -> dict:
    """Real re-tests' verdicts: P(accept) with its binomial standard error, P(each of `gates`
    fails), the mean completions used, and every re-test's bounds (for coverage against a
    pool's truth)."""
    count = len(runs)
    accepted = sum(all(run["passed"].values()) for run in runs)
    se = lambda k: math.sqrt(max(k * (count - k), 1) / count) / count  # noqa: E731
    failed = {gate: sum(not run["passed"].get(gate, True) for run in runs) for gate in gates}
    return {"count": count, "accepted": accepted, "p_accept": accepted / count,
            "p_accept_se": se(accepted),
            "p_fail": {gate: k / count for gate, k in failed.items()},
            "mean_completions": float(np.mean([run.get("completions", 0) for run in runs])),
            "runs": runs}


def bounds(verdict: dict, gate: str) -> tuple[float, float] | None:
    """The gate's anytime-valid (lower, upper) bounds at the look where the re-test stopped,
    as its `decide_run` row shows them (each one-sided at 97.5 %: together a 95 % interval)."""
    test = verdict["tests"].get(gate) or {}
    low, high = test.get("lower_bound"), test.get("upper_bound")
    return None if low is None or high is None else (float(low), float(high))


def judge(evidence: dict, gates: dict) -> dict:
    """The re-test's rows of `decide_run` on one draw: {gate: passed}, and each row's test."""
    rows = {row["name"]: row for row in decide_run(evidence, gates)["checks"]}
    return {"passed": {gate: rows[gate]["passed"] for gate in GATES if gate in rows},
            "tests": {gate: rows[gate].get("test") for gate in GATES if gate in rows}}


def study_policy(baseline: dict, candidate: dict, config: dict, draws: int, seed: int,
                 disjoint: bool = False) -> dict:
    """`draws` resampled sequential re-tests of one candidate: P(accept on the re-test's rows),
    P(each row fails), each tested gate's status shares, coverage of the true gains by the
    anytime bounds at the stopping look and their mean width, and the completions used."""
    gates = config["gates"]
    truth = true_gains(baseline, candidate, config)
    if disjoint:  # the baseline against itself: every true gain is 0 by construction
        truth = {**truth, "reward_skewness": None, **{
            key: {"point": 0.0, "low": 0.0, "high": 0.0} for key in TESTED}}
    rng = np.random.default_rng(seed)
    failed, accepted = dict.fromkeys(GATES, 0), 0
    covered, widths = dict.fromkeys(TESTED, 0), {gate: [] for gate in TESTED}
    statuses = {gate: {"shown": 0, "ruled_out": 0, "open": 0} for gate in TESTED}
    used, at_max = {"completions": [], "eval_prompts": [], "guard_samples": []}, 0
    for _ in range(draws):
        with _walk_cache():
            evidence = draw_evidence(baseline, candidate, config, rng, disjoint)
            verdict = judge(evidence, gates)
        accepted += all(verdict["passed"].values())
        for gate, passed in verdict["passed"].items():
            failed[gate] += not passed
        for gate in TESTED:
            interval = bounds(verdict, gate)
            if interval is None:
                continue
            covered[gate] += interval[0] <= truth[gate]["point"] <= interval[1]
            widths[gate].append(interval[1] - interval[0])
            statuses[gate][verdict["tests"][gate]["status"]] += 1
        retest = evidence["retest"]
        for key in used:
            used[key].append(retest[key])
        at_max += retest["reason"] == "the maximum re-test is spent"
    share = lambda count: count / draws  # noqa: E731
    fixed = 2 * FIXED_COMPLETIONS_PER_POLICY
    return {"draws": draws, "seed": seed, "truth": truth, "p_accept": share(accepted),
            "p_accept_se": math.sqrt(max(accepted * (draws - accepted), 1) / draws) / draws,
            "p_fail": {gate: share(count) for gate, count in failed.items()},
            "status": {gate: {key: share(n) for key, n in counts.items()}
                       for gate, counts in statuses.items() if widths[gate]},
            "coverage": {gate: share(covered[gate]) for gate in TESTED if widths[gate]},
            "mean_width": {gate: float(np.mean(w)) for gate, w in widths.items() if w},
            "mean_used": {key: float(np.mean(values)) for key, values in used.items()},
            "p_stop_at_maximum": share(at_max), "fixed_design_completions": fixed,
            "completions_vs_fixed": float(np.mean(used["completions"])) / fixed,
            "binomial_se_at_half": math.sqrt(0.25 / draws)}


def markdown(results: list[dict], design: dict) -> str:
    """The study's table: one row per policy."""
    def gain(value: dict) -> str:
        return f"{value['point']:+.3f} [{value['low']:+.3f}, {value['high']:+.3f}]"

    def shares(values: dict, names) -> str:
        return " / ".join(f"{values[g]:.3f}" if g in values else "-" for g in names)

    reuse = ("" if design["guard_samples"] >= design["guard_rounds"] * design["guard_group_size"]
             else " The guard pool holds fewer samples than the rounds take: samples repeat "
             "within a draw and the guard's figures are optimistic.")
    lines = [f"Design (sequential, evidence/stopping.py): eval prompts in batches of "
             f"{design['eval_batch_prompts']} up to {design['eval_prompts']} (x "
             f"{design['eval_group_size']}), guard rounds of {design['guard_prompts']} problems x "
             f"{design['guard_group_size']} up to {design['guard_rounds']}; drawn from pools of "
             f"{design['eval_pool']} x {design['eval_samples']} and {design['guard_pool']} x "
             f"{design['guard_samples']}; {design['draws']} draws per policy. Coverage and "
             "width: the anytime-valid bounds at the stopping look. Completions: both "
             f"policies' re-test completions; the fixed design (128 x 4 + 64 x 4 a policy) used "
             f"{2 * FIXED_COMPLETIONS_PER_POLICY}.{reuse}", "",
             "| policy | true reward gain [pool 95 %] | true pass@g gain | true guard gain | "
             "P(accept) | P(fail) " + " / ".join(GATES) + " | guard shown / loss shown / "
             "open | coverage reward / pass@g / guard | mean width reward / pass@g / guard | "
             "mean completions (x fixed) | mean eval prompts / guard samples |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        truth, used = result["truth"], result["mean_used"]
        guard = result["status"].get("guard", {})
        lines.append(
            f"| {result['policy']} | {gain(truth['reward'])} | {gain(truth['pass_at_group'])} | "
            f"{gain(truth['guard'])} | {result['p_accept']:.3f} | "
            f"{shares(result['p_fail'], GATES)} | "
            f"{shares(guard, ('shown', 'ruled_out', 'open'))} | "
            f"{shares(result['coverage'], TESTED)} | {shares(result['mean_width'], TESTED)} | "
            f"{used['completions']:.0f} ({result['completions_vs_fixed']:.2f}) | "
            f"{used['eval_prompts']:.0f} / {used['guard_samples']:.0f} |")
    return "\n".join(lines) + "\n"
