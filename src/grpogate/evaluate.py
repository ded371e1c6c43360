"""Independent re-test: fresh completions of the baseline and the candidate on isolated eval prompts.

Training trajectories only prove that an update happened; quality comes from here. Both policies
sample with the same seed over the same prompts in the same batch layout, so the comparison is
paired prompt by prompt. This module yields per-completion records; `metrics` reduces them.
"""

from __future__ import annotations

import contextlib

from grpogate.rollout import SamplingSettings, generate_completions, score_completions, trace_id
from grpogate.tasks import Problem


def evaluate_policy(model, tokenizer, problems: list[Problem], prompt_token_ids: list[list[int]],
                    *, policy_name: str, policy_version: str, verifier, group_size: int,
                    settings: SamplingSettings, seed: int, mode=contextlib.nullcontext,
                    progress=None) -> list[dict]:
    """Sample `group_size` fresh completions per eval prompt under `mode` and score them."""
    with mode():
        completions = generate_completions(model, tokenizer, prompt_token_ids, group_size,
                                           settings, seed, progress)
    rewards = score_completions(completions, problems, verifier)
    records = []
    for completion, reward in zip(completions, rewards):
        problem = problems[completion.prompt_index]
        records.append({
            "policy": policy_name,
            "policy_version": policy_version,
            "prompt_id": problem.prompt_id,
            "sample_index": completion.sample_index,
            "trace_id": trace_id(f"eval-{policy_name}", 0, problem.prompt_id, completion.sample_index),
            "seed": seed,
            "verifier_version": verifier.version,
            "completion": completion.text,
            "completion_tokens": len(completion.completion_token_ids),
            "hit_max_length": completion.hit_max_length,
            "reward": float(reward),
        })
    return records
