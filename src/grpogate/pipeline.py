"""One run: admission, rollout, reward and update, independent re-test, delivery — in that order.

Each stage takes plain data from the one before. Stage seconds are measured separately
(rollout = generation, verification = scoring, update, evaluation) and memory is read at the
end. Nothing is written before admission passes; the manifest is written last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from grpogate import decisions, metrics
from grpogate.config import RunConfig
from grpogate.errors import InputError
from grpogate.evaluate import evaluate_policy
from grpogate.evidence import (JsonlLog, atomic_write_bytes, atomic_write_json, build_manifest,
                               create_run_dir, jsonl_bytes, library_versions,
                               read_baseline_manifest, sha256_path)
from grpogate.policy import (Policy, current_version, load_policy, reference_mode,
                             resolve_base_model, default_cache_dir, check_adapter_dir,
                             save_adapter, sha256_file, trainable_parameters)
from grpogate.rollout import (SamplingSettings, contract_groups, encode_prompts,
                              generate_completions, score_completions, trajectory_records)
from grpogate.tasks import (Problem, check_isolation, check_problem_set, load_gsm8k,
                            load_reasoning_gym, problem_set_hash)
from grpogate.update import NonFiniteUpdate, UpdateSettings, build_update_batch, grpo_update
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
    task = config.task
    if task.source == "gsm8k":
        eval_set, eval_id = load_gsm8k(task.path, task.eval_split, config.eval_prompts, task.eval_seed)
        train, train_id = load_gsm8k(task.path, task.train_split, config.train_prompts, task.train_seed)
    else:
        # Eval first: the train generator then skips eval prompts instead of leaking them.
        eval_set, eval_id = load_reasoning_gym(task.name, task.params, config.eval_prompts,
                                               task.eval_seed)
        train, train_id = load_reasoning_gym(task.name, task.params, config.train_prompts,
                                             task.train_seed, frozenset(p.prompt_id for p in eval_set))
    check_problem_set(train, "train")
    check_problem_set(eval_set, "eval")
    check_isolation(train, eval_set)
    train_id["problem_set_sha256"] = problem_set_hash(train)
    eval_id["problem_set_sha256"] = problem_set_hash(eval_set)
    return train, train_id, eval_set, eval_id


def admit(config: RunConfig) -> Admission:
    """Check config, inputs and environment; raises InputError before anything is written."""
    run_dir = run_dir_for(config)
    if run_dir.exists():
        raise InputError(f"{run_dir}: output already exists; choose a new run label (--label) or --out")
    model_spec, revision, adapter = config.model, config.model_revision, config.adapter
    if config.baseline_manifest:
        baseline = read_baseline_manifest(config.baseline_manifest)
        model_spec, revision, adapter = baseline["model"], baseline["revision"], baseline["adapter"]
    if adapter:
        check_adapter_dir(adapter)
    try:
        verifier = get_verifier(config.resolved_verifier())
    except ValueError as error:
        raise InputError(f"verifier: {error}") from None
    train, train_id, eval_set, eval_id = load_problem_sets(config)
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


def sampling_settings(config: RunConfig) -> SamplingSettings:
    return SamplingSettings(config.max_new_tokens, config.temperature, config.top_p,
                            config.generation_batch_size)


def update_settings(config: RunConfig) -> UpdateSettings:
    return UpdateSettings(config.clip_epsilon, config.kl_coef, config.max_grad_norm,
                          config.micro_batch_size, config.groups_per_update,
                          config.loss_aggregation, config.temperature)


def train(policy: Policy, admission: Admission, log: JsonlLog, reporter) -> dict:
    """The rollout / reward / update loop. Returns the per-step records and the totals."""
    config = admission.config
    verifier = admission.verifier
    prompts = encode_prompts(policy.tokenizer, admission.train, config.resolved_system_prompt(),
                             config.max_prompt_tokens)
    parameters = trainable_parameters(policy)
    optimizer = torch.optim.AdamW(parameters, lr=config.learning_rate,
                                  weight_decay=config.weight_decay)
    settings, update = sampling_settings(config), update_settings(config)
    steps, trajectories, status = [], [], "ok"
    seconds = {"rollout": 0.0, "verification": 0.0, "update": 0.0}
    contract = {"admitted": True, "failed_checks": []}
    for step in range(config.steps):
        begin = step * config.prompts_per_step
        problems = admission.train[begin:begin + config.prompts_per_step]
        version = current_version(policy)
        started = time.perf_counter()
        with reporter.task(f"step {step + 1}/{config.steps} rollout",
                           len(problems) * config.group_size) as advance:
            completions = generate_completions(policy.model, policy.tokenizer,
                                               prompts[begin:begin + len(problems)],
                                               config.group_size, settings, config.seed + step,
                                               advance)
        rollout_seconds = time.perf_counter() - started
        started = time.perf_counter()
        rewards = score_completions(completions, problems, verifier)
        verification_seconds = time.perf_counter() - started
        # Counted before any check can stop the loop: an aborted step still paid its cost.
        seconds["rollout"] += rollout_seconds
        seconds["verification"] += verification_seconds
        records = trajectory_records(completions, rewards, problems, run_id=str(admission.run_dir),
                                     step=step, policy_version=version,
                                     verifier_version=verifier.version)
        log.append(records)
        trajectories.extend(records)
        step_contract = decisions.check_rollout_contract(
            contract_groups(records), version, verifier.version, config.group_size)
        if not step_contract["admitted"]:
            contract = {"admitted": False, "failed_checks": step_contract["failed_checks"],
                        "step": step}
            status = "contract_failed"
            break
        batch = build_update_batch([c.prompt_token_ids for c in completions],
                                   [c.completion_token_ids for c in completions], rewards,
                                   config.group_size)
        started = time.perf_counter()
        try:
            with reporter.task(f"step {step + 1}/{config.steps} update", len(batch)) as advance:
                record = grpo_update(policy.model, optimizer, batch, update,
                                     policy.tokenizer.pad_token_id,
                                     lambda: reference_mode(policy), parameters, advance)
        except NonFiniteUpdate as error:
            seconds["update"] += time.perf_counter() - started
            reporter.log(f"[red]{error}: stopping; the last good adapter is kept")
            status = "non_finite_update"
            break
        update_seconds = time.perf_counter() - started
        generated = sum(len(c.completion_token_ids) for c in completions)
        step_summary = metrics.rollout_summary(records, config.group_size)
        steps.append({
            "step": step, "policy_version": version, "mean_reward": step_summary["mean_reward"],
            "group_count": step_summary["group_count"],
            "valid_group_count": step_summary["valid_group_count"],
            "valid_group_ratio": step_summary["valid_group_ratio"],
            "max_length_hit_ratio": step_summary["max_length_hit_ratio"],
            "generated_tokens": generated,
            "generation_tokens_per_second": generated / rollout_seconds if rollout_seconds else 0.0,
            "rollout_seconds": rollout_seconds, "verification_seconds": verification_seconds,
            "update_seconds": update_seconds, **record.summary()})
        seconds["update"] += update_seconds
        reporter.log(f"step {step + 1}/{config.steps}: reward {step_summary['mean_reward']:.3f}, "
                     f"valid groups {step_summary['valid_group_count']}/{step_summary['group_count']}, "
                     f"updates {record.update_count}, kl {record.summary()['mean_kl']:.4f}")
    return {"steps": steps, "trajectories": trajectories, "status": status, "contract": contract,
            "seconds": seconds}


def rollout_evidence(trajectories: list[dict], steps: list[dict], seconds: dict, group_size: int,
                     verifier) -> dict:
    summary = metrics.rollout_summary(trajectories, group_size)
    generated = sum(s["generated_tokens"] for s in steps)
    return {"group_size": group_size, **summary, "rollout_seconds": seconds["rollout"],
            "verification_seconds": seconds["verification"], "generated_tokens": generated,
            "generation_tokens_per_second": generated / seconds["rollout"] if seconds["rollout"] else 0.0,
            "verifier_errors": getattr(verifier, "error_count", 0)}


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


def retest(policy: Policy, admission: Admission, baseline_version: str, candidate_version: str,
           reporter) -> tuple[list[dict], dict]:
    """Fresh completions of both policies on the eval prompts, same seed, paired comparison."""
    config = admission.config
    prompts = encode_prompts(policy.tokenizer, admission.eval, config.resolved_system_prompt(),
                             config.max_prompt_tokens)
    settings = sampling_settings(config)
    records = {}
    for name, version, mode in (("baseline", baseline_version, lambda: reference_mode(policy)),
                                ("candidate", candidate_version, contextlib.nullcontext)):
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
    }
    return records["baseline"] + records["candidate"], comparison


def run(config: RunConfig, reporter=None) -> dict:
    """Run every stage; returns the evidence dict (also on disk with the manifest)."""
    reporter = reporter or NullReporter()
    started_run = time.perf_counter()
    admission = admit(config)
    started = time.perf_counter()
    policy = load_policy(dataclasses.replace(config, model=admission.model_spec,
                                             model_revision=admission.model_revision),
                         adapter=admission.adapter, seed=config.seed)
    load_seconds = time.perf_counter() - started
    if policy.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(policy.device)
    run_dir = create_run_dir(admission.run_dir)
    reporter.log(f"run directory: {run_dir}")
    log = JsonlLog(run_dir / "trajectories.jsonl")
    trained = train(policy, admission, log, reporter)
    steps, trajectories, seconds = trained["steps"], trained["trajectories"], trained["seconds"]

    adapter_sha = save_adapter(policy, run_dir / "adapter")
    candidate_version = current_version(policy)
    started = time.perf_counter()
    eval_records, comparison = retest(policy, admission, policy.baseline_version,
                                      candidate_version, reporter)
    seconds["evaluation"] = time.perf_counter() - started

    rollout = rollout_evidence(trajectories, steps, seconds, config.group_size, admission.verifier)
    update = update_evidence(config, steps, seconds)
    status = trained["status"]
    if status == "ok" and (rollout["valid_group_count"] == 0 or update["update_count"] == 0):
        status = "no_effective_update"
    # The artifact counts only if the file on disk still hashes to what we recorded.
    on_disk = sha256_file(run_dir / "adapter" / "adapter_model.safetensors")
    evidence = {
        "grpogate_evidence_version": 1,
        "run_label": config.label or run_dir.name,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "status": status,
        "config": config.to_dict(),
        "environment": library_versions() | {"torch_threads": torch.get_num_threads(),
                                             "device": str(policy.device)},
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
        "contract": trained["contract"],
        "rollout": rollout,
        "update": update,
        "comparison": comparison,
        "timings": {"load_seconds": load_seconds, "rollout_seconds": seconds["rollout"],
                    "verification_seconds": seconds["verification"],
                    "update_seconds": seconds["update"],
                    "evaluation_seconds": seconds["evaluation"]},
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
    evidence["timings"]["total_seconds"] = time.perf_counter() - started_run
    evidence["decision"] = decisions.decide_run(evidence, dataclasses.asdict(config.gates))

    atomic_write_bytes(run_dir / "eval_completions.jsonl", jsonl_bytes(eval_records))
    atomic_write_json(run_dir / "evidence.json", evidence)
    atomic_write_json(run_dir / "manifest.json", build_manifest(evidence, run_dir, trajectories))
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
