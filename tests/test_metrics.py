import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpogate.evidence.metrics import (
    length_histogram,
    length_summary,
    mcnemar_exact,
    paired_bootstrap,
    paired_comparison,
    rollout_summary,
    sign_test,
    shared_bin_edges,
    summarize_completions,
)

scipy_stats = pytest.importorskip("scipy.stats")


def completion(policy, prompt_id, index, reward, tokens, hit=False):
    return {
        "policy": policy,
        "prompt_id": prompt_id,
        "sample_index": index,
        "trace_id": f"{policy}-{prompt_id}-{index}",
        "completion": "...",
        "completion_tokens": tokens,
        "hit_max_length": hit,
        "reward": reward,
    }


def policy_records(policy, rewards_by_prompt, tokens_by_prompt, hits_by_prompt):
    return [
        completion(policy, prompt_id, i, reward, tokens_by_prompt[prompt_id][i], hits_by_prompt[prompt_id][i])
        for prompt_id, rewards in rewards_by_prompt.items()
        for i, reward in enumerate(rewards)
    ]


# 2 prompts x 4 samples, max_new_tokens = 80.
#   p1: rewards 1,0,0,1  tokens 10,20,30,40  hits F,F,F,T
#   p2: rewards 0,0,0,0  tokens 50,60,70,80  hits F,F,T,T
BASELINE = policy_records(
    "baseline",
    {"p1": [1.0, 0.0, 0.0, 1.0], "p2": [0.0, 0.0, 0.0, 0.0]},
    {"p1": [10, 20, 30, 40], "p2": [50, 60, 70, 80]},
    {"p1": [False, False, False, True], "p2": [False, False, True, True]},
)
# candidate: p1 rewards 1,1,1,0 ; p2 rewards 1,0,0,0 ; tokens all 40, no hits.
CANDIDATE = policy_records(
    "candidate",
    {"p2": [1.0, 0.0, 0.0, 0.0], "p1": [1.0, 1.0, 1.0, 0.0]},  # p2 first: output must sort
    {"p1": [40] * 4, "p2": [40] * 4},
    {"p1": [False] * 4, "p2": [False] * 4},
)


def test_summarize_completions_hand_computed():
    summary = summarize_completions(BASELINE, group_size=4, max_new_tokens=80)
    # mean reward 2/8 = 0.25; pass@group: p1 has a success, p2 none -> 1/2; hits 3/8 = 0.375
    assert summary["prompt_count"] == 2
    assert summary["completion_count"] == 8
    assert summary["mean_reward"] == 0.25
    assert summary["pass_at_group"] == 0.5
    assert summary["max_length_hit_ratio"] == 0.375
    # tokens 10..80 step 10: mean 45, median (40+50)/2 = 45,
    # p90 at linear position 0.9*7 = 6.3 -> 70 + 0.3*10 = 73
    assert summary["length"] == {
        "count": 8, "mean": 45.0, "median": 45.0, "p90": pytest.approx(73.0), "min": 10.0, "max": 80.0,
    }
    assert summary["per_prompt"] == [
        {"prompt_id": "p1", "mean_reward": 0.5, "pass_rate": 0.5, "passed": True, "samples": 4},
        {"prompt_id": "p2", "mean_reward": 0.0, "pass_rate": 0.0, "passed": False, "samples": 4},
    ]
    histogram = summary["length_histogram"]
    assert histogram["bin_edges"][0] == 0.0 and histogram["bin_edges"][-1] == 80.0
    assert len(histogram["bin_edges"]) == 13 and sum(histogram["counts"]) == 8
    json.dumps(summary)  # evidence must serialize as is


def test_summarize_keeps_the_drawn_order_and_counts_pass_at_group():
    summary = summarize_completions(CANDIDATE, group_size=4, max_new_tokens=80)
    # both prompts have a success -> pass@group 1.0; rewards 4/8 = 0.5. The per-prompt rows
    # follow the records (the re-test's drawn order, which the sequential looks read).
    assert [p["prompt_id"] for p in summary["per_prompt"]] == [
        r["prompt_id"] for r in CANDIDATE[::4]]
    assert summary["pass_at_group"] == 1.0
    assert summary["mean_reward"] == 0.5
    assert {p["prompt_id"]: p["pass_rate"] for p in summary["per_prompt"]}["p1"] == 0.75


