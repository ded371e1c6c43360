"""TRL's GRPOConfig (and TrainingArguments) names in a grpogate configuration.

Most knobs here already carry TRL's name (beta, epsilon, loss_type, num_iterations, ...). Where
TRL names the same knob differently and the meaning is the same, the TRL name is taken as an
alias of grpogate's key, with a one-line note naming that key; where grpogate has no exact
equivalent, the TRL name is refused with the key to use instead. An unknown key that is close
to a known one (a typo) is refused with that key.
"""

from __future__ import annotations

import difflib
import functools
import logging

from grpogate.errors import InputError

# TRL name -> (grpogate key, what differs, or ""). Each is the same quantity.
TRL_ALIASES = {
    "num_generations": ("group_size", ""),
    "num_generations_eval": ("eval_group_size", ""),
    "max_completion_length": ("max_new_tokens", ""),
    "max_prompt_length": ("max_prompt_tokens", "a longer prompt is refused, never truncated"),
    "max_steps": ("steps", "sets train_prompts = steps x prompts_per_step"),
    "output_dir": ("out", "the run directory, which must not exist yet"),
}

# TRL (or PEFT LoraConfig) name -> (the grpogate key to use, how it differs); no exact
# equivalent, so the name is refused with the key.
TRL_HINTS = {
    "reward_weights": ("rewards", 'a list of tables, e.g. rewards = [{name = "correctness", '
                       'weight = 1.0}, {name = "format", weight = 0.5}]'),
    "reward_funcs": ("rewards", "built-in names or module:function, each with its weight"),
    "per_device_train_batch_size": ("prompts_per_step", "a step samples prompts_per_step x "
                                    "group_size completions; micro_batch_size is sequences "
                                    "per forward"),
    "gradient_accumulation_steps": ("groups_per_update", "valid groups per optimizer step"),
    "steps_per_generation": ("groups_per_update", "valid groups per optimizer step"),
    "num_train_epochs": ("steps", "training steps of prompts_per_step prompts"),
    "bf16": ("dtype", "float32, bfloat16 or auto"),
    "use_cpu": ("device", "auto, cpu or cuda"),
    "vllm_importance_sampling_correction": ("rollout_correction", "none, token_tis or "
                                            "sequence_mask"),
    "vllm_importance_sampling_cap": ("rollout_correction_cap", ""),
    "r": ("lora_r", ""),
    "target_modules": ("lora_target_modules", "all-linear or a comma list of names"),
}

logger = logging.getLogger(__name__)


def grpogate_key(key: str, where: str) -> str:
    """The grpogate key a top-level `key` stands for: itself, or the key a TRL alias names
    (noted once on the log, which the CLI prints on stderr)."""
    if key not in TRL_ALIASES:
        return key
    target, differs = TRL_ALIASES[key]
    _note(f"note: {where}: {key} is TRL's name; grpogate's key is {target}"
          + (f" ({differs})" if differs else ""))
    return target


def grpogate_table(table: dict, where: str) -> dict:
    """`table` (a config file's top level) with every TRL alias renamed to grpogate's key."""
    renamed = {grpogate_key(key, where): value for key, value in table.items()}
    if len(renamed) < len(table):
        both = [key for key in table if key in TRL_ALIASES and TRL_ALIASES[key][0] in table]
        raise InputError(f"{where}: {both[0]} and {TRL_ALIASES[both[0]][0]} name the same key; "
                         "give one")
    return renamed


def unknown_key_words(name: str, known: list[str], prefix: str) -> str:
    """Why `name` (dotted) is refused: a TRL name with no exact equivalent, a near miss of a
    known key, or else the list of known keys at that level."""
    key = name.removeprefix(prefix)
    if not prefix and key in TRL_HINTS:
        target, how = TRL_HINTS[key]
        return (f"unknown key {key!r}: TRL's name, with no exact equivalent here; did you mean "
                f"`{target}`" + (f" ({how})?" if how else "?"))
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    if close:
        return (f"unknown key {name!r}; did you mean `{prefix}{close[0]}`? (grpogate config "
                "show lists every key)")
    return f"unknown key {name!r}; known: {', '.join(f'{prefix}{k}' for k in known)}"


@functools.lru_cache(maxsize=None)
def _note(text: str) -> None:
    """Log `text` once per process: a run that loads its configuration twice (resume, the
    torchrun launcher) says it once."""
    logger.warning(text)
