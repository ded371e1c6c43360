"""The command line: parse, call the pipeline, print. No pipeline logic lives here.

Exit codes: 0 the run finished and wrote its decision (whatever it is, unless
--exit-code-from-decision), 2 bad input (nothing written), 1 an unexpected failure,
130 / 143 a run stopped by SIGINT / SIGTERM (evidence written with status `interrupted`).
"""

from __future__ import annotations

import contextlib
import errno
import json
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from grpogate.config import load_config
from grpogate.errors import InputError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Auditable GRPO runs that end in an accept / tune / reject decision.")
console = Console(highlight=False)
DECISION_EXIT_CODES = {"accept": 0, "tune": 3, "reject": 4}
OUTPUT_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.EFBIG)
DECISION_STYLE = {"accept": "bold green", "tune": "bold yellow", "reject": "bold red"}


class RichReporter:
    """Progress bars for rollout, update and evaluation, and one log line per step."""

    def __init__(self, progress: Progress):
        self.progress = progress

    @contextlib.contextmanager
    def task(self, description: str, total: int):
        task_id = self.progress.add_task(description, total=max(total, 1))
        try:
            yield lambda advance=1: self.progress.advance(task_id, advance)
        finally:
            self.progress.remove_task(task_id)

    def log(self, message: str) -> None:
        self.progress.console.print(message)


@app.callback()
def main() -> None:
    """grpogate: GRPO with evidence and a delivery decision."""


def _fail(error: Exception) -> None:
    # escape: a message quoting "[gates]" or a path with brackets is text, not rich markup.
    console.print(f"[bold red]error:[/] {escape(str(error))}", soft_wrap=True)
    raise typer.Exit(2)


def gates_table(decision: dict) -> Table:
    table = Table(title="delivery gates")
    for column in ("check", "value", "threshold", "result", "on fail"):
        table.add_column(column)
    for row in decision["checks"]:
        value = row["value"]
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        result = "[green]pass" if row["passed"] else "[red]FAIL"
        table.add_row(row["name"], shown, str(row["threshold"]), result, row["on_fail"])
    return table


