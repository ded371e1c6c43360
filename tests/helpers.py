"""Helpers shared by the test files that drive real runs."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256(path: Path) -> str:
    """A file's sha256, computed here rather than by grpogate, so hash checks are independent."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def alternating_rewards(completions, problems, verifier) -> list[float]:
    """Stands in for the training verifier: even samples 1, odd 0, so every group is valid and
    every optimizer step runs even on a random model that never earns a real reward."""
    return [1.0 if c.sample_index % 2 == 0 else 0.0 for c in completions]


def record_ratio_inputs(monkeypatch) -> list:
    """Spy on the objective: every call appends (log-probs, old log-probs), detached copies, so
    a test sees the ratio each micro-batch was really computed from."""
    from grpogate.training import objectives

    seen, real_terms = [], objectives.policy_token_terms

    def spy(logp, old_logp, *args, **kwargs):
        seen.append((logp.detach().clone(), old_logp.detach().clone()))
        return real_terms(logp, old_logp, *args, **kwargs)

    monkeypatch.setattr(objectives, "policy_token_terms", spy)
    return seen
