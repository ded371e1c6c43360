"""The default run's settings search on a development eval set, one `grpogate run` per candidate.

    python bench/default_search.py [--plan bench/default_search.toml] [--only A,B]
                                   [--record bench/default_search_record.jsonl] [--set KEY=VALUE]
                                   [--seeds 42,43]

Protocol (issue 14): settings are chosen on a DEVELOPMENT eval set — a third reasoning-gym seed
(`dev_seed`, far from the train seed 1 and the default eval seed 2; item i at seed s is item
i + k at seed s - k, so nearby seeds share problems) — never on the default eval set the
accept/tune decision is measured on. Each candidate is a real `grpogate run` whose eval set is the
development set (`--set task.eval_seed=<dev_seed>`), so the run's own admission proves train and
development prompts disjoint; this script also counts how many development prompts the default
eval set holds (0 expected) and records it.

Every finished candidate, good or bad, is appended as one JSON line to the record (append-only,
so earlier searches stay): settings, command, commit, machine, wall time, decision, re-test gain
and its 95 % paired interval, pass@group change, the largest per-step KL to the baseline,
entropy, truncation, valid groups and stage timings. A candidate that fails is recorded with its
exit code and the tail of its output. `--set` applies to every candidate after the plan (tests
use it to run the plan on a tiny model). `--seeds 42,43` runs each candidate once per run seed
(records carry `run_seed`) and prints each candidate's mean gain over them: on this task one
development run moved by about 0.06 between seeds or with a rounding-level code change, more than
most candidates differ (docs/measurements.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import tomllib
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PLAN = REPO / "bench" / "default_search.toml"
DEFAULT_RECORD = REPO / "bench" / "default_search_record.jsonl"
RECORD_VERSION = 1


# --- the plan ---------------------------------------------------------------------------------


def load_plan(path: Path) -> dict:
    """{dev_seed, scale: {key: value}, candidates: [{name, set}]}; names unique, seeds far apart."""
    plan = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    unknown = set(plan) - {"dev_seed", "scale", "candidate"}
    if unknown:
        raise SystemExit(f"error: {path}: unknown key(s) {sorted(unknown)}; a plan holds "
                         "dev_seed, [scale] and [[candidate]] tables")
    candidates = plan.get("candidate") or []
    names = [c.get("name") for c in candidates]
    if not candidates or not all(isinstance(n, str) and n for n in names) \
            or len(set(names)) != len(names):
        raise SystemExit(f"error: {path}: every [[candidate]] needs a unique non-empty name")
    if not isinstance(plan.get("dev_seed"), int):
        raise SystemExit(f"error: {path}: dev_seed must be an integer (a reasoning-gym seed)")
    return {"dev_seed": plan["dev_seed"], "scale": dict(plan.get("scale") or {}),
            "candidates": [{"name": c["name"], "set": dict(c.get("set") or {})}
                           for c in candidates]}


def toml_value(value) -> str:
    """A `--set` value the config parser reads back as the same TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def candidate_overrides(plan: dict, candidate: dict, extra: list[str]) -> list[str]:
    """The `--set` list of one candidate: development eval seed, shared scale, the candidate's
    own settings, then the caller's extra overrides (last wins, as on the command line)."""
    sets = [f"task.eval_seed={plan['dev_seed']}"]
    sets += [f"{key}={toml_value(value)}" for key, value in plan["scale"].items()]
    sets += [f"{key}={toml_value(value)}" for key, value in candidate["set"].items()]
    return sets + list(extra)


def candidate_runs(plan: dict, candidate: dict, extra: list[str],
                   seeds: list[int]) -> list[tuple[str, list[str], int | None]]:
    """(run directory name, `--set` list, run seed) of each run of one candidate: one run at
    the config's seed, or one per seed in `seeds` (named NAME-seedN), the seed set last."""
    overrides = candidate_overrides(plan, candidate, extra)
    if not seeds:
        return [(candidate["name"], overrides, None)]
    return [(f"{candidate['name']}-seed{seed}", overrides + [f"seed={seed}"], seed)
            for seed in seeds]