@app.command()
def run(
    profile: Optional[str] = typer.Option(None, help="Packaged profile: default, smoke, "
                                          "gsm8k_qwen05b (default: default)."),
    config_file: str = typer.Option("", "--config", help="TOML file applied on top of the profile."),
    gates_file: str = typer.Option("", "--gates", help="TOML or JSON file with a [gates] table "
                                   "applied on top of --config."),
    overrides: list[str] = typer.Option([], "--set", help="key=value override, e.g. task.params.max_digits=3."),
    out: Optional[str] = typer.Option(None, help="Run directory (must not exist)."),
    label: Optional[str] = typer.Option(None, help="Run label: outputs go to runs/<label>."),
    model: Optional[str] = typer.Option(None, help="Bundled id, HF model directory, .gguf file or HF id."),
    adapter: Optional[str] = typer.Option(None, help="Baseline LoRA adapter directory (PEFT, safetensors)."),
    baseline_manifest: Optional[str] = typer.Option(None, help="Baseline manifest JSON (decision accept)."),
    seed: Optional[int] = typer.Option(None, help="Run seed."),
    device: Optional[str] = typer.Option(None, help="auto, cpu or cuda."),
    dtype: Optional[str] = typer.Option(None, help="float32, bfloat16 or auto."),
    tensorboard: Optional[str] = typer.Option(
        None, "--tensorboard", metavar="DIR",
        help="Also write the per-step scalars as TensorBoard event files into DIR."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check config, inputs and environment only."),
    resume: Optional[str] = typer.Option(
        None, "--resume", help="Continue the run in this directory from its last checkpoint, "
        "with its stored config (other options may only repeat it)."),
    exit_code_from_decision: bool = typer.Option(
        False, help="Exit 0 on accept, 3 on tune, 4 on reject."),
) -> None:
    """Run admission, rollout, GRPO update, independent re-test and delivery."""
    from grpogate import pipeline
    from grpogate.interrupts import RunInterrupted, exit_code

    named = dict(model=model, adapter=adapter, baseline_manifest=baseline_manifest, seed=seed,
                 device=device, dtype=dtype, tensorboard=tensorboard)
    config = None
    try:
        if resume is not None:
            config = _resume_config(resume, out, label, dry_run, profile, config_file, gates_file,
                                    overrides, named)
        else:
            config = load_config(profile or "default", config_file, overrides,
                                 gates_file=gates_file, out=out, label=label, **named)
        if dry_run:
            report = pipeline.dry_run(config)
            console.print_json(json.dumps(report))
            console.print("[green]dry run passed:[/] configuration, inputs and environment are usable")
            return
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())
        with Progress(*columns, console=console, transient=False) as progress:
            if resume is not None:
                evidence = pipeline.resume(resume, config, RichReporter(progress))
            else:
                evidence = pipeline.run(config, RichReporter(progress))
    except InputError as error:
        _fail(error)
    except OSError as error:
        if error.errno not in OUTPUT_ERRNOS:
            raise
        # A full or read-only disk is the environment's fault: say which file and the OS's
        # reason; whatever checkpoint was complete before it stays resumable.
        _fail(InputError(f"{error.filename or 'output'}: {error.strerror}; free space or choose "
                         "another --out (a started run continues with --resume)"))
    except RunInterrupted as interrupted:
        console.print(f"[bold red]{escape(str(interrupted))}")
        raise typer.Exit(exit_code(interrupted.signal_name))
    except KeyboardInterrupt:  # a second signal: stopped at once, mid-step
        if config is None:
            raise
        run_dir = resume or config.out or f"runs/{config.label}"
        console.print(f"[bold red]stopped at once;[/] continue from the last checkpoint with "
                      f"`grpogate run --resume {escape(run_dir)}`", soft_wrap=True)
        raise typer.Exit(130)
    decision = evidence["decision"]
    console.print(gates_table(decision))
    comparison = evidence["comparison"]
    if comparison.get("skipped"):
        console.print("re-test skipped: the run stopped before it")
    else:
        console.print(
            f"re-test (correctness verifier alone) mean reward "
            f"{comparison['baseline']['mean_reward']:.4f} -> "
            f"{comparison['candidate']['mean_reward']:.4f}, pass@group "
            f"{comparison['baseline']['pass_at_group']:.4f} -> "
            f"{comparison['candidate']['pass_at_group']:.4f}")
    dynamic = evidence["rollout"].get("dynamic_sampling") or {}
    if dynamic.get("enabled"):
        console.print(f"dynamic sampling: {dynamic['prompts_drawn']} prompts drawn, "
                      f"{dynamic['groups_kept']} groups kept, {dynamic['refill_prompts']} refill "
                      f"prompts costing {dynamic['refill_generation_seconds']:.1f} s of generation")
    style = DECISION_STYLE[decision["decision"]]
    failed = ", ".join(decision["failed_checks"]) or "none"
    console.print(f"decision: [{style}]{decision['decision']}[/] (failed checks: {failed})")
    console.print(f"evidence: {evidence['run_dir']}/manifest.json")
    if evidence["interruption"]:
        stopped = evidence["interruption"]
        console.print(f"[bold red]interrupted by {stopped['signal']}[/] {stopped['safe_point']} "
                      f"after {stopped['completed_steps']} finished step(s); continue it with "
                      f"`grpogate run --resume {escape(evidence['run_dir'])}`", soft_wrap=True)
        raise typer.Exit(exit_code(stopped["signal"]))
    if evidence["failure"]:
        console.print(f"[bold red]{evidence['status']}[/] at step {evidence['failure']['step']}: "
                      f"{escape(evidence['failure']['message'])}", soft_wrap=True)
    if exit_code_from_decision:
        raise typer.Exit(DECISION_EXIT_CODES[decision["decision"]])


def _resume_config(run_dir: str, out, label, dry_run: bool, profile, config_file: str,
                   gates_file: str, overrides: list[str], named: dict):
    """The stored config of the run in `run_dir`; the other options may only repeat it."""
    from grpogate.training.checkpoint import checkpoint_to_resume
    from grpogate.config import resume_config

    if out is not None or label is not None:
        raise InputError("--resume takes the run directory itself; do not pass --out or --label")
    if dry_run:
        raise InputError("--resume and --dry-run cannot be combined")
    checkpoint = checkpoint_to_resume(run_dir)
    return resume_config(checkpoint.state.get("config"), str(checkpoint.directory / "state.json"),
                         profile, config_file, overrides, gates_file, **named)


