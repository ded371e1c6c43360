"""A foreign trainer's log -> the rollout and update sections of the evidence, and the whole
evidence document of a gated foreign run (`grpogate gate --from-trl`).

TRL's GRPOTrainer keeps no trajectories: what it trained on survives only as the per-step means
it logged into trainer_state.json's `log_history`. The figures here are read from that log and
marked `"source": "trainer_log"`; they cannot be re-derived from completions, and `decide` can
only re-check the log's hash and this arithmetic. The counts use the same rule as a grpogate
run (docs/design.md §3): a group is valid when its rewards are not all equal, effective
trajectories = valid groups x G, and the decision's own `evaluate_grpo_candidate` divides them by the run's
seconds (TRL's `train_runtime`: generation, rewards and update together, the log does not split
them). Per logged entry, with P = per_device_train_batch_size x gradient_accumulation_steps x
num_processes completions per generation (one generation every num_iterations optimizer steps):

    groups = generations in the window x P / G
    valid groups = (1 - frac_reward_zero_std) x groups   (TRL averages the fraction over the
                                                          window's generations; must be whole)

`frac_reward_zero_std` counts groups only under scale_rewards "group" or "none" with
multi_objective_aggregation "sum_then_normalize"; other settings are refused (InputError).
Pure Python (no torch).
"""

from __future__ import annotations

import math

from grpogate.errors import InputError
from grpogate.evidence import decisions, guard
from grpogate.evidence.assemble import (EVIDENCE_VERSION, bootstrap_settings, comparison_section,
                                        decided, run_status, seeds, skipped_comparison)

SOURCE = decisions.FOREIGN_LOG
SOURCE_NOTE = ("read from the trainer's own log (trainer_state.json log_history); the run "
               "stored no trajectories, so these figures cannot be re-derived from completions")
NOT_RECORDED_NOTE = ("not recorded: the candidate came without its trainer's log, so its groups, "
                     "updates, truncation and throughput are unknown; the decision rests on the "
                     "re-test, the guard and the re-test KL")
WHOLE_TOLERANCE = 1e-3  # TRL logs the fraction as a float32 mean: 1/3 is 0.3333333432674408


# Bounds on what a log may claim, so that no figure derived from it can overflow a float and
# no work depends on a value (only on the number of entries). A step number is at most 2**53
# (a float counts it exactly; TRL's max_steps is far below), a whole-number setting at most
# 2**20 (1,048,576 processes, batch rows or generations): the counts derived from them stay
# under 2**53 x 2**60 = 2**113 (about 1e34). A logged figure's magnitude is at most 1e100, so a
# figure x a count is under 1e134 and a sum over the at most 2**22 entries of a log file under
# 1e141, far from the float limit (1.8e308): `gate` can never fail on the log after the re-test.
MAX_STEP = 1 << 53
MAX_SETTING = 1 << 20
MAX_FIGURE = 1e100


def _number(entry: dict, key: str, where: str, required: bool = True) -> float | None:
    value = entry.get(key)
    if value is None and not required:
        return None
    if not _finite(value):
        raise InputError(f"{where}: field {key!r} must be a finite number of magnitude at most "
                         f"{MAX_FIGURE:g} (got {value!r})")
    return float(value)


def _fraction(entry: dict, key: str, where: str) -> float | None:
    """An optional logged fraction (frac_reward_zero_std): a number in [0, 1]."""
    value = _number(entry, key, where, required=False)
    if value is not None and not 0.0 <= value <= 1.0:
        raise InputError(f"{where}: field {key!r} is a fraction of groups, in [0, 1] (got "
                         f"{value!r})")
    return value


def _generations(previous_step: int, step: int, num_iterations: int) -> int:
    """Optimizer steps k in (previous_step, step] that start with a generation: k - 1 divisible
    by num_iterations (each generation is trained on num_iterations times). The multiples of n
    in [a, b] number b // n - (a - 1) // n; here a = previous_step, b = step - 1. Closed form:
    the cost is one division whatever the step numbers are."""
    return (step - 1) // num_iterations - (previous_step - 1) // num_iterations


