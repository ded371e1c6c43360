"""The rollout -> reward -> update loop, one checkpoint after every finished step.

Each step samples G completions per prompt from the current policy (seeded with
`config.seed + step`), scores them, appends them to trajectories.jsonl, checks the rollout
contract, updates the adapter on the valid groups and checkpoints. Everything the loop has
produced lives in a `LoopState`, which a checkpoint stores and a resumed run restores.
With `dynamic_sampling` (DAPO), a step whose groups are not all valid draws the shortfall of
new train prompts and generates again, up to `max_generation_rounds` rounds; every round's
groups are recorded (their cost is real) and only the valid ones train. The data cursor counts
prompts, not steps: it moves on with every prompt drawn, wraps into a new epoch at the end of
the train set, and never hands one step the same prompt twice; a checkpoint keeps it.
Safe points for a requested stop (SIGINT / SIGTERM) are the start of a step and the boundary
between its rollout and its update; a step stopped there is dropped from the trajectories file.
Under torchrun each rank samples and scores its shard of a round's prompts and every rank
gathers the whole round, so all ranks hold the same records and take the same decisions;
stops are agreed at the safe points; only rank 0 writes (its log and checkpoints).

Call map (pipeline._execute calls `train`):
  train                      one iteration per step, from state.next_step
    _rollout                 generation rounds until the step has its valid groups
      _generation_round      sample + score one round (this rank's shard, then gathered)
        _sample_and_score    sampling.rollout.generate_completions, score_completions, score_rewards
        _gather_round        every rank's groups in prompt order
    _admit_rollout           evidence.decisions.check_step_contract, then a safe point
    _update                  advantages.build_update_batch -> update.update_with_retry
    _finish_step             the step record, the checkpoint, on_step, one line to the terminal
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field

from grpogate.config import RunConfig
from grpogate.distributed import SINGLE, StageClock, World, agree_stop, in_shard_order, shard
from grpogate.errors import plain
from grpogate.evidence import decisions
from grpogate.evidence.metrics import rollout_summary
from grpogate.evidence.assemble import step_summary, update_throughput
from grpogate.files import JsonlLog
from grpogate.inputs.policy import Policy, current_version, reference_mode, sampling_weights
from grpogate.inputs.tasks import Problem
from grpogate.interrupts import StopRequest
from grpogate.seeding import rollout_seed
from grpogate.engines import engine_for
from grpogate.engines.rows import shared_prefix_length
from grpogate.sampling.rollout import (Completion, generate_completions, sampling_settings,
                                       score_completions, score_rewards, trajectory_records)
from grpogate.training.advantages import RewardComponents, build_update_batch
from grpogate.training.checkpoint import CheckpointWriter
from grpogate.training.schedule import learning_rate_at
from grpogate.training.update import (NonFiniteUpdate, UpdateFailed, UpdateSettings,
                                      update_with_retry)


@dataclass
class LoopState:
    """What the rollout / update loop has produced so far. A checkpoint stores all of it except
    the trajectories, which are re-read from trajectories.jsonl up to `trajectories_offset`."""

    micro_batch_size: int
    next_step: int = 0
    # The data cursor: prompts drawn so far over all epochs; the next one is
    # problems[next_prompt % len(problems)]. Without dynamic sampling it is next_step * P.
    next_prompt: int = 0
    steps: list[dict] = field(default_factory=list)
    trajectories: list[dict] = field(default_factory=list)
    seconds: dict = field(default_factory=lambda: dict.fromkeys(
        ("rollout", "verification", "update", "checkpoint"), 0.0))
    trajectories_offset: int = 0  # bytes of trajectories.jsonl that belong to finished steps
    verifier_errors: int = 0
    reward_errors: int = 0  # user reward functions that raised, timed out or returned non-finite
    oom_retries: int = 0
    status: str = "ok"
    contract: dict = field(default_factory=lambda: {"admitted": True, "failed_checks": []})
    failure: dict | None = None  # {"step", "message"} when an update aborted the run
    interruption: dict | None = None  # {"signal", "safe_point", "completed_steps"}
    # This rank's own seconds per stage (outside collectives), this process only: the evidence
    # compares the ranks with them.
    own_seconds: dict = field(default_factory=lambda: dict.fromkeys(
        ("rollout", "verification", "update"), 0.0))

    CHECKPOINTED = ("micro_batch_size", "next_step", "next_prompt", "steps", "seconds",
                    "trajectories_offset", "verifier_errors", "reward_errors", "oom_retries")

    def checkpointed(self) -> dict:
        return {name: getattr(self, name) for name in self.CHECKPOINTED}

    @classmethod
    def from_checkpoint(cls, state: dict, trajectories: list[dict]) -> "LoopState":
        return cls(**{name: state[name] for name in cls.CHECKPOINTED}, trajectories=trajectories)

    def interrupt(self, stop: StopRequest, safe_point: str) -> None:
        self.status = "interrupted"
        self.interruption = {"signal": stop.signal_name, "safe_point": safe_point,
                             "completed_steps": len(self.steps)}


@dataclass
class Loop:
    """What stays fixed over the loop: the policy, its inputs, where it writes."""

    policy: Policy
    config: RunConfig
    verifier: object
    reward_set: object  # inputs.rewards.RewardSet: the weighted components trained on
    problems: list[Problem]  # the train set, in cursor order
    prompts: list[list[int]]  # their encoded prompts
    log: JsonlLog
    reporter: object
    run_label: str
    optimizer: object
    stop: StopRequest
    checkpoints: CheckpointWriter
    world: World = SINGLE

    @functools.cached_property
    def shared_prefix(self) -> int:
        """The decoder's once-per-batch prefix, fixed over the whole train set: batching (one
        process or several) then never changes a prompt's numerics."""
        return shared_prefix_length(self.prompts) if self.prompts else 0