def seed_means(rows: list[dict]) -> dict[str, dict]:
    """Per candidate, its finished runs' reward gains and their mean over the run seeds: one
    development run does not rank settings closer than its seed-to-seed spread."""
    means = {}
    for row in rows:
        if row["status"] != "failed":
            entry = means.setdefault(row["name"], {"seeds": [], "gains": []})
            entry["seeds"].append(row.get("run_seed"))
            entry["gains"].append(row["reward"]["gain"])
    for entry in means.values():
        entry["mean_gain"] = sum(entry["gains"]) / len(entry["gains"])
    return means


# --- one record line ----------------------------------------------------------------------------


def _interval(paired: dict, name: str) -> dict:
    entry = paired.get(name) or {}
    return {"low": entry.get("low"), "high": entry.get("high")}


def largest_kl(evidence: dict) -> dict:
    """The largest per-step mean KL to the baseline and its step; not measured when beta = 0
    (no reference forward runs, and the step records 0)."""
    if not (evidence.get("config") or {}).get("beta"):
        return {"value": None, "step": None, "note": "not measured: beta = 0"}
    steps = [s for s in evidence.get("steps") or [] if isinstance(s.get("mean_kl"), (int, float))]
    if not steps:
        return {"value": None, "step": None, "note": "no step recorded a KL"}
    worst = max(steps, key=lambda s: s["mean_kl"])
    return {"value": worst["mean_kl"], "step": worst["step"]}


def retest_drift(evidence: dict) -> dict | None:
    """The re-test's KL to the baseline and entropies (None: a run recorded before them)."""
    drift = (evidence.get("comparison") or {}).get("drift")
    if not isinstance(drift, dict):
        return None
    return {"kl_to_baseline": drift.get("kl_to_baseline"), "entropy": drift.get("entropy")}


def guard_summary(evidence: dict) -> dict | None:
    """The guard set's means and paired reward gain (None: no guard recorded, or off)."""
    guard = evidence.get("guard")
    if not isinstance(guard, dict) or not guard.get("enabled") or guard.get("skipped"):
        return None
    return {"task": guard["task"], "prompts": guard["prompts"],
            "baseline": guard["baseline"]["mean_reward"],
            "candidate": guard["candidate"]["mean_reward"], "gain": guard["reward_mean_gain"],
            **_interval(guard["paired"], "reward_mean_gain")}


def record_row(name: str, settings: dict, evidence: dict, wall_seconds: float) -> dict:
    """What the search keeps of one finished run: the evidence's own numbers, nothing recomputed."""
    from grpogate.evidence import decisions

    comparison, paired = evidence["comparison"], evidence["comparison"].get("paired") or {}
    baseline, candidate = comparison["baseline"], comparison["candidate"]
    steps = evidence.get("steps") or []
    entropies = [s["entropy"] for s in steps if isinstance(s.get("entropy"), (int, float))]
    config = evidence["config"]
    return {
        "name": name, "settings": settings, "status": evidence["status"],
        "decision": evidence["decision"]["decision"],
        "failed_checks": evidence["decision"]["failed_checks"],
        "gain_rule": decisions.gain_rule(config["gates"]),
        "wall_seconds": wall_seconds, "steps": len(steps),
        "eval": {"seed": config["task"]["eval_seed"], "prompts": baseline["prompt_count"],
                 "group_size": config["eval_group_size"]},
        "reward": {"baseline": baseline["mean_reward"], "candidate": candidate["mean_reward"],
                   "gain": comparison["reward_mean_gain"],
                   **_interval(paired, "reward_mean_gain"),
                   "sign_test_p": ((paired.get("reward_mean_gain") or {}).get("sign_test")
                                   or {}).get("p_value"),
                   "gain_lower_bound": ((paired.get("reward_mean_gain") or {}).get("gain_test")
                                        or {}).get("bound")},
        "pass_at_group": {"baseline": baseline["pass_at_group"],
                          "candidate": candidate["pass_at_group"],
                          "gain": comparison["pass_at_group_gain"],
                          **_interval(paired, "pass_at_group_gain")},
        "largest_kl": largest_kl(evidence),
        "entropy": {"first": entropies[0] if entropies else None,
                    "min": min(entropies) if entropies else None,
                    "last": entropies[-1] if entropies else None},
        "truncation": {"train": evidence["rollout"]["max_length_hit_ratio"],
                       "eval_baseline": baseline["max_length_hit_ratio"],
                       "eval_candidate": candidate["max_length_hit_ratio"]},
        "retest_drift": retest_drift(evidence),
        "guard": guard_summary(evidence),
        "valid_group_ratio": evidence["rollout"]["valid_group_ratio"],
        "update_count": evidence["update"]["update_count"],
        "timings": {key: round(value, 1) for key, value in (evidence.get("timings") or {}).items()
                    if isinstance(value, (int, float))},
    }


