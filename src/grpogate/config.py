"""The typed run configuration: one dataclass tree, loaded from a profile, a TOML file and overrides.

Precedence, lowest first: the dataclass defaults (the `default` profile), a packaged profile
(`--profile smoke`), a user TOML file (`--config FILE`), then `--set key=value` overrides and the
CLI's named flags. `validate()` checks every invariant up front and says how to fix it.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from grpogate.errors import InputError
from grpogate.files import read_json

BUNDLED_MODEL = "bundled:SmolLM2-135M-Instruct"

# Chosen (before any training run) so that the bundled SmolLM2 baseline lands inside the
# 10-60 % band where GRPO has signal: measured on the 48 default eval prompts x 4 samples,
# the bare instruction at temperature 1.0 scored 0.089; this prompt at 0.7 scored 0.25.
CHAIN_SUM_SYSTEM_PROMPT = (
    "You are a careful calculator. Reply with the result only, on one line of the form "
    "'Answer: <number>'. Example: for '2 + 3 =' reply 'Answer: 5'."
)
GSM8K_SYSTEM_PROMPT = (
    "Solve the math word problem step by step. End your reply with the final numeric answer "
    "on its own line."
)


@dataclass
class TaskConfig:
    """Where problems come from. Train and eval sets are chosen separately (split or seed)."""

    source: str = "reasoning-gym"  # "reasoning-gym" or "gsm8k"
    name: str = "chain_sum"  # reasoning-gym dataset name
    params: dict = field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
    )
    path: str = ""  # gsm8k: a directory with train/test.jsonl, one .jsonl file, or an HF dataset id
    train_split: str = "train"
    eval_split: str = "test"
    train_seed: int = 1  # reasoning-gym generation seed; for gsm8k the row-sampling seed
    eval_seed: int = 2


@dataclass
class Gates:
    """Delivery gates (docs/design.md §6). Minimums and maximums are inclusive."""

    minimum_valid_group_ratio: float = 0.20
    # 0.5 effective trajectories/s on the 2-core CPU default; the GPU reference profile asks 1.0.
    minimum_effective_trajectories_per_second: float = 0.5
    minimum_update_count: float = 1
    minimum_reward_gain: float = 0.0
    minimum_pass_at_group_gain: float = 0.0
    maximum_max_length_hit_ratio: float = 0.50
    maximum_peak_allocated_bytes: float = 10 * 1024**3
    # true (the default profile, docs/design.md §6): the reward and pass_at_group gates must be
    # cleared by the 95 % paired bootstrap interval's lower bound, so `accept` means a gain the
    # re-test resolves; false reads the point estimate (the reference profile's published
    # gates, gsm8k_qwen05b.toml).
    require_significant_gain: bool = True


@dataclass
class RunConfig:
    label: str = ""  # names the run directory runs/<label>; empty -> "<profile>-<timestamp>"
    out: str = ""  # explicit run directory; overrides runs/<label>
    profile: str = "default"

    # Baseline policy
    model: str = BUNDLED_MODEL  # bundled GGUF, HF model dir, .gguf file, or HF id (online)
    model_revision: str = ""
    adapter: str = ""  # optional baseline LoRA adapter (PEFT directory)
    baseline_manifest: str = ""  # alternative to model/adapter: a manifest JSON with decision accept
    cache_dir: str = ""  # dequantized GGUF cache; empty -> $GRPOGATE_CACHE or ~/.cache/grpogate
    # "auto": bfloat16 base weights where the hardware computes bf16 natively (CUDA, avx512_bf16),
    # else float32. LoRA weights and the loss stay float32 either way.
    dtype: str = "auto"
    device: str = "auto"  # "auto" | "cpu" | "cuda"

    # Problems and verifier
    task: TaskConfig = field(default_factory=TaskConfig)
    verifier: str = ""  # empty -> derived from the task
    system_prompt: str = ""  # empty -> derived from the task
    train_prompts: int = 128
    eval_prompts: int = 48

    # Rollout
    group_size: int = 8
    eval_group_size: int = 4
    prompts_per_step: int = 8
    max_prompt_tokens: int = 192
    max_new_tokens: int = 48
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0  # keep the k most likely tokens; 0: off
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability; 0: off
    generation_batch_size: int = 64
    # DAPO dynamic sampling: while a step has fewer valid groups than prompts_per_step, draw
    # the shortfall of new train prompts, up to max_generation_rounds rounds of generation.
    dynamic_sampling: bool = False
    max_generation_rounds: int = 3

    # Rewards: [{name, weight}, ...] of "correctness", "format", "overlong" or "module:function";
    # empty: correctness alone. The decision reads correctness alone whatever is trained on.
    rewards: list = field(default_factory=list)
    multi_objective_aggregation: str = "sum_then_normalize"  # or "normalize_then_sum" (GDPO)
    overlong_buffer_len: int = 16  # DAPO soft overlong punishment: the last N tokens of the budget
    overlong_penalty_factor: float = 1.0
    reward_time_limit_seconds: float = 1.0  # per call of a user `module:function` reward

    # Update
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: str = "all-linear"
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    # The objective, named as TRL's GRPOConfig names it (training/objectives.py has the maths).
    # grpo: token mean per sequence, then mean over sequences (DeepSeekMath); bnpo: token mean
    # per micro-batch; dapo: token mean over the optimizer step; dr_grpo: token sum over
    # sequences x max_new_tokens; cispo: clipped detached weight x log-prob (MiniMax-M1).
    loss_type: str = "grpo"
    importance_sampling_level: str = "token"  # "sequence": GSPO's length-normalized ratio
    epsilon: float = 0.2  # lower clip: ratio >= 1 - epsilon
    epsilon_high: float = 0.0  # upper clip 1 + epsilon_high (DAPO: 0.28); 0 -> epsilon
    delta: float = 0.0  # dual clip: the unclipped ratio capped at delta (> 1 + epsilon_high); 0 -> off
    beta: float = 0.02  # KL coefficient; 0 -> no reference forward at all
    kl_estimator: str = "k3"  # k1, k2 or k3 (Schulman 2020)
    scale_rewards: str = "group"  # advantage std: group, batch or none (Dr. GRPO)
    num_iterations: int = 1  # optimizer passes over each rollout (mu)
    top_entropy_quantile: float = 1.0  # train on the top fraction of tokens by entropy; 1 -> all
    # Truncated importance sampling for the sampler-trainer mismatch: none, token_tis or
    # sequence_mask, with the cap on pi_old / pi_sampler.
    rollout_correction: str = "none"
    rollout_correction_cap: float = 2.0
    max_grad_norm: float = 1.0  # gradient-norm clip, > 0
    groups_per_update: int = 0  # valid groups per optimizer step; 0 -> all valid groups of a step
    micro_batch_size: int = 16  # sequences per forward/backward
    # Completions that hit max_new_tokens add no loss (their group's advantages still count them).
    mask_truncated_completions: bool = False

    seed: int = 42
    # Directory for TensorBoard event files of the per-step scalars; empty: none written
    # (unless report_to names tensorboard: then <run dir>/tensorboard).
    tensorboard: str = ""
    report_to: list = field(default_factory=list)  # TRL's name; see REPORTERS
    gates: Gates = field(default_factory=Gates)

    @property
    def steps(self) -> int:
        return step_count(self.train_prompts, self.prompts_per_step)

    def resolved_verifier(self) -> str:
        if self.verifier:
            return self.verifier
        if self.task.source == "gsm8k":
            return "gsm8k-final-number-v1"
        return f"reasoning-gym/{self.task.name}"

    def resolved_system_prompt(self) -> str:
        if self.system_prompt:
            return self.system_prompt
        return GSM8K_SYSTEM_PROMPT if self.task.source == "gsm8k" else CHAIN_SUM_SYSTEM_PROMPT

    def resolved_epsilon_high(self) -> float:
        return self.epsilon_high or self.epsilon

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def step_count(train_prompts: int, prompts_per_step: int) -> int:
    """Training steps: whole steps of prompts (a remainder is not trained on)."""
    return train_prompts // prompts_per_step


MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
BUILT_IN_REWARDS = ("correctness", "format", "overlong")  # inputs/rewards.py implements them
USER_REWARD_PATH = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*", re.ASCII)
# Bounds that keep every reward total finite in float64: a component's value within +-1e6 (a user
# function's beyond it scores 0 and is counted) times a weight within +-1e6 is at most 1e12, a
# total over a few components ~1e13, its square in a group variance ~1e26 -- far from 1.8e308.
# Nothing useful lies beyond: a weight 1e6 times another already drowns the smaller component
# below float32's 7 significant digits, where the update computes.
MAX_REWARD_WEIGHT = 1e6
MAX_REWARD_VALUE = 1e6


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


SEED_LIMIT = 2**32


def _leaves(config: RunConfig) -> list[tuple[str, Any]]:
    """(dotted name, value) of every plain field, nested tables flattened (task.params kept)."""
    return [(name, value) for name, value in flatten(config.to_dict()).items()]


REPORTERS = ("tensorboard", "mlflow", "wandb", "trackio")  # report_to values, as TRL names them
# Knobs renamed to TRL's names: a config using the old one is told the new one.
RENAMED_KEYS = {"clip_epsilon": "epsilon", "kl_coef": "beta",
                "loss_aggregation": "loss_type (sequence_mean -> grpo, token_mean -> dapo)"}
LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo", "cispo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
SCALE_REWARDS = ("group", "batch", "none")
ROLLOUT_CORRECTIONS = ("none", "token_tis", "sequence_mask")
DTYPES = ("float32", "bfloat16", "auto")


def validate(config: RunConfig) -> RunConfig:
    """Raise InputError with a how-to-fix message for the first broken invariant."""

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise InputError(f"config: {message}")

    for name, value in _leaves(config):
        need(not isinstance(value, float) or math.isfinite(value),
             f"{name} must be a finite number (got {value!r})")
    for name, value in (("seed", config.seed), ("task.train_seed", config.task.train_seed),
                        ("task.eval_seed", config.task.eval_seed)):
        # torch's generators take a 64-bit seed and the re-test adds an offset: 0 .. 2**32 - 1.
        need(0 <= value < SEED_LIMIT, f"{name} must be in [0, {SEED_LIMIT - 1}] (got {value})")
    need(label_is_a_name(config.label), f"label {config.label!r} must be a name (no / or \\, "
         "not . or ..): the run directory is runs/LABEL; use --out DIR for a path")
    need(0 <= config.lora_dropout < 1, f"lora_dropout must be in [0, 1) (got {config.lora_dropout})")
    need(config.group_size >= 2, f"group_size must be >= 2 (got {config.group_size}): "
         "a group-relative advantage needs at least two completions per prompt")
    need(config.eval_group_size >= 1, "eval_group_size must be >= 1")
    need(config.train_prompts >= 1 and config.eval_prompts >= 1,
         "train_prompts and eval_prompts must be >= 1")
    need(config.prompts_per_step >= 1, "prompts_per_step must be >= 1")
    need(config.train_prompts % config.prompts_per_step == 0,
         f"train_prompts ({config.train_prompts}) must be divisible by prompts_per_step "
         f"({config.prompts_per_step})")
    need(config.max_new_tokens >= 1 and config.max_prompt_tokens >= 8,
         "max_new_tokens must be >= 1 and max_prompt_tokens >= 8")
    need(config.temperature > 0, "temperature must be > 0 (GRPO samples; greedy groups have no variance)")
    need(0 < config.top_p <= 1, "top_p must be in (0, 1]")
    need(config.top_k >= 0, f"top_k must be >= 0 (0 = off; got {config.top_k})")
    need(math.isfinite(config.min_p) and 0 <= config.min_p < 1,
         f"min_p must be in [0, 1) (0 = off; got {config.min_p})")
    need(config.max_generation_rounds >= 1,
         f"max_generation_rounds must be >= 1 (got {config.max_generation_rounds})")
    _validate_rewards(config, need)
    need(config.generation_batch_size >= 1 and config.micro_batch_size >= 1,
         "generation_batch_size and micro_batch_size must be >= 1")
    need(config.groups_per_update >= 0, "groups_per_update must be >= 0 (0 = all valid groups)")
    need(config.lora_r >= 1 and config.lora_alpha > 0, "lora_r must be >= 1 and lora_alpha > 0")
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
    need(config.task.source in ("reasoning-gym", "gsm8k"),
         f"task.source must be 'reasoning-gym' or 'gsm8k' (got {config.task.source!r})")
    need(config.task.source != "gsm8k" or bool(config.task.path),
         "task.path is required for gsm8k: a directory with train.jsonl/test.jsonl, a .jsonl file "
         "or a Hugging Face dataset id")
    unknown = [name for name in config.report_to if name not in REPORTERS]
    need(not unknown, f"report_to: unknown tracker {', '.join(map(repr, unknown))}; known: "
         f"{', '.join(REPORTERS)} (comma-separated, or none)")
    need(not (config.baseline_manifest and config.adapter),
         "give either baseline_manifest or adapter, not both (the manifest names its adapter)")
    from grpogate.gates import validate_gates

    validate_gates(dataclasses.asdict(config.gates))
    return config


def label_is_a_name(label: str) -> bool:
    """A run label names one directory under runs/: "" (the default), or no separator, no
    NUL, not "." or ".." (an absolute path has a separator)."""
    return not label or (label not in (".", "..") and not any(c in label for c in "/\\\0"))


def _validate_objective(config: RunConfig, need) -> None:
    """The objective's knobs: known names, and bounds that keep the clip meaningful."""
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
    need(config.num_iterations >= 1, f"num_iterations must be >= 1 (got {config.num_iterations})")
    need(0 < config.top_entropy_quantile <= 1,
         f"top_entropy_quantile must be in (0, 1] (got {config.top_entropy_quantile}); 1 trains "
         "on every token, 0.2 on the top 20 % by entropy")
    need(config.rollout_correction == "none" or config.rollout_correction_cap >= 1,
         f"rollout_correction_cap must be >= 1 (got {config.rollout_correction_cap}): it caps "
         "pi_old / pi_sampler, which is 1 when they agree")


