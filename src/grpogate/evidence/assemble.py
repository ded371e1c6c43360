"""Assemble: plain records -> the evidence document, one pure function the run and the audit share.

The run hands `assemble_evidence` what only it can know (the facts: identities, timings,
resources, the loop's outcome, the artifact) and the records it produced (per-step records,
trajectories, re-test completions). Everything else in the document — rollout coverage, update
totals, the re-test comparison, seeds, effective throughput, the status and the decision — is
derived here. `grpogate decide` calls the same function on the facts as recorded and the
records as stored, and compares: an audit with its own copy of a rule could agree with a bug.
"""

from __future__ import annotations

import platform
from importlib import metadata

from grpogate.config import RunConfig, step_count
from grpogate.evidence import decisions, guard, metrics, retest_checks, stopping
from grpogate.seeding import REFILL_SEED_OFFSET, eval_seed, rollout_seed

EVIDENCE_VERSION = 1
BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95
# The per-step fields recomputable from that step's trajectory records.
STEP_FIELDS = ("mean_reward", "group_count", "valid_group_count", "valid_group_ratio",
               "max_length_hit_ratio", "generated_tokens", "reward_component_means",
               "prompts_drawn", "groups_generated", "groups_kept", "refill_prompts", "tokens")


def library_versions() -> dict:
    versions = {"python": platform.python_version(), "platform": platform.platform()}
    for package in ("grpogate", "torch", "transformers", "peft", "safetensors", "gguf",
                    "reasoning-gym", "numpy", "math-verify"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def bootstrap_seed(config: dict) -> int:
    """The paired bootstrap's seed: the run seed (read without building `seeds`)."""
    return config["seed"]


def seeds(config: dict) -> dict:
    """Step s samples with run seed + s, the re-test with run seed + 10,000 (both policies).
    One rollout seed per step: the comparison and bootstrap read their seeds without it."""
    seed, steps = config["seed"], step_count(config["train_prompts"], config["prompts_per_step"])
    return {"run": seed, "rollout": [rollout_seed(seed, s) for s in range(steps)],
            "refill": f"run seed + step + {REFILL_SEED_OFFSET:,} x round (round >= 1)",
            "eval": eval_seed(seed), "bootstrap": bootstrap_seed(config),
            "per_prompt": "prompt_seed(round or eval seed, prompt index) = first 63 bits of "
                          "sha256('<seed>|<index>'), the index in the train or eval set"}


def _kept(group: list[dict], mask_truncated: bool) -> bool:
    """A group enters the update when its rewards differ and, with truncated completions
    masked, at least one member still adds loss (`advantages.build_update_batch`)."""
    rewards = [float(r["reward"]) for r in group]
    return max(rewards) > min(rewards) and (
        not mask_truncated or not all(r["hit_max_length"] for r in group))


def step_summary(records: list[dict], group_size: int, mask_truncated: bool = False,
                 num_iterations: int = RunConfig.num_iterations) -> dict:
    """One step's STEP_FIELDS from its trajectory records (the loop records, the audit checks):
    coverage, per-component means, for dynamic sampling what every round drew and kept, and
    `tokens`, the tokens the update trained on: every completion token of the kept groups that
    adds loss, once per pass (the update's own count must equal it)."""
    summary = metrics.rollout_summary(records, group_size)
    summary["generated_tokens"] = sum(int(r["completion_tokens"]) for r in records)
    summary["reward_component_means"] = metrics.component_means(records)
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(str(record["prompt_id"]), []).append(record)
    summary["prompts_drawn"] = summary["groups_generated"] = len(groups)
    summary["groups_kept"] = sum(len(g) == group_size and _kept(g, mask_truncated)
                                 for g in groups.values())
    summary["refill_prompts"] = sum(int(g[0].get("round", 0)) > 0 for g in groups.values())
    summary["tokens"] = num_iterations * sum(
        int(r["completion_tokens"]) for g in groups.values()
        if len(g) == group_size and _kept(g, mask_truncated)
        for r in g if not (mask_truncated and r["hit_max_length"]))
    return {key: summary[key] for key in STEP_FIELDS}


def update_throughput(tokens: int, forwarded: int, forwarded_real: int, seconds: float) -> dict:
    """What an update's compute bought: the tokens trained per second, and the share of the
    forwarded positions (policy, reference, pi_old forwards) that was padding."""
    return {"update_tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
            "padding_fraction": 1.0 - forwarded_real / forwarded if forwarded else 0.0}


def sampling_section(config: dict) -> dict:
    """The rollout's sampling settings, and which distribution the update's ratio divides by."""
    settings = {key: config.get(key, default) for key, default in
                (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0))}
    truncated = settings["top_p"] < 1.0 or settings["top_k"] > 0 or settings["min_p"] > 0.0
    return {**settings, "truncated": truncated,
            "ratio_old_logprobs": (
                "sampler: the truncated, renormalized distribution the tokens were drawn from"
                if truncated else "the full softmax(logits / temperature) of the rollout policy")}


