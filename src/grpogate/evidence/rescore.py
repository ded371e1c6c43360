"""What `decide` re-scores, and what it takes as recorded.

A run directory is data from whoever wrote it, so the audit bounds and limits what it does with
it. It never imports code the directory names: a user reward (`module:function` in the
recorded config) is taken as recorded -- each record's value for it, and its version from the
evidence -- unless the user names that code on the command line (`--trust-reward-code`), it is
importable here from outside the run directory, and its source hashes to the version the run
recorded. The built-in components (correctness through the verifier, format, overlong) are
always re-scored, and every weighted total is recomputed from the components.

Its cost is bounded: a recorded config with a count past caps far above any real run, or a
step count that is not what the evidence holds, is refused before anything is built from it;
a file holding more records than a real run of the recorded config writes is refused as it is
read, before a line of it is parsed (audit_files.numbered_jsonl); `--max-rescore N`
re-scores a random sample of N records (the seed is reported; the others' verifier and
user-code values are taken as recorded, everything else is still checked), and the estimated
time is announced before a long re-scoring starts.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from grpogate.config import BUILT_IN_REWARDS, MAX_REWARD_VALUE, MAX_REWARD_WEIGHT, step_count
from grpogate.errors import InputError
from grpogate.evidence.manifest import GUARD_FILE, PROBLEMS_FILE
from grpogate.inputs.rewards import (CORRECTNESS, TRL_SIGNATURE_SUFFIX, RewardSet,
                                     reward_set_from_config,
                                     user_reward_names, user_reward_source)
from grpogate.inputs.verifiers import MATH_VERIFY

# Typical seconds per re-scored record of the verifiers whose cost is worth saying: math-verify
# scores in a sandboxed child (about a millisecond for a short boxed answer, taken 10x for
# long completions; docs/measurements.md, "Figures moved from code comments"), each call
# bounded by its time limit (the "at most"). Keyed
# by the verifier's name, which stays when its version moves.
TYPICAL_SECONDS = {MATH_VERIFY: 0.01}
ANNOUNCE_AFTER_SECONDS = 30.0  # a worst case past this is announced before the work starts


# Caps far above any real run, checked before the audit builds anything from a count (it builds
# one rollout seed per step, assemble.seeds): the largest public math RL sets hold about 10**6
# problems, a GRPO group is 2 to 64 samples, dynamic sampling draws 3 rounds by default, and a
# step (a generation and an update) takes seconds: 10**6 steps is 12 days at one a second.
MAX_PROMPTS = 10_000_000  # train, eval and guard set sizes; prompts per step
MAX_GROUP_SIZE = 65_536  # group_size, eval_group_size, guard.group_size
MAX_GENERATION_ROUNDS = 1_000
MAX_GUARD_ROUNDS = 1_000  # the sequential re-test's guard rounds (16 by default)
MAX_STEPS = 1_000_000


def _count(settings: dict, key: str, cap: int, name: str, default: Any = None) -> int:
    """settings[key], a positive integer at most `cap`; InputError naming config field `name`."""
    value = settings.get(key, default)
    if type(value) is not int or not 1 <= value <= cap:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise InputError(f"evidence.json: field config.{name}: expected a positive integer at "
                         f"most {cap:,}, got {shown}")
    return value


def record_limits(config: dict) -> dict[str, int]:
    """The most records a real run of `config` writes: trajectories, steps x prompts_per_step x
    group_size x generation rounds (dynamic sampling refills at most a step's prompts per round);
    the re-test, both policies x eval_prompts x eval_group_size; the guard set, both policies x
    its prompts x its group size x its rounds (1 for a run recorded before rounds);
    problems.jsonl, the train, eval and guard sets. InputError
    when a count the bound is made of is not a positive integer within its cap."""
    def count(key: str, cap: int, default: Any = None) -> int:
        return _count(config, key, cap, key, default)

    rounds = (count("max_generation_rounds", MAX_GENERATION_ROUNDS, 1)
              if config.get("dynamic_sampling") is True else 1)
    train, per_step = count("train_prompts", MAX_PROMPTS), count("prompts_per_step", MAX_PROMPTS)
    trajectories = train // per_step * per_step * count("group_size", MAX_GROUP_SIZE) * rounds
    eval_prompts = count("eval_prompts", MAX_PROMPTS)
    retest = 2 * eval_prompts * count("eval_group_size", MAX_GROUP_SIZE)
    guard = config.get("guard") if isinstance(config.get("guard"), dict) else {}
    # both policies on the guard set; none when the guard is off or its size unreadable
    guard_size = (0, 0, 0)
    if all(type(guard.get(key)) is int and guard[key] > 0 for key in ("prompts", "group_size")):
        guard_size = (_count(guard, "prompts", MAX_PROMPTS, "guard.prompts"),
                      _count(guard, "group_size", MAX_GROUP_SIZE, "guard.group_size"),
                      _count(guard, "rounds", MAX_GUARD_ROUNDS, "guard.rounds", 1))
    return {"trajectories.jsonl": trajectories, "eval_completions.jsonl": retest,
            GUARD_FILE: 2 * guard_size[0] * guard_size[1] * guard_size[2],
            PROBLEMS_FILE: train + eval_prompts + guard_size[0]}


def run_limits(evidence: dict) -> dict[str, int]:
    """`record_limits` of the recorded config, once its step count is checked against what the
    evidence holds: at most MAX_STEPS, one recorded rollout seed per step (a run records
    assemble.seeds), no more step records than steps. InputError otherwise, before anything is
    built from the counts."""
    config = evidence["config"]
    limits = record_limits(config)
    steps = step_count(config["train_prompts"], config["prompts_per_step"])
    implied = "config.train_prompts // config.prompts_per_step"
    if steps > MAX_STEPS:
        raise InputError(f"evidence.json: field config.train_prompts: {implied} = {steps:,} "
                         f"steps, more than {MAX_STEPS:,}; not a grpogate run directory")
    seeds = evidence.get("seeds") if isinstance(evidence.get("seeds"), dict) else {}
    rollout = seeds.get("rollout")
    if not isinstance(rollout, list) or len(rollout) != steps:
        held = f"{len(rollout)} seeds" if isinstance(rollout, list) else "no list"
        raise InputError(f"evidence.json: field seeds.rollout: {held}, not one per step of the "
                         f"recorded config ({implied} = {steps}); not a grpogate run directory")
    recorded = evidence.get("steps")
    if isinstance(recorded, list) and len(recorded) > steps:
        raise InputError(f"evidence.json: field steps: {len(recorded)} step records, more than "
                         f"the recorded config runs ({implied} = {steps}); not a grpogate run "
                         "directory")
    return limits


@dataclass
class RescorePlan:
    """Which records get the expensive components (the verifier, trusted user code) re-run."""

    records: int  # records that carry a reward: trajectories + re-test
    sample: frozenset[int] | None  # indexes (trajectories first) re-scored; None: all
    seed: int | None

    @classmethod
    def choose(cls, records: int, max_rescore: int | None) -> "RescorePlan":
        if max_rescore is None or max_rescore >= records:
            return cls(records, None, None)
        seed = secrets.randbelow(2**32)  # unpredictable to the directory's writer, reported
        import random

        return cls(records, frozenset(random.Random(seed).sample(range(records), max_rescore)),
                   seed)

    def covers(self, index: int) -> bool:
        return self.sample is None or index in self.sample

    @property
    def rescored(self) -> int:
        return self.records if self.sample is None else len(self.sample)


def estimate_seconds(verifier, reward_set: RewardSet | None, records: int) -> tuple[float, float]:
    """(typical, at most) seconds to re-score `records` records: the verifier's per-completion
    time limit bounds each call, and a trusted user reward's own limit each of its calls."""
    limit = float(getattr(verifier, "time_limit_seconds", 0.0) or 0.0)
    typical = TYPICAL_SECONDS.get(getattr(verifier, "name", ""), 0.0)
    if reward_set is not None:
        called = [name for name in user_reward_names([{"name": n} for n in reward_set.weights])
                  if name not in reward_set.as_recorded]
        limit += len(called) * reward_set.user_time_limit_seconds
    return typical * records, limit * records


def announce_cost(announce: Callable[[str], None] | None, verifier, reward_set,
                  plan: RescorePlan) -> None:
    typical, at_most = estimate_seconds(verifier, reward_set, plan.rescored)
    if announce is not None and at_most > ANNOUNCE_AFTER_SECONDS:
        announce(f"re-scoring {plan.rescored} of {plan.records} records with "
                 f"{getattr(verifier, 'name', 'the verifier')}: about {typical:.0f} s, at most "
                 f"{at_most:.0f} s (each call's time limit); --max-rescore N re-scores a sample")


def audit_reward_set(audit, evidence: dict, verifier, run_dir: Path,
                     trusted: list[str]) -> RewardSet | None:
    """The run's reward set as the audit may use it: built-ins re-scored, user components taken
    as recorded except those the user trusts (named, importable outside the run directory, and
    of the recorded version, checked before the module is imported; each located once, and
    imported from the file checked). InputError for a trusted name the run does not record or
    that cannot be found; a version that differs is a mismatch."""
    config = evidence["config"]
    recorded = {entry.get("name"): entry.get("version")
                for entry in evidence["inputs"].get("rewards") or [] if isinstance(entry, dict)}
    user = user_reward_names(config.get("rewards") or [])
    located = {}  # name -> (version, file): each module located once, imported from that file
    for name in trusted:
        if name not in user:
            raise InputError(f"--trust-reward-code {name}: the run records no such reward "
                             f"component (its user components: {', '.join(user) or 'none'})")
        try:
            version, file = user_reward_source(name, run_dir)
        except ValueError as error:
            raise InputError(f"--trust-reward-code {name}: {error}") from None
        # A TRL-style function's recorded version carries a marker its signature adds on import.
        if version != str(recorded.get(name) or "").removesuffix(TRL_SIGNATURE_SUFFIX):
            audit.mismatch(f"inputs.rewards {name} version (--trust-reward-code: not the code "
                           "the run recorded; its values are taken as recorded)",
                           recorded.get(name), version)
        else:
            located[name] = (version, file)
    try:
        reward_set = reward_set_from_config(config, verifier.version, importable=list(located),
                                            recorded_versions=recorded, located=located)
    except ValueError as error:
        audit.mismatch(f"config.rewards ({error})")
        return None
    outside = [name for name, weight in reward_set.weights.items()
               if not abs(weight) <= MAX_REWARD_WEIGHT]
    if outside:
        audit.mismatch(f"config.rewards {outside[0]} weight (outside +-{MAX_REWARD_WEIGHT:g})",
                       reward_set.weights[outside[0]])
        return None
    audit.compare("inputs.rewards", evidence["inputs"].get("rewards"), reward_set.describe())
    return reward_set


def recorded_value(audit, where: str, value: Any, allow_none: bool = False) -> float | None:
    """A value taken as recorded: a number within the value bound (or None, "not applicable",
    where `allow_none`), else a mismatch and 0.0."""
    if value is None and allow_none:
        return None
    if (isinstance(value, (int, float)) and not isinstance(value, bool)
            and abs(value) <= MAX_REWARD_VALUE):
        return float(value)
    audit.mismatch(where, value, f"a number within +-{MAX_REWARD_VALUE:g} (taken as recorded)")
    return 0.0


def describe(reward_set: RewardSet | None, plan: RescorePlan) -> dict:
    """What the audit re-scored and what it took as recorded, for the output and --json."""
    names = list(reward_set.weights) if reward_set is not None else [CORRECTNESS]
    as_recorded = list(reward_set.as_recorded) if reward_set is not None else []
    return {"components_rescored": [name for name in names if name not in as_recorded],
            "components_as_recorded": as_recorded, "records": plan.records,
            "records_rescored": plan.rescored, "sample_seed": plan.seed}


def rescored_reward(audit, where: str, record: dict, reference: str, verifier,
                     reward_set, sampled: bool, problem=None) -> float:
    """The record's reward recomputed: the verifier's (re-run when `sampled`, else as recorded)
    alone, or with `reward_set` the weighted total of every component, the components compared
    with the recorded ones. Values taken as recorded must be numbers within the value bound.
    `problem`: the stored train problem (its question and columns reach TRL-style rewards)."""
    recorded = record.get("rewards") if isinstance(record.get("rewards"), dict) else {}
    if sampled:
        correctness = verifier.score(record.get("completion"), reference)
    elif reward_set is not None:
        correctness = recorded_value(audit, f"{where} rewards.correctness",
                                     recorded.get("correctness"))
    else:
        correctness = recorded_value(audit, f"{where} reward", record.get("reward"))
    if reward_set is None:
        return correctness
    taken = [name for name in reward_set.weights if name not in BUILT_IN_REWARDS
             and (name in reward_set.as_recorded or not sampled)]
    # A user component may record None ("not applicable", a TRL-style function's answer).
    values = {name: recorded_value(audit, f"{where} rewards.{name}", recorded.get(name),
                                   allow_none=True) for name in taken}
    tokens = record.get("completion_tokens")
    components = reward_set.score(record.get("completion"), reference,
                                  tokens if isinstance(tokens, int) else 0, correctness,
                                  question=problem.question if problem else "",
                                  recorded=values, taken=taken,
                                  columns=problem.columns if problem else "")
    audit.compare(f"{where} rewards", record.get("rewards"), components)
    return reward_set.total(components)