@dataclass
class Rollout:
    """One step's sampled and scored group, before its update."""

    version: str
    next_prompt: int  # the data cursor after this step
    completions: list[Completion] = field(default_factory=list)  # every round's, in order
    rewards: list[float] = field(default_factory=list)  # weighted totals
    components: list[list[float]] = field(default_factory=list)  # [N][K], reward set's order
    records: list[dict] = field(default_factory=list)
    rounds: list[dict] = field(default_factory=list)  # per round: seed, prompts, valid groups, seconds
    decode_path: str = ""
    rollout_seconds: float = 0.0
    verification_seconds: float = 0.0
    log_offset: int = 0  # bytes of trajectories.jsonl once this step's records are in


def train(loop: Loop, state: LoopState, on_step=None) -> None:
    """The rollout / reward / update loop from `state.next_step`; updates `state` in place and
    checkpoints after every finished step, then calls `on_step(record)` (if given)."""
    config = loop.config
    for step in range(state.next_step, config.steps):
        if agree_stop(loop.world, loop.stop):
            state.interrupt(loop.stop, f"before step {step}")
            return
        rollout = _rollout(loop, state, step)
        if not _admit_rollout(loop, state, step, rollout):
            return
        update_record = _update(loop, state, step, rollout)
        if update_record is None:
            return
        _finish_step(loop, state, step, rollout, update_record, on_step)


def _rollout(loop: Loop, state: LoopState, step: int) -> Rollout:
    """Sample the step's groups (round 0: P prompts; with dynamic sampling, refill rounds for
    the shortfall of valid groups), score them, log the records."""
    config = loop.config
    rollout = Rollout(version=current_version(loop.policy), next_prompt=state.next_prompt)
    rounds = config.max_generation_rounds if config.dynamic_sampling else 1
    valid_groups, drawn = 0, 0
    for generation_round in range(rounds):
        # Never the same prompt twice in one step: its groups would merge in the contract.
        wanted = min(config.prompts_per_step - valid_groups, len(loop.problems) - drawn)
        if wanted <= 0:
            break
        indexes = [(rollout.next_prompt + i) % len(loop.problems) for i in range(wanted)]
        rollout.next_prompt += wanted
        drawn += wanted
        valid_groups += _generation_round(loop, state, step, generation_round, indexes, rollout)
        if valid_groups >= config.prompts_per_step:
            break
    # Counted before any check can stop the loop: an aborted step still paid its cost.
    state.seconds["rollout"] += rollout.rollout_seconds
    state.seconds["verification"] += rollout.verification_seconds
    rollout.log_offset = loop.log.append(rollout.records)
    state.trajectories.extend(rollout.records)
    return rollout