def generation_rounds(records: list[dict], group_size: int, run_seed: int, step: int) -> list[dict]:
    """One step's rounds as its records show them: round, seed, prompts, valid groups (the
    loop records these plus seconds; the audit recomputes them)."""
    by_round: dict[int, list[dict]] = {}  # grouped once: linear in the records
    for record in records:
        by_round.setdefault(int(record.get("round", 0)), []).append(record)
    summary = []
    for number in sorted(by_round):
        coverage = metrics.rollout_summary(by_round[number], group_size)
        summary.append({"round": number, "seed": rollout_seed(run_seed, step, number),
                        "prompts": coverage["group_count"],
                        "valid_groups": coverage["valid_group_count"]})
    return summary


def dynamic_sampling_section(config: dict, steps: list[dict]) -> dict:
    """Totals of the per-step refill records: the refill's generation counts in the effective
    throughput's denominator because it is part of the rollout seconds."""
    return {"enabled": bool(config.get("dynamic_sampling", False)),
            "max_generation_rounds": config.get("max_generation_rounds", 1),
            **{key: sum(s.get(key, 0) for s in steps)
               for key in ("prompts_drawn", "groups_generated", "groups_kept", "refill_prompts",
                           "refill_generation_seconds")}}


def rollout_section(trajectories: list[dict], steps: list[dict], seconds: dict, config: dict,
                    verifier_errors: int, reward_errors: int) -> dict:
    group_size = config["group_size"]
    summary = metrics.rollout_summary(trajectories, group_size)
    generated = sum(s["generated_tokens"] for s in steps)
    return {"group_size": group_size, **summary,
            # `reward` of a trajectory is the weighted total of these components; the decision
            # reads only the re-test's correctness (comparison), never these.
            "reward_component_means": metrics.component_means(trajectories),
            "multi_objective_aggregation": config.get("multi_objective_aggregation",
                                                      "sum_then_normalize"),
            "reward_errors": reward_errors,
            "dynamic_sampling": dynamic_sampling_section(config, steps),
            "sampling": sampling_section(config),
            "rollout_seconds": seconds["rollout"],
            "verification_seconds": seconds["verification"], "generated_tokens": generated,
            "generation_tokens_per_second": generated / seconds["rollout"] if seconds["rollout"] else 0.0,
            "decode_paths": sorted({s["decode_path"] for s in steps if "decode_path" in s}),
            "verifier_errors": verifier_errors}


# The objective's knobs, recorded in the update section as configured.
OBJECTIVE_KEYS = ("loss_type", "importance_sampling_level", "epsilon", "delta", "beta",
                  "kl_estimator", "scale_rewards", "num_iterations", "top_entropy_quantile",
                  "rollout_correction", "rollout_correction_cap")


def _weighted_mean(steps: list[dict], key: str, weight: str):
    """The `weight`-weighted mean of a per-step value over the steps that measured it."""
    measured = [s for s in steps if s.get(key) is not None and s.get(weight)]
    total = sum(s[weight] for s in measured)
    return sum(s[key] * s[weight] for s in measured) / total if total else None


