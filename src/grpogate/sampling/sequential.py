"""The sequential re-test: both policies answer the eval and guard sets batch by batch, in the
sets' drawn order, until the stopping rule (evidence/stopping.py) says the decision is known.

Each batch is `retest_both` on the next positions of a set, so every prompt keeps the seed of its
position and the records are exactly those a one-shot re-test of the same prompts writes; the
rule is read on the per-prompt differences of everything sampled so far, by the same pure
function `decide` walks over the stored records.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from grpogate.config import RunConfig
from grpogate.distributed import SINGLE, World
from grpogate.evidence import metrics, stopping
from grpogate.evidence.guard import sample_differences
from grpogate.evidence.metrics import per_prompt_deltas
from grpogate.inputs.policy import Policy
from grpogate.interrupts import StopRequest
from grpogate.sampling.retest import retest_both


@dataclass
class RetestSet:
    """One set the re-test samples: its problems, their encoded prompts, its verifier."""

    problems: list
    prompts: list[list[int]]
    verifier: object
    group_size: int
    label: str  # "re-test" (the eval set) or "guard"


def differences(records: list[dict], group_size: int, max_new_tokens: int
                ) -> tuple[list[float], list[float]]:
    """(reward, pass@group) candidate-minus-baseline per prompt, in the records' drawn order."""
    if not records:
        return [], []
    summaries = [metrics.summarize_completions(
        [r for r in records if r["policy"] == name], group_size, max_new_tokens)["per_prompt"]
        for name in ("baseline", "candidate")]
    reward, passed = (per_prompt_deltas(*summaries, field) for field in ("mean_reward", "passed"))
    if reward is None or passed is None:  # the two policies' records must pair prompt by prompt
        raise ValueError("the re-test's baseline and candidate records do not pair by prompt")
    return reward, passed


def sequential_retest(policy: Policy, eval_set: RetestSet, guard_set: RetestSet | None,
                      config: RunConfig, candidate_version: str, reporter, stop: StopRequest,
                      world: World = SINGLE) -> tuple[list[dict], list[dict], int] | None:
    """(eval records, guard records, verifier errors) of the re-test the rule stops, or None
    when a stop was requested at a safe point. Eval looks add prompts in drawn order; guard
    looks add a round over every guard problem."""
    design = stopping.design_of(config.to_dict())
    sampled: dict[str, list[dict]] = {"re-test": [], "guard": []}
    errors = 0
    while True:
        reward, passed = differences(sampled["re-test"], eval_set.group_size,
                                     config.max_new_tokens)
        guard = None if guard_set is None else sample_differences(sampled["guard"])
        walked = stopping.walk_looks(reward, passed, guard, design,
                                     stopping.margins_of(dataclasses.asdict(config.gates)))
        if walked["complete"]:
            reporter.log(f"re-test stopped at look {len(walked['looks'])}: {walked['reason']} "
                         f"({walked['eval_prompts']} eval prompts, {walked['guard_samples']} "
                         "paired guard samples)")
            return sampled["re-test"], sampled["guard"], errors
        look = len(walked["looks"]) + 1
        batches = []
        if walked["next"][0] > len(reward):
            batches.append((eval_set, {"indexes": range(len(reward), walked["next"][0])}))
        if guard_set is not None and walked["next"][1] > len(guard):
            round_index = len(guard) // (len(guard_set.problems) * guard_set.group_size)
            batches.append((guard_set, {"round_index": round_index}))
        for chosen, where in batches:
            result = retest_both(
                policy, chosen.problems, chosen.prompts, chosen.verifier, config,
                candidate_version, reporter, stop, world, group_size=chosen.group_size,
                label=chosen.label, progress=f"{chosen.label} look {look}",
                drift=chosen.label == "re-test", **where)
            if result is None:
                return None
            sampled[chosen.label] = _in_order(sampled[chosen.label] + result[0])
            errors += result[1]


def _in_order(records: list[dict]) -> list[dict]:
    """Baseline records then candidate records, each in drawn order (a one-shot re-test's
    layout), from batches that each list the baseline's then the candidate's."""
    return [r for name in ("baseline", "candidate") for r in records if r["policy"] == name]