def _whole(value: float, where: str, what: str) -> int:
    if abs(value - round(value)) > WHOLE_TOLERANCE:
        raise InputError(f"{where}: {what} is {value:.6g}, not a whole number; the declared GRPO "
                         "settings (num_generations, batch size, gradient_accumulation_steps, "
                         "num_iterations, num_processes) do not match this log")
    return int(round(value))


def check_settings(settings: dict, where: str) -> None:
    if settings.get("scale_rewards") not in ("group", "none") or settings.get(
            "multi_objective_aggregation") != "sum_then_normalize":
        raise InputError(f"{where}: with scale_rewards={settings.get('scale_rewards')!r} and "
                         f"multi_objective_aggregation={settings.get('multi_objective_aggregation')!r} "
                         "TRL's frac_reward_zero_std does not count groups; the valid-group ratio "
                         "cannot be read from this log")
    for key in ("num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
                "num_iterations", "num_processes"):
        if settings[key] > MAX_SETTING:
            raise InputError(f"{where}: GRPO setting {key}={settings[key]} is over "
                             f"{MAX_SETTING}; not a run a trainer logs")
    per_generation = (settings["per_device_train_batch_size"]
                      * settings["gradient_accumulation_steps"] * settings["num_processes"])
    if per_generation % settings["num_generations"]:
        raise InputError(f"{where}: {per_generation} completions per generation is not a "
                         f"multiple of num_generations={settings['num_generations']}")


def log_steps(trainer_state: dict, settings: dict, where: str) -> list[dict]:
    """One record per logged training entry (those with a `step` and a `loss`), in order."""
    check_settings(settings, where)
    group_size = settings["num_generations"]
    per_generation = (settings["per_device_train_batch_size"]
                      * settings["gradient_accumulation_steps"] * settings["num_processes"])
    steps, previous, tokens_before = [], 0, 0.0
    for index, entry in enumerate(trainer_state["log_history"]):
        if "loss" not in entry or "train_runtime" in entry or "step" not in entry:
            continue  # evaluation entries and the closing summary
        at = f"{where} log_history[{index}]"
        step = entry["step"]
        if type(step) is not int or not previous < step <= MAX_STEP:
            raise InputError(f"{at}: field 'step' must be a whole number after {previous}, at "
                             f"most {MAX_STEP}")
        generations = _generations(previous, step, settings["num_iterations"])
        frac = _fraction(entry, "frac_reward_zero_std", at)
        groups = generations * per_generation // group_size if frac is not None else 0
        valid = _whole((1.0 - frac) * groups, at, "(1 - frac_reward_zero_std) x groups") \
            if frac is not None else 0
        completions = groups * group_size
        num_tokens = _number(entry, "num_tokens", at, required=False)
        steps.append(_measured({
            # 0-based as a grpogate run counts its steps; TRL's own step number beside it
            "step": step - 1, "trl_step": step, "optimizer_steps": step - previous,
            "generations": generations,
            "group_count": groups, "valid_group_count": valid,
            "valid_group_ratio": valid / groups if groups else 0.0, "completions": completions,
            "frac_reward_zero_std": frac,
            "mean_reward": _number(entry, "reward", at, required=False),
            "max_length_hit_ratio": _number(entry, "completions/clipped_ratio", at, required=False),
            "mean_length": _number(entry, "completions/mean_length", at, required=False),
            "num_tokens": num_tokens,
            "tokens": (num_tokens - tokens_before) if num_tokens is not None else None,
            "mean_kl": _number(entry, "kl", at, required=False),
            "clip_fraction": _number(entry, "clip_ratio/region_mean", at, required=False),
            "clip_low_fraction": _number(entry, "clip_ratio/low_mean", at, required=False),
            "clip_high_fraction": _number(entry, "clip_ratio/high_mean", at, required=False),
            "entropy": _number(entry, "entropy", at, required=False),
            "loss": _number(entry, "loss", at), "grad_norm": _number(entry, "grad_norm", at, False),
            "learning_rate": _number(entry, "learning_rate", at, required=False),
            "step_time": _number(entry, "step_time", at, required=False),
            "reward_component_means": _component_means(entry, at),
        }))
        previous = step
        tokens_before = num_tokens if num_tokens is not None else tokens_before
    return steps


