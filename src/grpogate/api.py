"""The Python API for a run: build a configuration in code, run it, read the result.

    import grpogate

    config = grpogate.load_config("default", steps=16, learning_rate=5e-5,
                                  task={"source": "reasoning-gym", "name": "chain_sum"})
    result = grpogate.run(config)
    result.decision, result.reward_mean_gain, result.reward_mean_gain_interval, result.run_dir

`load_config(profile, config_file, overrides, **keys)` starts from a packaged profile (as
`grpogate run --profile` does), then the TOML file, the `--set`-style overrides and the keyword
arguments named as the configuration keys (`grpogate config show` lists them; `steps` sets
train_prompts = steps x prompts_per_step). A `RunConfig` built or changed by hand is validated
when it runs. `run` is what `grpogate run` executes (the CLI is a thin layer over it).

Errors: anything wrong with the inputs (a key, a value, a file, a model, a dataset, an output
directory that exists, a full disk) raises `grpogate.InputError` (a ValueError) with one line
naming the file and field; input errors are found before anything is written. A run stopped by
SIGINT / SIGTERM returns its result with status "interrupted" (continue it with
`grpogate run --resume RUN_DIR`), or, stopped before it wrote anything, raises
`grpogate.interrupts.RunInterrupted`.
"""

from __future__ import annotations

import dataclasses
import errno
from dataclasses import dataclass
from pathlib import Path

from grpogate.config import RunConfig, load_config, validate  # noqa: F401 (re-exported)
from grpogate.errors import InputError

OUTPUT_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.EFBIG)


@dataclass(frozen=True)
class RunResult:
    """What a run ended with; `evidence` is the whole evidence document (evidence.json)."""

    decision: str  # accept | tune | reject
    failed_checks: list[str]
    status: str
    reward_mean_gain: float
    pass_at_group_gain: float
    reward_mean_gain_interval: tuple[float, float] | None  # 95 % paired bootstrap
    run_dir: Path
    evidence: dict

    @classmethod
    def from_evidence(cls, evidence: dict) -> "RunResult":
        comparison = evidence["comparison"]
        interval = (comparison.get("paired") or {}).get("reward_mean_gain")
        return cls(decision=evidence["decision"]["decision"],
                   failed_checks=list(evidence["decision"]["failed_checks"]),
                   status=evidence["status"], reward_mean_gain=comparison["reward_mean_gain"],
                   pass_at_group_gain=comparison["pass_at_group_gain"],
                   reward_mean_gain_interval=(interval["low"], interval["high"])
                   if interval else None,
                   run_dir=Path(evidence["run_dir"]), evidence=evidence)


def output_disk_error(error: OSError, out_name: str = "out") -> InputError:
    """A full or read-only output disk as one input error: the file and the OS's reason (it is
    the environment's fault; whatever checkpoint was complete before it stays resumable)."""
    return InputError(f"{error.filename or 'output'}: {error.strerror}; free space or choose "
                      f"another {out_name} (a started run continues with --resume)")


def run(run_config: RunConfig, reporter=None, world=None, *, out_name: str = "out") -> RunResult:
    """Run every stage (admission, rollout + update, re-test, delivery) and return the result.
    `reporter` receives progress (`task(description, total)`, `log(message)`); `world` is the
    torchrun world (the CLI passes it; a script leaves it None: one process); `out_name` is
    how a full-disk error names the output setting to change (the CLI's is --out)."""
    from grpogate import pipeline
    from grpogate.distributed import SINGLE

    checked = validate(dataclasses.replace(run_config))
    try:
        evidence = pipeline.run(checked, reporter, world or SINGLE)
    except OSError as error:
        if error.errno not in OUTPUT_ERRNOS:
            raise
        raise output_disk_error(error, out_name) from None
    if run_config.label != checked.label:
        run_config.label = checked.label  # the run named itself: the caller can read it
    return RunResult.from_evidence(evidence)