# --- loading -------------------------------------------------------------------------------


def available_profiles() -> list[str]:
    packaged = resources.files("grpogate") / "profiles"
    return ["default"] + sorted(p.name[:-5] for p in packaged.iterdir() if p.name.endswith(".toml"))


def _profile_document(name: str) -> dict:
    if name == "default":
        return {}
    # A profile is a packaged name, never a path: "../../x" is looked up, not joined (a file
    # of one's own goes through --config FILE).
    if name not in available_profiles():
        raise InputError(f"unknown profile {name!r}; known: {', '.join(available_profiles())} "
                         "(a TOML file of your own: --config FILE)")
    path = resources.files("grpogate") / "profiles" / f"{name}.toml"
    return tomllib.loads(path.read_text(encoding="utf-8"))


def _profile_table(name: str) -> dict:
    """The profile's settings; its `note` is what it is for, not a setting."""
    return {k: v for k, v in _profile_document(name).items() if k != PROFILE_NOTE_KEY}


PROFILE_NOTE_KEY = "note"


def profile_note(name: str) -> str:
    """What a packaged profile is for, as its TOML's `note` says (the run's output and the
    report show it); "" for the default, a profile without one, or one no longer packaged."""
    if name not in available_profiles():
        return ""
    note = _profile_document(name).get(PROFILE_NOTE_KEY, "")
    return note if isinstance(note, str) else ""


