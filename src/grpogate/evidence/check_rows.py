"""The rows every decision check is written as, and the junk-tolerant reads they take.

Pure Python (no torch). A row is {"name", "value", "threshold", "passed", "on_fail"}; a read of a
missing key, a wrong type or NaN gives None, and None fails the check that needed it.
"""

from __future__ import annotations

from typing import Any

from grpogate.gates import finite_number


def _get(mapping: Any, *keys: str) -> Any:
    """mapping[k1][k2]... or None when any level is missing or not a dict."""
    for key in keys:
        if not isinstance(mapping, dict):
            return None
        mapping = mapping.get(key)
    return mapping


def _non_empty_str(value: Any) -> bool:
    return isinstance(value, str) and value.strip() != ""


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _same_version(recorded: Any, expected: Any) -> bool:
    return _non_empty_str(expected) and isinstance(recorded, str) and recorded == expected


def _row(name: str, value: Any, threshold: Any, passed: bool, on_fail: str) -> dict[str, Any]:
    return {"name": name, "value": value, "threshold": threshold, "passed": bool(passed),
            "on_fail": on_fail}


def _gate_row(name: str, value: Any, gates: Any, gate_name: str) -> dict[str, Any]:
    """A `tune` check of a measured value against an inclusive minimum_/maximum_ gate."""
    measured, threshold = finite_number(value), finite_number(_get(gates, gate_name))
    passed = measured is not None and threshold is not None and (
        measured >= threshold if gate_name.startswith("minimum_") else measured <= threshold)
    return _row(name, measured, threshold, passed, "tune")


def _retest_skipped(evidence: Any) -> bool:
    """An interrupted run records a skipped re-test as zeros with `"skipped": true`; zeros that
    were never measured must not pass a quality gate."""
    return _get(evidence, "comparison", "skipped") is True