def test_summarize_refuses_incomplete_groups_and_mixed_policies():
    with pytest.raises(ValueError, match="p2.*3 samples"):
        summarize_completions(BASELINE[:-1], group_size=4, max_new_tokens=80)
    with pytest.raises(ValueError, match="mix policies"):
        summarize_completions(BASELINE + CANDIDATE, group_size=8, max_new_tokens=80)
    with pytest.raises(ValueError):
        summarize_completions([], group_size=4, max_new_tokens=80)


def test_length_summary_p90_and_empty():
    # 1..10: p90 at linear position 0.9*9 = 8.1 -> 9 + 0.1 = 9.1
    assert length_summary(list(range(1, 11)))["p90"] == pytest.approx(9.1)
    assert length_summary([]) == {"count": 0, "mean": 0.0, "median": 0.0, "p90": 0.0, "min": 0.0, "max": 0.0}


def test_histograms_share_edges_and_refuse_out_of_range_counts():
    assert length_histogram([0, 5, 10, 10], [0, 5, 10]) == {"bin_edges": [0.0, 5.0, 10.0], "counts": [1, 3]}
    edges = shared_bin_edges([3, 7], [12], max_new_tokens=8, bins=4)
    assert edges == [0.0, 3.0, 6.0, 9.0, 12.0]  # stretched to cover the 12-token count
    assert shared_bin_edges([], [], max_new_tokens=48, bins=12)[-1] == 48.0
    with pytest.raises(ValueError, match="outside"):
        length_histogram([11], [0, 5, 10])


@pytest.mark.parametrize(
    "deltas, expected",
    [
        ([1] * 8 + [-1], 2 * (1 + 9) / 512),  # 8 vs 1: 2 * (C(9,0) + C(9,1)) / 2^9 = 0.0390625
        ([1] * 5, 2 / 32),  # 5 vs 0: 2 * 1/2^5 = 0.0625
        ([1] * 10 + [-1] * 2, 2 * (1 + 12 + 66) / 4096),  # n = 12: 158/4096 = 0.03857421875
        ([1, 1, 1, -1, -1, -1], 1.0),  # balanced: capped at 1
        ([0.0, 0.0], 1.0),  # all ties
    ],
)
def test_sign_test_hand_computed(deltas, expected):
    assert sign_test(deltas)["p_value"] == expected


def test_sign_test_counts_and_matches_scipy_binomtest():
    assert sign_test([0.5, -0.25, 0.0, 0.0, 1.0]) == {
        "positive": 2, "negative": 1, "ties": 2, "p_value": 1.0,
    }
    rng = np.random.default_rng(7)
    for _ in range(20):
        deltas = rng.choice([-1.0, 0.0, 1.0], size=int(rng.integers(1, 40)), p=[0.3, 0.2, 0.5])
        result = sign_test(deltas.tolist())
        n = result["positive"] + result["negative"]
        expected = 1.0 if n == 0 else scipy_stats.binomtest(result["positive"], n, 0.5).pvalue
        assert result["p_value"] == pytest.approx(expected, rel=1e-12)


@given(st.lists(st.floats(-5, 5, allow_nan=False), max_size=30))
def test_sign_test_is_symmetric_under_negation(deltas):
    forward, backward = sign_test(deltas), sign_test([-d for d in deltas])
    assert forward["p_value"] == backward["p_value"]
    assert 0.0 < forward["p_value"] <= 1.0
    assert forward["positive"] + forward["negative"] + forward["ties"] == len(deltas)


