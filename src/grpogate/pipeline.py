"""One run: admission, rollout, reward and update, independent re-test, delivery — in that order.

Each stage takes plain data from the one before. Stage seconds are measured separately
(rollout = generation, verification = scoring, update, evaluation) and memory is read at the
end. Nothing is written before admission passes; the manifest is written last.

The rollout / update loop (training.py) checkpoints after every step; `resume` continues a
killed run from its last checkpoint with the run's stored config and finishes it normally.
SIGINT / SIGTERM stop a run at the next safe point: the evidence then says `interrupted`, the
re-test is skipped (its fields zero and flagged), and the decision is `reject`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import resource
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from grpogate import decisions, metrics
from grpogate.checkpoint import (CHECKPOINTS, Checkpoint, checkpoint_to_resume,
                                 remove_checkpoints, restore_training_state, save_checkpoint)
from grpogate.config import RunConfig, resume_config
from grpogate.errors import InputError
from grpogate.evaluate import evaluate_policy
from grpogate.evidence import (JsonlLog, atomic_directory, atomic_write_bytes, atomic_write_json,
                               build_manifest, create_run_dir, jsonl_bytes, library_versions,
                               read_baseline_manifest, read_jsonl, refuse_existing_output,
                               remove_staging, sha256_path)
from grpogate.interrupts import RunInterrupted, StopRequest, stop_on_signals
from grpogate.policy import (Policy, current_version, load_policy, sampling_weights,
                             resolve_base_model, default_cache_dir, check_adapter_dir,
                             save_adapter, trainable_parameters)
from grpogate.rollout import encode_prompts
from grpogate import tasks
from grpogate.tasks import Problem
from grpogate.tensorboard import TensorBoardWriter
from grpogate.training import TrainingProgress, sampling_settings, train, trainable_tensors
from grpogate.verifiers import get_verifier


class NullReporter:
    """What the pipeline tells the user; the CLI supplies a rich implementation."""

    @contextlib.contextmanager
    def task(self, description: str, total: int):
        yield lambda advance=1: None

    def log(self, message: str) -> None:
        pass


@dataclass
class Admission:
    """Everything frozen before the first completion is sampled."""

    config: RunConfig
    run_dir: Path
    model_spec: str
    model_revision: str
    adapter: str
    verifier: object
    train: list[Problem]
    eval: list[Problem]
    train_identity: dict
    eval_identity: dict


def run_dir_for(config: RunConfig) -> Path:
    if config.out:
        return Path(config.out)
    label = config.label or f"{config.profile}-{datetime.now():%Y%m%d-%H%M%S}"
    config.label = label
    return Path("runs") / label


def load_problem_sets(config: RunConfig) -> tuple[list[Problem], dict, list[Problem], dict]:
    return tasks.load_problem_sets(config.task, config.train_prompts, config.eval_prompts)


def admit(config: RunConfig, resume_dir: Path | None = None) -> Admission:
    """Check config, inputs and environment; raises InputError before anything is written.

    A new run refuses an existing output path; a resumed run (`resume_dir`) reuses its own.
    """
    run_dir = resume_dir or run_dir_for(config)
    if resume_dir is None:
        refuse_existing_output(run_dir)
    if config.tensorboard and Path(config.tensorboard).is_file():
        raise InputError(f"tensorboard {config.tensorboard}: is a file; give a directory for the "
                         "events files")
    model_spec, revision, adapter = config.model, config.model_revision, config.adapter
    if config.baseline_manifest:
        baseline = read_baseline_manifest(config.baseline_manifest)
        model_spec, revision, adapter = baseline["model"], baseline["revision"], baseline["adapter"]
    if adapter:
        check_adapter_dir(adapter)
    # Problems before the verifier: an unknown task name is then reported as the task's error.
    train, train_id, eval_set, eval_id = load_problem_sets(config)
    try:
        verifier = get_verifier(config.resolved_verifier())
    except ValueError as error:
        raise InputError(f"verifier: {error}") from None
    return Admission(config, run_dir, model_spec, revision, adapter, verifier, train, eval_set,
                     train_id, eval_id)


def dry_run(config: RunConfig) -> dict:
    """Everything `admit` checks, plus where the model comes from; loads no weights, samples nothing."""
    admission = admit(config)
    base = "hub id (resolved at load time)"
    if admission.model_spec.count("/") != 1 or Path(admission.model_spec).exists():
        base = resolve_base_model(admission.model_spec, admission.model_revision,
                                  default_cache_dir(config)).identity()
    return {"run_dir": str(admission.run_dir), "model": base, "adapter": admission.adapter or None,
            "verifier": admission.verifier.version, "train_prompts": len(admission.train),
            "eval_prompts": len(admission.eval), "steps": config.steps,
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "libraries": library_versions()}


def peak_memory(device: torch.device) -> dict:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    if device.type == "cuda":
        return {"device": "cuda", "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device), "peak_rss_bytes": rss}
    # On the CPU the resident set is the honest peak: there is no allocator to ask.
    return {"device": "cpu", "peak_allocated_bytes": rss, "peak_reserved_bytes": rss,
            "peak_rss_bytes": rss}


def rollout_evidence(trajectories: list[dict], steps: list[dict], seconds: dict, group_size: int,
                     verifier_errors: int) -> dict:
    summary = metrics.rollout_summary(trajectories, group_size)
    generated = sum(s["generated_tokens"] for s in steps)
    return {"group_size": group_size, **summary, "rollout_seconds": seconds["rollout"],
            "verification_seconds": seconds["verification"], "generated_tokens": generated,
            "generation_tokens_per_second": generated / seconds["rollout"] if seconds["rollout"] else 0.0,
            "decode_paths": sorted({s["decode_path"] for s in steps if "decode_path" in s}),
            "verifier_errors": verifier_errors}


def update_evidence(config: RunConfig, steps: list[dict], seconds: dict) -> dict:
    tokens = sum(s["tokens"] for s in steps)
    return {
        "update_count": sum(s["update_count"] for s in steps), "update_seconds": seconds["update"],
        "clip_epsilon": config.clip_epsilon, "kl_coef": config.kl_coef,
        "mean_kl": sum(s["mean_kl"] * s["tokens"] for s in steps) / tokens if tokens else 0.0,
        "clip_fraction": sum(s["clip_fraction"] * s["tokens"] for s in steps) / tokens if tokens else 0.0,
        "grad_norm": [g for s in steps for g in s["grad_norm"]],
        "learning_rate": config.learning_rate, "optimizer": "AdamW",
        "max_grad_norm": config.max_grad_norm, "loss_aggregation": config.loss_aggregation,
        "trained_sequences": sum(s["sequences"] for s in steps), "trained_tokens": tokens,
    }


def retest(policy: Policy, admission: Admission, prompts: list[list[int]], baseline_version: str,
           candidate_version: str, reporter, stop: StopRequest) -> tuple[list[dict], dict] | None:
    """Fresh completions of both policies on the encoded eval prompts, same seed, paired
    comparison. None when a stop was requested before either policy's pass (a safe point)."""
    config = admission.config
    settings = sampling_settings(config)
    records = {}
    errors_before = admission.verifier.error_count
    for name, version, mode in (
            ("baseline", baseline_version, lambda: sampling_weights(policy, baseline=True)),
            ("candidate", candidate_version, lambda: sampling_weights(policy))):
        if stop.requested:
            return None
        with reporter.task(f"re-test {name}", len(prompts) * config.eval_group_size) as advance:
            records[name] = evaluate_policy(
                policy.model, policy.tokenizer, admission.eval, prompts, policy_name=name,
                policy_version=version, verifier=admission.verifier,
                group_size=config.eval_group_size, settings=settings, seed=config.seed + 10_000,
                mode=mode, progress=advance)
    baseline = metrics.summarize_completions(records["baseline"], config.eval_group_size,
                                             config.max_new_tokens)
    candidate = metrics.summarize_completions(records["candidate"], config.eval_group_size,
                                              config.max_new_tokens)
    paired = metrics.paired_comparison(baseline, candidate, seed=config.seed)
    comparison = {
        "reward_mean_gain": candidate["mean_reward"] - baseline["mean_reward"],
        "pass_at_group_gain": candidate["pass_at_group"] - baseline["pass_at_group"],
        "eval_group_size": config.eval_group_size, "eval_seed": config.seed + 10_000,
        "baseline": baseline, "candidate": candidate, "paired": paired,
        "verifier_errors": admission.verifier.error_count - errors_before,
    }
    return records["baseline"] + records["candidate"], comparison


