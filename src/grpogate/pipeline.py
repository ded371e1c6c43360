"""One run: admission, rollout + update, independent re-test, delivery — each one call, in order.

`run` (or `resume`) admits (admission.py), then `_execute` reads as the stages: load the
policy and encode the prompts, open the run directory (or reopen a killed one), train
(training/loop.py checkpoints after every step), deliver the adapter, re-test both policies on
the eval prompts, assemble the evidence from plain records (evidence/assemble.py, the function
the audit calls too) and write it, the manifest last. Nothing is written before admission
passes.

`resume` continues a killed or interrupted run from its last checkpoint with the run's stored
config and finishes it normally. SIGINT / SIGTERM stop a run at the next safe point: the
evidence then says `interrupted`, the re-test is skipped (its fields zero and flagged), the
interim decision is `reject`, and the checkpoints stay so that `--resume` can continue it.
Every run holds an exclusive lock on its directory (files.RunDirLock) while it writes.

Under torchrun every rank runs these same stages (distributed.World says which rank it is):
all load the policy, sample their shard and train their share; rank 0 alone creates, locks
and writes the run directory, the others hand it what it writes through gathers; at the end
all ranks check that they hold the same adapter, and rank 0's evidence is every rank's result.
A worker group restarted by torchrun's elastic agent resumes its job's run
(distributed/elastic.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Collection

import torch

from grpogate.admission import Admission, admit, check_budget, run_dir_for
from grpogate.config import RunConfig, resume_config
from grpogate.delivery import deliver_adapter, peak_memory, run_environment, write_run_files
from grpogate.distributed import SINGLE, StageClock, World, agree_stop, elastic
from grpogate.errors import InputError, plain
from grpogate.evidence.assemble import assemble_evidence
from grpogate.evidence.trackers import Trackers
from grpogate.files import (ADAPTER_WEIGHTS, JsonlLog, NullLog, RunDirLock, create_run_dir,
                            read_jsonl, remove_staging, sha256_path)
from grpogate.inputs import tasks
from grpogate.inputs.policy import Policy, current_version, load_policy, trainable_parameters
from grpogate.inputs.rewards import user_reward_names
from grpogate.interrupts import RunInterrupted, StopRequest, stop_on_signals
from grpogate.sampling.sequential import RetestSet, sequential_retest
from grpogate.sampling.rollout import encode_prompts
from grpogate.training.checkpoint import (CHECKPOINTS, Checkpoint, CheckpointWriter,
                                          checkpoint_to_resume, latest_checkpoint,
                                          never_checkpointed, restore_training_state)
from grpogate.training.loop import Loop, LoopState, train
from grpogate.training.resume_check import check_resume_point


class NullReporter:
    """What the pipeline tells the user; the CLI supplies a rich implementation."""

    @contextlib.contextmanager
    def task(self, description: str, total: int):
        yield lambda advance=1: None

    def log(self, message: str) -> None:
        pass


def input_identity(admission: Admission, policy: Policy) -> dict:
    """What a resumed run must find unchanged: problem sets, verifier, base model, baseline."""
    return {"train_set": admission.train_identity, "eval_set": admission.eval_identity,
            "guard_set": admission.guard_identity,
            "verifier_version": admission.verifier.version,
            "reward_versions": admission.reward_set.versions, "model_sha256": policy.base.sha256,
            "baseline_policy_version": policy.baseline_version}


def run(config: RunConfig, reporter=None, world: World = SINGLE) -> dict:
    """Run every stage; returns the evidence dict (also on disk with the manifest).

    SIGINT / SIGTERM stop the run at the next safe point with status `interrupted`. A worker
    group that torchrun's agent restarted continues its job's run (distributed/elastic.py)."""
    elastic.settle_run_dir(config, world)
    if elastic.restart_action(run_dir_for(config), world) == "resume":
        reporter = reporter or NullReporter()
        reporter.log(f"restarted by torchrun (restart {world.restart_count}): resuming "
                     f"{run_dir_for(config)}")
        return resume(run_dir_for(config), config, reporter, world,
                      reward_code=user_reward_names(config.rewards))
    with stop_on_signals() as stop, contextlib.ExitStack() as held:
        return _execute(admit(config), reporter or NullReporter(), stop, None, held, world)


def resume(run_dir: str | Path, config: RunConfig | None = None, reporter=None,
           world: World = SINGLE, reward_code: Collection[str] = ()) -> dict:
    """Continue a killed run from its last complete checkpoint and finish it normally.

    `config` defaults to the run's stored config; when given it must be identical to it.
    `reward_code`: the user rewards the user named (config.rewards_named_by); the stored config
    is the run directory's data, so any other user reward in it is refused, never imported."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: no such run directory to resume")
    # One writer per run directory: a second resume of the same run is refused here, before
    # it reads the checkpoint, truncates the trajectories or writes anything.
    with contextlib.ExitStack() as held, stop_on_signals() as stop:
        if world.is_main:
            held.enter_context(RunDirLock(run_dir))
        checkpoint = checkpoint_to_resume(run_dir)
        where = str(checkpoint.directory / "state.json")
        stored = resume_config(checkpoint.state.get("config"), where)
        if config is not None and config.to_dict() != stored.to_dict():
            raise InputError(f"{where}: the given config differs from the run's stored config; "
                             "a resumed run uses its stored config unchanged")
        check_resume_point(checkpoint, run_dir, stored.steps)  # before a weight loads
        return _execute(admit(stored, resume_dir=run_dir, reward_code=reward_code),
                        reporter or NullReporter(), stop, checkpoint, held, world)


