"""`grpogate run --nproc N ...`: the run under torch's elastic agent, as `torchrun --standalone`.

The agent is started in this process (torch.distributed.launcher), not as a torchrun command,
so that a failed worker group comes back as data (which rank, which exit code or signal)
rather than as every rank's traceback and the agent's report on the terminal (about 270 lines
for one killed worker of two). The workers' stdout (rank 0's progress, tables and `error:`
lines) is the terminal's as before; their stderr and the agent's own log go to a log file.
On a worker that died, one `error:` line on stderr names the rank, how it ended, the log file
(moved into the run directory when the run got that far) and the command that continues the
run. A refusal (exit 2) ends with rank 0's own `error:` line, read back from its stderr log
and printed on stderr; a stop by signal (130 / 143, rank 0 printed how to continue) ends with
that exit code and nothing more.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

from grpogate.errors import command, plain
from grpogate.files import file_mode, write_in_run_dir
from grpogate.cli.terminal import messages

FAILURE_LOG = "torchrun-failure.log"
QUIET_EXITS = (2, 130, 143)  # rank 0 has said why already


def launch(nproc: int, max_restarts: int, worker_args: list[str], run_dir: str | None,
           profile: str) -> int:
    """Run `python -m grpogate <worker_args>` on `nproc` local workers; the exit code.

    `run_dir` is where the workers will write, None for a run without --out or --label: the
    launcher draws the rendezvous id, so it knows the `runs/<profile>-job-<id[:12]>` every
    worker names (elastic.settle_run_dir)."""
    job = uuid.uuid4().hex
    run_dir = run_dir or f"runs/{profile}-job-{job[:12]}"
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logs = Path(tempfile.mkdtemp(prefix="grpogate-torchrun-"))
    agent_log = logging.FileHandler(logs / "agent.log")
    elastic = logging.getLogger("torch.distributed.elastic")
    elastic.addHandler(agent_log)
    elastic.propagate = False  # the agent's warnings and failure report: the log file only
    # torchrun's default: one thread per worker when several share the machine.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=job,
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts,
        logs_specs=DefaultLogsSpecs(log_dir=str(logs), redirects=Std.ERR))
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "grpogate", *worker_args)
        return 0
    except ChildFailedError as error:
        rank, failure = _died_first(error.failures)
        codes = {f.exitcode for f in error.failures.values()}
        if codes <= set(QUIET_EXITS):
            if 2 in codes:
                _repeat_refusal(logs)
            return max(codes)
        where = _keep_log(logs, Path(run_dir))
        how = (f"killed by {failure.signal_name()}" if failure.exitcode < 0
               else f"exit code {failure.exitcode}")
        messages.print(f"[bold red]error:[/] rank {rank} died ({how}); the worker group "
                      f"stopped. Tracebacks: {plain(where)}. "
                      f"{_next_step(run_dir, worker_args, nproc)}", soft_wrap=True)
        return 1
    finally:
        elastic.removeHandler(agent_log)
        agent_log.close()
        elastic.propagate = True


def _repeat_refusal(logs: Path) -> None:
    """Rank 0's `error:` line (a refusal: bad input), from its stderr log, once on stderr."""
    for log in sorted(logs.rglob("stderr.log")):
        if log.parent.name != "0":  # .../attempt_N/<local rank>/stderr.log
            continue
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
        refusal = [line for line in lines if line.startswith("error: ")]
        if refusal:
            messages.print(plain(refusal[-1]), soft_wrap=True, highlight=False)
            return


def expected_run_dir(label, profile: str, config_file: str, overrides) -> str | None:
    """The run directory the workers will name from --label, or from a --config / --set that
    sets out or label; None when nothing does (then `launch` draws the job's default)."""
    from grpogate.config import load_config
    from grpogate.errors import InputError

    try:
        config = load_config(profile, config_file, overrides, label=label)
    except InputError:  # the workers refuse it, in their own words
        return None
    return config.out or (f"runs/{config.label}" if config.label else None)


def _died_first(failures: dict) -> tuple:
    """(rank, failure) of the worker that brought the group down: one killed by a signal
    (not the SIGTERM the agent sends the rest) before one that failed on its own, since the
    others then fail in their next collective (gloo: connection closed by peer)."""
    killed = {r: f for r, f in failures.items() if f.exitcode < 0 and f.signal_name() != "SIGTERM"}
    pool = killed or failures
    rank = min(pool, key=lambda r: (pool[r].timestamp, r))
    return rank, pool[rank]


def _keep_log(logs: Path, run_dir: Path) -> Path:
    """Every rank's stderr of every attempt and the agent's log, as one file: in the run
    directory when it exists, else in the temporary log folder."""
    parts = sorted(logs.rglob("stderr.log")) + [logs / "agent.log"]
    target = run_dir / FAILURE_LOG if run_dir.is_dir() else logs / FAILURE_LOG
    text = "".join(f"==> {part.relative_to(logs)} <==\n"
                   + part.read_text(encoding="utf-8", errors="replace") for part in parts)
    # Replaced atomically, no link followed (files/confine.py): a FAILURE_LOG symlink planted in
    # the run directory is replaced, its target untouched.
    write_in_run_dir(target.parent, target.name, text.encode("utf-8"), file_mode())
    if run_dir.is_dir():
        shutil.rmtree(logs, ignore_errors=True)
    return target


def _next_step(run_dir: str, worker_args: list[str], nproc: int) -> str:
    checkpoints = Path(run_dir) / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.glob("step-*")):
        return ("Continue it with `" + command("grpogate", "run", "--resume", run_dir,
                                               "--nproc", nproc) + "`")
    if "--resume" in worker_args:
        return "Continue it with `" + command("grpogate", "run", *worker_args, "--nproc", nproc) + "`"
    return "No step finished, so there is nothing to resume: start the run again."