def update_section(config: dict, steps: list[dict], seconds: dict, micro_batch_size: int,
                   oom_retries: int) -> dict:
    """The update totals over the per-step records (token-weighted KL, clip fraction, entropy
    and sampler-trainer mismatch; the largest mismatch of any step)."""
    tokens = sum(s["tokens"] for s in steps)
    forwarded = {}
    if any("tokens_forwarded" in s for s in steps):  # absent from evidence written before them
        counts = [sum(s.get(key, 0) for s in steps)
                  for key in ("tokens_forwarded", "tokens_forwarded_real")]
        # Padding included: forwarded - forwarded_real positions were computed for nothing.
        forwarded = {"tokens_forwarded": counts[0], "tokens_forwarded_real": counts[1],
                     **update_throughput(tokens, *counts, seconds["update"])}
    maxima = [s["mismatch_max_abs_logp"] for s in steps
              if s.get("mismatch_max_abs_logp") is not None]
    return {
        "update_count": sum(s["update_count"] for s in steps), "update_seconds": seconds["update"],
        **{key: config[key] for key in OBJECTIVE_KEYS},
        "epsilon_high": config["epsilon_high"] or config["epsilon"],
        "mean_kl": _weighted_mean(steps, "mean_kl", "tokens") or 0.0,
        "clip_fraction": _weighted_mean(steps, "clip_fraction", "tokens") or 0.0,
        "entropy": _weighted_mean(steps, "entropy", "entropy_tokens"),
        "sampler_trainer_mismatch": {
            "tokens": sum(s.get("mismatch_tokens", 0) for s in steps),
            "mean_abs_logp": _weighted_mean(steps, "mismatch_mean_abs_logp", "mismatch_tokens"),
            "max_abs_logp": max(maxima) if maxima else None,
            "k3_kl": _weighted_mean(steps, "mismatch_k3_kl", "mismatch_tokens")},
        "grad_norm": [g for s in steps for g in s["grad_norm"]],
        "learning_rate": config["learning_rate"], "optimizer": "AdamW",
        # runs written before the schedule existed trained at a constant rate
        "lr_scheduler_type": config.get("lr_scheduler_type", "constant"),
        "warmup_ratio": config.get("warmup_ratio", 0.0),
        "last_learning_rate": (steps[-1].get("learning_rate", config["learning_rate"])
                               if steps else None),
        "max_grad_norm": config["max_grad_norm"],
        "trained_sequences": sum(s["sequences"] for s in steps), "trained_tokens": tokens,
        **forwarded,
        # Forwarded with their group but adding no loss: they hit max_new_tokens.
        "mask_truncated_completions": config.get("mask_truncated_completions", False),
        "masked_truncated_sequences": sum(s.get("masked_truncated_sequences", 0) for s in steps),
        # An out-of-memory update is retried once at half the micro-batch, which then stays.
        "micro_batch_size": micro_batch_size, "oom_retries": oom_retries,
    }


def comparison_section(eval_records: list[dict], config: dict, verifier_errors: int) -> dict:
    """Baseline vs candidate on the re-test records, paired prompt by prompt."""
    group_size, budget = config["eval_group_size"], config["max_new_tokens"]
    baseline = metrics.summarize_completions(
        [r for r in eval_records if r["policy"] == "baseline"], group_size, budget)
    candidate = metrics.summarize_completions(
        [r for r in eval_records if r["policy"] == "candidate"], group_size, budget)
    paired = metrics.paired_comparison(baseline, candidate, **bootstrap_settings(config))
    comparison = {
        "reward_mean_gain": candidate["mean_reward"] - baseline["mean_reward"],
        "pass_at_group_gain": candidate["pass_at_group"] - baseline["pass_at_group"],
        "eval_group_size": group_size, "eval_seed": eval_seed(config["seed"]),
        "baseline": baseline, "candidate": candidate, "paired": paired,
        "identical_completions": metrics.identical_pairs(eval_records),
        "verifier_errors": verifier_errors,
    }
    drift = guard.drift_section(eval_records)
    if drift is not None:  # absent from runs recorded before the drift was measured
        comparison["drift"] = drift
    return comparison


def bootstrap_settings(config: dict) -> dict:
    """The paired bootstrap of the eval and guard comparisons: resamples, seed, confidence."""
    return {"resamples": BOOTSTRAP_RESAMPLES, "seed": bootstrap_seed(config),
            "confidence": CONFIDENCE}