def skipped_comparison(config: RunConfig) -> dict:
    """The comparison of a run stopped before its re-test: every field present, zero, and
    flagged, so readers and `decisions.decide_run` work (which fails the quality checks)."""
    empty = {"prompt_count": 0, "completion_count": 0, "mean_reward": 0.0, "pass_at_group": 0.0,
             "max_length_hit_ratio": 0.0, "length": metrics.length_summary([]),
             "length_histogram": None, "per_prompt": []}
    return {"skipped": True, "reward_mean_gain": 0.0, "pass_at_group_gain": 0.0,
            "eval_group_size": config.eval_group_size, "eval_seed": config.seed + 10_000,
            "baseline": dict(empty), "candidate": dict(empty), "paired": {},
            "verifier_errors": 0}


def deliver_adapter(policy: Policy, run_dir: Path) -> str:
    """Write adapter/ through a staging directory and a rename; returns the weights' sha256."""
    with atomic_directory(run_dir / "adapter") as staging:
        adapter_sha = save_adapter(policy, staging)
        # PEFT writes target_modules from a set, in an order that changes with the process's
        # string-hash seed; sorted, the same run gives the same file (and manifest) every time.
        config_file = staging / "adapter_config.json"
        adapter_config = json.loads(config_file.read_text(encoding="utf-8"))
        if isinstance(adapter_config.get("target_modules"), list):
            adapter_config["target_modules"] = sorted(adapter_config["target_modules"])
            config_file.write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n",
                                   encoding="utf-8")
    return adapter_sha


