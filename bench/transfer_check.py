"""Did a run's adapter learn the task or its eval set? Its paired gain on problems it never saw.

    python bench/transfer_check.py RUN_DIR [--seed 2000000] [--eval-prompts N]
                                   [--neighbour task.params.min_terms=3 --neighbour ...]
                                   [--record bench/transfer_record.jsonl]

Two paired comparisons, baseline vs the run's delivered adapter, each on fresh completions under
one seed (the run's re-test seed) with the run's own sampling settings and eval group size:

- unseen seed: the run's task and params, eval problems drawn at `--seed` — a reasoning-gym
  seed no setting was chosen on (the default eval seed is 2, the search's development seed
  1,000,000). Its gain should match the run's own re-test gain if the adapter learned the task.
- neighbouring task: the same generator with `--neighbour` overrides (default: chain_sum with
  three terms instead of two) at the run's eval seed.

Both draw their problems skipping every prompt the run trained on (its problems.jsonl and
trajectories), then check it as `grpogate eval --exclude-run` does: disjointness is proven, not
assumed. Seeds alone would not do it: chain_sum's one-digit half has 200 distinct questions, so
a 64-prompt set at seed 2,000,000 shares 6 prompts with a 64-prompt train set at seed 1
(measured). The skipping makes these sets slightly harder than the run's own eval set (fewer
one-digit problems), which is part of what the comparison with the run's own gain shows.
The result (gains, 95 % paired intervals, exact tests, truncation) is printed and appended as one
JSON line to the record.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from default_search import append_record, commit, machine  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RECORD = REPO / "bench" / "transfer_record.jsonl"
UNSEEN_SEED = 2_000_000
NEIGHBOUR = ["task.params.min_terms=3", "task.params.max_terms=3"]


def run_config(run_dir: Path):
    """The run's own configuration, exactly as stored (the audit and replay rebuild it so)."""
    from grpogate.config import resume_config
    from grpogate.files import read_json
    from grpogate.review.replay import refuse_sources_inside

    if not (run_dir / "evidence.json").is_file() or not (run_dir / "manifest.json").is_file():
        raise SystemExit(f"error: {run_dir}: not a finished run directory (no evidence.json "
                         "or manifest.json)")
    evidence = read_json(run_dir / "evidence.json")  # bounded and strict: untrusted
    config = resume_config(evidence.get("config") if isinstance(evidence, dict) else None,
                           f"{run_dir}/evidence.json")
    refuse_sources_inside(config, run_dir)
    return config, evidence


def shifted(config, overrides: list[str], eval_prompts: int | None):
    """The run's config with task overrides (`task.eval_seed=...`, `task.params.k=v`) applied
    through the config loader's own parser, so a bad override fails as it would on the CLI."""
    from grpogate.config import parse_override, validate

    task = dataclasses.replace(config.task, params=dict(config.task.params))
    for text in overrides:
        keys, value = parse_override(text)
        if keys[:2] == ["task", "params"] and len(keys) == 3:
            task.params[keys[2]] = value
        elif keys[0] == "task" and len(keys) == 2 and hasattr(task, keys[1]):
            setattr(task, keys[1], value)
        else:
            raise SystemExit(f"error: {text!r}: only task.<key> and task.params.<key> overrides "
                             "are allowed (the policy and its sampling stay the run's)")
    changed = dataclasses.replace(config, task=task,
                                  eval_prompts=eval_prompts or config.eval_prompts)
    return validate(changed)