def skipped_comparison(config: dict) -> dict:
    """The comparison of a run stopped before its re-test: every field present, zero, and
    flagged, so readers and `decisions.decide_run` work (which fails the quality checks)."""
    empty = {"prompt_count": 0, "completion_count": 0, "mean_reward": 0.0, "pass_at_group": 0.0,
             "max_length_hit_ratio": 0.0, "length": metrics.length_summary([]),
             "length_histogram": None, "per_prompt": []}
    return {"skipped": True, "reward_mean_gain": 0.0, "pass_at_group_gain": 0.0,
            "eval_group_size": config["eval_group_size"], "eval_seed": eval_seed(config["seed"]),
            "baseline": dict(empty), "candidate": dict(empty), "paired": {},
            "verifier_errors": 0}


RANK_STAGES = ("rollout", "verification", "update", "evaluation")


def distributed_section(recorded: dict) -> dict:
    """World size, backend, every rank's own stage seconds (outside collectives) and, per
    stage, the slowest rank: the one the others waited for. The evidence's stage timings are
    rank 0's wall clock over each stage, waits included: the job's time, which the effective
    throughput divides by."""
    per_rank = recorded["per_rank_seconds"]
    slowest = {}
    for stage in RANK_STAGES:
        seconds = [float(rank.get(stage, 0.0)) for rank in per_rank]
        worst = max(range(len(seconds)), key=seconds.__getitem__) if seconds else 0
        slowest[stage] = {"rank": worst, "seconds": seconds[worst] if seconds else 0.0}
    return {**recorded, "slowest_rank_seconds": slowest}


def training_steps_section(config: dict, steps: list[dict], trajectories: list[dict],
                           loop_status: str) -> dict:
    """Configured and completed training steps. A step counts as completed when its record
    follows the one before (numbered 0, 1, ...) and trajectories.jsonl holds its records, so
    the audit rebuilds the count from the stored records; a loop that stopped early names its
    status as the early stop (interrupted or failed: the execution check rejects it)."""
    logged = {r.get("step") for r in trajectories if isinstance(r, dict)
              and type(r.get("step")) is int}
    completed = 0
    for step in steps:
        if not isinstance(step, dict) or step.get("step") != completed or completed not in logged:
            break
        completed += 1
    return {"configured": step_count(config["train_prompts"], config["prompts_per_step"]),
            "completed": completed, "early_stop": None if loop_status == "ok" else loop_status}


def run_status(loop_status: str, rollout: dict, update: dict) -> str:
    """A finished loop with no valid group or no real optimizer step did not update the policy."""
    if loop_status == "ok" and (rollout["valid_group_count"] == 0 or update["update_count"] == 0):
        return "no_effective_update"
    return loop_status


def assemble_evidence(facts: dict, config: dict, steps: list[dict], trajectories: list[dict],
                      eval_records: list[dict], guard_records: list[dict] = ()) -> dict:
    """The evidence document. `facts` holds: run_label, created, loop_status, failure,
    interruption, resumes, environment, inputs, contract, seconds (rollout, verification,
    update, evaluation, checkpoint, load, total), verifier_errors, reward_errors, retest_verifier_errors,
    retest_skipped, micro_batch_size, oom_retries, resources, artifact and (optional)
    distributed: world_size, backend, restart_count, per_rank_seconds. `guard_records`: both
    policies' re-test completions on the guard set (config `guard`)."""
    seconds = facts["seconds"]
    rollout = rollout_section(trajectories, steps, seconds, config, facts["verifier_errors"],
                              facts.get("reward_errors", 0))
    update = update_section(config, steps, seconds, facts["micro_batch_size"],
                            facts["oom_retries"])
    comparison = (skipped_comparison(config) if facts["retest_skipped"] else
                  comparison_section(eval_records, config, facts["retest_verifier_errors"]))
    evidence = {
        "grpogate_evidence_version": EVIDENCE_VERSION,
        "run_label": facts["run_label"],
        "created": facts["created"],
        "status": run_status(facts["loop_status"], rollout, update),
        "failure": facts["failure"],
        "interruption": facts["interruption"],
        "resumes": facts["resumes"],
        "config": config,
        "environment": facts["environment"],
        "seeds": seeds(config),
        "inputs": facts["inputs"],
        "contract": facts["contract"],
        "rollout": rollout,
        "update": update,
        "comparison": comparison,
        "timings": {f"{stage}_seconds": seconds[stage] for stage in
                    ("load", "rollout", "verification", "update", "evaluation", "checkpoint")},
        "resources": facts["resources"],
        "artifact": facts["artifact"],
        "steps": steps,
        "training_steps": training_steps_section(config, steps, trajectories,
                                                 facts["loop_status"]),
    }
    if facts.get("distributed") is not None:  # absent from runs recorded before torchrun
        evidence["distributed"] = distributed_section(facts["distributed"])
    guard_result = guard.guard_section(config, list(guard_records), bootstrap_settings(config),
                                       skipped=facts["retest_skipped"])
    if guard_result is not None:  # absent from runs recorded before the guard
        evidence["guard"] = guard_result
    return decided(evidence, config, seconds["total"])


