"""The gain and guard tests: anytime-valid one-sided tests of a mean of paired differences.

Pure Python and numpy (no torch). The re-test samples baseline and candidate with the same
per-prompt seeds, so each prompt gives one difference d in [-1, 1] (a mean of G rewards in
[0, 1], or a pass@group in {0, 1}, minus the baseline's). A gate asks whether the mean of d over
the prompt population lies above a margin m. The test must hold its level for every
distribution of bounded differences with that mean, skewed ones included (many small gains and
a few large losses), and at every look of a re-test that stops when the answer is known.

The test is a wager (Waudby-Smith and Ramdas, "Estimating means of bounded random variables by
betting", JRSS-B 2024). On the unit scale x = (d + 1) / 2, with m0 = (m + 1) / 2, a bettor who
stakes the fraction c in (0, 1) of the largest safe stake 1/m0 on "the mean exceeds m0" turns
one unit into

    K_c(m0) = prod_i (1 + (c / m0) (x_i - m0)) = prod_i (1 - c + c x_i / m0)   (each >= 1 - c > 0)

Under H0 "E x <= m0", with the prompts drawn independently, each factor has expectation <= 1,
so K_c is a nonnegative supermartingale with K_0 = 1. The capital used here is the mixture over
a fixed grid of fractions, K(m0) = mean over c of K_c(m0): a mixture of supermartingales is one,
so by Ville's inequality P(K(m0) ever reaches 1/alpha) <= alpha, at every sample size and under
any stopping rule. Rejecting H0 when the capital reaches 1/alpha at a look is therefore a
level-alpha test however many looks are taken, and extending an inconclusive re-test keeps the
level. The fractions are fixed (not fitted to the data), so the capital depends on the set of
differences seen, not on their order within it, and each factor is nonincreasing in m0: the
lower confidence bound, the m0 where the capital falls to 1/alpha, is found by bisection and
lies above the margin exactly when the test rejects there. The grid spans stakes from 0.9 of the
largest down to about 1/200 of it, so the test adapts to both the size of the gain and its
noise (the growth-optimal stake is about effect / variance), at the cost of the mixture's
weight (log 16 in the exponent).

- `greater`: H0 "mean <= m"; the lower bound is shown. `less`: H0 "mean >= m" (a loss beyond
  m, or a gain ruled out below it); the test runs on -d and -m and the upper bound is shown.
- An identical candidate (every difference 0) never rejects "mean <= 0": its capital at m = 0
  stays 1.
"""

from __future__ import annotations

import math

import numpy as np

SIGNIFICANCE_LEVEL = 0.025  # one-sided: each controlled error (a false gain, a missed guard loss)
THRESHOLD = 1.0 / SIGNIFICANCE_LEVEL  # the capital at which a test rejects
# Stakes as fractions of the largest safe one: 0.9 x 2^(-k/2), k = 0..15 (0.9 down to 0.005),
# equally weighted.
STAKES = tuple(0.9 * 2.0 ** (-k / 2) for k in range(16))
METHOD = ("anytime-valid betting test (one-sided, paired by prompt; mixture of 16 fixed stakes; "
          "Waudby-Smith and Ramdas 2024)")
_BISECTION_STEPS = 60  # the bound to about 1e-18 of the unit interval


def _unit(deltas, margin: float, alternative: str) -> tuple[np.ndarray, float]:
    """The differences and the margin on the unit scale, flipped for `less`."""
    if alternative not in ("greater", "less"):
        raise ValueError(f"alternative must be 'greater' or 'less', got {alternative!r}")
    values = np.asarray(list(deltas), dtype=float)
    if values.size and (not np.all(np.isfinite(values)) or np.any(np.abs(values) > 1.0)):
        raise ValueError("paired differences must be finite and within [-1, 1]")
    if not math.isfinite(margin) or abs(margin) >= 1.0:
        raise ValueError(f"the margin must lie strictly between -1 and 1, got {margin!r}")
    sign = 1.0 if alternative == "greater" else -1.0
    return (sign * values + 1.0) / 2.0, (sign * float(margin) + 1.0) / 2.0


def _log_capital(unit: np.ndarray, null_mean: float) -> float:
    """log K(null_mean): the log of the mean over STAKES c of prod (1 - c + c x / null_mean)."""
    if unit.size == 0:
        return 0.0
    if null_mean <= 0.0:  # no mean lies below 0: H0 "E x <= 0" is rejected by any x > 0
        return math.inf if np.any(unit > 0.0) else 0.0
    stakes = np.asarray(STAKES)[:, None]  # [S, 1]
    logs = np.log(1.0 - stakes + stakes * unit[None, :] / null_mean).sum(axis=1)  # [S]
    top = float(logs.max())
    return top + math.log(float(np.exp(logs - top).mean()))


def log_capital(deltas, margin: float, alternative: str = "greater") -> float:
    """The natural log of the betting capital against H0 at `margin` (0 before any prompt)."""
    unit, null_mean = _unit(deltas, margin, alternative)
    return _log_capital(unit, null_mean)


