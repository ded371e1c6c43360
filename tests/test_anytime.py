"""The anytime-valid betting test (evidence/anytime.py) and the sequential stopping rule
(evidence/stopping.py): capital and bounds by hand, the level under a skewed weak null at every
look, and where the rule stops."""

import math

import numpy as np
import pytest

from grpogate.evidence.anytime import (STAKES, THRESHOLD, betting_test, confidence_bound,
                                       log_capital, resolvable_difference, sequential_test)
from grpogate.evidence.stopping import design_of, walk_looks

FRACTIONS = [0.9 * 2 ** (-k / 2) for k in range(16)]  # the stakes, as the module documents them


def test_the_stakes_are_sixteen_fractions_of_the_largest_safe_stake():
    assert STAKES == pytest.approx(FRACTIONS)
    assert (STAKES[0], round(STAKES[-1], 5)) == (0.9, round(0.9 / 2 ** 7.5, 5))  # 0.00497
    assert THRESHOLD == 40.0  # 1 / 0.025


def test_capital_by_hand():
    # Two prompts that each gain 1 (unit scale x = 1) against margin 0 (m0 = 0.5): each stake c
    # multiplies by 1 - c + c * 1 / 0.5 = 1 + c, so K = mean over c of (1 + c)^2.
    by_hand = sum((1 + c) ** 2 for c in FRACTIONS) / 16
    assert math.exp(log_capital([1.0, 1.0], 0.0)) == pytest.approx(by_hand, rel=1e-12)
    assert by_hand == pytest.approx(1.48385, abs=1e-5)
    # Against margin 0.5 (m0 = 0.75): 1 - c + c / 0.75 = 1 + c / 3.
    by_hand = sum((1 + c / 3) ** 2 for c in FRACTIONS) / 16
    assert math.exp(log_capital([1.0, 1.0], 0.5)) == pytest.approx(by_hand, rel=1e-12)
    # A loss of 1 (x = 0) against margin 0: 1 - c; the `less` side flips it into a gain.
    assert math.exp(log_capital([-1.0], 0.0)) == pytest.approx(sum(1 - c for c in FRACTIONS) / 16)
    assert log_capital([-1.0], 0.0, "less") == pytest.approx(log_capital([1.0], 0.0))


def test_ten_full_gains_reject_nine_do_not():
    # mean over c of (1 + c)^n: n = 9 gives 29.48 < 40, n = 10 gives 52.18 >= 40.
    assert sum((1 + c) ** 9 for c in FRACTIONS) / 16 == pytest.approx(29.4776, abs=1e-3)
    assert sum((1 + c) ** 10 for c in FRACTIONS) / 16 == pytest.approx(52.1799, abs=1e-3)
    assert not betting_test([1.0] * 9)["rejected"]
    assert betting_test([1.0] * 10)["rejected"]


def test_the_bound_is_where_the_capital_falls_to_forty_and_matches_the_decision():
    bound = confidence_bound([1.0] * 10)
    null_mean = (bound + 1) / 2
    capital = sum((1 - c + c / null_mean) ** 10 for c in FRACTIONS) / 16
    assert capital == pytest.approx(40.0, rel=1e-9)
    assert bound == pytest.approx(0.03123, abs=1e-5)
    rng = np.random.default_rng(3)
    for _ in range(40):
        deltas = rng.choice([-0.5, -0.25, 0.0, 0.25, 0.5, 1.0], size=int(rng.integers(1, 60)))
        margin = float(rng.uniform(-0.3, 0.3))
        test = betting_test(deltas, margin)
        assert test["rejected"] == (test["bound"] > margin) or abs(test["bound"] - margin) < 1e-9
        upper = betting_test(deltas, margin, "less")
        assert upper["rejected"] == (upper["bound"] < margin) or abs(upper["bound"] - margin) < 1e-9


def test_an_identical_candidate_never_shows_a_gain():
    test = betting_test([0.0] * 500)
    assert (test["log_capital"], test["rejected"], test["differing_prompts"]) == (0.0, False, 0)


