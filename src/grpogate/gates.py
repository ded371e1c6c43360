"""The gate schema: the seven thresholds, the optional ones and the switch a decision reads, and
their validation.

Pure Python, below every wing. `Gates` lists every gate once, with its default and why; the
configuration's gates table is a `Gates`, and the decisions read the names derived from it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from grpogate.errors import InputError


@dataclass
class Gates:
    """Delivery gates (docs/design.md §6). Point-estimate minimums and maximums are inclusive;
    a gain gate under the significant rule is a strict test of "gain <= minimum"."""

    minimum_valid_group_ratio: float = 0.20
    # 0.5 effective trajectories/s on the 2-core CPU default; the GPU reference profile asks 1.0.
    minimum_effective_trajectories_per_second: float = 0.5
    minimum_update_count: float = 1
    minimum_reward_gain: float = 0.0
    minimum_pass_at_group_gain: float = 0.0
    maximum_max_length_hit_ratio: float = 0.50
    maximum_peak_allocated_bytes: float = 10 * 1024**3
    # true (the default profile, docs/design.md §6): the reward and pass_at_group gates pass
    # only when the anytime-valid sequential test shows "gain > minimum" at 2.5 %
    # (evidence/anytime.py, evidence/stopping.py), so `accept` means a gain the re-test
    # resolves, whatever the shape of the per-prompt differences; false reads
    # the point estimate (the reference profile's published gates, gsm8k_qwen05b.toml), a rule
    # that accepts a zero gain.
    require_significant_gain: bool = True
    # Optional gates: absent from an older gates table (and an older run's evidence), off, so
    # those keep their decision. Both are >= 0.
    # The candidate's mean per-token KL to the baseline on the re-test's fresh completions;
    # 0 = off (the KL is still recorded). 1.0 nats per token is about 1.5 times the largest
    # re-test KL of any searched setting that reached the default's gain on the development set
    # (0.20 to 0.65; 48 steps at lr 2e-4, beta 0.04, the largest; docs/measurements.md): it
    # tunes a run that drifts further than any of them needed.
    maximum_retest_kl: float = 1.0
    # The non-inferiority margin delta of the guard set: under the significant rule the guard
    # passes only when the anytime-valid test shows "guard gain > -delta" (its lower bound above
    # -delta); under the point-estimate rule the guard gain itself >= -delta. 0.05: a loss of
    # one guard answer in twenty is the most an accepted candidate is allowed to hide.
    maximum_guard_reward_loss: float = 0.05


# Switches rather than thresholds: bools, optional in a gates table and off when absent, so a
# table written for the reference profile (docs/design.md §13) keeps its meaning in the decision
# functions. (A run's config always records the switch: the default profile sets it true, and a
# --gates file that omits it keeps the profile's value.)
SWITCH_GATE_NAMES = tuple(f.name for f in dataclasses.fields(Gates) if f.type in (bool, "bool"))
OPTIONAL_GATE_NAMES = ("maximum_retest_kl", "maximum_guard_reward_loss")
GATE_NAMES = tuple(f.name for f in dataclasses.fields(Gates)
                   if f.name not in SWITCH_GATE_NAMES + OPTIONAL_GATE_NAMES)
# A user may accept a small quality loss (e.g. -0.02); every other gate is a count, a ratio,
# a rate or a size, for which a negative bound is a mistake.
_SIGNED_GATES = frozenset({"minimum_reward_gain", "minimum_pass_at_group_gain"})


def finite_number(value: Any) -> int | float | None:
    """A finite real number (ints kept exact for the gates table), else None. Bools are not
    numbers here: `True` as a byte count or a gain is a bug upstream, not a 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return value if math.isfinite(float(value)) else None
    except OverflowError:  # an int too large for a float
        return None


def validate_gates(gates: Any) -> dict[str, float | bool]:
    """The seven gates as floats, plus any optional gate and switch given (a float, a bool);
    InputError for an
    unknown, missing, non-number, non-finite or (except the two gain gates) negative value,
    or a switch that is not true/false."""
    if not isinstance(gates, dict):
        raise InputError(f"gates must be a table of {len(GATE_NAMES)} numbers, got "
                         f"{type(gates).__name__}")
    known = ", ".join(GATE_NAMES + OPTIONAL_GATE_NAMES + SWITCH_GATE_NAMES)
    for name in gates:
        if name not in GATE_NAMES + OPTIONAL_GATE_NAMES + SWITCH_GATE_NAMES:
            raise InputError(f"unknown gate {name!r}; known gates: {known}")
    missing = [name for name in GATE_NAMES if name not in gates]
    if missing:
        raise InputError(f"missing gate(s): {', '.join(missing)}; all of these are required: "
                         f"{', '.join(GATE_NAMES)}")
    validated = {}
    for name in GATE_NAMES + tuple(n for n in OPTIONAL_GATE_NAMES if n in gates):
        value = gates[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InputError(f"gate {name!r} must be a number, got {value!r}")
        if finite_number(value) is None:
            raise InputError(f"gate {name!r} must be a finite number, got {value!r}")
        if value < 0 and name not in _SIGNED_GATES:
            raise InputError(f"gate {name!r} must be >= 0, got {value!r}")
        validated[name] = float(value)
    for name in SWITCH_GATE_NAMES:
        if name in gates:
            if not isinstance(gates[name], bool):
                raise InputError(f"gate {name!r} must be true or false, got {gates[name]!r}")
            validated[name] = gates[name]
    return validated
