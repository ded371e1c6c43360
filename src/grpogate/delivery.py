"""Delivery: the candidate adapter and the run's files, the manifest last (docs/design.md §2, §4).

The adapter is written through a staging directory and a rename; the records, the evidence and
then the manifest follow (its existence means the run completed), and the report after them.
"""

from __future__ import annotations

import resource
from pathlib import Path

import torch

from grpogate.errors import command, plain
from grpogate.evidence.assemble import library_versions
from grpogate.evidence.manifest import GUARD_FILE, PROBLEMS_FILE, build_manifest
from grpogate.files import atomic_directory, atomic_write_bytes, atomic_write_json, jsonl_bytes
from grpogate.inputs.policy import Policy, save_adapter
from grpogate.engines import engine_for, kernels_identity
from grpogate.training.checkpoint import remove_checkpoints


def run_environment(policy: Policy) -> dict:
    """The evidence's `environment`: library versions and how this process ran the policy
    (a grpogate run and a gated foreign run record the same fields)."""
    dtype = next(policy.model.parameters()).dtype
    return library_versions() | {
        "torch_threads": torch.get_num_threads(), "device": str(policy.device),
        "dtype": str(dtype).removeprefix("torch."),
        "native_kernels": kernels_identity(dtype, policy.device),
        "engine": engine_for(policy.model).identity()}


def peak_memory(device: torch.device) -> dict:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    if device.type == "cuda":
        return {"device": "cuda", "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device), "peak_rss_bytes": rss}
    # On the CPU the resident set is the honest peak: there is no allocator to ask.
    return {"device": "cpu", "peak_allocated_bytes": rss, "peak_reserved_bytes": rss,
            "peak_rss_bytes": rss}


def deliver_adapter(policy: Policy, run_dir: Path) -> str:
    """Write adapter/ through a staging directory and a rename; returns the weights' sha256."""
    with atomic_directory(run_dir / "adapter") as staging:
        adapter_sha = save_adapter(policy, staging)
    return adapter_sha


def write_run_files(run_dir: Path, evidence: dict, problems: list[dict],
                    eval_records: list[dict], trajectories: list[dict], reporter,
                    guard_records: list[dict] = ()) -> None:
    """Problems, re-test (and guard) records, evidence, then the manifest (last: the run is
    complete), the report. The problems make the directory self-contained: `decide` re-scores
    from them."""
    atomic_write_bytes(run_dir / PROBLEMS_FILE, jsonl_bytes(problems))
    atomic_write_bytes(run_dir / "eval_completions.jsonl", jsonl_bytes(eval_records))
    if guard_records:
        atomic_write_bytes(run_dir / GUARD_FILE, jsonl_bytes(list(guard_records)))
    atomic_write_json(run_dir / "evidence.json", evidence)
    atomic_write_json(run_dir / "manifest.json", build_manifest(evidence, run_dir, trajectories))
    # A finished run can no longer be resumed: its checkpoints are waste. A run stopped by a
    # signal keeps them: its manifest is interim (status interrupted) and `--resume` continues
    # it, its final manifest then replacing this one by an atomic rename.
    if evidence["status"] != "interrupted":
        remove_checkpoints(run_dir)
    # The report is derived from the files above and written after the manifest: a plotting
    # failure (any exception type matplotlib may raise) is logged and never loses the run;
    # `grpogate report RUN_DIR` can write it again.
    try:
        from grpogate.evidence.report import write_report

        reporter.log(f"report: {plain(write_report(run_dir))}")
    except Exception as error:  # noqa: BLE001
        reporter.log(f"[yellow]report not written ({type(error).__name__}: {plain(error)}); "
                     f"retry with `{command('grpogate', 'report', run_dir)}`")