def paired_gain(config, run_dir: Path, evidence: dict) -> dict:
    """Baseline and candidate on `config`'s eval set, same seed, paired per prompt."""
    from grpogate.seeding import eval_seed
    from grpogate.review.standalone_eval import compare_evaluations, evaluate_standalone

    seed = eval_seed(config.seed)
    baseline = evaluate_standalone(config, "baseline", seed, skip_run=str(run_dir))
    adapter = run_dir / (evidence.get("artifact") or {}).get("path", "adapter")
    candidate_config = dataclasses.replace(config, adapter=str(adapter), baseline_manifest="")
    candidate = evaluate_standalone(candidate_config, f"candidate {adapter}", seed,
                                    skip_run=str(run_dir))
    if candidate["policy"]["policy_version"] != evidence["artifact"]["new_policy_version"]:
        raise SystemExit(f"error: {adapter}: its policy version is not the run's "
                         "new_policy_version; the adapter was changed after the run")
    result = compare_evaluations(baseline, candidate, names=("baseline", "candidate"))
    paired = result["paired"]
    return {
        "task": {"name": config.task.name, "params": dict(config.task.params),
                 "eval_seed": config.task.eval_seed},
        "eval_set_sha256": baseline["eval_set"]["problem_set_sha256"],
        "prompts": paired["prompt_count"], "group_size": config.eval_group_size, "seed": seed,
        "trained_prompts_checked": baseline["excluded_run"]["trained_prompts"],
        "reward": {"baseline": result["baseline"]["mean_reward"],
                   "candidate": result["candidate"]["mean_reward"],
                   "gain": result["reward_mean_gain"],
                   "low": paired["reward_mean_gain"]["low"],
                   "high": paired["reward_mean_gain"]["high"],
                   "sign_test_p": paired["reward_mean_gain"]["sign_test"]["p_value"]},
        "pass_at_group": {"baseline": result["baseline"]["pass_at_group"],
                          "candidate": result["candidate"]["pass_at_group"],
                          "gain": result["pass_at_group_gain"],
                          "low": paired["pass_at_group_gain"]["low"],
                          "high": paired["pass_at_group_gain"]["high"]},
        "truncation": {"baseline": result["baseline"]["max_length_hit_ratio"],
                       "candidate": result["candidate"]["max_length_hit_ratio"]},
        "seconds": baseline["seconds"]["evaluation"] + candidate["seconds"]["evaluation"],
    }


def own_retest(evidence: dict) -> dict:
    """The run's own re-test gain, for the comparison the unseen seed should match."""
    comparison = evidence["comparison"]
    paired = comparison.get("paired") or {}
    return {"eval_seed": evidence["config"]["task"]["eval_seed"],
            "prompts": comparison["baseline"]["prompt_count"],
            "gain": comparison["reward_mean_gain"],
            "low": (paired.get("reward_mean_gain") or {}).get("low"),
            "high": (paired.get("reward_mean_gain") or {}).get("high"),
            "pass_at_group_gain": comparison["pass_at_group_gain"]}


def transfer(run_dir: Path, seed: int, neighbour: list[str], eval_prompts: int | None) -> dict:
    config, evidence = run_config(run_dir)
    started = time.monotonic()
    checks = {
        "unseen_seed": paired_gain(shifted(config, [f"task.eval_seed={seed}"], eval_prompts),
                                   run_dir, evidence),
        "neighbouring_task": paired_gain(shifted(config, neighbour, eval_prompts), run_dir,
                                         evidence),
    }
    return {"run_dir": str(run_dir), "run_settings": {
                key: evidence["config"][key] for key in (
                    "learning_rate", "beta", "loss_type", "train_prompts", "prompts_per_step",
                    "dynamic_sampling", "seed")},
            "own_retest": own_retest(evidence), **checks, "neighbour_overrides": neighbour,
            "wall_seconds": time.monotonic() - started, "commit": commit(), "machine": machine()}


def summary(row: dict) -> str:
    lines = []
    own = row["own_retest"]
    lines.append(f"own re-test (eval seed {own['eval_seed']}, {own['prompts']} prompts): "
                 f"{own['gain']:+.3f} [{own['low']:+.3f}, {own['high']:+.3f}]")
    for name in ("unseen_seed", "neighbouring_task"):
        check = row[name]
        reward, passed = check["reward"], check["pass_at_group"]
        lines.append(f"{name} ({check['task']['name']} {check['task']['params']}, eval seed "
                     f"{check['task']['eval_seed']}, {check['prompts']} prompts x "
                     f"{check['group_size']}): reward {reward['baseline']:.3f} -> "
                     f"{reward['candidate']:.3f} ({reward['gain']:+.3f} [{reward['low']:+.3f}, "
                     f"{reward['high']:+.3f}]), pass@group {passed['gain']:+.3f} "
                     f"[{passed['low']:+.3f}, {passed['high']:+.3f}]")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--seed", type=int, default=UNSEEN_SEED,
                        help="the unseen eval seed (default 2,000,000)")
    parser.add_argument("--neighbour", action="append", default=None, metavar="task.KEY=VALUE",
                        help="the neighbouring task's overrides (default: chain_sum, 3 terms)")
    parser.add_argument("--eval-prompts", type=int, default=None,
                        help="prompts per check (default: the run's eval_prompts)")
    parser.add_argument("--record", type=Path, default=DEFAULT_RECORD)
    args = parser.parse_args(argv)
    from grpogate.errors import InputError, visible

    try:
        row = transfer(args.run_dir, args.seed, args.neighbour or NEIGHBOUR, args.eval_prompts)
    except InputError as error:
        raise SystemExit(f"error: {visible(error)}") from None
    append_record(args.record, row)
    print(summary(row), flush=True)


if __name__ == "__main__":
    main()
