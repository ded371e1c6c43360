"""The decision study (bench/decision_quality.py, bench/decision_resample.py,
bench/decision_mixtures.py): the resampler's draws against an enumerable design, the guard's
round schedule, the sequential draw stopping where the rule stops, the gain test's false-pass
rate on a skewed weak null, the completions a large gain uses, the tuned weak-null mixture,
the null candidate, and --quick end to end.

Every frequency is checked against its exact value with a tolerance of 4 binomial standard
errors at the number of draws (a false failure about once in 16,000 runs per check).
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import decision_mixtures  # noqa: E402
import decision_resample  # noqa: E402


def _tolerance(probability: float, draws: int) -> float:
    return 4.0 * math.sqrt(probability * (1.0 - probability) / draws)


def _pool(rewards: list[list[float]], prefix: str) -> dict:
    return {"prompt_ids": [f"{prefix}{i}" for i in range(len(rewards))], "rewards": rewards,
            "texts": [[f"{prefix}{i}-{k}-{r}" for k, r in enumerate(row)]
                      for i, row in enumerate(rewards)],
            "tokens": [[3] * len(row) for row in rewards],
            "hit": [[False] * len(row) for row in rewards]}


def _config(eval_prompts=2, eval_group=2, guard_prompts=2, guard_group=2, eval_batch=32,
            guard_rounds=1) -> dict:
    from grpogate.config import RunConfig

    config = RunConfig().to_dict()
    config.update(eval_prompts=eval_prompts, eval_group_size=eval_group, max_new_tokens=8,
                  eval_batch_prompts=eval_batch)
    config["guard"].update(prompts=guard_prompts, group_size=guard_group, rounds=guard_rounds)
    return config


# A hand-made pool: 3 prompts x 3 samples. The design draws 2 prompts x 2 samples, so one draw
# is one of 3 prompt pairs and, per drawn prompt, one of 3 sample pairs: 27 equally likely draws.
BASELINE = [[0.0, 0.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
CANDIDATE = [[1.0, 0.0, 1.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]]


def test_the_design_draws_every_prompt_pair_and_sample_pair_equally_often():
    rng, draws = np.random.default_rng(0), 6000
    prompt_pairs, sample_pairs = Counter(), Counter()
    for _ in range(draws):
        chosen, (samples,) = decision_resample.draw_design(rng, 3, 3, 2, 2)
        assert len(set(chosen)) == 2 and all(len(set(row)) == 2 for row in samples)
        prompt_pairs[frozenset(chosen.tolist())] += 1
        sample_pairs[frozenset(samples[0].tolist())] += 1
    assert len(prompt_pairs) == 3 and len(sample_pairs) == 3
    for counts in (prompt_pairs, sample_pairs):
        for count in counts.values():
            assert abs(count / draws - 1 / 3) <= _tolerance(1 / 3, draws)


def test_two_sides_take_disjoint_samples_of_the_same_prompts():
    chosen, (first, second) = decision_resample.draw_design(np.random.default_rng(1), 5, 8, 3,
                                                            4, sides=2)
    assert len(chosen) == 3
    for a, b in zip(first, second):
        assert set(a).isdisjoint(b) and len(set(a) | set(b)) == 8
    with pytest.raises(ValueError, match="does not fit"):
        decision_resample.draw_design(np.random.default_rng(1), 5, 7, 3, 4, sides=2)


def _exact_gain_distribution() -> Counter:
    """The reward gain of each of the 27 equally likely draws, enumerated."""
    exact = Counter()
    for prompts in itertools.combinations(range(3), 2):
        for samples in itertools.product(itertools.combinations(range(3), 2), repeat=2):
            gain = sum(CANDIDATE[p][k] - BASELINE[p][k] for p, pair in zip(prompts, samples)
                       for k in pair) / 4
            exact[round(gain, 6)] += 1
    return exact


def test_resampled_reward_gains_follow_the_enumerated_distribution():
    """The evidence each draw builds (the run's comparison_section) holds the drawn gain; its
    frequencies match the 27 enumerated draws', and the drawn records pair sample for sample."""
    baseline = {"eval": _pool(BASELINE, "e"), "guard": _pool(BASELINE, "g")}
    candidate = {"eval": _pool(CANDIDATE, "e"), "guard": _pool(CANDIDATE, "g")}
    config, rng, draws = _config(), np.random.default_rng(2), 1500
    observed = Counter()
    for _ in range(draws):
        evidence = decision_resample.draw_evidence(baseline, candidate, config, rng)
        comparison = evidence["comparison"]
        assert comparison["baseline"]["prompt_count"] == 2
        assert comparison["identical_completions"]["pairs"] == 4
        observed[round(comparison["reward_mean_gain"], 6)] += 1
    exact = _exact_gain_distribution()
    assert set(observed) <= set(exact)
    for gain, count in exact.items():
        probability = count / 27
        assert abs(observed[gain] / draws - probability) <= _tolerance(probability, draws)
    truth = decision_resample.true_gains(baseline, candidate, config)
    expected = sum(g * c for g, c in exact.items()) / 27  # the design's estimate is unbiased
    assert truth["reward"]["point"] == pytest.approx(expected)


def test_expected_pass_counts_draws_without_replacement():
    rewards = np.array([[1.0, 0.0, 0.0, 0.0], [0.0] * 4, [1.0] * 4])
    # one success among 4, two drawn: it is missed by C(3, 2) = 3 of the C(4, 2) = 6 pairs
    assert decision_resample.expected_pass(rewards, 2).tolist() == [0.5, 0.0, 1.0]


def _bernoulli_retest(rng, rates, gain, prompts, group):
    """One re-test on a synthetic population: per-prompt success rates `rates`, the candidate's
    rates shifted by `gain` (clipped), independent samples (no shared seeds)."""
    from grpogate.evidence.metrics import summarize_completions

    chosen = rng.choice(len(rates), size=prompts, replace=False)
    sides = {}
    for name, shift in (("baseline", 0.0), ("candidate", gain)):
        records = [{"policy": name, "prompt_id": f"p{i}", "completion_tokens": 4,
                    "hit_max_length": False,
                    "reward": float(rng.random() < min(1.0, max(0.0, rates[i] + shift)))}
                   for i in chosen for _ in range(group)]
        sides[name] = summarize_completions(records, group, 8)
    return sides


def test_the_gain_test_false_passes_at_most_its_level_and_the_interval_covers():
    """Candidate as good as the baseline: the reward gate's test (anytime.betting_test on the
    per-prompt differences the gate reads, retest_checks.section_deltas) passes at most 2.5 %
    + 4 SE. True gain +0.10 (every rate shifted, none clipped): the recorded 95 % paired
    bootstrap interval covers it 95 % +- 4 SE of the time."""
    from grpogate.evidence.anytime import SIGNIFICANCE_LEVEL, THRESHOLD, log_capital
    from grpogate.evidence.metrics import paired_bootstrap
    from grpogate.evidence.retest_checks import section_deltas

    rng = np.random.default_rng(3)
    rates = rng.uniform(0.1, 0.8, size=400)  # +0.10 never leaves [0, 1]
    draws, passes = 600, 0
    for _ in range(draws):
        sides = _bernoulli_retest(rng, rates, 0.0, 64, 4)
        deltas = section_deltas({"baseline": sides["baseline"], "candidate": sides["candidate"]},
                                "reward_mean_gain")
        passes += log_capital(deltas, 0.0) >= math.log(THRESHOLD)  # betting_test's rule
    assert passes / draws <= SIGNIFICANCE_LEVEL + _tolerance(SIGNIFICANCE_LEVEL, draws)
    draws, covered, true_gain = 300, 0, 0.10
    for _ in range(draws):
        sides = _bernoulli_retest(rng, rates, true_gain, 64, 4)
        deltas = [c["mean_reward"] - b["mean_reward"] for b, c in
                  zip(sides["baseline"]["per_prompt"], sides["candidate"]["per_prompt"])]
        interval = paired_bootstrap(deltas, resamples=1000, seed=0)
        covered += interval["low"] <= true_gain <= interval["high"]
    assert abs(covered / draws - 0.95) <= _tolerance(0.95, draws)


def test_study_policy_on_a_synthetic_pool_reads_the_real_gates():
    """The baseline against itself on disjoint samples: true gains 0, the null candidate-like
    effective-update row passes (completions differ), every draw stops where the rule stops
    (decide_run's retest_stopping row), every share is a share of the draws."""
    rng = np.random.default_rng(4)
    rates = rng.uniform(0.1, 0.8, size=40)
    rewards = (rng.random((40, 8)) < rates[:, None]).astype(float).tolist()
    pool = {"eval": _pool(rewards, "e"), "guard": _pool(rewards[:20], "g")}
    config = _config(eval_prompts=24, eval_group=4, guard_prompts=12, guard_group=2,
                     eval_batch=8, guard_rounds=2)
    result = decision_resample.study_policy(pool, pool, config, 40, seed=0, disjoint=True)
    assert result["truth"]["reward"]["point"] == 0.0
    assert set(result["p_fail"]) == set(decision_resample.GATES)
    assert result["p_fail"]["effective_update"] == 0.0
    assert result["p_fail"]["retest_stopping"] == 0.0
    assert all(0.0 <= value <= 1.0 for value in result["coverage"].values())
    # No gain is shown on 24 prompts of a null, so every draw takes all 24 eval prompts; the
    # guard takes one or both rounds of 12 x 2: completions 2 x (24 x 4 + 24 or 48).
    assert result["mean_used"]["eval_prompts"] == 24.0
    assert 2 * (96 + 24) <= result["mean_used"]["completions"] <= 2 * (96 + 48)
    identical = decision_resample.study_policy(pool, pool, config, 10, seed=0)
    assert identical["p_fail"]["effective_update"] == 1.0  # same completions: no update
    assert identical["p_fail"]["reward"] == 1.0 and identical["p_accept"] == 0.0


def test_the_null_candidate_computes_the_baseline_under_another_hash(tiny_config, tmp_path):
    import torch

    import decision_quality
    from grpogate.files import sha256_path
    from grpogate.inputs.policy import ADAPTER_WEIGHTS, load_policy, sampling_weights

    config = tiny_config(tmp_path)
    directory = decision_quality.null_candidate(config, tmp_path / "null")
    baseline, null = load_policy(config, seed=0), load_policy(config, adapter=str(directory),
                                                              seed=0)
    assert null.baseline_adapter_sha256 == sha256_path(directory / ADAPTER_WEIGHTS)
    assert null.baseline_version != baseline.baseline_version
    ids = torch.tensor([[1, 17, 230, 4051, 9, 2]])
    with torch.no_grad():
        with sampling_weights(baseline, baseline=True):
            expected = baseline.model(input_ids=ids).logits
        with sampling_weights(null, baseline=True):  # the null adapter merged into W
            merged = null.model(input_ids=ids).logits
        unmerged = null.model(input_ids=ids).logits  # the same adapter through PEFT's forward
    assert torch.equal(merged, expected) and torch.equal(unmerged, expected)


def test_quick_runs_end_to_end_and_reuses_its_pools(tiny_model_dir, tmp_path, capsys):
    import decision_quality

    work = tmp_path / "study"
    arguments = ["--work-dir", str(work), "--quick", "--baseline", str(tiny_model_dir),
                 "--draws", "6"]
    decision_quality.main(arguments)
    result = json.loads((work / "decision_quality.json").read_text())
    names = [row["policy"] for row in result["results"]]
    assert names[:4] == [decision_resample.SELF, "null candidate", "perturbed (quick)",
                         "mixture 0.5 of perturbed (quick)"]
    assert names[4].startswith("weak null: perturbed (quick) at ")
    null = result["results"][1]
    assert null["p_fail"]["effective_update"] == 1.0 and null["p_accept"] == 0.0
    assert null["truth"]["reward"]["point"] == 0.0
    assert abs(result["results"][4]["truth"]["reward"]["point"]) <= 0.005
    # The quick design: eval batches of 2 up to 6 prompts x 2, guard rounds of 3 x 2 up to 3.
    # A re-test uses 2 x (2 x 2 + 6) = 20 completions at least and 2 x (6 x 2 + 18) = 60 at
    # most, and every draw stops where the rule stops.
    for row in result["results"]:
        assert 20 <= row["mean_used"]["completions"] <= 60
        assert row["p_fail"]["retest_stopping"] == 0.0
        assert row["fixed_design_completions"] == 1536
    assert result["generation"]["completions"] == 3 * (8 * 4 + 3 * 8)
    assert "| null candidate |" in (work / "decision_quality.md").read_text()
    pools = sorted((work / "pools").iterdir())
    assert len(pools) == 3
    capsys.readouterr()
    decision_quality.main(arguments)  # the pools are read back, not generated again
    assert "generating" not in capsys.readouterr().out
    assert sorted((work / "pools").iterdir()) == pools
    # Another design on the same pools (--set): at most 4 eval prompts, so a re-test uses at
    # most 2 x (4 x 2 + 18) = 52 completions.
    decision_quality.main(arguments + ["--set", "eval_prompts=4"])
    assert "generating" not in capsys.readouterr().out
    result = json.loads((work / "decision_quality.json").read_text())
    assert result["design"]["eval_prompts"] == 4
    assert all(20 <= row["mean_used"]["completions"] <= 52 for row in result["results"])
    # --rows: the policies whose names begin with one of the parts, in the study's order.
    decision_quality.main(arguments + ["--rows", "null,self"])
    result = json.loads((work / "decision_quality.json").read_text())
    assert [row["policy"] for row in result["results"]] == [decision_resample.SELF,
                                                            "null candidate"]


def test_a_whole_draw_judges_the_re_test_exactly_as_it_was_sampled():
    # 2 prompts x 2 samples each side, the whole re-test: the per-prompt mean differences are
    # (1 + 0)/2 - 0 = 0.5 and 1 - (1 + 1)/2 = 0; their mean 0.25 is the recorded reward gain.
    baseline = {"eval": _pool([[0.0, 0.0], [1.0, 1.0]], "e"),
                "guard": _pool([[1.0, 0.0], [0.0, 0.0]], "g")}
    candidate = {"eval": _pool([[1.0, 0.0], [1.0, 1.0]], "e"),
                 "guard": _pool([[1.0, 0.0], [0.0, 0.0]], "g")}
    config = _config()
    chosen, (samples,) = decision_resample.draw_design(decision_resample.WHOLE, 2, 2, 2, 2)
    assert chosen.tolist() == [0, 1] and samples.tolist() == [[0, 1], [0, 1]]
    evidence = decision_resample.draw_evidence(baseline, candidate, config,
                                               decision_resample.WHOLE)
    assert evidence["comparison"]["reward_mean_gain"] == pytest.approx(0.25)
    assert evidence["guard"]["reward_mean_gain"] == 0.0
    # One look holds the whole design (2 prompts, one guard round of 2 x 2): 2 x (2 x 2 + 4).
    assert evidence["retest"]["stopped_at_look"] == 1
    assert evidence["retest"]["completions"] == 16


def test_real_re_tests_are_summarized_with_their_binomial_error():
    def run(**passed):
        return {"passed": {gate: passed.get(gate, True) for gate in decision_resample.GATES}}

    # 4 re-tests: 3 accepted, one failing reward: P(accept) 3/4, SE sqrt(3 x 1 / 4) / 4 =
    # sqrt(0.75) / 4 = 0.21651; P(reward fails) 1/4, every other gate 0.
    summary = decision_resample.summarize_real([run(), run(reward=False), run(), run()])
    assert summary["p_accept"] == 0.75 and summary["accepted"] == 3
    assert summary["p_accept_se"] == pytest.approx(math.sqrt(0.75) / 4)
    assert summary["p_fail"] == {"reward": 0.25, "pass_at_group": 0.0, "guard": 0.0,
                                 "length_budget": 0.0, "effective_update": 0.0,
                                 "retest_stopping": 0.0}


def test_quick_real_re_tests_use_fresh_seeds_and_problems(tiny_model_dir, tmp_path):
    import decision_quality

    work = tmp_path / "real"
    decision_quality.main(["--work-dir", str(work), "--quick", "--baseline",
                           str(tiny_model_dir), "--real-retests", "2", "--perturbed", "0.05"])
    real = json.loads((work / "real_retests.json").read_text())
    (name, summary), = real["results"].items()
    assert "perturbed-0.05" in name and summary["count"] == 2
    assert [run["seed"] for run in summary["runs"]] == [1000, 1001]
    # Each re-test is a whole gate: its run directory, its own seed and its own eval problems.
    gates = sorted((work / "gates").iterdir())
    assert [path.name.rsplit("-", 1)[1] for path in gates] == ["1000", "1001"]
    evidence = [json.loads((path / "evidence.json").read_text()) for path in gates]
    assert [e["config"]["seed"] for e in evidence] == [1000, 1001]
    assert [e["config"]["task"]["eval_seed"] for e in evidence] == [1000, 1001]
    eval_ids = [{json.loads(line)["prompt_id"] for line in
                 (path / "eval_completions.jsonl").read_text().splitlines()} for path in gates]
    assert eval_ids[0] != eval_ids[1]
    # Every gate's decision is the run's own, every check counted (retest_kl among them).
    assert [run["decision"] for run in summary["runs"]] == [
        e["decision"]["decision"] for e in evidence]
    assert "retest_kl" in summary["p_fail"] and "guard" in summary["p_fail"]
    # Between the first look (2 eval prompts x 2, 3 guard problems x 2, both policies: 20)
    # and the maximum (6 x 2 + 3 x 3 rounds x 2, both policies: 60).
    assert all(20 <= run["completions"] <= 60 for run in summary["runs"])
    # A second call finds both re-tests in real_retests.jsonl and runs neither again.
    decision_quality.main(["--work-dir", str(work), "--quick", "--baseline",
                           str(tiny_model_dir), "--real-retests", "2", "--perturbed", "0.05"])
    assert len((work / "real_retests.jsonl").read_text().splitlines()) == 2


def test_a_mixture_takes_each_sample_whole_from_one_of_the_two_pools():
    baseline = {"eval": _pool([[0.0] * 50] * 4, "e"), "guard": _pool([[0.0] * 50] * 2, "g")}
    candidate = {"eval": _pool([[1.0] * 50] * 4, "e"), "guard": _pool([[1.0] * 50] * 2, "g")}
    assert decision_mixtures.mixture(baseline, candidate, 0.0, 0)["eval"]["rewards"] == (
        baseline["eval"]["rewards"])
    assert decision_mixtures.mixture(baseline, candidate, 1.0, 0)["eval"]["rewards"] == (
        candidate["eval"]["rewards"])
    mixed = decision_mixtures.mixture(baseline, candidate, 0.3, 0)["eval"]
    # _pool's texts end in the reward: every sample's text and reward come from the same pool.
    for row_rewards, row_texts in zip(mixed["rewards"], mixed["texts"]):
        assert all(text.endswith(f"-{reward}") for reward, text in zip(row_rewards, row_texts))
    # 200 coins at 0.3: the share of candidate samples within 4 binomial SE of 0.3.
    share = np.mean(mixed["rewards"])
    assert abs(share - 0.3) <= _tolerance(0.3, 200)
    other = dict(candidate, eval=_pool([[1.0] * 50] * 3, "e"))
    with pytest.raises(ValueError, match="different prompts"):
        decision_mixtures.mixture(baseline, other, 0.5, 0)


def test_guard_rounds_take_fresh_samples_until_the_pool_is_spent():
    # 5 problems x 6 samples, rounds of 2: three rounds use each problem's 6 samples once.
    (one,) = decision_resample.guard_schedule(np.random.default_rng(5), 5, 6, 3, 2)
    assert one.shape == (3, 5, 2)
    for problem in range(5):
        assert sorted(one[:, problem].reshape(-1).tolist()) == list(range(6))
    # Five rounds: the first three spend the pool, the next two start a new order of it.
    (more,) = decision_resample.guard_schedule(np.random.default_rng(5), 5, 6, 5, 2)
    for problem in range(5):
        assert sorted(more[:3, problem].reshape(-1).tolist()) == list(range(6))
        assert len(set(more[3:, problem].reshape(-1).tolist())) == 4
    # Two sides (the "self" null): disjoint halves of every order, 3 samples a side a cycle.
    first, second = decision_resample.guard_schedule(np.random.default_rng(6), 4, 6, 3, 1,
                                                     sides=2)
    for problem in range(4):
        assert set(first[:, problem, 0]).isdisjoint(second[:, problem, 0])
    with pytest.raises(ValueError, match="does not fit"):
        decision_resample.guard_schedule(np.random.default_rng(6), 4, 6, 3, 4, sides=2)


def test_a_whole_draw_of_guard_rounds_numbers_samples_as_the_run_does():
    # 2 guard problems x 4 samples, rounds of 2 up to 2: round r holds sample indexes 2r, 2r + 1.
    baseline = {"eval": _pool([[0.0, 0.0], [1.0, 1.0]], "e"),
                "guard": _pool([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], "g")}
    candidate = {"eval": _pool([[1.0, 0.0], [1.0, 1.0]], "e"),
                 "guard": _pool([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]], "g")}
    config = _config(guard_rounds=2)
    evidence = decision_resample.draw_evidence(baseline, candidate, config,
                                               decision_resample.WHOLE)
    # Nothing is decided on 2 prompts or 4 samples, so the rule takes both rounds: the guard's
    # sample differences are round 0 (0, 0, 0, 0) then round 1 (1, 1, 0, 0).
    assert evidence["guard"]["rounds"] == 2
    assert evidence["guard"]["sample_differences"] == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert evidence["retest"]["stopped_at_look"] == 2
    assert evidence["retest"]["completions"] == 2 * (2 * 2 + 8)


