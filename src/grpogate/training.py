"""The rollout -> reward -> update loop, one checkpoint after every finished step.

Each step samples G completions per prompt from the current policy (seeded with
`config.seed + step`), scores them, appends them to trajectories.jsonl, checks the rollout
contract, updates the adapter on the valid groups and checkpoints. Everything the loop has
produced lives in a `TrainingProgress`, which a checkpoint stores and a resumed run restores.
Safe points for a requested stop (SIGINT / SIGTERM) are the start of a step and the boundary
between its rollout and its update; a step stopped there is dropped from the trajectories file.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from rich.markup import escape

from grpogate import decisions, metrics
from grpogate.config import RunConfig
from grpogate.decoding import make_stepper
from grpogate.evidence import JsonlLog
from grpogate.interrupts import StopRequest
from grpogate.policy import (Policy, current_version, reference_mode, sampling_weights,
                             trainable_parameters)
from grpogate.rollout import (SamplingSettings, contract_groups, generate_completions,
                              score_completions, trajectory_records)
from grpogate.update import (NonFiniteUpdate, UpdateFailed, UpdateSettings, build_update_batch,
                             update_with_retry)

if TYPE_CHECKING:  # pipeline imports this module
    from grpogate.pipeline import Admission


def sampling_settings(config: RunConfig) -> SamplingSettings:
    return SamplingSettings(config.max_new_tokens, config.temperature, config.top_p,
                            config.generation_batch_size)


def update_settings(config: RunConfig) -> UpdateSettings:
    return UpdateSettings(config.clip_epsilon, config.kl_coef, config.max_grad_norm,
                          config.micro_batch_size, config.groups_per_update,
                          config.loss_aggregation, config.temperature)


def trainable_tensors(policy: Policy) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in policy.model.named_parameters() if p.requires_grad}


@dataclass
class TrainingProgress:
    """What the rollout / update loop has produced so far. A checkpoint stores all of it except
    the trajectories, which are re-read from trajectories.jsonl up to `trajectories_offset`."""

    micro_batch_size: int
    next_step: int = 0  # the data cursor: step k trains on prompts [k * P, (k + 1) * P)
    steps: list[dict] = field(default_factory=list)
    trajectories: list[dict] = field(default_factory=list)
    seconds: dict = field(default_factory=lambda: dict.fromkeys(
        ("rollout", "verification", "update", "checkpoint"), 0.0))
    trajectories_offset: int = 0  # bytes of trajectories.jsonl that belong to finished steps
    verifier_errors: int = 0
    oom_retries: int = 0
    status: str = "ok"
    contract: dict = field(default_factory=lambda: {"admitted": True, "failed_checks": []})
    failure: dict | None = None  # {"step", "message"} when an update aborted the run
    interruption: dict | None = None  # {"signal", "safe_point", "completed_steps"}

    CHECKPOINTED = ("micro_batch_size", "next_step", "steps", "seconds", "trajectories_offset",
                    "verifier_errors", "oom_retries")

    def state(self) -> dict:
        return {name: getattr(self, name) for name in self.CHECKPOINTED}

    @classmethod
    def from_state(cls, state: dict, trajectories: list[dict]) -> "TrainingProgress":
        return cls(**{name: state[name] for name in cls.CHECKPOINTED}, trajectories=trajectories)

    def interrupt(self, stop: StopRequest, safe_point: str) -> None:
        self.status = "interrupted"
        self.interruption = {"signal": stop.signal_name, "safe_point": safe_point,
                             "completed_steps": len(self.steps)}


def train(policy: Policy, admission: Admission, prompts: list[list[int]], log: JsonlLog,
          reporter, *, run_label: str, progress: TrainingProgress, optimizer, stop: StopRequest,
          save_checkpoint_of, on_step=None) -> None:
    """The rollout / reward / update loop from `progress.next_step` over the encoded train
    `prompts`; updates `progress` in place and calls `save_checkpoint_of(progress)` after every
    finished step, then `on_step(record)` (if given) with that step's record."""
    config = admission.config
    verifier = admission.verifier
    parameters = trainable_parameters(policy)
    settings = sampling_settings(config)
    update = dataclasses.replace(update_settings(config), micro_batch_size=progress.micro_batch_size)
    seconds = progress.seconds

    def on_retry(error: str, micro_batch_size: int) -> None:
        progress.oom_retries += 1
        reporter.log(f"[yellow]{escape(error)}: retrying the update once at micro_batch_size "
                     f"{micro_batch_size}")

    for step in range(progress.next_step, config.steps):
        if stop.requested:
            progress.interrupt(stop, f"before step {step}")
            return
        begin = step * config.prompts_per_step
        problems = admission.train[begin:begin + config.prompts_per_step]
        version = current_version(policy)
        started = time.perf_counter()
        with reporter.task(f"step {step + 1}/{config.steps} rollout",
                           len(problems) * config.group_size) as advance, sampling_weights(policy):
            stepper = make_stepper(policy.model)
            completions = generate_completions(policy.model, policy.tokenizer,
                                               prompts[begin:begin + len(problems)],
                                               config.group_size, settings, config.seed + step,
                                               advance, stepper)
        rollout_seconds = time.perf_counter() - started
        started = time.perf_counter()
        errors_before = verifier.error_count
        rewards = score_completions(completions, problems, verifier)
        progress.verifier_errors += verifier.error_count - errors_before
        verification_seconds = time.perf_counter() - started
        # Counted before any check can stop the loop: an aborted step still paid its cost.
        seconds["rollout"] += rollout_seconds
        seconds["verification"] += verification_seconds
        records = trajectory_records(completions, rewards, problems, run_id=run_label,
                                     step=step, policy_version=version,
                                     verifier_version=verifier.version)
        offset = log.append(records)
        progress.trajectories.extend(records)
        step_contract = decisions.check_rollout_contract(
            contract_groups(records), version, verifier.version, config.group_size)
        if not step_contract["admitted"]:
            progress.contract = {"admitted": False, "failed_checks": step_contract["failed_checks"],
                                 "step": step}
            progress.status = "contract_failed"
            return
        if stop.requested:
            # A safe point between stages. The half-finished step is dropped exactly as a resume
            # would drop it, so the evidence never shows groups that did not reach the update.
            log.truncate(progress.trajectories_offset)
            del progress.trajectories[len(progress.trajectories) - len(records):]
            progress.interrupt(stop, f"after the rollout of step {step}, before its update")
            return
        batch = build_update_batch([c.prompt_token_ids for c in completions],
                                   [c.completion_token_ids for c in completions], rewards,
                                   config.group_size)
        started = time.perf_counter()
        try:
            with reporter.task(f"step {step + 1}/{config.steps} update", len(batch)) as advance:
                record, update = update_with_retry(
                    policy.model, optimizer, batch, update, policy.tokenizer.pad_token_id,
                    lambda: reference_mode(policy), parameters, advance, on_retry)
        except (NonFiniteUpdate, UpdateFailed) as error:
            # update_with_retry rolled the adapter back: what gets saved is the last good one.
            seconds["update"] += time.perf_counter() - started
            reporter.log(f"[red]{escape(str(error))}: stopping; the last good adapter is kept")
            progress.status = ("non_finite_update" if isinstance(error, NonFiniteUpdate)
                               else "update_failed")
            progress.failure = {"step": step, "message": str(error)}
            return
        update_seconds = time.perf_counter() - started
        progress.micro_batch_size = update.micro_batch_size
        generated = sum(len(c.completion_token_ids) for c in completions)
        step_summary = metrics.rollout_summary(records, config.group_size)
        progress.steps.append({
            "step": step, "policy_version": version, "mean_reward": step_summary["mean_reward"],
            "group_count": step_summary["group_count"],
            "valid_group_count": step_summary["valid_group_count"],
            "valid_group_ratio": step_summary["valid_group_ratio"],
            "max_length_hit_ratio": step_summary["max_length_hit_ratio"],
            "generated_tokens": generated, "decode_path": stepper.name,
            "generation_tokens_per_second": generated / rollout_seconds if rollout_seconds else 0.0,
            "rollout_seconds": rollout_seconds, "verification_seconds": verification_seconds,
            "update_seconds": update_seconds, "micro_batch_size": update.micro_batch_size,
            **record.summary()})
        seconds["update"] += update_seconds
        progress.trajectories_offset = offset
        progress.next_step = step + 1
        started = time.perf_counter()
        save_checkpoint_of(progress)
        seconds["checkpoint"] += time.perf_counter() - started
        # After the checkpoint, not right after the append: a step a resume would redo (killed
        # before its checkpoint) then never reaches the events file twice.
        if on_step is not None:
            on_step(progress.steps[-1])
        reporter.log(f"step {step + 1}/{config.steps}: reward {step_summary['mean_reward']:.3f}, "
                     f"valid groups {step_summary['valid_group_count']}/{step_summary['group_count']}, "
                     f"updates {record.update_count}, kl {record.summary()['mean_kl']:.4f}")