def retest_looks(evidence: dict, config: dict) -> dict | None:
    """Every look of the sequential re-test, where the rule stopped and why, and the
    completions it used, recomputed from the per-prompt records (retest_checks.
    sequential_outcome); None for a skipped re-test or a config without the sequential design."""
    design = retest_checks.recorded_design(evidence)
    if not design or evidence["comparison"].get("skipped") is True:
        return None
    outcome = retest_checks.sequential_outcome(evidence, config["gates"])
    if outcome is None:
        return None
    recorded = outcome["recorded"]
    return {"rule": stopping.RULE if retest_checks.gain_rule(config["gates"]) ==
            retest_checks.SEQUENTIAL_RULE else "one look at the maximum (point-estimate gates)",
            "design": design, "margins": outcome["margins"], "looks": outcome["looks"],
            "stopped_at_look": len(outcome["looks"]) if outcome["complete"] else None,
            "reason": outcome["reason"], "status": outcome["status"],
            "eval_prompts": recorded["eval_prompts"], "guard_samples": recorded["guard_samples"],
            "completions": 2 * (recorded["eval_prompts"] * config["eval_group_size"]
                                + recorded["guard_samples"])}


def decided(evidence: dict, config: dict, total_seconds: float) -> dict:
    """The evidence with what derives from it added: the sequential re-test's looks (a grpogate
    run's and a gate's alike), the coverage figures, the total time and the decision."""
    looks = retest_looks(evidence, config)
    if looks is not None:
        evidence["retest"] = looks
    gates = config["gates"]
    if evidence["status"] == "ok" and decisions.no_change_reason(evidence):
        evidence["status"] = "no_effective_update"  # the re-test shows the baseline, unchanged
    candidate = decisions.evaluate_grpo_candidate(evidence, gates)
    for key in ("effective_trajectory_count", "effective_trajectories_per_second",
                "valid_group_ratio"):
        evidence[key] = candidate[key]
    evidence["timings"]["total_seconds"] = total_seconds
    evidence["decision"] = decisions.decide_run(evidence, gates)
    return evidence


def recorded_facts(evidence: dict) -> dict:
    """The facts of a stored evidence document, as `assemble_evidence` takes them: what the
    audit cannot recompute and so takes as recorded (the records are checked separately)."""
    timings, rollout = evidence["timings"], evidence["rollout"]
    update, comparison = evidence["update"], evidence["comparison"]
    status = evidence["status"]
    return {
        "run_label": evidence["run_label"], "created": evidence["created"],
        # `run_status` derives no_effective_update from a finished loop; recomputing it from
        # "ok" checks that the claim matches the records (and that an "ok" claim is earned).
        "loop_status": "ok" if status == "no_effective_update" else status,
        "failure": evidence["failure"], "interruption": evidence["interruption"],
        "resumes": evidence["resumes"], "environment": evidence["environment"],
        "inputs": evidence["inputs"], "contract": evidence["contract"],
        "seconds": {"load": timings["load_seconds"], "rollout": timings["rollout_seconds"],
                    "verification": timings["verification_seconds"],
                    "update": timings["update_seconds"],
                    "evaluation": timings["evaluation_seconds"],
                    "checkpoint": timings["checkpoint_seconds"],
                    "total": timings["total_seconds"]},
        "verifier_errors": rollout["verifier_errors"],
        "reward_errors": rollout.get("reward_errors", 0),
        "retest_verifier_errors": comparison["verifier_errors"],
        "retest_skipped": comparison.get("skipped") is True,
        "micro_batch_size": update["micro_batch_size"], "oom_retries": update["oom_retries"],
        "resources": evidence["resources"], "artifact": evidence["artifact"],
        "distributed": ({key: value for key, value in evidence["distributed"].items()
                         if key != "slowest_rank_seconds"} if "distributed" in evidence else None),
    }
