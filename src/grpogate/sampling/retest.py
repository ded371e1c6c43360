"""Independent re-test: fresh completions of the baseline and the candidate on isolated eval prompts.

Training trajectories only prove that an update happened; quality comes from here. Both policies
sample with the same seed over the same prompts in the same batch layout, so the comparison is
paired prompt by prompt. This module yields per-completion records; `metrics` reduces them.
"""

from __future__ import annotations

import contextlib

from grpogate.config import RunConfig
from grpogate.evidence.assemble import seeds
from grpogate.inputs.policy import Policy, sampling_weights
from grpogate.inputs.tasks import Problem
from grpogate.interrupts import StopRequest
from grpogate.sampling.rollout import (SamplingSettings, generate_completions, sampling_settings,
                                       score_completions, trace_id)


def evaluate_policy(model, tokenizer, problems: list[Problem], prompt_token_ids: list[list[int]],
                    *, policy_name: str, policy_version: str, verifier, group_size: int,
                    settings: SamplingSettings, seed: int, mode=contextlib.nullcontext,
                    advance=None) -> list[dict]:
    """Sample `group_size` fresh completions per eval prompt under `mode` and score them."""
    with mode():
        completions = generate_completions(model, tokenizer, prompt_token_ids, group_size,
                                           settings, seed, advance)
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


def retest_both(policy: Policy, problems: list[Problem], prompts: list[list[int]], verifier,
                config: RunConfig, candidate_version: str, reporter,
                stop: StopRequest) -> tuple[list[dict], int] | None:
    """Fresh completions of the baseline, then the candidate, on the encoded eval prompts with
    the same seed; returns the records and the verifier errors. None when a stop was
    requested before either policy's pass (a safe point)."""
    records: list[dict] = []
    errors_before = verifier.error_count
    for name, version, mode in (
            ("baseline", policy.baseline_version, lambda: sampling_weights(policy, baseline=True)),
            ("candidate", candidate_version, lambda: sampling_weights(policy))):
        if stop.requested:
            return None
        with reporter.task(f"re-test {name}", len(prompts) * config.eval_group_size) as advance:
            records += evaluate_policy(
                policy.model, policy.tokenizer, problems, prompts, policy_name=name,
                policy_version=version, verifier=verifier, group_size=config.eval_group_size,
                settings=sampling_settings(config), seed=seeds(config.to_dict())["eval"],
                mode=mode, advance=advance)
    return records, verifier.error_count - errors_before