@dataclass
class Prepared:
    """The loaded policy, its prompts encoded, and what the run's optimizer trains."""

    policy: Policy
    train_prompts: list[list[int]]
    eval_prompts: list[list[int]]
    trainable: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    inputs: dict  # input_identity: what a resumed run must find unchanged
    load_seconds: float
    guard_prompts: list[list[int]] = field(default_factory=list)


@dataclass
class OpenRun:
    """The run directory being written, new or reopened, and the loop's state in it."""

    run_dir: Path
    run_label: str
    log: JsonlLog
    state: LoopState
    resumes: list[dict]
    checkpoints: CheckpointWriter


def prepare(admission: Admission) -> Prepared:
    """Load the policy and encode both prompt sets; nothing is written yet."""
    config = admission.config
    started = time.perf_counter()
    policy = load_policy(dataclasses.replace(config, model=admission.model_spec,
                                             model_revision=admission.model_revision),
                         adapter=admission.adapter, seed=config.seed)
    load_seconds = time.perf_counter() - started
    check_budget(admission, policy)
    if admission.baseline_version and policy.baseline_version != admission.baseline_version:
        raise InputError(f"{config.baseline_manifest}: the loaded baseline is policy "
                         f"{policy.baseline_version}, not the manifest's new_policy_version "
                         f"{admission.baseline_version} (another base model under that name?)")
    if policy.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(policy.device)
    # Encoded before anything is written: a prompt over max_prompt_tokens is bad input, and an
    # eval prompt must not fail only after hours of training.
    train_prompts, eval_prompts, guard_prompts = (
        encode_prompts(policy.tokenizer, problems, config.resolved_system_prompt(),
                       config.max_prompt_tokens) if problems else []
        for problems in (admission.train, admission.eval, admission.guard))
    trainable = trainable_parameters(policy)
    # fused: one kernel over all LoRA tensors instead of a dozen operations per tensor (420 of
    # them on SmolLM2: 19 -> 4 ms a step on a 2-core CPU), rounding like the loop to an ulp;
    # transformers' Trainer (TRL's) defaults to it too ("adamw_torch_fused", torch >= 2.8).
    fused = all(p.device.type in ("cpu", "cuda") for p in trainable.values())
    optimizer = torch.optim.AdamW(trainable.values(), lr=config.learning_rate,
                                  weight_decay=config.weight_decay, fused=fused or None)
    return Prepared(policy=policy, train_prompts=train_prompts, eval_prompts=eval_prompts,
                    trainable=trainable, optimizer=optimizer,
                    inputs=input_identity(admission, policy), load_seconds=load_seconds,
                    guard_prompts=guard_prompts)


