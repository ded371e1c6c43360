"""Independent re-test: fresh completions of the baseline and the candidate on isolated eval prompts.

Training trajectories only prove that an update happened; quality comes from here. Both policies
sample with the same seed over the same prompts in the same batch layout, so the comparison is
paired prompt by prompt. Each prompt's seed follows its index in the eval set, so under
torchrun each rank re-tests its shard of the prompts and all ranks gather the records in the
eval set's order before the paired comparison: the same records as one process.
This module yields per-completion records; `metrics` reduces them.
"""

from __future__ import annotations

import contextlib
import math

from grpogate.config import RunConfig
from grpogate.distributed import SINGLE, World, agree_stop, in_shard_order, shard
from grpogate.seeding import eval_seed
from grpogate.inputs.policy import Policy, sampling_weights
from grpogate.inputs.tasks import Problem
from grpogate.interrupts import StopRequest
from grpogate.engines import engine_for
from grpogate.engines.rows import shared_prefix_length
from grpogate.sampling.drift import DriftStepper, measure_drift
from grpogate.sampling.rollout import (SamplingSettings, generate_completions, sampling_settings,
                                       score_completions, trace_id)


def evaluate_policy(model, tokenizer, problems: list[Problem], prompt_token_ids: list[list[int]],
                    *, policy_name: str, policy_version: str, verifier, group_size: int,
                    settings: SamplingSettings, seed: int, mode=contextlib.nullcontext,
                    advance=None, prompt_indexes: list[int] | None = None,
                    shared_prefix: int | None = None, trace_prefix: str = "eval",
                    keep: list | None = None, wrap=None, sample_offset: int = 0) -> list[dict]:
    """Sample `group_size` fresh completions per eval prompt under `mode` and score them;
    `prompt_indexes`: the prompts' indexes in the eval set (their seeds; default 0, 1, ...).
    `keep`: a list the completions (with their token ids) are also appended to. `wrap`: a
    function of the decode stepper built under `mode`, returning the one to sample with.
    `sample_offset`: added to every record's sample index (a later round of the guard)."""
    with mode():
        stepper = engine_for(model).stepper(model)
        completions = generate_completions(model, tokenizer, prompt_token_ids, group_size,
                                           settings, seed, advance,
                                           stepper=wrap(stepper) if wrap else stepper,
                                           prompt_indexes=prompt_indexes,
                                           shared_prefix=shared_prefix)
    if keep is not None:
        keep += completions
    rewards = score_completions(completions, problems, verifier)
    records = []
    for completion, reward in zip(completions, rewards):
        problem = problems[completion.prompt_index]
        records.append({
            "policy": policy_name,
            "policy_version": policy_version,
            "prompt_id": problem.prompt_id,
            "sample_index": completion.sample_index + sample_offset,
            "trace_id": trace_id(f"{trace_prefix}-{policy_name}", 0, problem.prompt_id,
                                 completion.sample_index + sample_offset),
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
                stop: StopRequest, world: World = SINGLE,
                shared_prefix: int | None = None, *, group_size: int | None = None,
                label: str = "re-test", drift: bool = False,
                indexes: range | None = None, progress: str = "",
                round_index: int = 0) -> tuple[list[dict], int] | None:
    """Fresh completions of the baseline, then the candidate, on the encoded eval prompts with
    the same seed; returns the records and the verifier errors (of every rank). None when a
    stop was requested (on any rank) before either policy's pass (a safe point).
    `shared_prefix` defaults to the common prefix of all `prompts` (see generate_completions);
    a caller re-testing a part of the eval set passes the whole set's. `group_size` (default
    eval_group_size) and `label` ("re-test", or "guard": its trace ids and progress line) serve
    the guard set; `drift` adds each completion's entropy and the candidate's KL to the
    baseline (sampling/drift.py) to its record. `indexes`: the set's positions to re-test
    (default: all of them), one batch of the sequential re-test; each keeps its position's seed.
    `progress`: the progress line's name (default `label`). `round_index` r: the guard's r-th
    round over the same prompts, sampled at seed positions r x len(prompts) + i with sample
    indexes from r x group_size, so no two rounds share a seed or a trace id."""
    group_size = group_size or config.eval_group_size
    errors_before = verifier.error_count
    indexes = range(len(prompts)) if indexes is None else indexes
    positions = [indexes[k] for k in shard(len(indexes), world)]
    if shared_prefix is None:
        shared_prefix = shared_prefix_length(prompts) if prompts else 0
    mine: dict[str, tuple[list[dict], list]] = {}
    lockstep = _LockstepDrift(config.temperature) if drift else None
    for name, version, mode in (
            ("baseline", policy.baseline_version, lambda: sampling_weights(policy, baseline=True)),
            ("candidate", candidate_version, lambda: sampling_weights(policy))):
        if agree_stop(world, stop):
            return None
        completions: list = []
        with reporter.task(f"{progress or label} {name}", len(indexes) * group_size) as advance:
            records = evaluate_policy(
                policy.model, policy.tokenizer, [problems[k] for k in positions],
                [prompts[k] for k in positions], policy_name=name,
                policy_version=version, verifier=verifier, group_size=group_size,
                settings=sampling_settings(config), seed=eval_seed(config.seed),
                mode=mode, advance=advance,
                prompt_indexes=[round_index * len(prompts) + k for k in positions],
                sample_offset=round_index * group_size,
                shared_prefix=shared_prefix, trace_prefix="eval" if label == "re-test" else label,
                keep=completions, wrap=lockstep and getattr(lockstep, name))
            advance(len(indexes) * group_size - len(records))
        mine[name] = (records, completions)
    if drift:
        values = (tuple([c.measured for c in completions] for _, completions in mine.values())
                  if lockstep.measured else
                  measure_drift(policy, mine["baseline"][1], mine["candidate"][1],
                                config.temperature, shared_prefix))
        for (records, _), measured in zip(mine.values(), values):
            for record, extra in zip(records, measured):
                record.update(extra)
                _null_non_finite(record)
    gathered = [r for name in ("baseline", "candidate")
                for r in _gathered(world, mine[name][0], positions, group_size)]
    errors = world.all_gather_object(verifier.error_count - errors_before)
    return gathered, sum(errors)


def _null_non_finite(record: dict) -> None:
    """A drift value that is NaN or infinite (the candidate's logits were: a diverged model) is
    recorded as null with its name under "non_finite": JSON has no NaN, and the drift section
    then has no mean: the finite_retest check rejects the candidate instead of the run
    crashing."""
    bad = [key for key in DRIFT_KEYS if key in record and not math.isfinite(record[key])]
    for key in bad:
        record[key] = None
    if bad:
        record["non_finite"] = bad


DRIFT_KEYS = ("entropy", "kl_to_baseline")


class _LockstepDrift:
    """The re-test's drift measured while both policies sample (drift.DriftStepper): the
    baseline's entropies on its own distributions, then the candidate's, with a stepper on the
    baseline's weights in lockstep for the KL. That needs a stepper that holds its own copy of
    the weights (`holds_weights`, the accelerator's): the baseline pass's serves both (`fresh`).
    Where the engine's stepper reads the model's weights as they are (the reference engine),
    nothing is measured here and `measure_drift` runs afterwards."""

    def __init__(self, temperature: float):
        self.temperature, self.measured = temperature, False
        self.baseline_stepper = None  # a fresh stepper on the baseline pass's weights

    def baseline(self, stepper):
        if not getattr(stepper, "holds_weights", False):
            return stepper
        self.baseline_stepper = stepper.fresh()  # the weights only: no cache held meanwhile
        return DriftStepper(stepper, self.temperature)

    def candidate(self, stepper):
        if self.baseline_stepper is None or not getattr(stepper, "holds_weights", False):
            return stepper
        self.measured = True
        return DriftStepper(stepper, self.temperature, baseline=self.baseline_stepper)


def _gathered(world: World, mine: list[dict], positions: list[int], group_size: int) -> list[dict]:
    """Every rank's records in eval-set order (G consecutive records per prompt)."""
    if not world.distributed:
        return mine
    groups = [(position, mine[j * group_size:(j + 1) * group_size])
              for j, position in enumerate(positions)]
    return [r for _, members in in_shard_order(world.all_gather_object(groups)) for r in members]