def _bound(unit: np.ndarray) -> float:
    """The smallest unit-scale mean not rejected: the m0 where log K(m0) = log(1/alpha), by
    bisection (K is strictly decreasing in m0); 0 when even m0 = 0 is not rejected."""
    target = math.log(THRESHOLD)
    low, high = 0.0, 1.0
    if _log_capital(unit, low) < target:
        return 0.0
    for _ in range(_BISECTION_STEPS):
        middle = (low + high) / 2.0
        if _log_capital(unit, middle) >= target:
            low = middle
        else:
            high = middle
    return low


def confidence_bound(deltas, alternative: str = "greater") -> float:
    """The one-sided (1 - alpha) anytime-valid bound on the mean difference: the lower bound
    for `greater`, the upper for `less` (-1 / +1 before any rejection is possible)."""
    unit, _ = _unit(deltas, 0.0, alternative)
    sign = 1.0 if alternative == "greater" else -1.0
    return sign * (2.0 * _bound(unit) - 1.0)


def betting_test(deltas, margin: float = 0.0, alternative: str = "greater") -> dict:
    """One look of the one-sided anytime-valid test of H0 "mean(deltas) <= margin" (`greater`)
    or ">= margin" (`less`) on the differences seen so far.

    Returns {"method", "alternative", "margin", "level", "prompts", "differing_prompts",
    "mean", "log_capital", "rejected", "bound"}: `rejected` when the capital reaches 1/alpha;
    `bound` the matching one-sided confidence bound (lower for `greater`, upper for `less`).
    """
    unit, null_mean = _unit(deltas, margin, alternative)
    values = np.asarray(list(deltas), dtype=float)
    logk = _log_capital(unit, null_mean)
    sign = 1.0 if alternative == "greater" else -1.0
    return {"method": METHOD, "alternative": alternative, "margin": float(margin),
            "level": SIGNIFICANCE_LEVEL, "prompts": int(values.size),
            "differing_prompts": int(np.count_nonzero(values)),
            "mean": float(values.mean()) if values.size else None,
            "log_capital": logk, "rejected": logk >= math.log(THRESHOLD),
            "bound": sign * (2.0 * _bound(unit) - 1.0)}


def sequential_test(deltas, looks: list[int], margin: float = 0.0,
                    alternative: str = "greater") -> dict:
    """The test read at each look (the number of prompts seen then, increasing): it rejects at
    the first look whose capital reaches 1/alpha and stays rejected (the capital's crossing is
    what Ville's inequality bounds). Returns the last look's `betting_test` with
    "rejected_at_look" (1-based, or None) and "bound" the running best bound over the looks
    (the confidence sequence's intersection)."""
    values = list(deltas)
    if not looks or any(b <= a for a, b in zip(looks, looks[1:])) or looks[-1] > len(values) \
            or looks[0] < 1:
        raise ValueError(f"looks must be increasing prompt counts within 1..{len(values)}")
    rejected_at, best = None, None
    for number, seen in enumerate(looks, start=1):
        test = betting_test(values[:seen], margin, alternative)
        if test["rejected"] and rejected_at is None:
            rejected_at = number
        bound = test["bound"]
        best = bound if best is None else (max(best, bound) if alternative == "greater"
                                           else min(best, bound))
    return {**test, "rejected": rejected_at is not None, "rejected_at_look": rejected_at,
            "bound": best, "looks": list(looks)}


def resolvable_difference(spread: float, prompts: int, margin: float = 0.0,
                          power: float = 0.8) -> float | None:
    """The smallest mean difference beyond `margin` that this test detects with probability
    about `power` within `prompts` prompts, when per-prompt differences have standard deviation
    `spread`: the planning figure a dry run and a finished run state. At stake lam on the unit
    scale (D the effect, s the spread there) each prompt adds about lam D - lam^2 (s^2 + D^2) / 2
    to the log capital, with standard deviation lam s; the figure is the smallest D for which
    some stake of the grid gets n of them, less z_power standard deviations, past
    log(1/alpha) + log(len(STAKES)). None without a spread or prompts."""
    if not (isinstance(spread, (int, float)) and math.isfinite(spread) and spread > 0
            and prompts >= 1):
        return None
    z, need = _normal_quantile(power), math.log(THRESHOLD) + math.log(len(STAKES))
    null_mean, unit_spread = (margin + 1.0) / 2.0, spread / 2.0

    def detected(effect: float) -> bool:
        for fraction in STAKES:
            stake = fraction / null_mean
            growth = stake * effect - stake * stake * (unit_spread ** 2 + effect ** 2) / 2.0
            if prompts * growth - z * math.sqrt(prompts) * stake * unit_spread >= need:
                return True
        return False

    low, high = 0.0, 1.0 - null_mean
    if not detected(high):
        return None
    for _ in range(50):
        middle = (low + high) / 2.0
        low, high = (low, middle) if detected(middle) else (middle, high)
    return float(2.0 * high)


def _normal_quantile(p: float) -> float:
    from statistics import NormalDist
    return NormalDist().inv_cdf(p)