@app.command()
def decide(
    run_dir: str = typer.Argument(..., help="A finished run directory (evidence.json, manifest.json)."),
    as_json: bool = typer.Option(False, "--json", help="Print the full audit as JSON."),
    replay: int = typer.Option(0, "--replay", metavar="N", min=0,
                               help="Also regenerate the re-test completions of the first N eval "
                               "prompts (both policies) from the delivered artifacts and require "
                               "them to equal the stored ones (loads the model)."),
    verify_key: Optional[str] = typer.Option(
        None, "--verify-key", metavar="PUB",
        help="Also verify RUN_DIR/run.sig (grpogate sign) with this PEM public key."),
) -> None:
    """Re-check a finished run from its files alone and print the decision.

    Recomputes every quantity the trajectories and re-test files determine, re-runs the verifier
    on every stored completion, checks every hash the manifest records and re-runs the decision.
    Exit codes: 0 the audit agrees with the run's own decision and nothing mismatches; 4 reject
    because something mismatches (the fields are named); 2 not a readable run directory.
    """
    from grpogate.evidence.audit import audit_run

    try:
        audit = audit_run(run_dir)
        if replay:
            from grpogate.replay import apply_replay, replay_retest

            audit = apply_replay(audit, replay_retest(run_dir, replay))
        if verify_key:
            from grpogate.signing import verify_run

            problem = verify_run(run_dir, verify_key)
            audit["signature"] = {"key": verify_key, "verified": problem is None}
            if problem is not None:
                audit.update(mismatches=audit["mismatches"] + [
                    {"field": f"signature ({problem})", "recorded": None, "recomputed": None}],
                    decision="reject", agrees=False)
    except InputError as error:
        _fail(error)
    if as_json:
        console.print_json(json.dumps(audit))
    else:
        console.print(gates_table({"checks": audit["checks"]}))
        for name, gate in audit.get("non_default_gates", {}).items():
            console.print(f"[yellow]non-default gate[/] {name} = {gate['value']!r} "
                          f"(default {gate['default']!r})", soft_wrap=True)
        if audit.get("signature", {}).get("verified"):
            console.print(f"signature: run.sig verifies with {escape(verify_key)}", soft_wrap=True)
        if "replay" in audit:
            from grpogate.replay import replay_summary

            console.print(replay_summary(audit["replay"]), soft_wrap=True)
        for mismatch in audit["mismatches"][:50]:
            console.print(f"[red]mismatch[/] {mismatch['field']}: recorded "
                          f"{_short(mismatch['recorded'])}, recomputed {_short(mismatch['recomputed'])}",
                          soft_wrap=True)
        if len(audit["mismatches"]) > 50:
            console.print(f"... and {len(audit['mismatches']) - 50} more mismatches (--json lists all)")
        style = DECISION_STYLE[audit["decision"]]
        verdict = ("agrees with the run's own decision" if audit["agrees"] else
                   f"{len(audit['mismatches'])} mismatch(es); the run recorded "
                   f"{audit['recorded_decision']!r}")
        console.print(f"decision: [{style}]{audit['decision']}[/] ({verdict})")
    if not audit["agrees"]:
        raise typer.Exit(DECISION_EXIT_CODES["reject"])


def _short(value, limit: int = 80) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[:limit - 3] + "..."


@app.command("eval")
def eval_policy(
    policy: str = typer.Option(..., help="BASE[+ADAPTER]: bundled id, HF dir, .gguf or HF id, "
                               "optionally + a PEFT adapter directory."),
    out: str = typer.Option(..., help="Eval file to write (JSON; must not exist)."),
    tasks: Optional[str] = typer.Option(None, help="reasoning-gym:NAME or gsm8k:PATH; default: "
                                        "the profile's task."),
    group_size: Optional[int] = typer.Option(None, help="Samples per prompt (default: the "
                                             "profile's eval_group_size)."),
    seed: Optional[int] = typer.Option(None, help="Sampling seed (default: run seed + 10000, "
                                       "the seed of a run's re-test)."),
    eval_prompts: Optional[int] = typer.Option(None, help="Number of eval prompts."),
    profile: str = typer.Option("default", help="Packaged profile for task params and sampling."),
    config_file: str = typer.Option("", "--config", help="TOML file applied on top of the profile."),
    overrides: list[str] = typer.Option([], "--set", help="key=value override."),
    device: Optional[str] = typer.Option(None, help="auto, cpu or cuda."),
    dtype: Optional[str] = typer.Option(None, help="float32, bfloat16 or auto."),
) -> None:
    """Evaluate one policy alone: per-prompt records plus reduced metrics, for `grpogate compare`."""
    from pathlib import Path

    from grpogate.evidence.assemble import EVAL_SEED_OFFSET
    from grpogate.files import atomic_write_json
    from grpogate.standalone_eval import evaluate_standalone, parse_policy_spec, parse_tasks_spec

    try:
        if Path(out).exists():
            raise InputError(f"{out}: already exists; choose a new --out")
        base, adapter = parse_policy_spec(policy)
        config = load_config(profile, config_file, overrides, model=base, adapter=adapter,
                             device=device, dtype=dtype, eval_prompts=eval_prompts,
                             eval_group_size=group_size,
                             task=parse_tasks_spec(tasks) if tasks else None)
        sampling_seed = seed if seed is not None else config.seed + EVAL_SEED_OFFSET
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            task_id = progress.add_task("evaluate", total=config.eval_prompts * config.eval_group_size)
            document = evaluate_standalone(config, policy, sampling_seed,
                                           lambda advance=1: progress.advance(task_id, advance))
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out, document)
    except InputError as error:
        _fail(error)
    summary = document["metrics"]
    console.print(f"{policy}: mean reward {summary['mean_reward']:.4f}, pass@{config.eval_group_size} "
                  f"{summary['pass_at_group']:.4f}, max-length hit ratio "
                  f"{summary['max_length_hit_ratio']:.4f} on {summary['prompt_count']} prompts "
                  f"(seed {sampling_seed})")
    console.print(f"policy version {document['policy']['policy_version']}; eval file: {out}")