def input_identity(admission: Admission, policy: Policy) -> dict:
    """What a resumed run must find unchanged: problem sets, verifier, base model, baseline."""
    return {"train_set": admission.train_identity, "eval_set": admission.eval_identity,
            "verifier_version": admission.verifier.version, "model_sha256": policy.base.sha256,
            "baseline_policy_version": policy.baseline_version}


def run(config: RunConfig, reporter=None) -> dict:
    """Run every stage; returns the evidence dict (also on disk with the manifest).

    SIGINT / SIGTERM stop the run at the next safe point with status `interrupted`."""
    with stop_on_signals() as stop:
        return _execute(admit(config), reporter or NullReporter(), stop, None)


def resume(run_dir: str | Path, config: RunConfig | None = None, reporter=None) -> dict:
    """Continue a killed run from its last complete checkpoint and finish it normally.

    `config` defaults to the run's stored config; when given it must be identical to it."""
    run_dir = Path(run_dir)
    with stop_on_signals() as stop:
        checkpoint = checkpoint_to_resume(run_dir)
        where = str(checkpoint.directory / "state.json")
        stored = resume_config(checkpoint.state.get("config"), where)
        if config is not None and config.to_dict() != stored.to_dict():
            raise InputError(f"{where}: the given config differs from the run's stored config; "
                             "a resumed run uses its stored config unchanged")
        return _execute(admit(stored, resume_dir=run_dir), reporter or NullReporter(), stop,
                        checkpoint)


