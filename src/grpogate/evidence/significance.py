"""The gain test: a one-sided paired sign-flip randomization test on per-prompt differences.

Pure Python and numpy (no torch). The re-test samples baseline and candidate with the same
per-prompt seeds, so the per-prompt differences are paired, discrete (a mean of G rewards) and
often sparse: most prompts differ by exactly 0. A percentile bootstrap reads a handful of
same-signed differences as significant (four of four differing prompts in the candidate's
favour pass its inclusive lower bound although they have probability 1/16 under no gain). This
test does not: under "no gain" the two policies' labels are exchangeable within each prompt, so
every per-prompt difference is equally likely with either sign, and the p-value is the share of
the 2^n sign patterns whose sum reaches the observed sum.

- Margin: H0 is "mean gain <= margin" (`greater`) or ">= margin" (`less`, the guard's loss
  check); the test flips the signs of `difference - margin`.
- Exact: the differences are rational with a small denominator (means of G rewards in {0, 1},
  a margin such as 0.02), so they are integers on a lattice of step 1/L, and the null
  distribution of the signed sum is built exactly by convolution (k nonzero differences,
  k * range steps). Where no lattice of at most MAX_LATTICE steps fits, `draws` random sign
  patterns (seeded) estimate it, with p = (1 + hits) / (1 + draws) and its standard error.
- Studentized for free: sum(x_i^2) is the same under every sign pattern, so the t statistic is
  an increasing function of the sum and orders the patterns exactly as the sum does. The test is
  therefore the studentized sign-flip test, valid for the mean without assuming symmetry as the
  prompts grow (Janssen 1999), and exact under exchangeability.
- Zero differences carry no sign: a candidate identical to the baseline has p = 1.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

SIGNIFICANCE_LEVEL = 0.025  # one-sided: a 95 % two-sided interval's tail
RANDOM_FLIPS = 20_000  # Monte Carlo draws where no lattice fits (standard error <= 0.0035)
MAX_LATTICE = 1000  # lattice steps per unit tried (1/L for L = 1 .. MAX_LATTICE)
MAX_LATTICE_CELLS = 4_000_000  # the exact null distribution's largest array (32 MB)
METHOD = "sign-flip randomization (one-sided, paired by prompt)"
DETECTION_POWER = 0.8  # the power at which a re-test's detectable difference is stated


def detectable_difference(deltas, margin: float = 0.0, alternative: str = "greater",
                          power: float = DETECTION_POWER) -> float | None:
    """The mean difference this re-test detects with probability `power`: the margin moved by
    (z_{1-alpha} + z_power) * s / sqrt(n), s the per-prompt differences' standard deviation
    (n - 1), in the test's direction (a gain above a `greater` margin, a loss below a `less`
    one). The normal approximation of the test's power, from the run's own re-test variance;
    None when fewer than two prompts or no spread (nothing to estimate the noise from)."""
    values = np.asarray(list(deltas), dtype=float)
    if values.size < 2 or not np.any(values != values[0]):
        return None
    spread = float(values.std(ddof=1)) / math.sqrt(values.size)
    normal = NormalDist()
    resolution = (normal.inv_cdf(1.0 - SIGNIFICANCE_LEVEL) + normal.inv_cdf(power)) * spread
    return float(margin) + (resolution if alternative == "greater" else -resolution)


def _lattice(values: np.ndarray) -> tuple[int, np.ndarray] | None:
    """(L, integers) with values = integers / L, for the smallest L <= MAX_LATTICE; None when
    none fits within a millionth of a step or the exact distribution would be too large."""
    for steps in range(1, MAX_LATTICE + 1):
        scaled = values * steps
        integers = np.rint(scaled)
        if np.all(np.abs(scaled - integers) <= 1e-6):
            cells = 2 * int(np.abs(integers).sum()) + 1
            if cells > MAX_LATTICE_CELLS or cells * values.size > 50 * MAX_LATTICE_CELLS:
                return None
            return steps, integers.astype(np.int64)
    return None


def _exact_tail(integers: np.ndarray, observed: int) -> float:
    """P(sum of s_i * a_i >= observed) for independent fair signs s_i, by convolution: the
    distribution of the signed sum over [-total, total], one difference at a time."""
    total = int(np.abs(integers).sum())
    distribution = np.zeros(2 * total + 1)
    distribution[total] = 1.0
    for value in np.abs(integers):
        shifted = np.zeros_like(distribution)
        shifted[:distribution.size - value] += distribution[value:]  # s = -1
        shifted[value:] += distribution[:distribution.size - value]  # s = +1
        distribution = shifted / 2.0
    return float(min(1.0, distribution[observed + total:].sum()))


def _random_tail(values: np.ndarray, observed: float, draws: int, seed: int) -> float:
    """(1 + hits) / (1 + draws): the share of random sign patterns whose signed sum reaches
    `observed`, counting the observed pattern itself (valid at any number of draws)."""
    rng = np.random.default_rng(seed)
    tolerance = 1e-9 * max(1.0, float(np.abs(values).sum()))
    hits = 0
    for start in range(0, draws, 2000):  # [2000, k] sign blocks: memory stays under 20 MB
        signs = rng.choice(np.array([-1.0, 1.0]), size=(min(2000, draws - start), values.size))
        hits += int(np.count_nonzero(signs @ values >= observed - tolerance))
    return (1 + hits) / (1 + draws)


def sign_flip_test(deltas, margin: float = 0.0, alternative: str = "greater",
                   draws: int = RANDOM_FLIPS, seed: int = 0) -> dict:
    """One-sided paired test of H0 "mean(deltas) <= margin" (`greater`: is there a gain beyond
    the margin?) or "mean(deltas) >= margin" (`less`: is there a loss beyond it?).

    Returns {"method", "alternative", "margin", "statistic" (the mean of deltas - margin),
    "p_value", "differing_prompts", "prompts", "exact", "draws", "mc_standard_error",
    "detectable_difference", "detection_power"} (`detectable_difference`).
    """
    if alternative not in ("greater", "less"):
        raise ValueError(f"alternative must be 'greater' or 'less', got {alternative!r}")
    shifted = np.asarray(list(deltas), dtype=float) - float(margin)
    if shifted.size == 0:
        raise ValueError("the gain test needs at least one per-prompt difference")
    direction = 1.0 if alternative == "greater" else -1.0
    nonzero = direction * shifted[shifted != 0.0]
    result = {"method": METHOD, "alternative": alternative, "margin": float(margin),
              "statistic": float(shifted.mean()), "prompts": int(shifted.size),
              "differing_prompts": int(nonzero.size), "exact": True, "draws": 0,
              "mc_standard_error": 0.0,
              "detectable_difference": detectable_difference(shifted + float(margin), margin,
                                                             alternative),
              "detection_power": DETECTION_POWER}
    if nonzero.size == 0:
        return {**result, "p_value": 1.0}
    lattice = _lattice(nonzero)
    if lattice is not None:
        integers = lattice[1]
        return {**result, "p_value": _exact_tail(integers, int(integers.sum()))}
    p_value = _random_tail(nonzero, float(nonzero.sum()), draws, seed)
    return {**result, "p_value": p_value, "exact": False, "draws": int(draws),
            "mc_standard_error": math.sqrt(p_value * (1.0 - p_value) / draws)}


def significant(test: dict) -> bool:
    """Whether a `sign_flip_test` result rejects its H0 at SIGNIFICANCE_LEVEL."""
    return test["p_value"] <= SIGNIFICANCE_LEVEL


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