def test_mcnemar_exact_hand_computed_and_against_scipy():
    # baseline_only 1, candidate_only 6, both 3, neither 2 -> 2 * (1 + 7) / 2^7 = 0.125
    baseline = [True] + [False] * 6 + [True] * 3 + [False] * 2
    candidate = [False] + [True] * 6 + [True] * 3 + [False] * 2
    assert mcnemar_exact(baseline, candidate) == {
        "baseline_only": 1, "candidate_only": 6, "both": 3, "neither": 2, "p_value": 0.125,
    }
    rng = np.random.default_rng(3)
    for _ in range(20):
        b = rng.random(30) < 0.4
        c = rng.random(30) < 0.6
        result = mcnemar_exact(b.tolist(), c.tolist())
        n = result["baseline_only"] + result["candidate_only"]
        expected = 1.0 if n == 0 else scipy_stats.binomtest(result["candidate_only"], n, 0.5).pvalue
        assert result["p_value"] == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError):
        mcnemar_exact([True], [True, False])


def test_paired_bootstrap_is_deterministic_and_brackets_the_point():
    deltas = [0.25, -0.125, 0.5, 0.0, 0.375, 0.125, -0.25, 0.625, 0.25, 0.0]
    first = paired_bootstrap(deltas, resamples=2000, seed=11)
    assert first == paired_bootstrap(deltas, resamples=2000, seed=11)
    assert first != paired_bootstrap(deltas, resamples=2000, seed=12)
    assert first["point"] == pytest.approx(0.175)  # sum 1.75 / 10
    assert first["low"] <= first["point"] <= first["high"]
    assert first["low"] < first["high"]
    assert (first["resamples"], first["seed"], first["confidence"]) == (2000, 11, 0.95)


@pytest.mark.parametrize("constant", [0.5, 0.1, -1.0])
def test_paired_bootstrap_constant_deltas_give_zero_width_interval(constant):
    result = paired_bootstrap([constant] * 7, resamples=500, seed=0)
    assert result["low"] == result["high"]
    assert result["low"] == pytest.approx(constant, abs=1e-15)
    assert result["point"] == pytest.approx(constant, abs=1e-15)


def test_paired_bootstrap_refuses_empty_input():
    with pytest.raises(ValueError):
        paired_bootstrap([])


def test_paired_bootstrap_agrees_with_scipy_percentile_bootstrap():
    rng = np.random.default_rng(2024)
    deltas = rng.normal(0.1, 0.3, size=60)
    ours = paired_bootstrap(deltas.tolist(), resamples=10_000, seed=5, confidence=0.9)
    theirs = scipy_stats.bootstrap(
        (deltas,), np.mean, confidence_level=0.9, n_resamples=10_000,
        method="percentile", rng=np.random.default_rng(99),
    ).confidence_interval
    # Both estimate the same quantiles of the bootstrap distribution of the mean, with
    # independent RNG streams. Its spread is se = sd/sqrt(n); the Monte Carlo error of a
    # 5% quantile from B draws is sqrt(0.05*0.95/B)/phi(1.645) * se ~ 2.1 se/sqrt(B) = 0.021 se,
    # so the difference of two estimates has sd ~ 0.03 se. A 0.15 se tolerance is ~5 sd.
    se = float(np.std(deltas) / math.sqrt(deltas.size))
    assert ours["low"] == pytest.approx(theirs.low, abs=0.15 * se)
    assert ours["high"] == pytest.approx(theirs.high, abs=0.15 * se)


def test_paired_comparison_hand_computed():
    baseline = summarize_completions(BASELINE, group_size=4, max_new_tokens=80)
    candidate = summarize_completions(CANDIDATE, group_size=4, max_new_tokens=80)
    result = paired_comparison(baseline, candidate, resamples=500, seed=1)
    # per-prompt reward gains: p1 0.75 - 0.5 = 0.25, p2 0.25 - 0 = 0.25 (constant -> zero width);
    # equals the completion-level gain 0.5 - 0.25.
    assert result["reward_mean_gain"]["point"] == 0.25
    assert result["reward_mean_gain"]["low"] == result["reward_mean_gain"]["high"] == 0.25
    # two positive, no negative: p = 2 * 1/4 = 0.5
    assert result["reward_mean_gain"]["sign_test"] == {"positive": 2, "negative": 0, "ties": 0, "p_value": 0.5}
    # pass@group 1.0 - 0.5; passed deltas [0, 1]
    assert result["pass_at_group_gain"]["point"] == 0.5
    assert result["pass_at_group_gain"]["low"] <= 0.5 <= result["pass_at_group_gain"]["high"]
    # p1 passed by both, p2 only by the candidate: one discordant pair -> p = min(1, 2 * 1/2) = 1
    assert result["pass_at_group_gain"]["mcnemar"] == {
        "baseline_only": 0, "candidate_only": 1, "both": 1, "neither": 0, "p_value": 1.0,
    }
    # pass rates: p1 0.75 - 0.5, p2 0.25 - 0 -> 0.25 each
    assert result["pass_rate_gain"]["point"] == 0.25
    assert result["length_mean_change"] == 40.0 - 45.0
    assert result["max_length_hit_ratio_change"] == 0.0 - 0.375
    assert (result["prompt_count"], result["resamples"], result["seed"]) == (2, 500, 1)
    json.dumps(result)