def _read_toml(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise InputError(f"{path}: no such config file")
    try:
        return tomllib.loads(file.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"{path}: not valid TOML: {error}") from None
    except RecursionError:  # tomllib recurses per nested array or table: the stack unwinds
        raise InputError(f"{path}: not valid TOML: arrays or tables nested deeper than any "
                         "config (Python's recursion limit)") from None


def _read_gates_file(path: str) -> dict:
    """A gates file: TOML (or JSON, by its .json suffix) holding a [gates] table."""
    file = Path(path)
    if not file.is_file():
        raise InputError(f"{path}: no such gates file")
    if file.suffix == ".json":
        document = read_json(file)
    else:
        document = _read_toml(path)
    table = document.get("gates") if isinstance(document, dict) else None
    if not isinstance(table, dict) or set(document) != {"gates"}:
        raise InputError(f"{path}: a gates file holds exactly one table, [gates] "
                         "(JSON: {\"gates\": {...}})")
    from grpogate.gates import GATE_NAMES, SWITCH_GATE_NAMES

    for name in table:
        if name not in GATE_NAMES + SWITCH_GATE_NAMES:
            raise InputError(f"{path}: unknown gate {name!r} in [gates]; known gates: "
                             f"{', '.join(GATE_NAMES + SWITCH_GATE_NAMES)}")
    return table


def _check_gates(config: RunConfig, where: str) -> None:
    """Validate the gates right after a source set them, so the error names that source."""
    from grpogate.gates import validate_gates

    try:
        validate_gates(dataclasses.asdict(config.gates))
    except InputError as error:
        raise InputError(f"{where}: {error}") from None


def _apply(target: Any, table: dict, where: str) -> None:
    """Copy a (nested) table onto a dataclass, rejecting unknown keys and wrong types."""
    known = {f.name: f for f in fields(target)}
    for key, value in table.items():
        if key not in known and key in RENAMED_KEYS and "epsilon" in known:
            raise InputError(f"{where}: {key!r} was renamed to {RENAMED_KEYS[key]}, TRL's name")
        if key not in known:
            raise InputError(f"{where}: unknown key {key!r}; known: {', '.join(sorted(known))}")
        current = getattr(target, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise InputError(f"{where}: {key!r} must be a table")
            _apply(current, value, f"{where}.{key}")
            continue
        setattr(target, key, _coerce(current, value, f"{where}.{key}"))


def _coerce(current: Any, value: Any, where: str) -> Any:
    if isinstance(current, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif isinstance(current, int) and not isinstance(value, bool):
        if isinstance(value, int):
            return value
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(f"{where}: must be a finite number, got {value!r}")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif isinstance(current, float) and not isinstance(value, bool):
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif isinstance(current, str) and isinstance(value, (str, int, float)):
        return str(value)
    elif isinstance(current, dict) and isinstance(value, dict):
        return dict(value)
    elif isinstance(current, list) and isinstance(value, (str, list)):
        # report_to: "a,b" on the command line; rewards: a TOML array of tables.
        if isinstance(value, str):
            return [n.strip() for n in value.split(",") if n.strip() and n.strip() != "none"]
        return [dict(item) if isinstance(item, dict) else item for item in value]
    raise InputError(f"{where}: expected {type(current).__name__}, got {value!r}")


def parse_override(text: str) -> tuple[list[str], Any]:
    """`task.params.max_digits=3` -> (["task", "params", "max_digits"], 3); values parse as TOML."""
    if "=" not in text:
        raise InputError(f"--set {text!r}: expected key=value")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare strings need no quotes on the command line
    return key.strip().split("."), value


def load_config(profile: str = "default", config_file: str = "", overrides: list[str] = (),
                gates_file: str = "", **named: Any) -> RunConfig:
    """Build and validate a RunConfig. `named` holds CLI flags (None = not given)."""
    config = RunConfig()
    _apply(config, _profile_table(profile), f"profile {profile}")
    config.profile = profile
    _apply_sources(config, config_file, gates_file, overrides, named)
    return validate(config)


def _apply_sources(config: RunConfig, config_file: str, gates_file: str, overrides,
                   named: dict) -> None:
    """Apply, in precedence order: the config file, the gates file, the --task flag, --set
    overrides, the other flags. `steps` (from any of them, the last wins) is applied at the end:
    it sets train_prompts = steps x prompts_per_step, whatever order the two were given in."""
    named = dict(named)
    steps, task_flag = named.pop("steps", None), named.pop("task", None)
    if config_file:
        table = dict(_read_toml(config_file))
        steps = table.pop("steps", steps)
        gives_params = isinstance(table.get("task"), dict) and "params" in table["task"]
        _switching_task(config, lambda: _apply(config, table, config_file), gives_params)
        if "gates" in table:
            _check_gates(config, config_file)
    if gates_file:
        _apply(config.gates, _read_gates_file(gates_file), f"{gates_file} [gates]")
        _check_gates(config, gates_file)
    if task_flag is not None:
        _switching_task(config, lambda: _apply(config.task, task_flag, "--task"), False)
    for text in overrides:
        keys, value = parse_override(text)
        if keys == ["steps"]:
            steps = value
            continue
        table: dict = {}
        cursor = table
        for key in keys[:-1]:
            cursor = cursor.setdefault(key, {})
        cursor[keys[-1]] = value
        # Task params are free-form: merge a dotted override into the existing dict.
        if keys[:2] == ["task", "params"] and len(keys) == 3:
            config.task.params = {**config.task.params, keys[2]: value}
            continue
        _switching_task(config, lambda: _apply(config, table, f"--set {text}"),
                        keys[:2] == ["task", "params"])
        if keys[0] == "gates":
            _check_gates(config, f"--set {text}")
    _apply(config, {k: v for k, v in named.items() if v is not None}, "command line")
    if steps is not None:
        count = _coerce(0, steps, "steps")
        if count < 1:
            raise InputError(f"steps: must be >= 1 (got {count})")
        config.train_prompts = count * config.prompts_per_step


def _switching_task(config: RunConfig, apply, gives_params: bool) -> None:
    """Run `apply`; if it switched the task (source or name) without giving params, drop the
    previous task's params: they are another generator's keyword arguments (chain_sum's
    max_digits would make leg_counting fail, or worse, silently shape it)."""
    before = (config.task.source, config.task.name)
    apply()
    if (config.task.source, config.task.name) != before and not gives_params:
        config.task.params = {}


def flatten(table: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in table.items():
        if isinstance(value, dict) and key != "params":
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def resume_config(stored: dict, where: str, profile: str | None = None, config_file: str = "",
                  overrides: list[str] = (), gates_file: str = "", **named: Any) -> RunConfig:
    """The stored config of a run being resumed. A resumed run must use the identical config:
    options given with --resume may repeat stored values but never change one."""
    if not isinstance(stored, dict):
        raise InputError(f"{where}: field \"config\" is not a table")
    config = RunConfig()
    _apply(config, stored, f"{where} config")
    validate(config)
    before = flatten(config.to_dict())
    if profile is not None and profile != config.profile:
        raise InputError(f"--profile {profile}: the run was started with profile "
                         f"{config.profile!r}; a resumed run uses its stored config unchanged")
    _apply_sources(config, config_file, gates_file, overrides, named)
    after = flatten(config.to_dict())
    changed = [f"{key} (stored {before[key]!r}, given {after[key]!r})"
               for key in before if before[key] != after[key]]
    if changed:
        raise InputError(f"--resume: the options change the run's stored config: "
                         f"{'; '.join(changed)}. A resumed run uses its stored config unchanged; "
                         "start a new run (new --label) to change it")
    return validate(config)


def rewards_named_by(config_file: str = "", overrides: list[str] = ()) -> list[str]:
    """The `module:function` rewards the user's own --config FILE and --set options name: the
    only reward code `run --resume` may import (the run directory's stored config is data)."""
    config = RunConfig()
    _apply_sources(config, config_file, "", overrides, {})
    return [entry["name"] for entry in config.rewards if isinstance(entry, dict)
            and isinstance(entry.get("name"), str) and USER_REWARD_PATH.fullmatch(entry["name"])]
