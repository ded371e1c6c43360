"""`grpogate eval` and `grpogate compare`: parse, call review.standalone_eval, print
(cli/__init__.py registers them)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from grpogate.config import load_config
from grpogate.cli.terminal import console, fail, print_json, progress_bars
from grpogate.errors import InputError, plain

TASK_HELP = ("The task: reasoning-gym:NAME (e.g. reasoning-gym:leg_counting), gsm8k:PATH "
             "(directory, .jsonl file or HF dataset id) or dataset:PATH (parquet, JSONL, CSV, "
             "Arrow or a save_to_disk folder: verl's and TRL's formats). A new task starts from "
             "its generator's default params.")


def eval_policy(
    policy: str = typer.Option(..., metavar="BASE[+ADAPTER]",
                               help="Bundled id, HF directory, .gguf file or HF id, optionally "
                               "followed by + and a PEFT adapter directory."),
    out: str = typer.Option(..., metavar="FILE", help="Eval file to write (JSON; must not exist)."),
    task: Optional[str] = typer.Option(None, "--task", "--tasks", metavar="SOURCE:NAME",
                                       help=TASK_HELP + " Default: the profile's task."),
    exclude_run: Optional[str] = typer.Option(
        None, "--exclude-run", metavar="RUN_DIR",
        help="Refuse if any eval prompt is one that run trained on (its problems.jsonl)."),
    group_size: Optional[int] = typer.Option(None, metavar="N", help="Samples per prompt "
                                             "(default: the profile's eval_group_size)."),
    max_new_tokens: Optional[int] = typer.Option(None, metavar="N",
                                                 help="Completion token budget."),
    seed: Optional[int] = typer.Option(None, metavar="N", help="Sampling seed (default: run "
                                       "seed + 10000, the seed of a run's re-test)."),
    eval_prompts: Optional[int] = typer.Option(None, metavar="N", help="Number of eval prompts."),
    profile: str = typer.Option("default", metavar="NAME",
                                help="Packaged profile for task params and sampling."),
    config_file: str = typer.Option("", "--config", metavar="FILE",
                                    help="TOML file applied on top of the profile."),
    overrides: list[str] = typer.Option([], "--set", metavar="KEY=VALUE",
                                        help="Override any config key (see grpogate config show)."),
    device: Optional[str] = typer.Option(None, metavar="auto|cpu|cuda", help="Device."),
    dtype: Optional[str] = typer.Option(None, metavar="float32|bfloat16|auto",
                                        help="Base weights dtype."),
) -> None:
    """Evaluate one policy alone: per-prompt records plus reduced metrics, for `grpogate compare`."""
    from grpogate.seeding import eval_seed
    from grpogate.files import atomic_write_json
    from grpogate.review.standalone_eval import (evaluate_standalone, parse_policy_spec,
                                                 parse_tasks_spec)

    try:
        if Path(out).exists():
            raise InputError(f"{out}: already exists; choose a new --out")
        base, adapter = parse_policy_spec(policy)
        config = load_config(profile, config_file, overrides, model=base, adapter=adapter,
                             device=device, dtype=dtype, eval_prompts=eval_prompts,
                             eval_group_size=group_size, max_new_tokens=max_new_tokens,
                             task=parse_tasks_spec(task) if task else None)
        sampling_seed = seed if seed is not None else eval_seed(config.seed)
        with progress_bars(transient=True) as progress:
            task_id = progress.add_task("evaluate", total=config.eval_prompts * config.eval_group_size)
            document = evaluate_standalone(config, policy, sampling_seed,
                                           lambda advance=1: progress.advance(task_id, advance),
                                           exclude_run=exclude_run)
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out, document)
    except InputError as error:
        fail(error)
    summary = document["metrics"]
    console.print(f"{plain(policy)}: mean reward {summary['mean_reward']:.4f}, pass@{config.eval_group_size} "
                  f"{summary['pass_at_group']:.4f}, max-length hit ratio "
                  f"{summary['max_length_hit_ratio']:.4f} on {summary['prompt_count']} prompts "
                  f"(seed {sampling_seed})", soft_wrap=True)
    console.print(f"policy version {document['policy']['policy_version']}; eval file: {plain(out)}",
                  soft_wrap=True)


def compare(
    baseline_file: str = typer.Argument(..., metavar="A.json", help="Eval file A (the baseline)."),
    candidate_file: str = typer.Argument(..., metavar="B.json", help="Eval file B (the candidate)."),
    out: Optional[str] = typer.Option(None, metavar="FILE", help="Also write the comparison JSON here."),
    resamples: int = typer.Option(2000, metavar="N", help="Bootstrap resamples."),
    bootstrap_seed: int = typer.Option(0, metavar="N", help="Bootstrap seed."),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
) -> None:
    """Pair two eval files prompt by prompt: gains (B - A), bootstrap intervals, exact tests.

    Refuses (exit 2) when their prompt ids, seeds, verifier versions or group sizes differ.
    """
    from grpogate.files import atomic_write_json, read_json
    from grpogate.review.standalone_eval import compare_evaluations

    try:
        if out and Path(out).exists():  # it may even be one of the inputs: never overwritten
            raise InputError(f"{out}: already exists; choose a new --out for the comparison")
        documents = []
        for name in (baseline_file, candidate_file):
            if not Path(name).is_file():
                raise InputError(f"{name}: no such eval file")
            documents.append(read_json(name))
        result = compare_evaluations(*documents, names=(baseline_file, candidate_file),
                                     resamples=resamples, bootstrap_seed=bootstrap_seed)
        if out:
            atomic_write_json(out, result)
    except InputError as error:
        fail(error)
    if as_json:
        print_json(result)
        return
    console.print(comparison_table(result))
    console.print("gain lower bound: the anytime-valid one-sided 97.5 % bound of the paired gain "
                  "over prompts (a betting test); above 0 resolves a gain")
    for warning in result["warnings"]:
        console.print(f"[yellow]warning:[/] {plain(warning)}", soft_wrap=True)


def comparison_table(result: dict) -> Table:
    paired = result["paired"]
    table = Table(title=f"paired comparison on {paired['prompt_count']} prompts (B - A)")
    for column in ("metric", "A", "B", "gain", f"{paired['confidence']:.0%} bootstrap",
                   "gain lower bound"):
        table.add_column(column)
    a, b = result["baseline"], result["candidate"]
    tests = {"reward_mean_gain": ("mean_reward", paired["reward_mean_gain"]["gain_test"]["bound"]),
             "pass_at_group_gain": ("pass_at_group",
                                    paired["pass_at_group_gain"]["gain_test"]["bound"])}
    for gain, (metric, bound) in tests.items():
        interval = paired[gain]
        table.add_row(metric, f"{a[metric]:.4f}", f"{b[metric]:.4f}", f"{result[gain]:+.4f}",
                      f"[{interval['low']:+.4f}, {interval['high']:+.4f}]", f"{bound:+.4f}")
    table.add_row("mean length", f"{a['length']['mean']:.1f}", f"{b['length']['mean']:.1f}",
                  f"{paired['length_mean_change']:+.1f}", "", "")
    table.add_row("max-length hit ratio", f"{a['max_length_hit_ratio']:.4f}",
                  f"{b['max_length_hit_ratio']:.4f}", f"{paired['max_length_hit_ratio_change']:+.4f}",
                  "", "")
    return table