def test_paired_comparison_refuses_mismatched_prompt_sets():
    baseline = summarize_completions(BASELINE, group_size=4, max_new_tokens=80)
    other = [dict(r, prompt_id="p3") if r["prompt_id"] == "p2" else r for r in CANDIDATE]
    candidate = summarize_completions(other, group_size=4, max_new_tokens=80)
    with pytest.raises(ValueError, match="'p2' appears only in the baseline"):
        paired_comparison(baseline, candidate)


def trajectory(step, prompt_id, reward, tokens=10, hit=False):
    return {"step": step, "prompt_id": prompt_id, "completion_tokens": tokens,
            "hit_max_length": hit, "reward": reward}


def test_rollout_summary_spec_reference_groups():
    groups = {"a": [0, 1, 0, 1], "b": [1, 1, 1, 1], "c": [0, 0, 0, 0], "d": [0, 0, 1, 1]}
    records = [trajectory(0, p, float(r), hit=(p == "a" and i == 0))
               for p, rewards in groups.items() for i, r in enumerate(rewards)]
    summary = rollout_summary(records, group_size=4)
    assert summary["reward_groups"] == [[0.0, 1.0, 0.0, 1.0], [1.0] * 4, [0.0] * 4, [0.0, 0.0, 1.0, 1.0]]
    assert summary["group_count"] == 4
    assert summary["complete_group_count"] == 4
    assert summary["valid_group_count"] == 2
    assert summary["valid_group_ratio"] == 0.5
    assert summary["effective_trajectory_count"] == 8
    assert summary["total_trajectories"] == 16
    assert summary["mean_reward"] == 0.5  # (2 + 4 + 0 + 2) / 16
    assert summary["max_length_hit_ratio"] == 1 / 16
    assert summary["length"]["mean"] == 10.0
    json.dumps(summary)


def test_rollout_summary_groups_by_step_and_prompt_and_skips_wrong_length():
    records = [
        trajectory(0, "a", 0.0), trajectory(1, "a", 1.0),  # same prompt, two steps: two groups
        trajectory(0, "a", 1.0), trajectory(1, "a", 1.0),
        trajectory(0, "b", 0.0), trajectory(0, "b", 1.0), trajectory(0, "b", 1.0),  # 3 of G=2
    ]
    summary = rollout_summary(records, group_size=2)
    assert summary["reward_groups"] == [[0.0, 1.0], [1.0, 1.0], [0.0, 1.0, 1.0]]
    assert summary["complete_group_count"] == 2
    assert summary["valid_group_count"] == 1  # the varied "b" group has the wrong length
    assert summary["valid_group_ratio"] == 1 / 3
    assert summary["effective_trajectory_count"] == 2
    assert rollout_summary(records, group_size=2) == summary  # deterministic


def test_rollout_summary_empty_and_missing_fields():
    empty = rollout_summary([], group_size=4)
    assert (empty["valid_group_ratio"], empty["effective_trajectory_count"], empty["total_trajectories"]) == (0.0, 0, 0)
    with pytest.raises(ValueError, match="step"):
        rollout_summary([{"prompt_id": "a", "reward": 1.0, "completion_tokens": 3, "hit_max_length": False}], 1)
