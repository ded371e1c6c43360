"""The decision study's real re-tests (bench/decision_quality.py --real-retests N): the
resampled design checked against re-tests sampled fresh, each judged by the same code as a
draw. Generates completions (torch, through `grpogate eval`'s code path).
"""

from __future__ import annotations

import time
from pathlib import Path

import decision_resample
from decision_quality import QUICK_OVERRIDES, load_pool, pool_design


def real_retests(work_dir: Path, candidates: list[tuple[str, str]], count: int,
                 exclude_run: str | None, model: str | None, quick: bool = False) -> dict:
    """`count` real re-tests of each (name, adapter) candidate: per re-test, a fresh seed and
    fresh problems, every policy answering the design's maximum anew (the run's eval set in
    its drawn order, guard.rounds x group_size samples of each guard problem), the rule walked
    over them in order (decision_resample.WHOLE: the re-test as the run samples it, stopping
    where it stops); the verdicts, each gate's anytime bounds at the stop, the completions
    used, and P(accept) with its binomial standard error."""
    from grpogate.config import load_config

    outcomes: dict[str, list[dict]] = {name: [] for name, _ in candidates}
    started = time.monotonic()
    for k in range(count):
        seed = 1000 + k
        config = load_config("default", model=model, overrides=[
            *(QUICK_OVERRIDES if quick else []),
            f"seed={seed}", f"task.eval_seed={seed}", f"guard.seed={seed}"])
        sizes = {"eval_pool": config.eval_prompts, "eval_samples": config.eval_group_size,
                 "guard_pool": config.guard.prompts,
                 "guard_samples": config.guard.rounds * config.guard.group_size}
        design = pool_design(config, sizes, exclude_run)
        settings = config.to_dict()
        baseline = load_pool(config, "baseline", "", design, work_dir)
        for name, adapter in candidates:
            pool = load_pool(config, name, adapter, design, work_dir)
            # One "draw" of every prompt and sample in order: the re-test as it was sampled.
            evidence = decision_resample.draw_evidence(
                baseline, pool, settings, decision_resample.WHOLE)
            verdict = decision_resample.judge(evidence, settings["gates"])
            outcomes[name].append({
                "seed": seed, "passed": verdict["passed"],
                "completions": evidence["retest"]["completions"],
                "stopped_at_look": evidence["retest"]["stopped_at_look"],
                "bounds": {gate: decision_resample.bounds(verdict, gate)
                           for gate in decision_resample.TESTED}})
        print(f"real re-test {k + 1}/{count}: " + ", ".join(
            f"{name} {'accept' if all(o[-1]['passed'].values()) else 'not accepted'}"
            for name, o in outcomes.items()), flush=True)
    return {"count": count, "seconds": time.monotonic() - started,
            "results": {name: decision_resample.summarize_real(runs)
                        for name, runs in outcomes.items()}}