def _execute(admission: Admission, reporter, stop: StopRequest,
             resumed: Checkpoint | None) -> dict:
    config = admission.config
    started_run = time.perf_counter()
    policy = load_policy(dataclasses.replace(config, model=admission.model_spec,
                                             model_revision=admission.model_revision),
                         adapter=admission.adapter, seed=config.seed)
    load_seconds = time.perf_counter() - started_run
    if policy.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(policy.device)
    # Encoded before anything is written: a prompt over max_prompt_tokens is bad input, and an
    # eval prompt must not fail only after hours of training.
    train_prompts, eval_prompts = (
        encode_prompts(policy.tokenizer, problems, config.resolved_system_prompt(),
                       config.max_prompt_tokens) for problems in (admission.train, admission.eval))
    inputs = input_identity(admission, policy)
    trainable = trainable_tensors(policy)
    optimizer = torch.optim.AdamW(trainable_parameters(policy), lr=config.learning_rate,
                                  weight_decay=config.weight_decay)
    if stop.requested:  # nothing written or changed yet: stopping here leaves no trace
        raise RunInterrupted(stop.signal_name)
    if resumed is None:
        run_label = config.label or admission.run_dir.name
        run_dir = create_run_dir(admission.run_dir)
        log = JsonlLog(run_dir / "trajectories.jsonl")
        progress = TrainingProgress(micro_batch_size=config.micro_batch_size)
        resumes, earlier_seconds = [], 0.0
    else:
        state, run_dir = resumed.state, admission.run_dir
        changed = [key for key in inputs if json_roundtrip(inputs[key]) != state["inputs"].get(key)]
        if changed:
            raise InputError(f"{resumed.directory}/state.json: the run's inputs changed since it "
                             f"started ({', '.join(changed)}); it cannot be resumed")
        restore_training_state(resumed, trainable, optimizer)
        # Lines written after the checkpoint belong to a step that never finished: drop them.
        log = JsonlLog(run_dir / "trajectories.jsonl", existing=True)
        log.truncate(state["trajectories_offset"])
        remove_staging(run_dir)
        remove_staging(run_dir / CHECKPOINTS)
        progress = TrainingProgress.from_state(state, read_jsonl(log.path))
        run_label = state["run_label"]
        resumes = state["resumes"] + [{"from_step": progress.next_step,
                                       "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}]
        earlier_seconds = state["elapsed_seconds"]
        reporter.log(f"resuming {run_dir} at step {progress.next_step + 1}/{config.steps}")
    reporter.log(f"run directory: {run_dir}")

    def save_checkpoint_of(progress: TrainingProgress) -> None:
        elapsed = earlier_seconds + time.perf_counter() - started_run
        save_checkpoint(run_dir, {"config": config.to_dict(), "run_label": run_label,
                                  "inputs": inputs, "resumes": resumes,
                                  "elapsed_seconds": elapsed, **progress.state()},
                        trainable, optimizer)

    # A resumed run opens a new events file in the same directory; TensorBoard merges them.
    with (TensorBoardWriter(config.tensorboard) if config.tensorboard
          else contextlib.nullcontext()) as tensorboard:
        if tensorboard is not None:
            reporter.log(f"tensorboard events: {tensorboard.path}")
        train(policy, admission, train_prompts, log, reporter, run_label=run_label,
              progress=progress, optimizer=optimizer, stop=stop,
              save_checkpoint_of=save_checkpoint_of,
              on_step=tensorboard.write_step if tensorboard is not None else None)
    steps, trajectories, seconds = progress.steps, progress.trajectories, progress.seconds

    adapter_sha = deliver_adapter(policy, run_dir)
    candidate_version = current_version(policy)
    started = time.perf_counter()
    retested = None
    if progress.status == "ok" and stop.requested:
        progress.interrupt(stop, "before the re-test")
    elif progress.status != "interrupted":
        retested = retest(policy, admission, eval_prompts, policy.baseline_version,
                          candidate_version, reporter, stop)
        if retested is None:
            progress.interrupt(stop, "during the re-test")
    eval_records, comparison = retested or ([], skipped_comparison(config))
    seconds["evaluation"] = time.perf_counter() - started

    rollout = rollout_evidence(trajectories, steps, seconds, config.group_size,
                               progress.verifier_errors)
    update = update_evidence(config, steps, seconds)
    # An out-of-memory update is retried once at half the micro-batch, which then stays.
    update |= {"micro_batch_size": progress.micro_batch_size, "oom_retries": progress.oom_retries}
    status = progress.status
    if status == "ok" and (rollout["valid_group_count"] == 0 or update["update_count"] == 0):
        status = "no_effective_update"
    # The artifact counts only if the file on disk still hashes to what we recorded.
    on_disk = sha256_path(run_dir / "adapter" / "adapter_model.safetensors")
    evidence = {
        "grpogate_evidence_version": 1,
        "run_label": run_label,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "status": status,
        "failure": progress.failure,
        "interruption": progress.interruption,
        "resumes": resumes,
        "config": config.to_dict(),
        "environment": library_versions() | {
            "torch_threads": torch.get_num_threads(), "device": str(policy.device),
            "dtype": str(next(policy.model.parameters()).dtype).removeprefix("torch.")},
        "seeds": {"run": config.seed, "rollout": [config.seed + s for s in range(config.steps)],
                  "eval": config.seed + 10_000, "bootstrap": config.seed},
        "inputs": {
            "model": policy.base.identity(),
            "baseline_adapter": ({"path": admission.adapter, "sha256": policy.baseline_adapter_sha256}
                                 if admission.adapter else None),
            "baseline_manifest": config.baseline_manifest or None,
            "baseline_policy_version": policy.baseline_version,
            "verifier": {"name": config.resolved_verifier(), "version": admission.verifier.version},
            "train_set": admission.train_identity, "eval_set": admission.eval_identity,
        },
        "contract": progress.contract,
        "rollout": rollout,
        "update": update,
        "comparison": comparison,
        "timings": {"load_seconds": load_seconds, "rollout_seconds": seconds["rollout"],
                    "verification_seconds": seconds["verification"],
                    "update_seconds": seconds["update"],
                    "evaluation_seconds": seconds["evaluation"],
                    "checkpoint_seconds": seconds["checkpoint"]},
        "resources": peak_memory(policy.device),
        "artifact": {"path": "adapter", "sha256": adapter_sha if on_disk == adapter_sha else "",
                     "source_policy_version": policy.baseline_version,
                     "new_policy_version": candidate_version},
        "steps": steps,
    }
    candidate = decisions.evaluate_grpo_candidate(evidence, dataclasses.asdict(config.gates))
    evidence["effective_trajectory_count"] = candidate["effective_trajectory_count"]
    evidence["effective_trajectories_per_second"] = candidate["effective_trajectories_per_second"]
    evidence["valid_group_ratio"] = candidate["valid_group_ratio"]
    evidence["timings"]["total_seconds"] = earlier_seconds + time.perf_counter() - started_run
    evidence["decision"] = decisions.decide_run(evidence, dataclasses.asdict(config.gates))

    atomic_write_bytes(run_dir / "eval_completions.jsonl", jsonl_bytes(eval_records))
    atomic_write_json(run_dir / "evidence.json", evidence)
    atomic_write_json(run_dir / "manifest.json", build_manifest(evidence, run_dir, trajectories))
    # The manifest marks the run complete, so it can no longer be resumed: checkpoints are waste.
    remove_checkpoints(run_dir)
    evidence["run_dir"] = str(run_dir)
    # The report is derived from the files above and written after the manifest: a plotting
    # failure (any exception type matplotlib may raise) is logged and never loses the run;
    # `grpogate report RUN_DIR` can write it again.
    try:
        from grpogate.report import write_report

        reporter.log(f"report: {write_report(run_dir)}")
    except Exception as error:  # noqa: BLE001
        reporter.log(f"[yellow]report not written ({type(error).__name__}: {error}); "
                     f"retry with `grpogate report {run_dir}`")
    return evidence


def json_roundtrip(value):
    """`value` as it reads back from a JSON file (tuples become lists, and so on)."""
    return json.loads(json.dumps(value))