def _generation_round(loop: Loop, state: LoopState, step: int, generation_round: int,
                      indexes: list[int], rollout: Rollout) -> int:
    """Generate and score G completions for each of the train prompts `indexes` (this rank its
    shard, then all ranks gather all); append them to `rollout` and return how many of their
    groups are valid."""
    config = loop.config
    problems = [loop.problems[i] for i in indexes]
    seed = rollout_seed(config.seed, step, generation_round)
    clock = StageClock(loop.world)
    label = f"step {step + 1}/{config.steps} rollout" + (
        f" (refill {generation_round})" if generation_round else "")
    with loop.reporter.task(label, len(problems) * config.group_size) as advance:
        mine, decode_path, own = _sample_and_score(loop, state, indexes, seed, advance)
        completions, components, errors = _gather_round(loop.world, mine)
        advance(len(completions) - sum(len(members) for _, members, _ in mine["groups"]))
    state.verifier_errors += errors[0]
    state.reward_errors += errors[1]
    generation_seconds = clock.wall() - own["verification"]
    verification_seconds = own["verification"]
    state.own_seconds["rollout"] += own["generation"]
    state.own_seconds["verification"] += own["verification"]
    records = trajectory_records(completions, components, problems, run_id=loop.run_label,
                                 step=step, policy_version=rollout.version,
                                 verifier_version=loop.verifier.version,
                                 reward_set=loop.reward_set, generation_round=generation_round)
    valid = rollout_summary(records, config.group_size)["valid_group_count"]
    rollout.completions += completions
    rollout.rewards += [record["reward"] for record in records]
    # None (a TRL-style component that does not apply) adds 0 to the weighted sum: TRL's nansum.
    rollout.components += [[0.0 if values[name] is None else values[name]
                            for name in loop.reward_set.weights] for values in components]
    rollout.records += records
    rollout.decode_path = decode_path
    rollout.rollout_seconds += generation_seconds
    rollout.verification_seconds += verification_seconds
    rollout.rounds.append({"round": generation_round, "seed": seed, "prompts": len(indexes),
                           "valid_groups": valid, "generation_seconds": generation_seconds,
                           "verification_seconds": verification_seconds})
    return valid


def _sample_and_score(loop: Loop, state: LoopState, indexes: list[int], seed: int, advance):
    """This rank's shard of the round: ([(position, its G completions, their reward
    components)], decode path, own seconds). Completions' prompt_index is the position in
    `indexes`, as if one process had sampled them all."""
    config, policy = loop.config, loop.policy
    positions = shard(len(indexes), loop.world)
    mine = [indexes[k] for k in positions]
    started = time.perf_counter()
    with sampling_weights(policy):
        stepper = engine_for(policy.model).stepper(policy.model)
        completions = generate_completions(policy.model, policy.tokenizer,
                                           [loop.prompts[i] for i in mine], config.group_size,
                                           sampling_settings(config), seed, advance, stepper,
                                           prompt_indexes=mine, shared_prefix=loop.shared_prefix)
    generation = time.perf_counter() - started
    started = time.perf_counter()
    for completion in completions:
        completion.prompt_index = positions[completion.prompt_index]
    problems = [loop.problems[i] for i in indexes]
    errors_before = loop.verifier.error_count, loop.reward_set.error_count
    correctness = score_completions(completions, problems, loop.verifier)
    components = score_rewards(completions, problems, loop.reward_set, correctness)
    errors = (loop.verifier.error_count - errors_before[0],
              loop.reward_set.error_count - errors_before[1])
    groups = [(position, completions[j * config.group_size:(j + 1) * config.group_size],
               components[j * config.group_size:(j + 1) * config.group_size])
              for j, position in enumerate(positions)]
    return ({"groups": groups, "errors": errors}, stepper.name,
            {"generation": generation, "verification": time.perf_counter() - started})


def _gather_round(world: World, mine: dict) -> tuple[list[Completion], list[dict], tuple]:
    """Every rank's groups in prompt order, and the verifier / reward errors of all ranks: the
    round as one process would have produced it."""
    parts = world.all_gather_object(mine)  # [mine] in a one-process world
    groups = in_shard_order([part["groups"] for part in parts])
    completions = [c for _, members, _ in groups for c in members]
    components = [values for _, _, members in groups for values in members]
    errors = tuple(sum(part["errors"][k] for part in parts) for k in (0, 1))
    return completions, components, errors


def _admit_rollout(loop: Loop, state: LoopState, step: int, rollout: Rollout) -> bool:
    """The step's contract, then a safe point before its update; False stops the loop."""
    contract = decisions.check_step_contract(rollout.records, rollout.version,
                                             loop.verifier.version, loop.config.group_size,
                                             loop.reward_set.versions)
    if not contract["admitted"]:
        state.contract = {"admitted": False, "failed_checks": contract["failed_checks"],
                          "step": step}
        state.status = "contract_failed"
        return False
    if agree_stop(loop.world, loop.stop):
        # A safe point between stages. The half-finished step is dropped exactly as a resume
        # would drop it, so the evidence never shows groups that did not reach the update.
        loop.log.truncate(state.trajectories_offset)
        del state.trajectories[len(state.trajectories) - len(rollout.records):]
        state.interrupt(loop.stop, f"after the rollout of step {step}, before its update")
        return False
    return True