def open_run(admission: Admission, prepared: Prepared, resumed: Checkpoint | None,
             started: float, reporter, held: contextlib.ExitStack, world: World = SINGLE) -> OpenRun:
    """Create the run directory (and lock it for the rest of the run), or reopen a killed run
    at its last checkpoint (locked by `resume` before it read the checkpoint). Under torchrun
    only rank 0 creates, locks and writes; the others wait for it and keep a NullLog."""
    config = admission.config
    if resumed is None:
        run_dir = admission.run_dir
        if world.is_main:
            if never_checkpointed(run_dir):
                with RunDirLock(run_dir):  # refused while a live process holds it
                    reporter.log(f"{run_dir}: replacing a run that was stopped before its first "
                                 "checkpoint (nothing in it to resume)")
                shutil.rmtree(run_dir)
            create_run_dir(run_dir)
            held.enter_context(RunDirLock(run_dir))
            elastic.mark_job(run_dir, world)
        world.barrier()
        run_label = config.label or admission.run_dir.name
        log = JsonlLog(run_dir / "trajectories.jsonl") if world.is_main else NullLog()
        state, resumes, earlier_seconds = LoopState(micro_batch_size=config.micro_batch_size), [], 0.0
    else:
        checkpoint, run_dir = resumed.state, admission.run_dir
        changed = [key for key in prepared.inputs
                   if json_roundtrip(prepared.inputs[key]) != checkpoint["inputs"].get(key)]
        if changed:
            raise InputError(f"{resumed.directory}/state.json: the run's inputs changed since it "
                             f"started ({', '.join(changed)}); it cannot be resumed")
        restore_training_state(resumed, prepared.trainable, prepared.optimizer)
        # Lines written after the checkpoint belong to a step that never finished: drop them.
        path = run_dir / "trajectories.jsonl"
        if world.is_main:
            log = JsonlLog(path, existing=True)
            log.truncate(checkpoint["trajectories_offset"])
            remove_staging(run_dir)
            remove_staging(run_dir / CHECKPOINTS)
        else:
            log = NullLog(checkpoint["trajectories_offset"])
        world.barrier()  # the others read the trajectories once rank 0 has cut them
        state = LoopState.from_checkpoint(checkpoint, read_jsonl(path))
        run_label = checkpoint["run_label"]
        resumes = checkpoint["resumes"] + [{
            "from_step": state.next_step,
            "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}]
        earlier_seconds = checkpoint["elapsed_seconds"]
        reporter.log(f"resuming {plain(run_dir)} at step {state.next_step + 1}/{config.steps}")
    reporter.log(f"run directory: {plain(run_dir)}")
    header = {"config": config.to_dict(), "run_label": run_label, "inputs": prepared.inputs,
              "resumes": resumes}
    checkpoints = CheckpointWriter(run_dir=run_dir, header=header, trainable=prepared.trainable,
                                   optimizer=prepared.optimizer, started=started,
                                   earlier_seconds=earlier_seconds, writes=world.is_main)
    return OpenRun(run_dir=run_dir, run_label=run_label, log=log, state=state, resumes=resumes,
                   checkpoints=checkpoints)


def training_loop(admission: Admission, prepared: Prepared, opened: OpenRun, reporter,
                  stop: StopRequest, world: World = SINGLE) -> Loop:
    """What stays fixed over the rollout / update loop."""
    return Loop(policy=prepared.policy, config=admission.config, verifier=admission.verifier,
                reward_set=admission.reward_set, problems=admission.train,
                prompts=prepared.train_prompts, log=opened.log, reporter=reporter,
                run_label=opened.run_label, optimizer=prepared.optimizer, stop=stop,
                checkpoints=opened.checkpoints, world=world)


def retest_stage(admission: Admission, prepared: Prepared, state: LoopState,
                 candidate_version: str, reporter, stop: StopRequest,
                 world: World = SINGLE) -> tuple[list[dict], int, bool, list[dict]]:
    """The re-test unless the loop stopped or a stop is pending: (records, verifier errors,
    skipped, guard records). The eval set's records carry the drift (KL to the baseline,
    entropy); the guard set, when on, is answered by both policies after it. A stop during
    the re-test skips it as a whole."""
    config = admission.config
    if state.status == "ok" and agree_stop(world, stop):
        state.interrupt(stop, "before the re-test")
    elif state.status != "interrupted":
        eval_set = RetestSet(admission.eval, prepared.eval_prompts, admission.verifier,
                             config.eval_group_size, "re-test")
        guard_set = RetestSet(admission.guard, prepared.guard_prompts,
                              admission.guard_verifier, config.guard.group_size,
                              "guard") if admission.guard else None
        retested = sequential_retest(prepared.policy, eval_set, guard_set, config,
                                     candidate_version, reporter, stop, world)
        if retested is not None:
            return retested[0], retested[2], False, retested[1]
        state.interrupt(stop, "during the re-test")
    return [], 0, True, []


def run_facts(admission: Admission, prepared: Prepared, opened: OpenRun, seconds: dict,
              retested: tuple[list[dict], int, bool], adapter_sha: str,
              candidate_version: str, distributed: dict) -> dict:
    """What only the run knows, as `assemble_evidence` takes it."""
    config, policy, state = admission.config, prepared.policy, opened.state
    # The artifact counts only if the file on disk still hashes to what we recorded.
    on_disk = sha256_path(opened.run_dir / "adapter" / ADAPTER_WEIGHTS)
    return {
        "run_label": opened.run_label,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "loop_status": state.status, "failure": state.failure,
        "interruption": state.interruption, "resumes": opened.resumes,
        "environment": run_environment(policy),
        "inputs": {
            "model": policy.base.identity(),
            "baseline_adapter": ({"path": admission.adapter, "sha256": policy.baseline_adapter_sha256}
                                 if admission.adapter else None),
            "baseline_manifest": config.baseline_manifest or None,
            "baseline_policy_version": policy.baseline_version,
            "verifier": {"name": config.resolved_verifier(), "version": admission.verifier.version},
            # What training rewards are made of; the decision reads the verifier alone.
            "rewards": admission.reward_set.describe(),
            "train_set": admission.train_identity, "eval_set": admission.eval_identity,
            "guard_set": admission.guard_identity,
            "guard_verifier": ({"name": config.guard.verifier(),
                                "version": admission.guard_verifier.version}
                               if admission.guard_verifier is not None else None),
        },
        "contract": state.contract, "seconds": seconds,
        "verifier_errors": state.verifier_errors, "reward_errors": state.reward_errors,
        "retest_verifier_errors": retested[1],
        "retest_skipped": retested[2], "micro_batch_size": state.micro_batch_size,
        "oom_retries": state.oom_retries, "resources": peak_memory(policy.device),
        "distributed": distributed,
        "artifact": {"path": "adapter", "sha256": adapter_sha if on_disk == adapter_sha else "",
                     "source_policy_version": policy.baseline_version,
                     "new_policy_version": candidate_version},
    }


def prepare_uncollected(admission: Admission) -> Prepared:
    """`prepare` with the cyclic collector paused, then what it built (the model, the modules
    it imported: about 0.5 M objects) frozen out of the collector's passes until `gc.unfreeze`.
    Loading creates objects faster than garbage: each full pass walked them all for nothing
    (the default's load, 2-core CPU: 4 full passes, 0.7 s; the load 3.8 -> 2.9-3.0 s)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return prepare(admission)
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def _execute(admission: Admission, reporter, stop: StopRequest,
             resumed: Checkpoint | None, held, world: World = SINGLE) -> dict:
    """The stages of one run, in order."""
    started = time.perf_counter()
    # Registered first: what loading froze is handed back also when loading fails.
    held.callback(gc.unfreeze)
    # admission's second half: the policy loaded, prompts encoded
    prepared = prepare_uncollected(admission)
    if agree_stop(world, stop):  # nothing written or changed yet: stopping here leaves no trace
        raise RunInterrupted(stop.signal_name)
    opened = open_run(admission, prepared, resumed, started, reporter, held, world)
    trackers = open_trackers(admission.config, opened, reporter, world)
    decision = ""
    try:
        # rollout, reward and update, checkpointed after every step
        train(training_loop(admission, prepared, opened, reporter, stop, world), opened.state,
              on_step=trackers.log_step)
        candidate_version = current_version(prepared.policy)
        same_adapter_everywhere(world, candidate_version)
        adapter_sha = deliver_adapter(prepared.policy, opened.run_dir) if world.is_main else ""
        clock = StageClock(world)
        retested = retest_stage(admission, prepared, opened.state, candidate_version, reporter,
                                stop, world)
        seconds = {**opened.state.seconds, "load": prepared.load_seconds,
                   "evaluation": clock.wall()}
        distributed = distributed_facts(world, {**opened.state.own_seconds,
                                                "evaluation": clock.own()})
        seconds["total"] = opened.checkpoints.elapsed()
        evidence = None
        if world.is_main:  # assemble the evidence and write it, the manifest last
            facts = run_facts(admission, prepared, opened, seconds, retested, adapter_sha,
                              candidate_version, distributed)
            evidence = write_evidence(admission, opened, facts, retested[0], retested[3],
                                      reporter)
            trackers.log_final(evidence)
            evidence["run_dir"] = str(opened.run_dir)
        evidence = world.broadcast_object(evidence)
        decision = evidence["decision"]["decision"]
    except Exception as error:
        if resumed is None and world.is_main and latest_checkpoint(opened.run_dir) is None:
            trackers.close(decision)  # before its files go
            discard_unstarted_run(opened.run_dir, error)
        raise
    finally:
        trackers.close(decision)
    return evidence


class UnstartedRunFailed(RuntimeError):
    """A new run failed before its first checkpoint; its directory was removed."""


def discard_unstarted_run(run_dir: Path, error: Exception) -> None:
    """A run that fails before its first checkpoint can neither be resumed nor audited, and its
    directory would block the same --out: remove what this run created and say why (an
    OSError -- a full or read-only disk -- is re-raised as it is: the CLI names the file)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    if isinstance(error, OSError):
        return
    raise UnstartedRunFailed(
        f"{run_dir}: the run failed before its first checkpoint ({type(error).__name__}: "
        f"{error}); its directory was removed, so the same --out can be used again once the "
        "cause is fixed") from error


def open_trackers(config: RunConfig, opened: OpenRun, reporter, world: World) -> Trackers:
    """--report-to's trackers, on rank 0. A resumed run opens new tracker runs (TensorBoard: a
    new events file in the same directory)."""
    if not world.is_main:
        return Trackers.none()
    trackers = Trackers(config, opened.run_dir, opened.run_label)
    for name, tracker in trackers.opened:
        reporter.log(f"{name}: {tracker.where}")
    return trackers


def write_evidence(admission: Admission, opened: OpenRun, facts: dict, eval_records: list[dict],
                   guard_records: list[dict], reporter) -> dict:
    """Assemble the evidence from the run's facts and records (the audit's function too) and
    write the run's files; returns the evidence."""
    config, state = admission.config, opened.state
    evidence = assemble_evidence(facts, config.to_dict(), state.steps, state.trajectories,
                                 eval_records, guard_records)
    problems = tasks.problem_records(config.task, admission.train, admission.eval,
                                     config.guard, admission.guard)
    write_run_files(opened.run_dir, evidence, problems, eval_records, state.trajectories, reporter,
                    guard_records)
    return evidence


def same_adapter_everywhere(world: World, candidate_version: str) -> None:
    """Every rank must end with the adapter rank 0 delivers: a rank that drifted (a collective
    skipped, another library) would make the evidence describe a policy it did not train."""
    versions = world.all_gather_object(candidate_version)
    if len(set(versions)) > 1:
        raise RuntimeError("the ranks' adapters differ after training (policy versions by rank: "
                           + ", ".join(f"{rank}: {v}" for rank, v in enumerate(versions))
                           + "); the run is not delivered")


def distributed_facts(world: World, own_seconds: dict) -> dict:
    """World size, backend and every rank's own stage seconds (gathered from all ranks)."""
    return {**world.describe(), "per_rank_seconds": world.all_gather_object(own_seconds)}


def json_roundtrip(value):
    """`value` as it reads back from a JSON file (tuples become lists, and so on)."""
    return json.loads(json.dumps(value))