def _skewed_null_pools(prompts=1000, samples=8):
    """Seed-paired pools whose true reward gain is exactly 0 with skewed per-prompt
    differences: 16 % of prompts gain (baseline 0 on every sample, the candidate right on 2 of
    8: +0.25 in expectation), 4 % lose everything (-1), the rest tie with different texts.
    0.16 x 0.25 - 0.04 x 1 = 0. The pass@4 gain is positive (0.16 x (1 - C(6, 4) / C(8, 4))
    - 0.04 = 0.0857), so the reward gate alone stands between this candidate and accept."""
    rng = np.random.default_rng(7)
    base, cand = [], []
    kinds = ["up"] * (prompts * 16 // 100) + ["down"] * (prompts * 4 // 100)
    kinds += ["tie"] * (prompts - len(kinds))
    for kind in kinds:
        if kind == "up":
            row = [0.0] * samples
            wins = rng.choice(samples, size=2, replace=False)
            base.append(row)
            cand.append([1.0 if k in wins else 0.0 for k in range(samples)])
        elif kind == "down":
            base.append([1.0] * samples)
            cand.append([0.0] * samples)
        else:
            row = (rng.random(samples) < 0.3).astype(float).tolist()
            base.append(row)
            cand.append(list(row))
    baseline = {"eval": _pool(base, "e"), "guard": _pool([[1.0] * 4] * 2, "g")}
    candidate = {"eval": _pool(cand, "e"), "guard": _pool([[1.0] * 4] * 2, "g")}
    for row in candidate["eval"]["texts"]:  # tied samples differ in text: an effective update
        row[:] = [text + "'" for text in row]
    return baseline, candidate


def test_a_skewed_weak_null_is_accepted_at_most_at_the_tests_level():
    """True reward gain 0 with many small gains and a few full losses (where the sign-flip
    test passed 4.9-5.8 %, and a t test on these pools passes 4.9 % of 2,000 draws of 128):
    sequential draws of up to 128 prompts in batches of 32 accept at most 2.5 % + 3 binomial
    SE of the time (4.4 % at 600 draws, so a 4.9 % rate would fail here), and the reward gate
    is what stops them. The guard is off (guard.prompts = 0: its row passes as "off")."""
    from grpogate.evidence.anytime import SIGNIFICANCE_LEVEL

    baseline, candidate = _skewed_null_pools()
    config = _config(eval_prompts=128, eval_group=4, guard_prompts=0, eval_batch=32)
    draws = 600
    result = decision_resample.study_policy(baseline, candidate, config, draws, seed=0)
    assert result["truth"]["reward"]["point"] == pytest.approx(0.0, abs=1e-12)
    assert result["truth"]["reward_skewness"] < -1.0
    limit = SIGNIFICANCE_LEVEL + 3.0 * math.sqrt(SIGNIFICANCE_LEVEL * (1 - SIGNIFICANCE_LEVEL)
                                                 / draws)
    assert result["p_accept"] <= limit
    assert result["p_fail"]["reward"] >= 1.0 - limit
    assert result["p_fail"]["guard"] == 0.0 and result["p_fail"]["retest_stopping"] == 0.0


def test_a_large_gain_stops_at_the_first_look_and_uses_fewer_completions_than_the_fixed_design():
    """Baseline wrong on every sample, candidate right on every one, guard answers alike:
    every gate is shown at the first look (32 eval prompts, one round of 100 guard problems x
    2), so every draw uses 2 x (32 x 4 + 200) = 656 completions, under the fixed 128 x 4 +
    64 x 4 design's 2 x 768 = 1,536."""
    baseline = {"eval": _pool([[0.0] * 8] * 300, "e"), "guard": _pool([[1.0] * 32] * 100, "g")}
    candidate = {"eval": _pool([[1.0] * 8] * 300, "e"), "guard": _pool([[1.0] * 32] * 100, "g")}
    config = _config(eval_prompts=256, eval_group=4, guard_prompts=100, guard_group=2,
                     eval_batch=32, guard_rounds=16)
    result = decision_resample.study_policy(baseline, candidate, config, 5, seed=0)
    assert result["p_accept"] == 1.0
    assert result["mean_used"] == {"completions": 656.0, "eval_prompts": 32.0,
                                   "guard_samples": 200.0}
    assert result["fixed_design_completions"] == 1536
    assert result["completions_vs_fixed"] == pytest.approx(656 / 1536)
    assert result["status"]["guard"] == {"shown": 1.0, "ruled_out": 0.0, "open": 0.0}
    assert result["coverage"] == {"reward": 1.0, "pass_at_group": 1.0, "guard": 1.0}


def test_the_weak_null_share_is_tuned_to_a_zero_true_gain():
    # Baseline 0.5 on all 4 samples, A 1.0 (+0.5), B 0.0 (-0.5): each sample turned from A's
    # to B's moves the gain by -1 / 4, so exactly 2 of the 4 make it 0.
    baseline = {"eval": _pool([[0.5, 0.5]] * 2, "e"), "guard": _pool([[0.0]] * 2, "g")}
    gaining = {"eval": _pool([[1.0, 1.0]] * 2, "e"), "guard": _pool([[0.0]] * 2, "g")}
    damaging = {"eval": _pool([[0.0, 0.0]] * 2, "e"), "guard": _pool([[0.0]] * 2, "g")}
    share, gain = decision_mixtures.tuned_share(baseline, gaining, damaging, seed=3)
    assert gain == 0.0
    mixed = decision_mixtures.mixture(gaining, damaging, share, seed=3)
    assert sorted(sum(mixed["eval"]["rewards"], [])) == [0.0, 0.0, 1.0, 1.0]
    name, pool = decision_mixtures.build("1:2:null", baseline,
                                         [("A", gaining), ("B", damaging)], seed=3)
    assert name == f"weak null: B at {share:.3f} in A"
    assert pool["eval"]["rewards"] == mixed["eval"]["rewards"]
    # Two gaining policies have no zero between them: the nearest (+0.5) is named.
    with pytest.raises(ValueError, match=r"nearest \+0.5000"):
        decision_mixtures.build("1:2:null", baseline, [("A", gaining), ("A2", gaining)], 3)


def test_the_guard_margin_share_is_tuned_to_a_true_guard_loss_of_the_margin():
    # Guard: baseline 0.5 on all 10 samples, A 0.5 (gain 0), B 0.0 (-0.5): each sample turned
    # from A's to B's moves the guard gain by -0.5 / 10 = -0.05, so exactly one of the ten
    # puts it at -0.05, the margin; the eval pools take no part.
    baseline = {"eval": _pool([[0.5]] * 2, "e"), "guard": _pool([[0.5] * 5] * 2, "g")}
    level = {"eval": _pool([[1.0]] * 2, "e"), "guard": _pool([[0.5] * 5] * 2, "g")}
    damaging = {"eval": _pool([[0.0]] * 2, "e"), "guard": _pool([[0.0] * 5] * 2, "g")}
    share, gain = decision_mixtures.tuned_share(baseline, level, damaging, 3, "guard", -0.05)
    assert gain == pytest.approx(-0.05)
    name, pool = decision_mixtures.build("1:2:guard", baseline,
                                         [("A", level), ("B", damaging)], seed=3,
                                         guard_margin=0.05)
    assert name == f"at the guard margin: B at {share:.3f} in A"
    assert sum(sum(row) for row in pool["guard"]["rewards"]) == 4.5  # nine of ten kept 0.5
    # A margin no mixture reaches (the most damaging, all of B, loses 0.5) is refused.
    with pytest.raises(ValueError, match=r"guard gain within 0.005 of -0.6"):
        decision_mixtures.build("1:2:guard", baseline, [("A", level), ("B", damaging)], 3,
                                guard_margin=0.6)


def test_mixture_items_are_parsed_or_refused_with_the_reason():
    assert decision_mixtures.parse("0.3", 1) == (0, 1, 0.3)
    assert decision_mixtures.parse("1:2:null", 2) == (1, 2, "null")
    assert decision_mixtures.parse("1:2:guard", 2) == (1, 2, "guard")
    assert decision_mixtures.parse("2:0:0.25", 2) == (2, 0, 0.25)
    for item, reason in (("1:3:0.5", "lie in 0..2"), ("1:1:0.5", "must differ"),
                         ("0:1:1.5", r"\[0, 1\]"), ("a:1:0.5", "policy numbers"),
                         ("0:1", "expected SHARE")):
        with pytest.raises(ValueError, match=reason):
            decision_mixtures.parse(item, 2)


def test_a_pool_too_small_for_the_design_is_exit_2_before_any_generation(tmp_path, capsys):
    import decision_quality

    work = tmp_path / "small"
    with pytest.raises(SystemExit) as exit_info:  # --quick's design takes up to 6 eval prompts
        decision_quality.main(["--work-dir", str(work), "--quick", "--eval-pool", "4",
                               "--baseline", "unused-model-dir"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: --eval-pool 4: the design needs at least 6\n"
    assert not (work / "pools").exists() and not (work / "decision_quality.json").exists()


def test_a_candidate_without_adapter_weights_is_one_error_line(tmp_path, capsys):
    import decision_quality

    with pytest.raises(SystemExit) as stopped:
        decision_quality.main(["--work-dir", str(tmp_path / "work"), "--candidate",
                               str(tmp_path / "absent")])
    assert stopped.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "absent: no adapter_model.safetensors" in errors[0]
    assert not (tmp_path / "work").exists()  # nothing written
