"""The decision study's real re-tests (bench/decision_quality.py --real-retests N): the
resampled design checked against the product itself. Each re-test is a whole `grpogate gate
--candidate ADAPTER` (trl_gate.gate: admission, the sequential re-test sampled fresh look by
look and stopped where the rule stops, the eval set's KL to the baseline, the guard, the
evidence, `decide_run` over every gate, the run directory), with its own sampling seed and its
own eval and guard problems (seed, task.eval_seed and guard.seed all 1000 + k). The training
prompts are named as the config's train split (`--train-from-config`), so the isolation row is
checked as a user's gate checks it; the prompts the candidate's own run trained on
(`exclude_run`) that fall in a re-test's eval set are counted beside it. So P(accept) here
counts every gate the decision has, `retest_kl` and `length_budget` included, and the
completions are what a user's gate would sample. Generates completions (torch).

One model load serves every re-test: the gate's `load_policy` is answered from a cache for
the process (the baseline's weights do not change between re-tests, and the gate attaches the
candidate itself each time, `inputs.candidate.attach_candidate`). Each re-test's outcome is
appended to DIR/real_retests.jsonl as it ends, and a re-test already there is not run again,
so a long study can be stopped and continued. Every run directory stays in DIR/gates for
`grpogate decide` to re-check.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from pathlib import Path

import decision_resample
from decision_quality import QUICK_OVERRIDES

FIRST_SEED = 1000


@contextlib.contextmanager
def one_model_load():
    """Within the block, the gate's `load_policy` loads the base model once and hands the same
    policy to every later gate of the same model, dtype and device."""
    from grpogate import trl_gate

    original, cache = trl_gate.load_policy, {}

    def cached(config, adapter: str = "", seed: int | None = None):
        key = (config.model, config.dtype, config.device, adapter)
        if key not in cache:
            cache[key] = original(config, adapter=adapter, seed=seed)
        return cache[key]

    trl_gate.load_policy = cached
    try:
        yield
    finally:
        trl_gate.load_policy = original


def outcome(evidence: dict, trained: set[str]) -> dict:
    """What one gate decided, read from its evidence: the decision, every gate's pass, each
    tested gate's anytime bounds at the stop, the look it stopped at and the completions both
    policies drew (its `retest` section), and how many of its eval prompts the candidate's own
    run trained on (the prompt ids of its eval records)."""
    checks = {row["name"]: row for row in evidence["decision"]["checks"]}
    verdict = {"tests": {name: row.get("test") for name, row in checks.items()}}
    retest = evidence["retest"]
    by_set = {"eval": 2 * retest["eval_prompts"] * evidence["config"]["eval_group_size"],
              "guard": 2 * retest["guard_samples"]}
    eval_ids = set()
    if trained:
        records = Path(evidence["run_dir"]) / "eval_completions.jsonl"
        eval_ids = {json.loads(line)["prompt_id"]
                    for line in records.read_text().splitlines() if line.strip()}
    return {"decision": evidence["decision"]["decision"],
            "failed_checks": evidence["decision"]["failed_checks"],
            "passed": {name: row["passed"] for name, row in checks.items()},
            "bounds": {gate: decision_resample.bounds(verdict, gate)
                       for gate in decision_resample.TESTED},
            "stopped_at_look": retest["stopped_at_look"],
            "completions": retest["completions"], "by_set": by_set,
            "retest_kl": (checks.get("retest_kl") or {}).get("value"),
            "trained_eval_prompts": len(eval_ids & trained)}


def real_retests(work_dir: Path, candidates: list[tuple[str, str]], count: int,
                 exclude_run: str | None, model: str | None, quick: bool = False) -> dict:
    """`count` real re-tests of each (name, adapter) candidate, each a whole gate with fresh
    seeds and problems; P(accept) over every gate with its binomial standard error, P(each
    gate fails), the mean completions used. `exclude_run`: the run a candidate was trained by,
    whose training prompt ids each re-test's eval set is compared with (a gate draws its eval
    set from the task's population and cannot skip them; the overlap is recorded)."""
    from grpogate.config import load_config
    from grpogate.review.standalone_eval import trained_prompt_ids
    from grpogate.trl_gate import GateRequest, gate

    trained = trained_prompt_ids(exclude_run) if exclude_run else set()
    log_path = work_dir / "real_retests.jsonl"
    done = {(row["candidate"], row["seed"]): row for row in (
        json.loads(line) for line in (log_path.read_text().splitlines()
                                      if log_path.is_file() else []) if line.strip())}
    started = time.monotonic()
    with one_model_load():
        for k in range(count):
            seed = FIRST_SEED + k
            for name, adapter in candidates:
                if (name, seed) in done:
                    continue
                slug = re.sub(r"[^A-Za-z0-9.]+", "-", Path(adapter).parent.name + "-"
                              + Path(adapter).name).strip("-")
                config = load_config("default", model=model, overrides=[
                    *(QUICK_OVERRIDES if quick else []), f"seed={seed}",
                    f"task.eval_seed={seed}", f"guard.seed={seed}",
                    f"out={work_dir / 'gates' / f'{slug}-{seed}'}"])
                began = time.monotonic()
                request = GateRequest(candidate=adapter, train_from_config=True)
                row = {"candidate": name, "seed": seed,
                       **outcome(gate(config, request), trained),
                       "seconds": time.monotonic() - began}
                done[(name, seed)] = row
                with log_path.open("a") as log:
                    log.write(json.dumps(row) + "\n")
                print(f"real re-test {k + 1}/{count} {name}: {row['decision']} at look "
                      f"{row['stopped_at_look']}, {row['completions']} completions, "
                      f"{row['seconds']:.0f} s", flush=True)
    results = {}
    for name, _ in candidates:
        runs = [done[(name, FIRST_SEED + k)] for k in range(count)]
        results[name] = decision_resample.summarize_real(runs, gates=runs[0]["passed"]) | {
            "decisions": {d: sum(r["decision"] == d for r in runs)
                          for d in ("accept", "tune", "reject")},
            "max_trained_eval_prompts": max(r["trained_eval_prompts"] for r in runs)}
    return {"count": count, "seconds": time.monotonic() - started, "results": results}
