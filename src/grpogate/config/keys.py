"""What each configuration key means: `grpogate config show` prints these lines.

Kept beside the schema rather than in it so the typed configuration stays short to read; the
key names are the schema's own (flattened with dots: task.name, gates.minimum_reward_gain).
"""

from __future__ import annotations

from typing import Any

from grpogate.config.schema import RunConfig, flatten

# One line per key: the only place a key's meaning is written for users (`config show` prints
# it; tests/test_cli_help.py holds every field of RunConfig to having one, so a new key
# cannot land without its line).
KEY_HELP = {
    "label": "names the run directory runs/<label>; empty: <profile>-<date>-<time>",
    "out": "explicit run directory (must not exist); overrides runs/<label>",
    "profile": "the packaged profile the config started from",
    "model": "base model: bundled id, Hugging Face directory, .gguf file or hub id",
    "model_revision": "hub revision (commit, tag or branch) of a hub-id model",
    "adapter": "baseline LoRA adapter directory (PEFT, safetensors) to start from",
    "baseline_manifest": "an accepted run's manifest.json to start from instead of model/adapter",
    "cache_dir": "where the GGUF is dequantized once; empty: $GRPOGATE_CACHE or ~/.cache/grpogate",
    "dtype": "base weights: float32, bfloat16, or auto (bfloat16 where the hardware has it)",
    "device": "auto, cpu or cuda",
    "task.source": "where problems come from: reasoning-gym, gsm8k or dataset",
    "task.name": "the reasoning-gym dataset (chain_sum, leg_counting, ...)",
    "task.params": "the generator's keyword arguments; reset when the task changes",
    "task.path": "gsm8k: directory with train/test.jsonl, one .jsonl file or a hub dataset id; "
                 "dataset: a parquet/JSONL/CSV/Arrow file, a save_to_disk folder or a hub id",
    "task.train_split": "gsm8k/dataset split the training problems are drawn from",
    "task.eval_split": "gsm8k/dataset split the re-test problems are drawn from (a table with "
                       "one split holds out eval_prompts rows instead)",
    "task.train_seed": "seed of the training problems (reasoning-gym generation or gsm8k rows)",
    "task.eval_seed": "seed of the held-out problems; never overlapping the training set",
    "task.eval_pool": "reasoning-gym: the held-out problems are a seeded draw from this many "
                      "distinct ones (0: the first in generation order)",
    "task.prompt_field": "dataset: the prompt column, a string or one user chat message",
    "task.reference_field": "dataset: the reference column (dotted path); answer also finds "
                            "TRL's solution and verl's reward_model.ground_truth",
    "task.verifier": "dataset: number (last number equals the reference's), math "
                     "(math-verify) or exact (final answer equals the reference, whitespace "
                     "stripped); empty: number",
    "task.max_table_bytes": "dataset / --train-data: most bytes of a table's files (read and "
                            "decoded), checked before datasets builds anything",
    "task.max_table_rows": "dataset / --train-data: most rows of a table, all splits together",
    "task.max_cell_chars": "dataset / --train-data: longest text cell in characters (a JSONL "
                           "or CSV line holds at most 4 bytes a character of it)",
    "task.max_nesting_depth": "dataset / --train-data: deepest nesting of a row (lists, objects)",
    "verifier": "reward verifier; empty: the task's own (reasoning-gym scorer, gsm8k number)",
    "system_prompt": "system message of every prompt; empty: the task's default",
    "train_prompts": "training problems in all (steps x prompts_per_step)",
    "eval_prompts": "the most held-out problems the baseline and candidate are re-tested on",
    "eval_batch_prompts": "held-out problems added at each look of the sequential re-test",
    "steps": "training steps: sets train_prompts = steps x prompts_per_step",
    "group_size": "G: completions sampled per prompt (TRL num_generations)",
    "eval_group_size": "completions per held-out prompt in the re-test (pass@k's k)",
    "prompts_per_step": "prompts sampled per training step",
    "max_prompt_tokens": "a longer prompt is refused as bad input, never truncated",
    "max_new_tokens": "completion token budget (TRL max_completion_length)",
    "temperature": "sampling temperature of rollouts and re-test (> 0)",
    "top_p": "nucleus sampling mass (1.0: the whole vocabulary)",
    "top_k": "keep only the k most likely tokens when sampling; 0: off",
    "min_p": "drop tokens below min_p x the top token's probability; 0: off",
    "generation_batch_size": "rows decoded together (prompts x G)",
    "dynamic_sampling": "DAPO: refill a step's shortfall of valid groups with new prompts",
    "max_generation_rounds": "dynamic sampling: at most this many rounds of generation per step",
    "rewards": "trained reward components [{name, weight}]: correctness, format, overlong, "
               "module:function; |weight| <= 1e6 and a component's value within +-1e6, so totals "
               "and their group variance stay finite (a 1e6:1 weight ratio already drowns the "
               "smaller component in float32)",
    "multi_objective_aggregation": "sum_then_normalize, or normalize_then_sum (GDPO)",
    "overlong_buffer_len": "DAPO soft overlong punishment over the budget's last N tokens",
    "overlong_penalty_factor": "the overlong punishment reached at the budget's last token (0 to 1e6)",
    "reward_time_limit_seconds": "time limit per call of a user module:function reward",
    "lora_r": "LoRA rank of the trained adapter",
    "lora_alpha": "LoRA scaling numerator (scale = alpha / r)",
    "lora_dropout": "LoRA dropout during the update",
    "lora_target_modules": "layers that get LoRA (all-linear or a comma list)",
    "learning_rate": "AdamW learning rate of the LoRA weights",
    "lr_scheduler_type": "learning-rate schedule over the steps: constant, constant_with_warmup, "
                         "linear or cosine",
    "warmup_ratio": "fraction of the steps whose rate ramps up linearly from 0",
    "weight_decay": "AdamW weight decay",
    "loss_type": "objective: grpo, bnpo, dapo, dr_grpo or cispo (training/objectives.py)",
    "importance_sampling_level": "token, or sequence (GSPO: length-normalized sequence ratio)",
    "epsilon": "lower clip: the ratio is kept >= 1 - epsilon",
    "epsilon_high": "upper clip 1 + epsilon_high (DAPO clip-higher 0.28); 0: epsilon",
    "delta": "dual clip: the unclipped ratio capped at delta for negative advantages; 0: off",
    "beta": "KL coefficient to the baseline; 0: no reference forward at all",
    "kl_estimator": "KL estimator: k1, k2 or k3",
    "scale_rewards": "advantage std: group, batch or none (Dr. GRPO)",
    "num_iterations": "optimizer passes over each rollout (mu)",
    "top_entropy_quantile": "train only on this top fraction of tokens by entropy; 1: all",
    "rollout_correction": "sampler-trainer correction: none, token_tis or sequence_mask",
    "rollout_correction_cap": "cap on pi_old / pi_sampler for rollout_correction",
    "max_grad_norm": "gradient norm clip per optimizer step",
    "groups_per_update": "valid groups per optimizer step; 0: all valid groups of a step",
    "micro_batch_size": "sequences per forward/backward (halved on out-of-memory)",
    "mask_truncated_completions": "completions that hit max_new_tokens add no loss",
    "seed": "run seed: LoRA init, sampling; the re-test uses seed + 10000",
    "tensorboard": "directory for TensorBoard event files (implies report_to tensorboard)",
    "report_to": "trackers that also get the per-step scalars: tensorboard, mlflow, wandb, trackio",
    "gates.minimum_valid_group_ratio": "tune unless at least this share of groups had reward variance",
    "gates.minimum_effective_trajectories_per_second": "tune below this training throughput",
    "gates.minimum_update_count": "tune below this many optimizer steps",
    "gates.minimum_reward_gain": "tune unless the re-test mean reward gains at least this",
    "gates.minimum_pass_at_group_gain": "tune unless re-test pass@k gains at least this",
    "gates.maximum_max_length_hit_ratio": "tune if more completions than this hit max_new_tokens",
    "gates.maximum_peak_allocated_bytes": "tune if peak memory exceeds this",
    "gates.require_significant_gain": "true: the gain gates pass when an anytime-valid test shows "
                                      "'gain > minimum' at 2.5 % on the sequential re-test, the "
                                      "guard when it shows non-inferiority; false: the point "
                                      "estimate (the reference profile's gates)",
    "gates.maximum_retest_kl": "tune if the candidate's mean per-token KL to the baseline on the "
                               "re-test's fresh completions exceeds this; 0: off (still recorded)",
    "gates.maximum_guard_reward_loss": "the guard's non-inferiority margin: tune unless the re-test "
                                       "shows the guard gain above -this (its lower bound at 97.5 %)",
    "guard.prompts": "guard problems (the guard's population) both policies answer in each round "
                     "of the re-test; 0: guard off",
    "guard.group_size": "completions per guard problem and policy in each round",
    "guard.rounds": "the most guard rounds the sequential re-test takes",
    "guard.task": "the guard's reasoning-gym dataset: a neighbouring task the update must not damage",
    "guard.params": "the guard generator's keyword arguments",
    "guard.seed": "seed of the guard problems; never overlapping the train and eval sets",
}


def describe_config(config: RunConfig) -> list[tuple[str, Any, str, str]]:
    """(dotted key, value, type name, meaning) for every key, in the dataclass's order;
    the derived `steps` right after train_prompts."""
    rows = []
    for key, value in flatten(config.to_dict()).items():
        rows.append((key, value, type(value).__name__, KEY_HELP.get(key, "")))
        if key == "train_prompts":
            rows.append(("steps", config.steps, "int", KEY_HELP["steps"]))
    return rows