def _update(loop: Loop, state: LoopState, step: int, rollout: Rollout):
    """The step's optimizer steps on its valid groups; None (and the state says why) when the
    update failed and was rolled back."""
    config, policy = loop.config, loop.policy
    completions = rollout.completions
    sampler_logprobs = [c.sampler_logprobs for c in completions]
    batch = build_update_batch(
        [c.prompt_token_ids for c in completions], [c.completion_token_ids for c in completions],
        rollout.rewards, config.group_size,
        components=RewardComponents(values=rollout.components,
                                    weights=list(loop.reward_set.weights.values()),
                                    aggregation=config.multi_objective_aggregation),
        scale_rewards=config.scale_rewards,
        contributes=([not c.hit_max_length for c in completions]
                     if config.mask_truncated_completions else None),
        sampler_logprobs=sampler_logprobs,
        # a truncated sampling distribution is the behaviour policy the ratio divides by
        old_logprobs=sampler_logprobs if sampling_settings(config).truncates else None)
    settings = dataclasses.replace(UpdateSettings.from_config(config),
                                   micro_batch_size=state.micro_batch_size)
    for group in loop.optimizer.param_groups:  # this step's rate (training/schedule.py)
        group["lr"] = learning_rate_at(step, config)

    def on_retry(error: str, micro_batch_size: int) -> None:
        state.oom_retries += 1
        loop.reporter.log(f"[yellow]{plain(error)}: retrying the update once at "
                          f"micro_batch_size {micro_batch_size}")

    clock = StageClock(loop.world)
    try:
        with loop.reporter.task(f"step {step + 1}/{config.steps} update",
                                len(batch) * config.num_iterations) as advance:
            record, settings = update_with_retry(
                policy.model, loop.optimizer, batch, settings, policy.tokenizer.pad_token_id,
                lambda: reference_mode(policy), loop.checkpoints.trainable.values(), advance,
                on_retry, world=loop.world)
    except (NonFiniteUpdate, UpdateFailed) as error:
        # update_with_retry rolled the adapter back (on every rank, which agreed on the
        # failure): what gets saved is the last good one.
        state.seconds["update"] += clock.wall()
        state.own_seconds["update"] += clock.own()
        loop.reporter.log(f"[red]{plain(error)}: stopping; the last good adapter is kept")
        state.status = ("non_finite_update" if isinstance(error, NonFiniteUpdate)
                        else "update_failed")
        state.failure = {"step": step, "message": str(error)}
        return None
    state.micro_batch_size = settings.micro_batch_size
    state.own_seconds["update"] += clock.own()
    return record, clock.wall()


def _finish_step(loop: Loop, state: LoopState, step: int, rollout: Rollout, update_record,
                 on_step) -> None:
    """Record the step, checkpoint, then tell `on_step` and the terminal."""
    config = loop.config
    record, update_seconds = update_record
    summary = step_summary(rollout.records, config.group_size, config.mask_truncated_completions,
                           config.num_iterations)
    state.steps.append({
        "step": step, "policy_version": rollout.version, **summary,
        "decode_path": rollout.decode_path, "generation_rounds": rollout.rounds,
        "refill_generation_seconds": sum(r["generation_seconds"] for r in rollout.rounds[1:]),
        "generation_tokens_per_second": (summary["generated_tokens"] / rollout.rollout_seconds
                                         if rollout.rollout_seconds else 0.0),
        "rollout_seconds": rollout.rollout_seconds,
        "verification_seconds": rollout.verification_seconds,
        "update_seconds": update_seconds, "micro_batch_size": state.micro_batch_size,
        "learning_rate": learning_rate_at(step, config),
        **record.summary(), **update_throughput(record.tokens, record.forwarded_tokens,
                                                record.forwarded_real_tokens, update_seconds)})
    state.seconds["update"] += update_seconds
    state.trajectories_offset = rollout.log_offset
    state.next_step = step + 1
    state.next_prompt = rollout.next_prompt
    started = time.perf_counter()
    loop.checkpoints.save(state.checkpointed())
    state.seconds["checkpoint"] += time.perf_counter() - started
    # After the checkpoint, not right after the append: a step a resume would redo (killed
    # before its checkpoint) then never reaches the events file twice.
    if on_step is not None:
        on_step(state.steps[-1])
    update = record.summary()
    mismatch = update["mismatch_max_abs_logp"]
    loop.reporter.log(f"step {step + 1}/{config.steps}: reward {summary['mean_reward']:.3f}, "
                      f"valid groups {summary['valid_group_count']}/{summary['group_count']}, "
                      f"updates {record.update_count}, kl {update['mean_kl']:.4f}, "
                      f"clipped {update['clip_fraction']:.3f}"
                      + (f", sampler max |d logp| {mismatch:.2g}" if mismatch is not None else ""))