@app.command()
def compare(
    baseline_file: str = typer.Argument(..., help="Eval file A (the baseline)."),
    candidate_file: str = typer.Argument(..., help="Eval file B (the candidate)."),
    out: Optional[str] = typer.Option(None, help="Also write the comparison JSON here."),
    resamples: int = typer.Option(2000, help="Bootstrap resamples."),
    bootstrap_seed: int = typer.Option(0, help="Bootstrap seed."),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
) -> None:
    """Pair two eval files prompt by prompt: gains (B - A), bootstrap intervals, exact tests.

    Refuses (exit 2) when their prompt ids, seeds, verifier versions or group sizes differ.
    """
    from pathlib import Path

    from grpogate.files import atomic_write_json
    from grpogate.standalone_eval import compare_evaluations

    try:
        if out and Path(out).exists():  # it may even be one of the inputs: never overwritten
            raise InputError(f"{out}: already exists; choose a new --out for the comparison")
        documents = []
        for name in (baseline_file, candidate_file):
            if not Path(name).is_file():
                raise InputError(f"{name}: no such eval file")
            try:
                documents.append(json.loads(Path(name).read_text(encoding="utf-8")))
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise InputError(f"{name}: not valid JSON: {error}") from None
        result = compare_evaluations(*documents, names=(baseline_file, candidate_file),
                                     resamples=resamples, bootstrap_seed=bootstrap_seed)
        if out:
            atomic_write_json(out, result)
    except InputError as error:
        _fail(error)
    if as_json:
        console.print_json(json.dumps(result))
        return
    paired = result["paired"]
    table = Table(title=f"paired comparison on {paired['prompt_count']} prompts (B - A)")
    for column in ("metric", "A", "B", "gain", f"{paired['confidence']:.0%} bootstrap", "exact test p"):
        table.add_column(column)
    a, b = result["baseline"], result["candidate"]
    tests = {"reward_mean_gain": ("mean_reward", paired["reward_mean_gain"]["sign_test"]["p_value"]),
             "pass_at_group_gain": ("pass_at_group", paired["pass_at_group_gain"]["mcnemar"]["p_value"])}
    for gain, (metric, p_value) in tests.items():
        interval = paired[gain]
        table.add_row(metric, f"{a[metric]:.4f}", f"{b[metric]:.4f}", f"{result[gain]:+.4f}",
                      f"[{interval['low']:+.4f}, {interval['high']:+.4f}]", f"{p_value:.4g}")
    table.add_row("mean length", f"{a['length']['mean']:.1f}", f"{b['length']['mean']:.1f}",
                  f"{paired['length_mean_change']:+.1f}", "", "")
    table.add_row("max-length hit ratio", f"{a['max_length_hit_ratio']:.4f}",
                  f"{b['max_length_hit_ratio']:.4f}", f"{paired['max_length_hit_ratio_change']:+.4f}",
                  "", "")
    console.print(table)
    console.print("exact tests: sign test on per-prompt mean reward, McNemar on per-prompt pass@group")
    for warning in result["warnings"]:
        console.print(f"[yellow]warning:[/] {warning}")


@app.command()
def sign(
    run_dir: str = typer.Argument(..., help="A finished run directory."),
    key: str = typer.Option(..., "--key", metavar="PRIVATE", help="PEM elliptic-curve private key."),
) -> None:
    """Sign every file of a finished run (RUN_DIR/run.sig, OpenSSF model-signing, local key)."""
    from grpogate.signing import sign_run

    try:
        path = sign_run(run_dir, key)
    except InputError as error:
        _fail(error)
    console.print(f"signature: {path} (verify with `grpogate decide {run_dir} --verify-key PUB`)",
                  soft_wrap=True)


@app.command()
def report(
    run_dir: str = typer.Argument(..., help="A run directory (evidence.json)."),
) -> None:
    """Write RUN_DIR/report.html (self-contained, images embedded) and the report_*.png beside it."""
    from pathlib import Path

    from grpogate.evidence.report import write_report
    from grpogate.files import RunDirLock

    try:
        # One writer per run directory: not while a run or a resume is still writing it.
        with RunDirLock(run_dir) if Path(run_dir).is_dir() else contextlib.nullcontext():
            path = write_report(run_dir)
    except InputError as error:
        _fail(error)
    console.print(f"report: {path}")


if __name__ == "__main__":
    app()
