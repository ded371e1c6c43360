"""Graded policies for the decision study: per-sample mixtures of two real policies' pools, and
the weak null (a mixture tuned so its true reward gain on the pool is 0). Pure Python and numpy.

A mixture answers sample k of each prompt as policy B does with probability `share` and as
policy A does otherwise (one seeded coin per prompt and sample, the same coin for every field
of the sample): every completion is real and keeps its seed, so the mixture pairs with the
baseline sample for sample as A and B do. Mixing a trained candidate into the baseline gives
the power curve below the candidate's gain; mixing a gaining and a damaging candidate gives a
weak null: a policy that moves many prompts, some up and some down, with no mean gain. Its
per-prompt differences are as skewed as its two parents make them, which is where a test
valid only for symmetric differences fails.

`--mixtures` items (bench/decision_quality.py): `SHARE` mixes the first --candidate into the
baseline; `A:B:SHARE` mixes policy B into policy A, each 0 (the baseline) or a 1-based
--candidate index; `A:B:null` tunes the share so the true reward gain is 0 +- NULL_TOLERANCE;
`A:B:guard` tunes it so the true guard gain is -gates.maximum_guard_reward_loss +-
NULL_TOLERANCE: a candidate at the guard's margin, where accepting is the error the guard
controls.
"""

from __future__ import annotations

import numpy as np

SETS = ("eval", "guard")
FIELDS = ("rewards", "texts", "tokens", "hit")
NULL_TOLERANCE = 0.005  # the weak null's true reward gain on the pool: 0 +- this


def _coins(rng: np.random.Generator, pools: tuple[dict, dict]) -> dict:
    """One uniform number per prompt and sample of each set, in SETS order (the mixture's
    coins: sample k is B's when its number is below the share)."""
    first, second = pools
    coins = {}
    for name in SETS:
        if first[name]["prompt_ids"] != second[name]["prompt_ids"]:
            raise ValueError(f"{name}: the two pools hold different prompts")
        coins[name] = rng.random(np.shape(first[name]["rewards"]))
    return coins


def _mixed(first: dict, second: dict, coins: dict, share: float) -> dict:
    return {name: {"prompt_ids": first[name]["prompt_ids"], **{
        field: [[(b if coin < share else a) for a, b, coin in zip(row_a, row_b, row_coins)]
                for row_a, row_b, row_coins in zip(first[name][field], second[name][field],
                                                    coins[name])]
        for field in FIELDS}} for name in SETS}


def mixture(first: dict, second: dict, share: float, seed: int) -> dict:
    """The pool of the policy that answers each prompt's sample k as `second` does with
    probability `share` and as `first` does otherwise: every true gain about `share` of the way
    from first's to second's (the pool's own figure is exact for its coins)."""
    return _mixed(first, second, _coins(np.random.default_rng(seed), (first, second)), share)


def tuned_share(baseline: dict, first: dict, second: dict, seed: int, set_name: str = "eval",
                target: float = 0.0) -> tuple[float, float]:
    """(share, true gain) of the mixture of `first` and `second` (mixture's coins for `seed`)
    whose true reward gain over `baseline` on the `set_name` pool is nearest `target`. As the
    share grows past a sample's coin that sample turns from first's to second's, moving the
    gain by (second's reward - first's) / (prompts x samples); the gain is first's plus the
    running sum of those steps in coin order, so the share nearest the target is exact."""
    coins = _coins(np.random.default_rng(seed), (first, second))[set_name]
    base, rewards_a, rewards_b = (np.asarray(pool[set_name]["rewards"], dtype=float)
                                  for pool in (baseline, first, second))
    if base.shape != rewards_a.shape:
        raise ValueError(f"the baseline's {set_name} pool and the mixture's differ in shape")
    order = np.argsort(coins, axis=None)
    steps = ((rewards_b - rewards_a).reshape(-1) / rewards_a.size)[order]
    gains = (rewards_a - base).mean() + np.concatenate([[0.0], np.cumsum(steps)])
    best = int(np.argmin(np.abs(gains - target)))  # the first `best` in coin order are B's
    ordered = np.concatenate([[0.0], coins.reshape(-1)[order], [1.0]])
    return float((ordered[best] + ordered[best + 1]) / 2.0), float(gains[best])


def parse(item: str, candidates: int) -> tuple[int, int, float | str]:
    """(A, B, share, or "null" / "guard" for a tuned one) of one --mixtures item; ValueError
    with the reason for a malformed one."""
    parts = item.split(":")
    if len(parts) == 1:
        parts = ["0", "1", parts[0]]
    if len(parts) != 3:
        raise ValueError(f"{item!r}: expected SHARE or A:B:SHARE (SHARE a number, 'null' or "
                         "'guard')")
    try:
        first, second = int(parts[0]), int(parts[1])
        share = parts[2] if parts[2] in ("null", "guard") else float(parts[2])
    except ValueError:
        raise ValueError(f"{item!r}: A and B are policy numbers, SHARE a number, 'null' or "
                         "'guard'") from None
    if not (0 <= first <= candidates and 0 <= second <= candidates) or first == second:
        raise ValueError(f"{item!r}: A and B must differ and lie in 0..{candidates} (0: the "
                         "baseline, k: the k-th --candidate)")
    if not isinstance(share, str) and not 0.0 <= share <= 1.0:
        raise ValueError(f"{item!r}: SHARE must lie in [0, 1]")
    return first, second, share


def build(item: str, baseline: dict, named: list[tuple[str, dict]], seed: int,
          guard_margin: float = 0.05) -> tuple[str, dict]:
    """(name, pool) of one --mixtures item; `named`: the --candidate pools in order. A tuned
    mixture whose nearest share misses its target by more than NULL_TOLERANCE is a ValueError
    (the weak null's target: reward gain 0; the guard's: guard gain -guard_margin)."""
    first, second, share = parse(item, len(named))
    policies = [("baseline", baseline), *named]
    (name_a, pool_a), (name_b, pool_b) = policies[first], policies[second]
    if isinstance(share, str):
        set_name, target, what = (("eval", 0.0, "weak null") if share == "null" else
                                  ("guard", -guard_margin, "at the guard margin"))
        share, gain = tuned_share(baseline, pool_a, pool_b, seed, set_name, target)
        if abs(gain - target) > NULL_TOLERANCE:
            raise ValueError(f"{item!r}: no mixture of {name_a} and {name_b} has a true "
                             f"{set_name} gain within {NULL_TOLERANCE} of {target:+g} (nearest "
                             f"{gain:+.4f} at share {share:.3f}); mix a gaining with a "
                             "damaging candidate")
        label = f"{what}: {name_b} at {share:.3f} in {name_a}"
    else:
        label = (f"mixture {share:g} of {name_b}" if first == 0
                 else f"mixture {share:g} of {name_b} in {name_a}")
    return label, {"header": {"identity": label}, **mixture(pool_a, pool_b, share, seed)}
