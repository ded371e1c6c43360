"""The command line: parse, call the pipeline, print. No pipeline logic lives here.

`app` is the `grpogate` command (run, decide, sign, report, config show); `eval_commands` adds
eval / compare, and `terminal` is the output they share (progress bars, the gates table).

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

from grpogate import api
from grpogate.cli import eval_commands, gate_commands, options
from grpogate.cli.plan import print_dry_run
from grpogate.cli.results import print_audit_lines, print_run_result
from grpogate.evidence.retest_checks import test_lines
from grpogate.cli.terminal import (DECISION_EXIT_CODES, DECISION_STYLE, OneLineErrors,
                                   RichReporter, console, fail, gates_table,
                                   print_error, print_json, progress_bars, quiet_libraries)
from grpogate.config import load_config
from grpogate.errors import InputError, command, plain
from grpogate.evidence.audit_bounds import mismatches_found

app = typer.Typer(cls=OneLineErrors, add_completion=False, no_args_is_help=True,
                  rich_markup_mode="rich",
                  help="Auditable GRPO runs that end in an accept / tune / reject decision.")
config_app = typer.Typer(no_args_is_help=True, help="Show the configuration and what each key means.")
app.add_typer(config_app, name="config")
OUTPUT_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.EFBIG)


def _hide_type_tags() -> None:
    """Typer prints a type tag (<str>, <bool>, <list[str]>) beside every option that has no
    metavar; a flag needs none and every value option here names its own metavar."""
    from typer.core import TyperArgument, TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None:  # an older typer prints click's own metavars, no tags
        return

    def display_type_rich(self, ctx):
        if self.is_flag or self.metavar is None and self.name == "help":
            return None
        return shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich
    TyperArgument.display_type_rich = lambda self, ctx: None  # the metavar is its name


_hide_type_tags()


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        console.print(f"grpogate {version('grpogate')}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the installed grpogate version and exit."),
) -> None:
    """grpogate: GRPO with evidence and a delivery decision."""
    quiet_libraries()


@app.command()
def run(
    profile: Optional[str] = options.PROFILE,
    config_file: str = options.CONFIG_FILE,
    gates_file: str = options.GATES_FILE,
    overrides: list[str] = options.OVERRIDES,
    out: Optional[str] = options.OUT,
    label: Optional[str] = options.LABEL,
    model: Optional[str] = options.MODEL,
    adapter: Optional[str] = options.ADAPTER,
    task: Optional[str] = options.TASK,
    steps: Optional[int] = options.STEPS,
    group_size: Optional[int] = options.GROUP_SIZE,
    learning_rate: Optional[float] = options.LEARNING_RATE,
    max_new_tokens: Optional[int] = options.MAX_NEW_TOKENS,
    baseline_manifest: Optional[str] = options.BASELINE_MANIFEST,
    seed: Optional[int] = options.SEED,
    device: Optional[str] = options.DEVICE,
    dtype: Optional[str] = options.DTYPE,
    report_to: Optional[str] = options.REPORT_TO,
    tensorboard: Optional[str] = options.TENSORBOARD,
    dry_run: bool = options.DRY_RUN,
    as_json: bool = options.DRY_RUN_JSON,
    resume: Optional[str] = options.RESUME,
    exit_code_from_decision: bool = options.EXIT_CODE_FROM_DECISION,
    nproc: Optional[int] = options.NPROC,
    max_restarts: int = options.MAX_RESTARTS,
) -> None:
    """Run admission, rollout, GRPO update, independent re-test and delivery.

    The defaults shown are the default profile's; --profile and --config change them
    (`grpogate config show --profile NAME` lists every value)."""
    if nproc is not None:
        raise typer.Exit(_launch_torchrun(nproc, max_restarts, resume or out, label, profile,
                                          config_file, overrides))
    from grpogate.distributed import close_world, init_world

    world = init_world()
    if not world.is_main:
        console.quiet = True  # one voice: rank 0 prints, the others only compute
    try:
        _run(profile, config_file, gates_file, overrides, out, label, dry_run, as_json, resume,
             exit_code_from_decision, world,
             dict(model=model, adapter=adapter, baseline_manifest=baseline_manifest, seed=seed,
                  device=device, dtype=dtype, tensorboard=tensorboard, steps=steps,
                  group_size=group_size, learning_rate=learning_rate,
                  max_new_tokens=max_new_tokens, report_to=report_to, task=task))
    finally:
        close_world(world)


def _launch_torchrun(nproc: int, max_restarts: int, run_dir, label, profile, config_file,
                     overrides) -> int:
    """`grpogate run --nproc N ...` -> the elastic agent (cli/launch.py) with the same arguments,
    less these two."""
    import sys

    from grpogate.cli.launch import expected_run_dir, launch

    run_dir = run_dir or expected_run_dir(label, profile or "default", config_file, overrides)
    return launch(nproc, max_restarts, torchrun_arguments(sys.argv[1:]), run_dir,
                  profile or "default")


def torchrun_arguments(argv: list[str]) -> list[str]:
    """`argv` without --nproc / --max-restarts (and their values): what each worker runs."""
    kept, skip = [], False
    for argument in argv:
        if skip:
            skip = False
        elif argument in ("--nproc", "--max-restarts"):
            skip = True
        elif not argument.startswith(("--nproc=", "--max-restarts=")):
            kept.append(argument)
    return kept


def _run(profile, config_file, gates_file, overrides, out, label, dry_run, as_json, resume,
         exit_code_from_decision, world, named: dict) -> None:
    from grpogate import admission, pipeline
    from grpogate.interrupts import RunInterrupted, exit_code
    from grpogate.pipeline import NullReporter
    from grpogate.review.standalone_eval import parse_tasks_spec

    config = None
    task = named.pop("task")
    try:
        if as_json and not dry_run:
            raise InputError("--json goes with --dry-run (a run's evidence is RUN_DIR/"
                             "evidence.json; `grpogate decide RUN_DIR --json` prints its audit)")
        named["task"] = parse_tasks_spec(task) if task else None
        if resume is not None:
            config = _resume_config(resume, out, label, dry_run, profile, config_file, gates_file,
                                    overrides, named)
        else:
            config = load_config(profile or "default", config_file, overrides,
                                 gates_file=gates_file, out=out, label=label, **named)
        if dry_run:
            print_dry_run(admission.dry_run(config), as_json)
            return
        with progress_bars() if world.is_main else contextlib.nullcontext() as progress:
            reporter = RichReporter(progress) if world.is_main else NullReporter()
            if resume is not None:
                from grpogate.config import rewards_named_by

                evidence = pipeline.resume(resume, config, reporter, world,
                                           reward_code=rewards_named_by(config_file, overrides))
            else:
                evidence = api.run(config, reporter, world, out_name="--out").evidence
    except InputError as error:
        fail(error)
    except pipeline.UnstartedRunFailed as error:
        print_error(error)
        raise typer.Exit(1)
    except OSError as error:
        if error.errno not in OUTPUT_ERRNOS:
            raise
        fail(api.output_disk_error(error, "--out"))  # a resumed run's full or read-only disk
    except RunInterrupted as interrupted:
        console.print(f"[bold red]{plain(interrupted)}")
        raise typer.Exit(exit_code(interrupted.signal_name))
    except KeyboardInterrupt:  # a second signal: stopped at once, mid-step
        if config is None:
            raise
        run_dir = resume or config.out or f"runs/{config.label}"
        console.print(f"[bold red]stopped at once;[/] continue from the last checkpoint with "
                      f"`{command('grpogate', 'run', '--resume', run_dir)}`", soft_wrap=True)
        raise typer.Exit(130)
    print_run_result(evidence, exit_code_from_decision)


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
    run_dir: str = options.RUN_DIR,
    as_json: bool = options.AS_JSON,
    replay: int = options.REPLAY,
    verify_key: Optional[str] = options.VERIFY_KEY,
    trust_reward_code: list[str] = options.TRUST_REWARD_CODE,
    max_rescore: Optional[int] = options.MAX_RESCORE,
) -> None:
    """Re-check a finished run from its files alone and print the decision.

    Recomputes every quantity the trajectories and re-test files determine, re-runs the verifier
    on every stored completion, checks every hash the manifest records and re-runs the decision.
    The run directory is data: no code it names is run (see --trust-reward-code).
    Exit codes: 0 the audit agrees with the run's own decision and nothing mismatches; 4 reject
    because something mismatches (the fields are named); 2 not a readable run directory.
    """
    from grpogate.evidence.foreign_audit import audit_any

    try:
        audit = audit_any(run_dir, trusted_rewards=trust_reward_code, max_rescore=max_rescore,
                          announce=lambda line: typer.echo(f"decide: {line}", err=True))
        if replay:
            from grpogate.review.replay import apply_replay, replay_retest

            audit = apply_replay(audit, replay_retest(run_dir, replay))
        if verify_key:
            from grpogate.review.signing import verify_run

            problem = verify_run(run_dir, verify_key)
            audit["signature"] = {"key": verify_key, "verified": problem is None}
            if problem is not None:
                audit.update(mismatches=audit["mismatches"] + [
                    {"field": f"signature ({problem})", "recorded": None, "recomputed": None}],
                    decision="reject", agrees=False)
    except InputError as error:
        fail(error)
    if as_json:
        print_json(audit)
    else:
        console.print(gates_table({"checks": audit["checks"]}))
        if audit["checks"]:  # an unreadable evidence file has no gates to read
            console.print(plain(audit["gain_rule_line"]), soft_wrap=True)
        for line in test_lines({"checks": audit["checks"]}):
            console.print(line, soft_wrap=True)
        if audit.get("no_change"):
            console.print(f"[bold red]{plain(audit['no_change'])}[/]", soft_wrap=True)
        print_audit_lines(audit, verify_key)
        found, listed = mismatches_found(audit["mismatches"])
        if found > 50:
            console.print(f"... and {found - 50} more mismatches (--json lists the first "
                          f"{listed})")
        style = DECISION_STYLE[audit["decision"]]
        verdict = ("agrees with the run's own decision" if audit["agrees"] else
                   f"{found} mismatch(es); the run recorded "
                   f"{plain(repr(audit['recorded_decision']))}")
        console.print(f"decision: [{style}]{audit['decision']}[/] ({verdict})")
    if not audit["agrees"]:
        raise typer.Exit(DECISION_EXIT_CODES["reject"])


app.command("eval")(eval_commands.eval_policy)
app.command()(eval_commands.compare)
app.command("gate")(gate_commands.gate_command(print_run_result))


@app.command()
def sign(
    run_dir: str = typer.Argument(..., help="A finished run directory."),
    key: str = typer.Option(..., "--key", metavar="PRIVATE", help="PEM elliptic-curve private key."),
) -> None:
    """Sign every file of a finished run (RUN_DIR/run.sig, OpenSSF model-signing, local key)."""
    from grpogate.review.signing import sign_run

    try:
        path = sign_run(run_dir, key)
    except InputError as error:
        fail(error)
    console.print(f"signature: {plain(path)} (verify with "
                  f"`{command('grpogate', 'decide', run_dir, '--verify-key')} PUB`)", soft_wrap=True)


@app.command()
def report(
    run_dir: str = typer.Argument(..., metavar="RUN_DIR", help="A run directory (evidence.json)."),
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
        fail(error)
    console.print(f"report: {plain(path)}", soft_wrap=True)


@config_app.command("show")
def config_show(
    profile: str = typer.Option("default", metavar="NAME", help="Packaged profile to show."),
    config_file: str = typer.Option("", "--config", metavar="FILE",
                                    help="TOML file applied on top of the profile."),
    overrides: list[str] = typer.Option([], "--set", metavar="KEY=VALUE", help="Override a key."),
    as_json: bool = typer.Option(False, "--json", help="Print the resolved config as JSON."),
) -> None:
    """Every configuration key: its value in the profile, its type and what it means."""
    from grpogate.config.keys import describe_config

    try:
        config = load_config(profile, config_file, overrides)
    except InputError as error:
        fail(error)
    if as_json:
        print_json(config.to_dict() | {"steps": config.steps})
        return
    # TOML, one key a line with its type and meaning as a comment: copy lines into --config.
    from grpogate.config import profile_note

    if profile_note(profile):
        console.print(f"# profile {plain(profile)}: {plain(profile_note(profile))}",
                      soft_wrap=True)
    section = ""
    rows = describe_config(config)
    # Top-level keys first: in TOML a key after [task] belongs to [task].
    for key, value, type_name, meaning in sorted(rows, key=lambda row: "." in row[0]):
        table, _, name = key.rpartition(".")
        if table != section:
            console.print(f"\n\\[{table}]", highlight=False)
            section = table
        line = f"{name} = {_toml_literal(value)}"
        if key == "steps":  # derived: shown, not a key of its own in the file
            line = "# " + line
        console.print(f"{plain(line):<34} [dim]# {type_name}: {plain(meaning)}[/]", soft_wrap=True)


def _toml_literal(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    return json.dumps(value) if isinstance(value, str) else repr(value)