def test_the_capital_ignores_the_order_within_a_look():
    deltas = [0.25, -1.0, 0.5, 0.0, 0.25, 0.75]
    assert log_capital(deltas, 0.1) == pytest.approx(log_capital(deltas[::-1], 0.1), rel=1e-12)


def test_bad_differences_and_margins_are_refused():
    for deltas, margin in (([1.5], 0.0), ([float("nan")], 0.0), ([0.1], 1.0), ([0.1], -1.0)):
        with pytest.raises(ValueError):
            betting_test(deltas, margin)


def _skewed_null(rng, size):
    """The issue's weak null: +0.25 with probability 0.16, -1 with 0.04, else 0 (mean 0)."""
    u = rng.random(size)
    return np.where(u < 0.16, 0.25, np.where(u < 0.20, -1.0, 0.0))


def test_a_skewed_weak_null_passes_at_most_the_level_at_any_look():
    # 0.16 * 0.25 - 0.04 * 1 = 0: no mean gain, but many small gains and a few large losses
    # (the case where the sign-flip test passed 4.9-5.8 %). Read at every look of 32 up to 512
    # prompts, the crossing rate must stay within 2.5 % (plus 3 standard errors of 600 trials).
    rng = np.random.default_rng(59)
    trials, looks = 600, range(32, 513, 32)
    crossed = 0
    for _ in range(trials):
        deltas = _skewed_null(rng, 512)
        crossed += any(log_capital(deltas[:n], 0.0) >= math.log(THRESHOLD) for n in looks)
    assert crossed / trials <= 0.025 + 3 * math.sqrt(0.025 * 0.975 / trials)


def test_a_real_gain_is_found_and_planning_is_of_the_right_size():
    rng = np.random.default_rng(7)
    hits = 0
    for _ in range(100):  # per-prompt means of 4 rewards, 0.2 -> 0.4: a gain of +0.2
        deltas = rng.binomial(4, 0.4, 128) / 4 - rng.binomial(4, 0.2, 128) / 4
        hits += sequential_test(deltas, list(range(32, 129, 32)))["rejected"]
    assert hits >= 90
    # The planning figure falls like 1/sqrt(n) and lies between the gains seen found/missed.
    at_128, at_512 = resolvable_difference(0.3, 128), resolvable_difference(0.3, 512)
    assert at_512 == pytest.approx(at_128 / 2, rel=0.2)
    assert 0.05 < resolvable_difference(0.3, 256) < 0.12
    assert resolvable_difference(0.0, 100) is None


def test_sequential_test_keeps_the_first_crossing():
    deltas = [1.0] * 10 + [-1.0] * 30  # crosses at 10 prompts, then falls back
    result = sequential_test(deltas, [10, 40])
    assert (result["rejected"], result["rejected_at_look"]) == (True, 1)
    assert not betting_test(deltas)["rejected"]  # the last look alone would not reject
    with pytest.raises(ValueError):
        sequential_test(deltas, [20, 10])


DESIGN = {"eval_batch": 16, "eval_max": 64, "guard_batch": 16, "guard_max": 48}
MARGINS = {"reward": 0.0, "pass_at_group": 0.0, "guard": -0.05}


def test_the_rule_stops_when_every_gate_is_shown():
    # Every prompt gains 1 on both gains and the guard: 16 prompts give mean (1 + c)^16 >> 40
    # for the gains, and for the guard (m0 = 0.475) 1 - c + c / 0.475.
    walked = walk_looks([1.0] * 64, [1.0] * 64, [1.0] * 48, DESIGN, MARGINS)
    assert walked["complete"] and walked["reason"] == "every gate is shown"
    assert (len(walked["looks"]), walked["eval_prompts"], walked["guard_samples"]) == (1, 16, 16)


