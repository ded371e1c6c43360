"""Validation: every invariant of a configuration, checked up front, each message saying how to
fix it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from grpogate.config.schema import (BUILT_IN_REWARDS, DTYPES, IMPORTANCE_SAMPLING_LEVELS,
                                    MAX_RETEST_LOOKS,
                                    KL_ESTIMATORS, LOSS_TYPES, LR_SCHEDULER_TYPES,
                                    MAX_BATCH_ROWS, MAX_EVAL_PROMPTS, MAX_GENERATION_ROUNDS,
                                    MAX_GROUP_SIZE, MAX_ITERATIONS, MAX_STEPS, MAX_TOKENS,
                                    MAX_TRAIN_PROMPTS,
                                    MAX_REWARD_VALUE, MAX_REWARD_WEIGHT,
                                    MULTI_OBJECTIVE_AGGREGATIONS, REPORTERS, ROLLOUT_CORRECTIONS,
                                    SCALE_REWARDS, TASK_SOURCES, DATASET_VERIFIERS,
                                    USER_REWARD_PATH, RunConfig, flatten)
from grpogate.errors import InputError
from grpogate.config.adapter_patterns import ALL_LINEAR, MAX_NAME_CHARS, plain_targets
from grpogate.gates import validate_gates


SEED_LIMIT = 2**32


def _leaves(config: RunConfig) -> list[tuple[str, Any]]:
    """(dotted name, value) of every plain field, nested tables flattened (task.params kept)."""
    return [(name, value) for name, value in flatten(config.to_dict()).items()]


# What each annotated field type takes: a RunConfig built or changed in code (the Python API)
# is checked against its schema before any other rule compares or uses a value. A float field
# takes an int (1 and 1.0 are the same learning rate); an int field never takes a float or a
# bool (2.5 tokens is no budget, and True is not a count).
_TYPE_RULES = {
    "int": ("a whole number (int)", lambda v: type(v) is int),
    "float": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "bool": ("true or false (bool)", lambda v: isinstance(v, bool)),
    "dict": ("a table (dict)", lambda v: isinstance(v, dict)),
    "list": ("a list", lambda v: isinstance(v, list)),
}


def type_words(type_name: str) -> str:
    """What a field of this annotated type takes, in words: "int" -> "a whole number (int)"."""
    return _TYPE_RULES.get(type_name, (type_name, None))[0]


def check_types(node, prefix: str = "") -> None:
    """InputError naming the first field of `node` (a RunConfig or one of its tables) whose
    value is not of its schema's type; a table's fields are checked in turn."""
    for spec in dataclasses.fields(node):
        value, name = getattr(node, spec.name), f"{prefix}{spec.name}"
        table = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(table):
            if type(value) is not type(table):
                raise InputError(f"config: {name} must be a table of {type(table).__name__} "
                                 f"keys (got {value!r})")
            check_types(value, f"{name}.")
            continue
        what, fits = _TYPE_RULES.get(spec.type, ("", lambda v: True))  # others: their own rules
        if not fits(value):
            raise InputError(f"config: {name} must be {what} (got {value!r})")


def validate(config: RunConfig) -> RunConfig:
    """Raise InputError with a how-to-fix message for the first broken invariant."""

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise InputError(f"config: {message}")

    check_types(config)
    check_bounds(config)
    for name, value in _leaves(config):
        need(not isinstance(value, float) or math.isfinite(value),
             f"{name} must be a finite number (got {value!r})")
    for name, value in (("seed", config.seed), ("task.train_seed", config.task.train_seed),
                        ("task.eval_seed", config.task.eval_seed), ("guard.seed", config.guard.seed)):
        # torch's generators take a 64-bit seed and the re-test adds an offset: 0 .. 2**32 - 1.
        need(0 <= value < SEED_LIMIT, f"{name} must be in [0, {SEED_LIMIT - 1}] (got {value})")
    need(label_is_a_name(config.label), f"label {config.label!r} must be a name (no / or \\, "
         "not . or ..): the run directory is runs/LABEL; use --out DIR for a path")
    _validate_lora(config, need)
    need(config.group_size >= 2, f"group_size must be >= 2 (got {config.group_size}): "
         "a group-relative advantage needs at least two completions per prompt")
    need(config.eval_group_size >= 1, "eval_group_size must be >= 1")
    need(config.train_prompts >= 1 and config.eval_prompts >= 1,
         "train_prompts and eval_prompts must be >= 1")
    _validate_looks(config, need)
    need(config.prompts_per_step >= 1, "prompts_per_step must be >= 1")
    need(config.train_prompts % config.prompts_per_step == 0,
         f"train_prompts ({config.train_prompts}) must be divisible by prompts_per_step "
         f"({config.prompts_per_step})")
    need(config.max_new_tokens >= 1 and config.max_prompt_tokens >= 8,
         "max_new_tokens must be >= 1 and max_prompt_tokens >= 8")
    _validate_sampling(config, need)
    _validate_rewards(config, need)
    need(config.generation_batch_size >= 1 and config.micro_batch_size >= 1,
         "generation_batch_size and micro_batch_size must be >= 1")
    need(config.groups_per_update >= 0, "groups_per_update must be >= 0 (0 = all valid groups)")
    for name in ("learning_rate", "epsilon", "epsilon_high", "delta", "beta", "max_grad_norm",
                 "weight_decay", "rollout_correction_cap"):
        value = getattr(config, name)
        need(isinstance(value, (int, float)) and math.isfinite(value) and value >= 0,
             f"{name} must be a finite number >= 0 (got {value!r})")
    need(config.learning_rate > 0 and config.epsilon > 0, "learning_rate and epsilon must be > 0")
    need(config.max_grad_norm > 0, f"max_grad_norm must be > 0 (got {config.max_grad_norm!r}): "
         "0 would scale every gradient to zero while optimizer steps are still counted")
    _validate_objective(config, need)
    need(config.dtype in DTYPES, f"dtype must be one of {DTYPES} (got {config.dtype!r})")
    need(config.device in ("auto", "cpu", "cuda"), "device must be auto, cpu or cuda")
    _validate_task(config.task, need)
    unknown = [name for name in config.report_to if name not in REPORTERS]
    need(not unknown, f"report_to: unknown tracker {', '.join(map(repr, unknown))}; known: "
         f"{', '.join(REPORTERS)} (comma-separated, or none)")
    _validate_guard(config, need)
    need(not (config.baseline_manifest and config.adapter),
         "give either baseline_manifest or adapter, not both (the manifest names its adapter)")
    validate_gates(dataclasses.asdict(config.gates))
    return config


def _bounded_counts(config: RunConfig) -> list[tuple[str, int, str, int]]:
    """(key, value, cap's name, cap) of every count that sizes the work of a run."""
    return [
        # steps = train_prompts // prompts_per_step; a prompts_per_step < 1 is refused below
        ("steps", config.steps if config.prompts_per_step >= 1 else 0, "MAX_STEPS", MAX_STEPS),
        ("train_prompts", config.train_prompts, "MAX_TRAIN_PROMPTS", MAX_TRAIN_PROMPTS),
        ("eval_prompts", config.eval_prompts, "MAX_EVAL_PROMPTS", MAX_EVAL_PROMPTS),
        ("guard.prompts", config.guard.prompts, "MAX_EVAL_PROMPTS", MAX_EVAL_PROMPTS),
        ("eval_batch_prompts", config.eval_batch_prompts, "MAX_EVAL_PROMPTS", MAX_EVAL_PROMPTS),
        ("task.eval_pool", config.task.eval_pool, "MAX_EVAL_PROMPTS", MAX_EVAL_PROMPTS),
        ("guard.rounds", config.guard.rounds, "MAX_RETEST_LOOKS", MAX_RETEST_LOOKS),
        ("prompts_per_step", config.prompts_per_step, "MAX_EVAL_PROMPTS", MAX_EVAL_PROMPTS),
        ("group_size", config.group_size, "MAX_GROUP_SIZE", MAX_GROUP_SIZE),
        ("eval_group_size", config.eval_group_size, "MAX_GROUP_SIZE", MAX_GROUP_SIZE),
        ("guard.group_size", config.guard.group_size, "MAX_GROUP_SIZE", MAX_GROUP_SIZE),
        ("max_new_tokens", config.max_new_tokens, "MAX_TOKENS", MAX_TOKENS),
        ("max_prompt_tokens", config.max_prompt_tokens, "MAX_TOKENS", MAX_TOKENS),
        ("generation_batch_size", config.generation_batch_size, "MAX_BATCH_ROWS", MAX_BATCH_ROWS),
        ("micro_batch_size", config.micro_batch_size, "MAX_BATCH_ROWS", MAX_BATCH_ROWS),
        ("max_generation_rounds", config.max_generation_rounds, "MAX_GENERATION_ROUNDS",
         MAX_GENERATION_ROUNDS),
        ("num_iterations", config.num_iterations, "MAX_ITERATIONS", MAX_ITERATIONS),
    ]


def check_bounds(config: RunConfig) -> None:
    """InputError naming the first count above its maximum (config/schema.py): checked before
    anything else reads a count, so no problem is generated and no file read for a run that
    asks for more than any run may."""
    for key, value, cap_name, cap in _bounded_counts(config):
        if value > cap:
            raise InputError(f"config: {key} must be at most {cap:,} ({cap_name}; got "
                             f"{value:,})")


def _validate_lora(config: RunConfig, need) -> None:
    need(config.lora_r >= 1 and config.lora_alpha > 0, "lora_r must be >= 1 and lora_alpha > 0")
    need(0 <= config.lora_dropout < 1, f"lora_dropout must be in [0, 1) (got {config.lora_dropout})")
    need(plain_targets(config.lora_target_modules), f"lora_target_modules must be "
         f"\"{ALL_LINEAR}\" or a comma list of module names (letters, digits, _ and ., at "
         f"most {MAX_NAME_CHARS} each), never a pattern (got {config.lora_target_modules!r})")


def _validate_task(task, need) -> None:
    need(task.source in TASK_SOURCES,
         f"task.source must be one of {', '.join(TASK_SOURCES)} (got {task.source!r})")
    need(task.source != "gsm8k" or bool(task.path),
         "task.path is required for gsm8k: a directory with train.jsonl/test.jsonl, a .jsonl file "
         "or a Hugging Face dataset id")
    _validate_dataset_task(task, need)


def label_is_a_name(label: str) -> bool:
    """A run label names one directory under runs/: "" (the default), or no separator, no
    NUL, not "." or ".." (an absolute path has a separator)."""
    return not label or (label not in (".", "..") and not any(c in label for c in "/\\\0"))


def _validate_objective(config: RunConfig, need) -> None:
    """The objective's and the optimizer's knobs: known names, and bounds that keep the clip
    and the learning-rate schedule meaningful."""
    for name, known in (("loss_type", LOSS_TYPES),
                        ("importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS),
                        ("kl_estimator", KL_ESTIMATORS), ("scale_rewards", SCALE_REWARDS),
                        ("rollout_correction", ROLLOUT_CORRECTIONS)):
        value = getattr(config, name)
        need(value in known, f"{name} must be one of {', '.join(known)} (got {value!r})")
    need(config.epsilon < 1, f"epsilon must be < 1 (got {config.epsilon}): the lower clip bound "
         "is 1 - epsilon")
    need(config.delta == 0 or config.delta > 1 + config.resolved_epsilon_high(),
         f"delta must be 0 (off) or > 1 + epsilon_high = {1 + config.resolved_epsilon_high()} "
         f"(got {config.delta}): it caps the ratio above the clip range")
    need(config.lr_scheduler_type in LR_SCHEDULER_TYPES,
         f"lr_scheduler_type must be one of {', '.join(LR_SCHEDULER_TYPES)} "
         f"(got {config.lr_scheduler_type!r})")
    need(isinstance(config.warmup_ratio, (int, float)) and 0 <= config.warmup_ratio < 1,
         f"warmup_ratio must be in [0, 1) (got {config.warmup_ratio!r}): a run all warmup never "
         "trains at its learning_rate")
    need(config.num_iterations >= 1, f"num_iterations must be >= 1 (got {config.num_iterations})")
    need(0 < config.top_entropy_quantile <= 1,
         f"top_entropy_quantile must be in (0, 1] (got {config.top_entropy_quantile}); 1 trains "
         "on every token, 0.2 on the top 20 % by entropy")
    need(config.rollout_correction == "none" or config.rollout_correction_cap >= 1,
         f"rollout_correction_cap must be >= 1 (got {config.rollout_correction_cap}): it caps "
         "pi_old / pi_sampler, which is 1 when they agree")


def _validate_rewards(config: RunConfig, need) -> None:
    """Each entry {name, weight}: a built-in name or `module:function`, a finite weight, names
    unique; the overlong punishment needs a buffer inside the token budget."""
    fix = ('write rewards = [{name = "correctness", weight = 1.0}, {name = "format", '
           'weight = 0.5}]')
    names = []
    for index, entry in enumerate(config.rewards):
        where = f"rewards[{index}]"
        need(isinstance(entry, dict) and set(entry) <= {"name", "weight"} and "name" in entry,
             f"{where} must be a table with keys name and weight (got {entry!r}); {fix}")
        name, weight = entry["name"], entry.get("weight", 1.0)
        need(isinstance(name, str) and (name in BUILT_IN_REWARDS or bool(USER_REWARD_PATH.fullmatch(name))),
             f"{where}.name {name!r} is neither one of {BUILT_IN_REWARDS} nor a "
             "'module:function' path")
        need(isinstance(weight, (int, float)) and not isinstance(weight, bool)
             and math.isfinite(weight), f"{where}.weight must be a finite number (got {weight!r})")
        need(abs(weight) <= MAX_REWARD_WEIGHT, f"{where}.weight must be within "
             f"+-{MAX_REWARD_WEIGHT:g} (got {weight!r}) so that reward totals stay finite")
        need(name not in names, f"{where}.name {name!r} appears twice")
        names.append(name)
        entry.setdefault("weight", 1.0)
        entry["weight"] = float(entry["weight"])
    need(config.multi_objective_aggregation in MULTI_OBJECTIVE_AGGREGATIONS,
         f"multi_objective_aggregation must be one of {MULTI_OBJECTIVE_AGGREGATIONS} "
         f"(got {config.multi_objective_aggregation!r})")
    if "overlong" in names:
        need(0 < config.overlong_buffer_len <= config.max_new_tokens,
             f"overlong_buffer_len must be in [1, max_new_tokens={config.max_new_tokens}] "
             f"(got {config.overlong_buffer_len})")
    need(math.isfinite(config.overlong_penalty_factor)
         and 0 <= config.overlong_penalty_factor <= MAX_REWARD_VALUE,
         f"overlong_penalty_factor must be a number in [0, {MAX_REWARD_VALUE:g}] (a component's "
         "value bound, so that reward totals stay finite)")
    need(math.isfinite(config.reward_time_limit_seconds) and config.reward_time_limit_seconds > 0,
         "reward_time_limit_seconds must be a finite number > 0")


def _validate_sampling(config: RunConfig, need) -> None:
    """The sampler's knobs: a real distribution to draw groups from."""
    need(config.temperature > 0, "temperature must be > 0 (GRPO samples; greedy groups have no variance)")
    need(0 < config.top_p <= 1, "top_p must be in (0, 1]")
    need(config.top_k >= 0, f"top_k must be >= 0 (0 = off; got {config.top_k})")
    need(math.isfinite(config.min_p) and 0 <= config.min_p < 1,
         f"min_p must be in [0, 1) (0 = off; got {config.min_p})")
    need(config.max_generation_rounds >= 1,
         f"max_generation_rounds must be >= 1 (got {config.max_generation_rounds})")


def _validate_looks(config: RunConfig, need) -> None:
    """The sequential re-test's batches, pool and number of looks."""
    need(config.eval_batch_prompts >= 1, f"eval_batch_prompts must be >= 1 (got "
         f"{config.eval_batch_prompts}): the re-test's prompts per look")
    looks = -(-config.eval_prompts // config.eval_batch_prompts) + config.guard.rounds
    need(looks <= MAX_RETEST_LOOKS,
         f"the re-test may take at most {MAX_RETEST_LOOKS} looks: raise eval_batch_prompts or "
         f"lower guard.rounds (eval_prompts {config.eval_prompts}, eval_batch_prompts "
         f"{config.eval_batch_prompts}, guard.rounds {config.guard.rounds})")
    need(config.task.eval_pool == 0 or config.task.eval_pool >= config.eval_prompts,
         f"task.eval_pool ({config.task.eval_pool}) must be 0 or >= eval_prompts "
         f"({config.eval_prompts}): the eval prompts are drawn from it")


def _validate_guard(config: RunConfig, need) -> None:
    """The re-test's guard set: a size, and a task to draw it from when it is on."""
    need(config.guard.prompts >= 0 and config.guard.group_size >= 1,
         f"guard.prompts must be >= 0 (0 = off; got {config.guard.prompts}) and "
         f"guard.group_size >= 1 (got {config.guard.group_size})")
    need(not config.guard.enabled or bool(config.guard.task),
         "guard.task must name a reasoning-gym dataset (e.g. chain_sum), or set guard.prompts = 0")
    if not config.guard.enabled:
        return
    need(config.guard.rounds >= 1, f"guard.rounds must be >= 1 (got {config.guard.rounds}): "
         "the most rounds of guard samples the sequential re-test takes")
    loss = config.gates.maximum_guard_reward_loss
    need(not config.gates.require_significant_gain or 0 < loss < 1,
         f"gates.maximum_guard_reward_loss must be in (0, 1) with the guard on (got {loss!r}): "
         "the guard shows non-inferiority within this margin, and no re-test can show a loss "
         "of exactly 0 is absent; set guard.prompts = 0 to turn the guard off")


def _validate_dataset_task(task, need) -> None:
    """A dataset task's table, columns and verifier; the table bounds of any task (gate
    --train-data reads a table under them whatever the task)."""
    for name in ("max_table_bytes", "max_table_rows", "max_cell_chars", "max_nesting_depth"):
        value = getattr(task, name)
        need(type(value) is int and value >= 1, f"task.{name} must be a whole number >= 1 "
             f"(got {value!r})")
    if task.source != "dataset":
        return
    need(bool(task.path), "task.path is required for a dataset task: a parquet, JSONL, CSV or "
         "Arrow file, a save_to_disk folder or a hub dataset id")
    for name in ("prompt_field", "reference_field"):
        value = getattr(task, name)
        need(bool(value) and all(value.split(".")), f"task.{name} must name a column (a dotted "
             f"path for a nested one; got {value!r})")
    need(task.verifier in ("", *DATASET_VERIFIERS), f"task.verifier must be one of "
         f"{', '.join(DATASET_VERIFIERS)} (got {task.verifier!r}); a reward function of your own "
         "goes in rewards as module:function")
