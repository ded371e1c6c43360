"""The `steps` check: every configured training step ran, or the evidence names why not.

Pure Python, as decisions.py: a missing key, a wrong type or a bool fails the check.
"""

from __future__ import annotations

from typing import Any


def _whole(value: Any) -> bool:
    return type(value) is int


def steps_rows(evidence: Any) -> list[dict[str, Any]]:
    """The `steps` row (on fail `reject`): `training_steps` (which the audit rebuilds from the
    trajectories) says every configured step completed, or names an early stop of a run whose
    status is not ok (an interrupted or failed loop, which the execution check rejects too).
    A run whose step counter skipped training passes and still finished ok fails it. No row
    for evidence without the section (a run gated from another trainer's log: it has no
    trajectories to count)."""
    section = evidence.get("training_steps") if isinstance(evidence, dict) else None
    if section is None:
        return []
    section = section if isinstance(section, dict) else {}
    configured, completed = section.get("configured"), section.get("completed")
    counted = _whole(configured) and configured > 0 and _whole(completed)
    early_stop = section.get("early_stop")
    stopped = (isinstance(early_stop, str) and early_stop.strip() != ""
               and evidence.get("status") != "ok")
    passed = counted and (completed == configured or (stopped and 0 <= completed < configured))
    return [{"name": "steps", "value": f"{completed}/{configured}" if counted else None,
             "threshold": "every configured step (or a named early stop)", "passed": passed,
             "on_fail": "reject"}]
