"""The command line: parse, call the pipeline, print. No pipeline logic lives here.

Exit codes: 0 the run finished and wrote its decision (whatever it is, unless
--exit-code-from-decision), 2 bad input (nothing written), 1 an unexpected failure.
"""

from __future__ import annotations

import contextlib
import json
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from grpogate.config import load_config
from grpogate.errors import InputError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Auditable GRPO runs that end in an accept / tune / reject decision.")
console = Console(highlight=False)
DECISION_EXIT_CODES = {"accept": 0, "tune": 3, "reject": 4}
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
    console.print(f"[bold red]error:[/] {error}", soft_wrap=True)
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
    profile: str = typer.Option("default", help="Packaged profile: default, smoke, gsm8k_qwen05b."),
    config_file: str = typer.Option("", "--config", help="TOML file applied on top of the profile."),
    overrides: list[str] = typer.Option([], "--set", help="key=value override, e.g. task.params.max_digits=3."),
    out: Optional[str] = typer.Option(None, help="Run directory (must not exist)."),
    label: Optional[str] = typer.Option(None, help="Run label: outputs go to runs/<label>."),
    model: Optional[str] = typer.Option(None, help="Bundled id, HF model directory, .gguf file or HF id."),
    adapter: Optional[str] = typer.Option(None, help="Baseline LoRA adapter directory (PEFT, safetensors)."),
    baseline_manifest: Optional[str] = typer.Option(None, help="Baseline manifest JSON (decision accept)."),
    seed: Optional[int] = typer.Option(None, help="Run seed."),
    device: Optional[str] = typer.Option(None, help="auto, cpu or cuda."),
    dtype: Optional[str] = typer.Option(None, help="float32, bfloat16 or auto."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check config, inputs and environment only."),
    exit_code_from_decision: bool = typer.Option(
        False, help="Exit 0 on accept, 3 on tune, 4 on reject."),
) -> None:
    """Run admission, rollout, GRPO update, independent re-test and delivery."""
    from grpogate import pipeline

    try:
        config = load_config(profile, config_file, overrides, out=out, label=label, model=model,
                             adapter=adapter, baseline_manifest=baseline_manifest, seed=seed,
                             device=device, dtype=dtype)
        if dry_run:
            report = pipeline.dry_run(config)
            console.print_json(json.dumps(report))
            console.print("[green]dry run passed:[/] configuration, inputs and environment are usable")
            return
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())
        with Progress(*columns, console=console, transient=False) as progress:
            evidence = pipeline.run(config, RichReporter(progress))
    except InputError as error:
        _fail(error)
    decision = evidence["decision"]
    console.print(gates_table(decision))
    comparison = evidence["comparison"]
    console.print(
        f"re-test mean reward {comparison['baseline']['mean_reward']:.4f} -> "
        f"{comparison['candidate']['mean_reward']:.4f}, pass@group "
        f"{comparison['baseline']['pass_at_group']:.4f} -> {comparison['candidate']['pass_at_group']:.4f}")
    style = DECISION_STYLE[decision["decision"]]
    failed = ", ".join(decision["failed_checks"]) or "none"
    console.print(f"decision: [{style}]{decision['decision']}[/] (failed checks: {failed})")
    console.print(f"evidence: {evidence['run_dir']}/manifest.json")
    if exit_code_from_decision:
        raise typer.Exit(DECISION_EXIT_CODES[decision["decision"]])


if __name__ == "__main__":
    app()