# --- provenance -----------------------------------------------------------------------------------


def commit() -> str:
    """HEAD of the checkout the runs import, with "+dirty" when tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              check=False).stdout.strip()

    head = git("rev-parse", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine() -> dict:
    flags = ""
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        pass
    model = next((line.split(":", 1)[1].strip() for line in flags.splitlines()
                  if line.startswith("model name")), platform.processor())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "cores": cores, "avx512_bf16": " avx512_bf16" in flags,
            "platform": platform.platform()}


def dev_overlap_with_default_eval(overrides: list[str]) -> dict:
    """How many development-set prompts the default eval set (default eval seed, the default
    eval size or the plan's, whichever is larger) also holds, by stable prompt id. The run's
    admission proves train vs development disjoint; this proves development vs default eval."""
    from grpogate.config import RunConfig, load_config
    from grpogate.errors import InputError
    from grpogate.inputs.tasks import load_eval_set

    try:
        development = load_config("default", overrides=overrides)
    except InputError as error:  # the candidate's run refuses it too, and is recorded failed
        return {"error": str(error)}
    default_eval = load_config("default", overrides=overrides + [
        f"task.eval_seed={RunConfig().task.eval_seed}",
        f"eval_prompts={max(RunConfig().eval_prompts, development.eval_prompts)}"])
    dev_ids = {p.prompt_id for p in load_eval_set(development.task, development.eval_prompts)[0]}
    eval_ids = {p.prompt_id for p in load_eval_set(default_eval.task, default_eval.eval_prompts)[0]}
    return {"development_seed": development.task.eval_seed, "development_prompts": len(dev_ids),
            "default_eval_seed": default_eval.task.eval_seed, "default_eval_prompts": len(eval_ids),
            "shared_prompts": len(dev_ids & eval_ids)}


# --- running ----------------------------------------------------------------------------------------


def run_candidate(out_dir: Path, overrides: list[str]) -> tuple[int, float, str, list[str]]:
    """One `grpogate run` in a child process: (exit code, wall seconds, output tail, command);
    its whole output is kept in `<out_dir>.log`."""
    command = [sys.executable, "-m", "grpogate", "run", "--out", str(out_dir)]
    for text in overrides:
        command += ["--set", text]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.monotonic() - started
    # The terminal output, whole, beside the run directory (a run dir holds only run files).
    Path(f"{out_dir}.log").write_text(done.stdout + done.stderr, encoding="utf-8")
    return done.returncode, wall, (done.stdout + done.stderr)[-2000:], command


def append_record(record: Path, row: dict) -> None:
    record.parent.mkdir(parents=True, exist_ok=True)
    with record.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(row, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def search(plan: dict, workdir: Path, record: Path, only: list[str], extra: list[str],
           seeds: list[int] = ()) -> list[dict]:
    chosen = [c for c in plan["candidates"] if not only or c["name"] in only]
    missing = sorted(set(only) - {c["name"] for c in plan["candidates"]})
    if missing:
        raise SystemExit(f"error: --only names no candidate of the plan: {', '.join(missing)}")
    workdir.mkdir(parents=True, exist_ok=False)  # never reuse an earlier search's run dirs
    provenance = {"record_version": RECORD_VERSION, "commit": commit(), "machine": machine(),
                  "search_dir": str(workdir), "scale": plan["scale"],
                  "extra": list(extra)}  # every candidate's --set overrides, e.g. a seed
    rows = []
    for candidate in chosen:
        for out_name, overrides, seed in candidate_runs(plan, candidate, extra, seeds):
            overlap = dev_overlap_with_default_eval(overrides)
            out_dir = workdir / out_name
            code, wall, tail, command = run_candidate(out_dir, overrides)
            finished = datetime.now(timezone.utc).isoformat(timespec="seconds")
            evidence_file = out_dir / "evidence.json"
            if code == 0 and evidence_file.is_file():
                evidence = json.loads(evidence_file.read_text(encoding="utf-8"))
                row = record_row(candidate["name"], candidate["set"], evidence, wall)
            else:
                row = {"name": candidate["name"], "settings": candidate["set"],
                       "status": "failed", "exit_code": code, "wall_seconds": wall,
                       "output_tail": tail}
            row |= provenance | {"finished": finished, "command": command,
                                 "run_dir": str(out_dir), "dev_vs_default_eval": overlap,
                                 "run_seed": seed}
            append_record(record, row)
            rows.append(row)
            print(summary_line(row), flush=True)
    if seeds:
        for name, entry in seed_means(rows).items():
            gains = ", ".join(f"{gain:+.3f}" for gain in entry["gains"])
            print(f"{name}: mean reward gain {entry['mean_gain']:+.3f} over seeds "
                  f"{', '.join(map(str, entry['seeds']))} ({gains})", flush=True)
    return rows


def summary_line(row: dict) -> str:
    if row["status"] == "failed":
        return f"{row['name']}: failed (exit {row['exit_code']}) after {row['wall_seconds']:.0f} s"
    reward, passed, kl = row["reward"], row["pass_at_group"], row["largest_kl"]["value"]
    return (f"{row['name']}: {row['wall_seconds']:.0f} s, {row['decision']}, reward "
            f"{reward['baseline']:.3f} -> {reward['candidate']:.3f} ({reward['gain']:+.3f} "
            f"[{reward['low']:+.3f}, {reward['high']:+.3f}]), pass@group {passed['gain']:+.3f} "
            f"[{passed['low']:+.3f}, {passed['high']:+.3f}], largest KL "
            f"{'n/a' if kl is None else f'{kl:.4f}'}, train truncation "
            f"{row['truncation']['train']:.3f}" + _safety_text(row))


def _safety_text(row: dict) -> str:
    text = ""
    if (row.get("retest_drift") or {}).get("kl_to_baseline") is not None:
        text += f", re-test KL {row['retest_drift']['kl_to_baseline']:.4f}"
    guard = row.get("guard")
    if guard:
        text += (f", guard {guard['baseline']:.3f} -> {guard['candidate']:.3f} "
                 f"[{guard['low']:+.3f}, {guard['high']:+.3f}]")
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", type=Path, default=DEFAULT_PLAN)
    parser.add_argument("--only", default="", help="comma-separated candidate names")
    parser.add_argument("--record", type=Path, default=DEFAULT_RECORD)
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the run directories go (default runs/search-<UTC time>)")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                        help="an override applied to every candidate after the plan")
    parser.add_argument("--seeds", default="", help="comma-separated run seeds: each candidate "
                        "runs once per seed and the search prints its mean gain over them")
    args = parser.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds: comma-separated integers (got {args.seeds!r})")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    workdir = args.workdir or REPO / "runs" / f"search-{stamp}"
    search(load_plan(args.plan), workdir, args.record,
           [n for n in args.only.split(",") if n], args.extra, seeds)


if __name__ == "__main__":
    main()
