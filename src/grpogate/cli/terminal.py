"""What the terminal shows: progress bars, log lines, the gates table, errors, quiet libraries.

The CLI's commands use these; nothing here runs a pipeline stage. Library noise a user cannot
act on (transformers' weight-loading bar, a FutureWarning transformers raises inside its own
gradient-checkpointing property) is silenced here, for the command line only: a Python caller
of grpogate keeps its own warning and progress-bar settings.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import warnings

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from typer.core import TyperGroup

from grpogate.errors import plain

# emoji=False: ":warning:" in a recorded string prints as typed, like every other text.
# `console` is the output (tables, results, JSON: stdout); `messages` is every `error:` line and
# note (stderr), so that `grpogate ... --json | jq` reads the output alone.
console = Console(highlight=False, emoji=False)
messages = Console(stderr=True, highlight=False, emoji=False)
DECISION_EXIT_CODES = {"accept": 0, "tune": 3, "reject": 4}
DECISION_STYLE = {"accept": "bold green", "tune": "bold yellow", "reject": "bold red"}
BYTE_CHECKS = ("memory",)  # gate checks whose value and threshold are byte counts


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


def progress_bars(transient: bool = False) -> Progress:
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    return Progress(*columns, console=console, transient=transient)


class _ConsoleHandler(logging.Handler):
    """grpogate's own log lines (the GGUF dequantization notice, a TRL name's note) printed on
    stderr with the other messages."""

    def emit(self, record: logging.LogRecord) -> None:
        messages.print(plain(record.getMessage()), style="dim", soft_wrap=True)


def quiet_libraries() -> None:
    """Silence library output a user cannot act on; show grpogate's own log lines."""
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*",
                            category=FutureWarning)
    try:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # "Loading weights: 100%|..."
        transformers_logging.set_verbosity_error()
    except ImportError:  # decide / compare need no transformers
        pass
    # MLflow configures its own logger at import (INFO: database set-up chatter on first use);
    # its variable sets that level, unless the user set it already.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    logger = logging.getLogger("grpogate")
    if not any(isinstance(h, _ConsoleHandler) for h in logger.handlers):
        logger.addHandler(_ConsoleHandler())
    logger.setLevel(logging.INFO)


def print_error(message) -> None:
    """One `error:` line on stderr. plain: a message quoting "[gates]", a path with brackets or
    a file's bytes is text; its line breaks print as escapes, so it stays one line."""
    messages.print(f"[bold red]error:[/] {plain(message)}", soft_wrap=True)


def fail(error: Exception) -> None:
    print_error(error)
    raise typer.Exit(2)


# click's exception classes, as the installed typer raises them (typer 0.29 carries its own
# copy of click; earlier ones use click itself).
_CLICK_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


class OneLineErrors(TyperGroup):
    """The `grpogate` command group, whose usage errors (an unknown option, a value that is not
    a number, a missing argument) are one `error:` line on stderr and exit 2, like every other
    refusal, instead of click's usage text or typer's boxed panel. Both `grpogate` and typer's
    CliRunner enter through `main`."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True,
             **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except _CLICK_ERROR as error:
            if type(error).__name__ == "NoArgsIsHelpError":  # a bare `grpogate`: typer has
                raise SystemExit(error.exit_code) from None  # printed the help already
            print_error(usage_error_words(error))
            raise SystemExit(2) from None
        raise SystemExit(code if isinstance(code, int) else 0)


def usage_error_words(error: Exception) -> str:
    """click's message on one line, with the command it refers to and where its options are
    listed: "run: No such option: --stepz ... (see grpogate run --help)"."""
    message = " ".join(error.format_message().split())
    names, context = [], getattr(error, "ctx", None)
    while context is not None and context.parent is not None:  # the root is `grpogate`
        names.insert(0, context.info_name)
        context = context.parent
    where = f"{' '.join(names)}: " if names else ""
    return f"{where}{message} (see {' '.join(['grpogate', *names, '--help'])})"


def _finite(value):
    """The value with every non-finite float as None: JSON has no NaN or Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def print_json(value) -> None:
    """`--json` output: strict JSON, ASCII only. A run directory's strings can hold terminal
    controls (C1 codes such as U+009B, bidirectional overrides); escaped as \\uXXXX they reach
    the terminal as text, and a non-finite number read from a forged file prints as null."""
    typer.echo(json.dumps(_finite(value), indent=2, ensure_ascii=True, allow_nan=False))


def human_bytes(count: float) -> str:
    """1536 -> "1.5 KiB", 10 * 1024**3 -> "10.0 GiB": binary units, one decimal."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _shown(value, in_bytes: bool) -> str:
    if in_bytes and isinstance(value, (int, float)) and not isinstance(value, bool):
        return human_bytes(value)
    return f"{value:.4g}" if isinstance(value, float) else plain(value)


def gates_table(decision: dict) -> Table:
    """One row per check, sized to fit an 80-column terminal: names, values and results never
    wrap; only a long threshold text (the artifact's) wraps inside its own cell."""
    table = Table(title="delivery gates", padding=(0, 1), collapse_padding=True)
    for column in ("check", "value", "threshold", "result", "on fail"):
        table.add_column(column, no_wrap=column != "threshold", min_width=len(column),
                         overflow="fold")
    for row in decision["checks"]:
        in_bytes = row["name"] in BYTE_CHECKS
        result = "[green]pass" if row["passed"] else "[red]FAIL"
        # Every cell but the result is read from evidence (decide: a stranger's file): text.
        table.add_row(plain(row["name"]), _shown(row["value"], in_bytes),
                      _shown(row["threshold"], in_bytes), result, plain(row["on_fail"]))
    return table
