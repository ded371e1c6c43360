"""A TRL-signature reward that reads a verl row's other columns, which TRL passes to reward
functions as keyword arguments (used as `dataset_rewards:reads_verl_columns`)."""

from __future__ import annotations


def reads_verl_columns(prompts, completions, data_source, extra_info, reward_model, **kwargs):
    """1 when every verl column arrived with its row's values, else 0."""
    return [float(source == "two_term_sums" and isinstance(info["index"], int)
                  and model["ground_truth"].isdigit())
            for source, info, model in zip(data_source, extra_info, reward_model)]