def _component_means(entry: dict, where: str) -> dict:
    """Each reward function's logged mean ("rewards/NAME/mean"), by NAME; a NaN (TRL logs one
    when a function scored nothing) is left out, any other value must be a bounded number."""
    keys = [k for k in sorted(entry) if k.startswith("rewards/") and k.endswith("/mean")]
    return {key[len("rewards/"):-len("/mean")]: _number(entry, key, where) for key in keys
            if not (isinstance(entry[key], float) and math.isnan(entry[key]))}


def _measured(record: dict) -> dict:
    """The record without the figures this entry did not log (kl without beta, clip ratios of
    an older TRL): absent, never a made-up zero."""
    return {key: value for key, value in record.items() if value is not None}


def _finite(value) -> bool:
    """A number (not a bool) of magnitude at most MAX_FIGURE: NaN and infinity are not."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and abs(value) <= MAX_FIGURE)


def _weighted(steps: list[dict], key: str, weight: str) -> float | None:
    measured = [s for s in steps if s.get(key) is not None and s.get(weight)]
    total = sum(s[weight] for s in measured)
    return math.fsum(s[key] * s[weight] for s in measured) / total if total else None


def train_seconds(trainer_state: dict, steps: list[dict]) -> tuple[float | None, str]:
    """TRL's train_runtime (in the log once trainer.save_state() ran after train()), else the
    sum of the logged step_time (each entry's mean x its optimizer steps), else unknown."""
    for entry in trainer_state["log_history"]:
        if _finite(entry.get("train_runtime")) and entry["train_runtime"] >= 0:
            return float(entry["train_runtime"]), "train_runtime"
    if steps and all(s.get("step_time") is not None for s in steps):
        return math.fsum(s["step_time"] * s["optimizer_steps"] for s in steps), "sum of step_time"
    return None, "unknown (no train_runtime or step_time in the log)"


def rollout_from_log(steps: list[dict], trainer_state: dict, group_size: int) -> dict:
    groups = sum(s["group_count"] for s in steps)
    valid = sum(s["valid_group_count"] for s in steps)
    seconds, seconds_source = train_seconds(trainer_state, steps)
    hit = _weighted(steps, "max_length_hit_ratio", "completions")
    names = sorted({name for s in steps for name in s["reward_component_means"]})
    return {
        "source": SOURCE, "source_note": SOURCE_NOTE, "group_size": group_size,
        "group_count": groups, "valid_group_count": valid,
        "valid_group_ratio": valid / groups if groups else 0.0,
        "total_trajectories": groups * group_size, "effective_trajectory_count": valid * group_size,
        "max_length_hit_ratio": hit if hit is not None else None,
        "mean_reward": _weighted(steps, "mean_reward", "completions"),
        "reward_component_means": {name: _weighted(
            [{"v": s["reward_component_means"].get(name), "w": s["completions"]} for s in steps],
            "v", "w") for name in names},
        "generated_tokens": round(math.fsum(s["mean_length"] * s["completions"] for s in steps
                                            if s.get("mean_length") is not None)),
        # The trainer's whole time: the throughput gate divides by rollout + update seconds,
        # and the log does not split generation from the update.
        "rollout_seconds": seconds, "seconds_source": seconds_source,
    }


def update_from_log(steps: list[dict], trainer_state: dict, settings: dict) -> dict:
    return {
        "source": SOURCE, "source_note": SOURCE_NOTE,
        "update_count": trainer_state["global_step"], "update_seconds": 0.0,
        **{key: settings.get(key) for key in ("loss_type", "beta", "epsilon", "epsilon_high",
                                               "num_iterations", "scale_rewards",
                                               "importance_sampling_level", "learning_rate")},
        "mean_kl": _weighted(steps, "mean_kl", "optimizer_steps"),
        "clip_fraction": _weighted(steps, "clip_fraction", "optimizer_steps") or 0.0,
        "clip_low_fraction": _weighted(steps, "clip_low_fraction", "optimizer_steps"),
        "clip_high_fraction": _weighted(steps, "clip_high_fraction", "optimizer_steps"),
        "entropy": _weighted(steps, "entropy", "optimizer_steps"),
        "grad_norm": [s["grad_norm"] for s in steps if s.get("grad_norm") is not None],
        "num_input_tokens_seen": trainer_state.get("num_input_tokens_seen"),
    }


def unrecorded_sections() -> tuple[dict, dict]:
    """The rollout and update sections of a candidate gated without its trainer's log: every
    training-side figure None (unknown), marked so; decisions.py reads the source."""
    marked = {"source": decisions.NOT_RECORDED, "source_note": NOT_RECORDED_NOTE}
    rollout = marked | {"group_size": None, "reward_component_means": {},
                        "seconds_source": "not recorded"} | dict.fromkeys((
                            "group_count", "valid_group_count", "valid_group_ratio",
                            "total_trajectories", "effective_trajectory_count",
                            "max_length_hit_ratio", "mean_reward", "generated_tokens",
                            "rollout_seconds"))
    update = marked | {"update_count": None, "update_seconds": 0.0, "grad_norm": []}
    return rollout, update


def assemble_foreign_evidence(facts: dict, config: dict, trainer_state: dict | None,
                              eval_records: list[dict], guard_records: list[dict] = ()) -> dict:
    """The evidence document of a gated foreign run, from what the gate knows (`facts`: run_label,
    created, environment, inputs, foreign (with settings and admission), contract, seconds
    (load, evaluation, total), retest_verifier_errors, retest_skipped, resources, artifact),
    the trainer's log (None: not recorded) and the stored records. `grpogate decide` calls it
    again on the stored files."""
    foreign = facts["foreign"]
    steps = []
    if trainer_state is None:
        rollout, update = unrecorded_sections()
    else:
        steps = log_steps(trainer_state, foreign["settings"], "trainer_state.json")
        rollout = rollout_from_log(steps, trainer_state, config["group_size"])
        update = update_from_log(steps, trainer_state, foreign["settings"])
    comparison = (skipped_comparison(config) if facts["retest_skipped"] else
                  comparison_section(eval_records, config, facts["retest_verifier_errors"]))
    loop_status = "ok" if not facts["retest_skipped"] else "not_admitted"
    seconds = facts["seconds"]
    evidence = {
        "grpogate_evidence_version": EVIDENCE_VERSION, "run_label": facts["run_label"],
        "created": facts["created"], "status": run_status(loop_status, rollout, update),
        "failure": None, "interruption": None, "resumes": [], "config": config,
        "environment": facts["environment"], "seeds": seeds(config), "foreign": foreign,
        "inputs": facts["inputs"], "contract": facts["contract"], "rollout": rollout,
        "update": update, "comparison": comparison,
        "timings": {"load_seconds": seconds["load"], "rollout_seconds": rollout["rollout_seconds"],
                    "verification_seconds": 0.0, "update_seconds": 0.0,
                    "evaluation_seconds": seconds["evaluation"], "checkpoint_seconds": 0.0},
        "resources": facts["resources"], "artifact": facts["artifact"], "steps": steps,
    }
    guard_result = guard.guard_section(config, list(guard_records), bootstrap_settings(config),
                                       skipped=facts["retest_skipped"])
    if guard_result is not None:  # the same guard set and paired statistics as a grpogate run
        evidence["guard"] = guard_result
    return decided(evidence, config, seconds["total"])


def foreign_facts(evidence: dict) -> dict:
    """The facts of a stored foreign evidence document, as `assemble_foreign_evidence` takes
    them (what the audit cannot recompute and so takes as recorded)."""
    timings, comparison = evidence["timings"], evidence["comparison"]
    return {"run_label": evidence["run_label"], "created": evidence["created"],
            "environment": evidence["environment"], "inputs": evidence["inputs"],
            "foreign": evidence["foreign"], "contract": evidence["contract"],
            "seconds": {"load": timings["load_seconds"], "evaluation": timings["evaluation_seconds"],
                        "total": timings["total_seconds"]},
            "retest_verifier_errors": comparison["verifier_errors"],
            "retest_skipped": comparison.get("skipped") is True,
            "resources": evidence["resources"], "artifact": evidence["artifact"]}
