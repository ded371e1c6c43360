"""The typed run configuration: one dataclass tree, loaded from a profile, a TOML file and overrides.

Precedence, lowest first: the dataclass defaults (the `default` profile), a packaged profile
(`--profile smoke`), a user TOML file (`--config FILE`), a gates file, then `--set key=value`
overrides and the CLI's named flags. `validate()` checks every invariant up front and says how
to fix it.

  schema.py      the dataclasses (RunConfig, TaskConfig; Gates lives in gates.py), their
                 defaults, and the values each knob takes
  validation.py  validate(): every invariant, with a how-to-fix message
  loading.py     load_config / resume_config: profiles, TOML and gates files, --set
  trl_names.py   TRL's GRPOConfig names: aliases of grpogate's keys, or the key to use
  keys.py        one line of meaning per key, for `grpogate config show` and the help
"""

from grpogate.config.loading import (available_profiles, load_config, parse_override,
                                     profile_note, resume_config, rewards_named_by)
from grpogate.config.schema import (BUILT_IN_REWARDS, BUNDLED_MODEL, CHAIN_SUM_SYSTEM_PROMPT,
                                    DTYPES, GSM8K_SYSTEM_PROMPT, IMPORTANCE_SAMPLING_LEVELS,
                                    KL_ESTIMATORS, LOSS_TYPES, MAX_REWARD_VALUE, MAX_REWARD_WEIGHT,
                                    MULTI_OBJECTIVE_AGGREGATIONS,
                                    RENAMED_KEYS, REPORTERS, ROLLOUT_CORRECTIONS, SCALE_REWARDS,
                                    USER_REWARD_PATH, GuardConfig, RunConfig, TaskConfig, flatten,
                                    step_count)
from grpogate.config.validation import SEED_LIMIT, label_is_a_name, validate
from grpogate.gates import Gates

__all__ = [
    "BUILT_IN_REWARDS", "BUNDLED_MODEL", "CHAIN_SUM_SYSTEM_PROMPT", "DTYPES", "GSM8K_SYSTEM_PROMPT",
    "Gates", "GuardConfig", "IMPORTANCE_SAMPLING_LEVELS", "KL_ESTIMATORS", "LOSS_TYPES", "MAX_REWARD_VALUE",
    "MAX_REWARD_WEIGHT",
    "MULTI_OBJECTIVE_AGGREGATIONS", "RENAMED_KEYS", "REPORTERS", "ROLLOUT_CORRECTIONS",
    "RunConfig", "SCALE_REWARDS", "SEED_LIMIT", "TaskConfig", "USER_REWARD_PATH",
    "available_profiles", "flatten", "label_is_a_name", "load_config", "parse_override",
    "profile_note", "resume_config", "rewards_named_by", "step_count", "validate",
]