def test_the_rule_asks_for_the_next_batch_until_it_can_stop():
    walked = walk_looks([0.0] * 16, [0.0] * 16, [0.0] * 16, DESIGN, MARGINS)
    assert not walked["complete"] and walked["next"] == [32, 32]
    walked = walk_looks([0.0] * 64, [0.0] * 64, [0.0] * 48, DESIGN, MARGINS)
    # Nothing decided anywhere: the eval set runs to 64, the guard to 48; then the rule stops.
    assert walked["complete"] and walked["reason"] == "the maximum re-test is spent"
    assert [(look["eval_prompts"], look["guard_samples"]) for look in walked["looks"]] == [
        (16, 16), (32, 32), (48, 48), (64, 48)]
    assert walked["status"] == {"reward": "open", "pass_at_group": "open", "guard": "open"}


def test_a_gain_ruled_out_stops_everything():
    walked = walk_looks([-1.0] * 64, [-1.0] * 64, [0.0] * 48, DESIGN, MARGINS)
    assert walked["complete"] and walked["reason"] == "a gain is ruled out at its minimum"
    assert walked["status"]["reward"] == "ruled_out" and walked["eval_prompts"] == 16


def test_a_set_whose_gates_are_shown_stops_while_the_other_goes_on():
    walked = walk_looks([1.0] * 64, [1.0] * 64, [0.0] * 48, DESIGN, MARGINS)
    assert [(look["eval_prompts"], look["guard_samples"]) for look in walked["looks"]] == [
        (16, 16), (16, 32), (16, 48)]
    assert walked["status"]["guard"] == "open"


def test_design_of_a_recorded_config():
    # Eval: batches of prompts. Guard: a round is 100 problems x 2 samples = 200 paired samples,
    # up to 16 rounds = 3,200.
    config = {"eval_prompts": 256, "eval_batch_prompts": 32,
              "guard": {"prompts": 100, "group_size": 2, "rounds": 16},
              "gates": {"require_significant_gain": True}}
    assert design_of(config) == {"eval_batch": 32, "eval_max": 256, "guard_batch": 200,
                                 "guard_max": 3200}
    point = dict(config, gates={"require_significant_gain": False})
    assert design_of(point) == {"eval_batch": 256, "eval_max": 256, "guard_batch": 200,
                                "guard_max": 200}
    assert design_of({"eval_prompts": 8}) is None  # recorded before the sequential re-test


def test_the_plan_of_the_default_re_test():
    """The default: 256 eval prompts in looks of 32 (8 looks), 16 guard rounds of 100 x 2 (3,200
    paired samples); the most completions 2 x (256 x 4 + 3,200) = 8,448. At the planning
    spreads the resolvable figures are resolvable_difference's at those maxima and margins."""
    from grpogate.admission import retest_plan
    from grpogate.config import load_config
    from grpogate.evidence.stopping import PLANNING_SPREADS

    plan = retest_plan(load_config("default"))
    assert (plan["eval_looks"], plan["guard_rounds"], plan["max_completions"]) == (8, 16, 8448)
    assert plan["resolvable_reward_gain"] == resolvable_difference(
        PLANNING_SPREADS["reward"], 256, 0.0)
    assert plan["resolvable_guard_gain_beyond_margin"] == resolvable_difference(
        PLANNING_SPREADS["guard"], 3200, -0.05)
    assert plan["resolvable_guard_gain_beyond_margin"] < 0.05  # a neutral guard: shown at 0.8
    # The look by which a gain is shown (0.8): the resolvable gain at 32, 64, 96 ... 256 prompts
    # is 0.413, 0.233, 0.178, ... 0.103 at spread 0.36, so +0.30 needs 64 prompts (0.233 <= 0.30
    # < 0.413), +0.20 needs 96 (0.178 <= 0.20 < 0.233) and +0.10 is past the maximum (0.103).
    resolved = [resolvable_difference(0.36, n, 0.0) for n in (32, 64, 96, 256)]
    assert resolved[0] > 0.3 >= resolved[1] > 0.2 >= resolved[2] and resolved[3] > 0.1
    assert plan["eval_prompts_to_show_gain"] == {"+0.10": None, "+0.20": 96, "+0.30": 64}
    assert retest_plan(load_config("default", overrides=["guard.prompts=0"]))[
        "max_completions"] == 2 * 256 * 4
