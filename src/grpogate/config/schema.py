"""The configuration's schema: the dataclass tree, its defaults, and the values each knob takes."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from grpogate.gates import Gates

BUNDLED_MODEL = "bundled:SmolLM2-135M-Instruct"

# Chosen (before any training run) so that the bundled SmolLM2 baseline lands inside the
# 10-60 % band where GRPO has signal, which the bare instruction does not reach
# (docs/measurements.md, "Figures moved from code comments").
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

    source: str = "reasoning-gym"  # "reasoning-gym", "gsm8k" or "dataset" (inputs/dataset_task.py)
    name: str = "chain_sum"  # reasoning-gym dataset name
    params: dict = field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
    )
    # gsm8k: a directory with train/test.jsonl, one .jsonl file, or an HF dataset id; dataset: a
    # file or folder Hugging Face datasets reads (parquet, JSONL, CSV, Arrow, save_to_disk)
    path: str = ""
    train_split: str = "train"
    eval_split: str = "test"
    train_seed: int = 1  # reasoning-gym generation seed; for gsm8k the row-sampling seed
    eval_seed: int = 2
    # reasoning-gym: the eval prompts are drawn in a seeded random order from the first
    # eval_pool distinct problems, so every batch of the sequential re-test comes from one
    # population (later distinct problems of a generator are harder than early ones) and a
    # larger eval_prompts extends the same sequence. 0: the first eval_prompts in order.
    eval_pool: int = 1024
    # dataset: the prompt column (a string or chat messages), the reference column (a dotted
    # path; "answer" also finds TRL's "solution" and verl's "reward_model.ground_truth"), and
    # the verifier: "number" (the last number equals the reference's), "math" (math-verify) or
    # "exact" (the final answer equals the reference, whitespace stripped).
    prompt_field: str = "prompt"
    reference_field: str = "answer"
    verifier: str = ""
    # dataset and gate --train-data: the bounds a table's files are held to before Hugging Face
    # datasets builds anything (inputs/table_files.py; why these values: docs/design.md §19).
    max_table_bytes: int = 512 * 1024 * 1024
    max_table_rows: int = 200_000
    max_cell_chars: int = 1 << 20
    max_nesting_depth: int = 32


@dataclass
class GuardConfig:
    """The re-test's guard set: a neighbouring reasoning-gym task the training must not damage.

    Baseline and candidate also answer `prompts` guard problems (`group_size` samples each,
    the re-test's seed), disjoint by prompt id from the train and eval sets; a candidate
    significantly worse there is `tune` (gates.maximum_guard_reward_loss). prompts = 0: off,
    and the evidence records it as off. The default guard is the trained task's arithmetic
    neighbour, products of two one-digit numbers, chosen because the bundled baseline scores
    well above the floor there (a regression cannot show from near zero), where the other
    arithmetic neighbours score near it (docs/measurements.md, "Figures moved from code
    comments").
    """

    # The guard's population: its task's first `prompts` distinct problems (the default task
    # has exactly 100), the bound is on their mean. Each look of the sequential re-test is one
    # round: every problem answered `group_size` more times by both policies (fresh seeds per
    # round), up to `rounds` rounds; the test reads the paired samples (evidence/stopping.py).
    prompts: int = 100
    group_size: int = 2
    rounds: int = 16
    task: str = "products"  # a reasoning-gym dataset; its own scorer verifies
    params: dict = field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    )
    seed: int = 3  # reasoning-gym generation seed of the guard problems

    @property
    def enabled(self) -> bool:
        return self.prompts > 0

    def verifier(self) -> str:
        return f"reasoning-gym/{self.task}"


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
    # 64 steps of 8 prompts. Chosen on the development set (bench/default_search.toml,
    # docs/measurements.md), with lr and beta.
    train_prompts: int = 512
    # The sequential re-test (evidence/stopping.py): eval_batch_prompts more eval prompts at each
    # look, until every gate is decided or eval_prompts are spent.
    eval_prompts: int = 256
    eval_batch_prompts: int = 32

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
    # Rows decoded together (whole groups of G). A training step decodes prompts_per_step x G
    # rows whatever this is; the re-test and the guard set decode up to this many at a time,
    # faster at 256 than at 64 or 128 for a little more KV cache (docs/measurements.md,
    # "Figures moved from code comments").
    generation_batch_size: int = 256
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
    learning_rate: float = 1.5e-4
    lr_scheduler_type: str = "constant"  # TRL's: constant, constant_with_warmup, linear, cosine
    warmup_ratio: float = 0.0  # the first ceil(warmup_ratio x steps) steps ramp up from 0
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
    beta: float = 0.04  # KL coefficient; 0 -> no reference forward at all
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
    # Sequences per forward/backward. 64 = a default step's 8 x 8 in one packed forward: on the
    # bf16 class the update of 4 recorded default steps took 6.1-6.8 s against 7.8-8.1 s at 16
    # (bench/README.md); an out-of-memory update is retried at half.
    micro_batch_size: int = 64
    # Completions that hit max_new_tokens add no loss (their group's advantages still count them).
    mask_truncated_completions: bool = False

    seed: int = 42
    # Directory for TensorBoard event files of the per-step scalars; empty: none written
    # (unless report_to names tensorboard: then <run dir>/tensorboard).
    tensorboard: str = ""
    report_to: list = field(default_factory=list)  # TRL's name; see REPORTERS
    gates: Gates = field(default_factory=Gates)
    guard: GuardConfig = field(default_factory=GuardConfig)

    @property
    def steps(self) -> int:
        return step_count(self.train_prompts, self.prompts_per_step)

    def resolved_verifier(self) -> str:
        if self.verifier:
            return self.verifier
        if self.task.source == "gsm8k":
            return "gsm8k-final-number-v1"
        if self.task.source == "dataset":
            return DATASET_VERIFIERS[self.task.verifier or "number"]
        return f"reasoning-gym/{self.task.name}"

    def resolved_system_prompt(self) -> str:
        if self.system_prompt:
            return self.system_prompt
        if self.task.source == "dataset":
            return ""  # none: the prompt is rendered as TRL renders a dataset's own prompt
        return GSM8K_SYSTEM_PROMPT if self.task.source == "gsm8k" else CHAIN_SUM_SYSTEM_PROMPT

    def resolved_epsilon_high(self) -> float:
        return self.epsilon_high or self.epsilon

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def step_count(train_prompts: int, prompts_per_step: int) -> int:
    """Training steps: whole steps of prompts (a remainder is not trained on)."""
    return train_prompts // prompts_per_step


TASK_SOURCES = ("reasoning-gym", "gsm8k", "dataset")
# The sequential re-test's most looks (eval batches plus guard rounds): each look re-reads every
# gate's test on all observations so far, so a recorded design past it is refused unread.
MAX_RETEST_LOOKS = 4096
# task.verifier of a dataset task -> the verifier's name (inputs/verifiers.py)
DATASET_VERIFIERS = {"number": "gsm8k-final-number-v1", "math": "math-verify-v1",
                     "exact": "exact-answer-v1"}
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


# The most a run may ask for, checked when the configuration is loaded, before a problem is
# generated or a file read (a mistyped `--steps 1000000000` is refused in a second instead of
# generating problems until memory runs out). Far above any real run: a GRPO group is 2 to 64
# samples, the largest public math RL sets hold about 10**6 problems, a re-test of 10**5 prompts
# is hours on a GPU, and 10**5 steps are more than a day at one a second. Each is at most the
# audit's own cap (evidence/rescore.py), so every run grpogate starts, decide can re-check.
MAX_STEPS = 100_000
MAX_TRAIN_PROMPTS = 1_000_000  # train_prompts (steps x prompts_per_step)
MAX_EVAL_PROMPTS = 100_000  # eval_prompts, guard.prompts, and prompts_per_step
MAX_GROUP_SIZE = 1024  # group_size, eval_group_size, guard.group_size
MAX_TOKENS = 131_072  # max_new_tokens, max_prompt_tokens: the longest context of common models
MAX_BATCH_ROWS = 65_536  # generation_batch_size, micro_batch_size
MAX_GENERATION_ROUNDS = 1_000  # max_generation_rounds
MAX_ITERATIONS = 1_000  # num_iterations: optimizer passes over each rollout

REPORTERS = ("tensorboard", "mlflow", "wandb", "trackio")  # report_to values, as TRL names them
# Knobs renamed to TRL's names: a config using the old one is told the new one.
RENAMED_KEYS = {"clip_epsilon": "epsilon", "kl_coef": "beta",
                "loss_aggregation": "loss_type (sequence_mean -> grpo, token_mean -> dapo)"}
LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo", "cispo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
SCALE_REWARDS = ("group", "batch", "none")
ROLLOUT_CORRECTIONS = ("none", "token_tis", "sequence_mask")
LR_SCHEDULER_TYPES = ("constant", "constant_with_warmup", "linear", "cosine")  # training/schedule
DTYPES = ("float32", "bfloat16", "auto")


def flatten(table: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in table.items():
        if isinstance(value, dict) and key != "params":
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
