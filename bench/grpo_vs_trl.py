"""grpogate vs TRL's GRPOTrainer, side by side on one machine, in one invocation.

    python bench/grpo_vs_trl.py [--steps N] [--json FILE] [--systems grpogate,trl,trl-nogc] ...

Both systems get the same model (the bundled SmolLM2-135M-Instruct), task (reasoning-gym
chain_sum, grpogate's default system prompt), train prompts in the same order, G, token budget,
LoRA (r, alpha, all linear layers), learning rate (constant), beta = 0, one update per rollout and
number of steps. Each system trains in its own subprocess, so peak resident memory is per system.
A last subprocess re-tests the baseline and every trained adapter with the SAME grpogate
evaluator (same eval prompts, same seed, same batch layout), so held-out rewards are paired
prompt by prompt. The generation ideal (decode-step matrix products only) is timed here too.

Timing definitions, the same for both systems: a step is one rollout + reward + update (wall
clock, from the start of generation to the end of the optimizer step); effective trajectories are
valid groups (rewards not all equal) x G; generation tokens count completion tokens up to and
including EOS. grpogate's effective trajectories/s is its evidence's own figure (docs/design.md §3: ÷ rollout
+ update seconds); TRL's divides by its whole step seconds. Both systems' figure over wall-clock
step seconds is in the JSON as well (`effective_trajectories_per_second_ratio_wall`).

Files: decode_ideal.py times the ideal; trl_side.py runs TRL; bench_table.py builds the table;
this script runs grpogate and the paired re-test. Outputs: runs/bench-<timestamp>/ (never overwritten).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import resource
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from grpogate.config import BUNDLED_MODEL

import bench_table  # bench/ is sys.path[0] when this script runs
import decode_ideal
import trl_side
from bench_table import ALL_SYSTEMS, TRL_SYSTEMS

INSTALL_HINT = "pip install -e '.[bench]'"


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def machine_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# --- the shared configuration -----------------------------------------------------------------


def build_config(spec: dict, out: str = ""):
    """The grpogate RunConfig every child derives the same problems and settings from."""
    from grpogate.config import load_config

    s = spec["settings"]
    return load_config(
        "default", overrides=spec["grpogate_set"], out=out,
        train_prompts=s["steps"] * s["prompts_per_step"], prompts_per_step=s["prompts_per_step"],
        group_size=s["group_size"], max_new_tokens=s["max_new_tokens"],
        eval_prompts=s["eval_prompts"], eval_group_size=s["eval_samples"],
        learning_rate=s["learning_rate"], lora_r=s["lora_r"], lora_alpha=s["lora_alpha"],
        lora_dropout=0.0, lora_target_modules="all-linear", beta=0.0, temperature=1.0,
        top_p=1.0, seed=s["seed"], model=s["model"])


def problem_sets(config) -> tuple[list, list, dict]:
    from grpogate.admission import load_problem_sets

    train, train_id, eval_set, eval_id = load_problem_sets(config)
    return train, eval_set, {"train_sha256": train_id["problem_set_sha256"],
                             "eval_sha256": eval_id["problem_set_sha256"]}


def resolve_load_dir(config) -> str:
    from grpogate.inputs.policy import default_cache_dir, resolve_base_model

    return resolve_base_model(config.model, config.model_revision, default_cache_dir(config)).load_dir


def write_json(path: Path, document) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + "\n", encoding="utf-8")


# --- child: grpogate --------------------------------------------------------------------------


class StepClock:
    """A pipeline reporter that timestamps steps and snapshots peak RSS when training ends.

    The pipeline opens a "step k/N rollout" task at each step's start and logs "step k/N: ..." at
    its end; the first "re-test" task marks the end of training (its RSS excludes evaluation).
    """

    def __init__(self):
        self.starts: dict[int, float] = {}
        self.ends: dict[int, float] = {}
        self.training_peak_rss = 0

    @contextlib.contextmanager
    def task(self, description: str, total: int):
        match = re.match(r"step (\d+)/\d+ rollout", description)
        if match:
            self.starts.setdefault(int(match.group(1)) - 1, time.perf_counter())
        if description.startswith("re-test") and not self.training_peak_rss:
            self.training_peak_rss = peak_rss_bytes()
        yield lambda advance=1: None

    def log(self, message: str) -> None:
        match = re.match(r"step (\d+)/(\d+):", message)
        if match:
            step = int(match.group(1)) - 1
            self.ends[step] = time.perf_counter()
            print(f"[grpogate] step {step + 1}/{match.group(2)}: "
                  f"{self.ends[step] - self.starts.get(step, self.ends[step]):.1f} s", file=sys.stderr)


def run_grpogate(spec: dict, out_dir: Path) -> dict:
    from grpogate import pipeline

    config = build_config(spec, out=str(out_dir / "run"))
    _, _, sets = problem_sets(config)
    clock = StepClock()
    evidence = pipeline.run(config, reporter=clock)
    steps = []
    for record in evidence["steps"]:
        index = record["step"]
        stage_seconds = record["rollout_seconds"] + record["verification_seconds"] + record["update_seconds"]
        wall = clock.ends.get(index, 0.0) - clock.starts.get(index, 0.0)
        steps.append({"step": index, "seconds": wall if wall > 0 else stage_seconds,
                      "stage_seconds": stage_seconds, "update_seconds": record["update_seconds"],
                      "generation_seconds": record["rollout_seconds"],
                      "generated_tokens": record["generated_tokens"],
                      "valid_group_count": record["valid_group_count"],
                      "group_count": record["group_count"], "mean_reward": record["mean_reward"]})
    comparison = evidence["comparison"]
    return {
        "system": "grpogate", "status": evidence["status"],
        "decision": (evidence.get("decision") or {}).get("decision"), "steps": steps,
        "generation_tokens_per_second": evidence["rollout"]["generation_tokens_per_second"],
        # grpogate's own definition (docs/design.md §3): effective trajectories / (rollout + update seconds).
        "effective_trajectories_per_second": evidence["effective_trajectories_per_second"],
        "effective_trajectory_count": evidence["effective_trajectory_count"],
        "peak_rss_bytes": clock.training_peak_rss or evidence["resources"]["peak_rss_bytes"],
        "peak_rss_bytes_with_retest": evidence["resources"]["peak_rss_bytes"],
        "adapter": str(Path(evidence["run_dir"]) / "adapter"), "run_dir": evidence["run_dir"],
        "internal_retest_mean_reward": {"baseline": comparison["baseline"]["mean_reward"],
                                        "candidate": comparison["candidate"]["mean_reward"]},
        "problem_sets": sets, "timings": evidence["timings"],
    }


# --- child: the paired held-out re-test -------------------------------------------------------


def run_eval(spec: dict, out_dir: Path) -> dict:
    """Baseline and every trained adapter through one evaluator: same prompts, seed and batches."""
    from grpogate.evidence import metrics
    from grpogate.sampling.retest import evaluate_policy
    from grpogate.sampling.rollout import sampling_settings
    from grpogate.inputs.policy import current_version, load_policy, sampling_weights
    from grpogate.sampling.rollout import encode_prompts
    from grpogate.inputs.verifiers import get_verifier

    config = build_config(spec)
    _, eval_set, sets = problem_sets(config)
    verifier = get_verifier(config.resolved_verifier())
    seed = config.seed + 10_000  # the pipeline's re-test seed
    summaries, records = {}, {}
    for name, adapter in [("baseline", "")] + list(spec["adapters"].items()):
        policy = load_policy(config, adapter=adapter, seed=config.seed)
        prompts = encode_prompts(policy.tokenizer, eval_set, config.resolved_system_prompt(),
                                 config.max_prompt_tokens)
        # The same sampling path as grpogate's own re-test (LoRA merged into the weights), so a
        # reloaded grpogate adapter reproduces the run's re-test exactly.
        def mode(policy=policy, baseline=(name == "baseline")):
            return sampling_weights(policy, baseline=baseline)
        started = time.perf_counter()
        records[name] = evaluate_policy(
            policy.model, policy.tokenizer, eval_set, prompts, policy_name=name,
            policy_version=current_version(policy), verifier=verifier,
            group_size=config.eval_group_size, settings=sampling_settings(config), seed=seed,
            mode=mode)
        summaries[name] = metrics.summarize_completions(records[name], config.eval_group_size,
                                                        config.max_new_tokens)
        print(f"[eval] {name}: mean reward {summaries[name]['mean_reward']:.3f} "
              f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)
        del policy
    write_json(out_dir / "eval_records.json", records)
    return {"summaries": summaries, "problem_sets": sets, "seed": seed,
            "eval_prompts": len(eval_set), "eval_samples": config.eval_group_size}


# --- orchestration ----------------------------------------------------------------------------


def run_child(kind: str, spec_path: Path, out_dir: Path, threads: int) -> dict | None:
    """Run one system (or the re-test) in a fresh process; None if it failed (reason printed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    log = out_dir / "child.log"
    print(f"== {kind} (log: {log})", file=sys.stderr, flush=True)
    started = time.perf_counter()
    with open(log, "wb") as handle:
        finished = subprocess.run([sys.executable, __file__, "--child", kind, "--spec", str(spec_path),
                                   "--child-out", str(out_dir)], stdout=handle, env=env)
    if finished.returncode != 0:
        # Its traceback went to stderr above; one failed system must not lose the others' numbers.
        print(f"== {kind} FAILED (exit {finished.returncode}); its stdout is in {log}",
              file=sys.stderr, flush=True)
        return None
    result = json.loads((out_dir / "result.json").read_text())
    print(f"== {kind} done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return result


def child_main(kind: str, spec_path: Path, out_dir: Path) -> None:
    import torch

    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(spec["threads"])
    if kind == "grpogate":
        result = run_grpogate(spec, out_dir)
    elif kind in TRL_SYSTEMS:
        config = build_config(spec)
        train, _, sets = problem_sets(config)
        result = trl_side.run_trl(config, train, resolve_load_dir(config), spec["settings"],
                                  out_dir, TRL_SYSTEMS[kind], kind)
        result["problem_sets"] = sets
    elif kind == "eval":
        result = run_eval(spec, out_dir)
    else:
        raise SystemExit(f"unknown child {kind!r}")
    result["peak_rss_bytes_process"] = peak_rss_bytes()
    result["torch_threads_at_end"] = torch.get_num_threads()
    write_json(out_dir / "result.json", result)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--systems", default=",".join(ALL_SYSTEMS),
                        help="comma-separated subset of grpogate,trl,trl-nogc")
    parser.add_argument("--steps", type=int, default=16, help="training steps, the same for every system")
    parser.add_argument("--prompts-per-step", type=int, default=8, help="train prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="G, completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="token budget per completion")
    parser.add_argument("--eval-prompts", type=int, default=48, help="held-out prompts for the paired re-test")
    parser.add_argument("--eval-samples", type=int, default=4, help="completions per eval prompt")
    parser.add_argument("--learning-rate", type=float, default=5e-5, help="constant in every system")
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank on all linear layers")
    parser.add_argument("--lora-alpha", type=int, default=32, help="LoRA alpha")
    parser.add_argument("--seed", type=int, default=42, help="sampling, LoRA init and bootstrap seed")
    parser.add_argument("--model", default=BUNDLED_MODEL,
                        help="base model for every system: the bundled GGUF, an HF directory or a .gguf file")
    parser.add_argument("--threads", type=int, default=machine_cores(),
                        help="torch threads per system: this machine's cores")
    parser.add_argument("--grpogate-set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra grpogate config override (e.g. dtype=bfloat16); repeatable. "
                             "The shared settings above always win.")
    parser.add_argument("--ideal-seconds", type=float, default=1.0,
                        help="seconds per timed round of the decode-step ideal (5 rounds per dtype)")
    parser.add_argument("--workdir", default="", help="default: runs/bench-<timestamp>")
    parser.add_argument("--json", default="", metavar="FILE", help="also write the table as JSON")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--spec", default="", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default="", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def select_systems(text: str, trl_installed: bool) -> list[str]:
    """The --systems list, validated; without TRL its systems are dropped with an install hint."""
    systems = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(systems) - set(ALL_SYSTEMS))
    if unknown or not systems:
        raise SystemExit(f"--systems: unknown {unknown or text!r}; choose from {', '.join(ALL_SYSTEMS)}")
    if not trl_installed and any(name in TRL_SYSTEMS for name in systems):
        running = "grpogate and the ideal" if "grpogate" in systems else "the ideal"
        print(f"TRL is not installed: running {running} only. Install it with `{INSTALL_HINT}`.",
              file=sys.stderr)
        systems = [name for name in systems if name not in TRL_SYSTEMS]
    return systems


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args.child, Path(args.spec), Path(args.child_out))
        return 0
    systems = select_systems(args.systems, importlib.util.find_spec("trl") is not None)
    workdir = Path(args.workdir or f"runs/bench-{datetime.now():%Y%m%d-%H%M%S}")
    if workdir.exists():
        raise SystemExit(f"{workdir}: already exists; choose a new --workdir")
    settings = {key: getattr(args, key) for key in (
        "steps", "prompts_per_step", "group_size", "max_new_tokens", "eval_prompts",
        "eval_samples", "learning_rate", "lora_r", "lora_alpha", "seed", "threads", "model")}
    settings.update(systems=systems, beta=0.0, updates_per_rollout=1, temperature=1.0,
                    lora_target_modules="all-linear", lr_schedule="constant",
                    machine_cores=machine_cores(), grpogate_set=args.grpogate_set)
    spec = {"settings": settings, "grpogate_set": args.grpogate_set, "threads": args.threads,
            "adapters": {}}
    config = build_config(spec)  # validates every shared setting before anything runs
    workdir.mkdir(parents=True)
    spec_path = workdir / "spec.json"
    write_json(spec_path, spec)

    # Every number here is wall-clock time: other work on the machine (or a core count below
    # --threads) skews it; the load before the first measurement is recorded and flagged.
    load_at_start = os.getloadavg()[0]
    load_dir = resolve_load_dir(config)
    batch_size = min(config.generation_batch_size, args.prompts_per_step * args.group_size)
    print(f"== ideal decode step at batch {batch_size}", file=sys.stderr, flush=True)
    ideal_first = decode_ideal.measure_ideal(load_dir, batch_size, args.threads, args.ideal_seconds)

    attempted = {name: run_child(name, spec_path, workdir / name, args.threads) for name in systems}
    results = {name: result for name, result in attempted.items() if result is not None}
    spec["adapters"] = {name: result["adapter"] for name, result in results.items()}
    write_json(spec_path, spec)
    evaluation = run_child("eval", spec_path, workdir / "eval", args.threads)
    # Every child derived its problems from the same config: prove they are the same sets.
    sets = {json.dumps(r["problem_sets"], sort_keys=True)
            for r in [*results.values(), evaluation] if r is not None}
    if len(sets) > 1:
        raise SystemExit(f"children saw different problem sets: {sets}")
    # Timed again at the end: a busy moment before the first timing must not lower the ideal
    # (on this 2-core machine one timing has read 1,473 and another 1,978 tokens/s).
    print(f"== ideal decode step at batch {batch_size}, again", file=sys.stderr, flush=True)
    ideal = decode_ideal.fastest(ideal_first, decode_ideal.measure_ideal(
        load_dir, batch_size, args.threads, args.ideal_seconds))

    import peft
    import torch
    import transformers

    settings["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                            "peft": peft.__version__, "trl": next(
        (r["trl_version"] for name, r in results.items() if name in TRL_SYSTEMS), None)}
    settings["load_average_1min"] = {"start": load_at_start, "end": os.getloadavg()[0]}
    table = bench_table.build_table(settings, results, ideal, evaluation)
    table["workdir"] = str(workdir)
    failed = [name for name, result in attempted.items() if result is None]
    failed += ["eval (no held-out rewards)"] * (evaluation is None)
    table["notes"] += [f"{name} failed; see {workdir}/{name.split()[0]}/child.log" for name in failed]
    if load_at_start >= 0.5 or args.threads > machine_cores():
        table["notes"].append(f"1-minute load average {load_at_start:.1f} at start on {machine_cores()} "
                              f"cores, {args.threads} threads per system: other work was running, "
                              "so the timings are not a quiet-machine measurement")
    print(bench_table.format_table(table))
    write_json(workdir / "table.json", table)
    if args.json:
        write_json(Path(args.json), table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
