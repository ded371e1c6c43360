"""Admission, the first stage: check the configuration, the inputs and the environment, and fix
the inputs' identities, before anything is written (docs/design.md §2).

`admit` checks what needs no model: the output path, trackers, the baseline (its adapter
directory or manifest), the problem sets and their isolation, the verifier and the reward set.
Once the weights are loaded, `check_budget` (called by `pipeline.prepare`, before the run
directory exists) checks the memory estimate and disk room (inputs/budget.py, pure arithmetic)
against what this machine has. `grpogate run --dry-run` calls `dry_run`, whose
`dry_run_checks` makes the same checks from the model's config.json and tokenizer only (prompt
token lengths, LoRA target modules, memory, disk), so it refuses what the run would refuse,
with the same message; a hub id is resolved first, by the run's own rule (inputs/hub_model.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Collection

import torch

from grpogate import planning
from grpogate.config import RunConfig
from grpogate.errors import InputError
from grpogate.evidence import stopping
from grpogate.evidence.assemble import library_versions
from grpogate.evidence.manifest import read_baseline_manifest
from grpogate.evidence.trackers import check_trackers
from grpogate.files import refuse_existing_output, refuse_output_inside_a_run
from grpogate.inputs import budget, tasks
from grpogate.engines import expected_engine
from grpogate.inputs.policy import (check_adapter_dir, check_target_modules, default_cache_dir,
                                    resolve_base_model, resolve_device, resolve_dtype,
                                    weightless_model)
from grpogate.inputs.rewards import RewardSet, reward_set_from_config, user_reward_names
from grpogate.inputs.tasks import Problem
from grpogate.inputs.verifiers import check_references, get_verifier
from grpogate.sampling.rollout import encode_prompts
from grpogate.training.checkpoint import never_checkpointed


@dataclass
class Admission:
    """Everything frozen before the first completion is sampled."""

    config: RunConfig
    run_dir: Path
    model_spec: str
    model_revision: str
    adapter: str
    verifier: object
    reward_set: RewardSet
    train: list[Problem]
    eval: list[Problem]
    train_identity: dict
    eval_identity: dict
    baseline_version: str = ""  # what --baseline-manifest claims; the loaded policy must match
    # The re-test's guard set (config [guard]; empty when off), its identity and own verifier.
    guard: list[Problem] = field(default_factory=list)
    guard_identity: dict = field(default_factory=lambda: {"enabled": False})
    guard_verifier: object = None


def run_dir_for(config: RunConfig) -> Path:
    if config.out:
        return Path(config.out)
    label = config.label or f"{config.profile}-{datetime.now():%Y%m%d-%H%M%S}"
    config.label = label
    return Path("runs") / label


def load_problem_sets(config: RunConfig) -> tuple[list[Problem], dict, list[Problem], dict]:
    return tasks.load_problem_sets(config.task, config.train_prompts, config.eval_prompts)


def admit(config: RunConfig, resume_dir: Path | None = None,
          reward_code: Collection[str] | None = None) -> Admission:
    """Check config, inputs and environment; raises InputError before anything is written.

    A new run refuses an existing output path; a resumed run (`resume_dir`) reuses its own.
    `reward_code`: the user rewards (`module:function`) the user named on this command line;
    None when `config` is the user's own. A resumed run's config comes from its directory:
    every user reward in it must be named again, or nothing of it is imported.
    """
    run_dir = resume_dir or run_dir_for(config)
    if reward_code is not None:
        refuse_unnamed_reward_code(config, reward_code, run_dir)
    if resume_dir is None:
        if not never_checkpointed(run_dir):  # one a killed run left is replaced (open_run)
            refuse_existing_output(run_dir)
        refuse_output_inside_a_run(run_dir)
    # writable now; the room it needs is checked once the model's shapes are known
    budget.check_output_writable(run_dir, 0)
    if config.tensorboard and Path(config.tensorboard).is_file():
        raise InputError(f"tensorboard {config.tensorboard}: is a file; give a directory for the "
                         "events files")
    check_trackers(config)
    model_spec, revision, adapter = config.model, config.model_revision, config.adapter
    baseline_version = ""
    if config.baseline_manifest:
        baseline = read_baseline_manifest(config.baseline_manifest)
        model_spec, revision, adapter = baseline["model"], baseline["revision"], baseline["adapter"]
        baseline_version = baseline["policy_version"]
    if adapter:
        check_adapter_dir(adapter)
    # Problems before the verifier: an unknown task name is then reported as the task's error.
    train, train_id, eval_set, eval_id = load_problem_sets(config)
    try:
        verifier = get_verifier(config.resolved_verifier())
    except ValueError as error:
        raise InputError(f"verifier: {error}") from None
    check_references(verifier, train + eval_set)
    try:
        reward_set = reward_set_from_config(config.to_dict(), verifier.version,
                                            importable=reward_code)
    except ValueError as error:
        raise InputError(f"config: rewards: {error}") from None
    guard, guard_id, guard_verifier = guard_set(config, train, eval_set)
    return Admission(config=config, run_dir=run_dir, model_spec=model_spec, model_revision=revision,
                     adapter=adapter, verifier=verifier, reward_set=reward_set, train=train,
                     eval=eval_set, train_identity=train_id, eval_identity=eval_id,
                     baseline_version=baseline_version, guard=guard, guard_identity=guard_id,
                     guard_verifier=guard_verifier)


def guard_set(config: RunConfig, train: list[Problem], eval_set: list[Problem]):
    """The re-test's guard problems (disjoint from train and eval), their identity and their
    own verifier (None when the guard is off)."""
    guard, guard_id = tasks.load_guard_set(config.guard, train, eval_set)
    guard_verifier = None
    if config.guard.enabled:
        try:
            guard_verifier = get_verifier(config.guard.verifier())
        except ValueError as error:
            raise InputError(f"guard: {error}") from None
    return guard, guard_id, guard_verifier


def refuse_unnamed_reward_code(config: RunConfig, reward_code: Collection[str],
                               run_dir: Path) -> None:
    """InputError when the stored config names user reward code the user did not name."""
    unnamed = [name for name in user_reward_names(config.rewards) if name not in reward_code]
    if unnamed:
        raise InputError(
            f"{run_dir}: the run's rewards name user code ({', '.join(unnamed)}); --resume "
            "imports only reward code you name: pass --config FILE (or --set 'rewards=[...]') "
            "with the same rewards as the run")


def dry_run(config: RunConfig) -> dict:
    """Everything a run checks before it writes, without loading the weights or sampling:
    admission, the model resolved as the run resolves it (a hub id at its pinned commit, from
    the cache offline), the prompts' token lengths, the LoRA target modules (on a weightless
    copy of the model), the memory estimate and the disk room; -> the plan the run follows."""
    admission = admit(config)
    source = resolve_base_model(admission.model_spec, admission.model_revision,
                                default_cache_dir(config), weights=False)
    checked, tokenizer = dry_run_checks(admission, source)
    runtime = {key: checked[key] for key in ("engine", "device", "dtype")}
    return {"run_dir": str(admission.run_dir), "model": source.identity(),
            "adapter": admission.adapter or None, "engine": checked["engine"],
            "device": checked["device"], "dtype": checked["dtype"],
            "memory_estimate_bytes": checked["memory_estimate_bytes"],
            "verifier": admission.verifier.version, "rewards": admission.reward_set.describe(),
            "train_prompts": len(admission.train), "eval_prompts": len(admission.eval),
            "guard_prompts": len(admission.guard), "steps": config.steps,
            "retest_plan": retest_plan(config), "gates": dataclasses.asdict(config.gates),
            "libraries": library_versions(),
            **planning.cost_figures(admission, source, tokenizer, runtime)}


def retest_plan(config: RunConfig) -> dict | None:
    """The sequential re-test's looks, most completions and what it resolves at its maximum,
    at the default's measured spreads (stopping.plan); None under a config without it."""
    design = stopping.design_of(config.to_dict())
    if design is None:
        return None
    gates = dataclasses.asdict(config.gates)
    return stopping.plan(design, config.eval_group_size, stopping.margins_of(gates),
                         stopping.PLANNING_SPREADS) | {
        "spreads_from": "the default's re-test (seed 42); a finished run states its own"}


def dry_run_checks(admission, source) -> tuple[dict, object]:
    """The checks `prepare` makes after loading, made from the model's config and tokenizer;
    -> ({the memory estimate (bytes), the device, the dtype and the engine the run will use},
    the tokenizer)."""
    from transformers import AutoTokenizer

    config = admission.config
    model_config = json.loads((Path(source.load_dir) / "config.json").read_text(encoding="utf-8"))
    tokenizer = AutoTokenizer.from_pretrained(source.load_dir, trust_remote_code=False)
    for problems in (admission.train, admission.eval):
        encode_prompts(tokenizer, problems, config.resolved_system_prompt(),
                       config.max_prompt_tokens)
    # The targets of a fresh LoRA are checked; a baseline adapter's are checked as it loads.
    model = (weightless_model(source.load_dir) if admission.adapter else
             check_target_modules(source.load_dir, config))
    runtime = runtime_plan(config, model)
    device = torch.device(runtime["device"])
    dims = budget.model_dims(model_config)
    dtype_bytes = torch.empty((), dtype=getattr(torch, runtime["dtype"])).element_size()
    estimate = budget.check_fits(config, dims, dtype_bytes, available_memory(device), str(device))
    budget.check_output_writable(admission.run_dir, budget.checkpoint_bytes(config, dims))
    return runtime | {"memory_estimate_bytes": estimate["total"]}, tokenizer


def runtime_plan(config: RunConfig, model) -> dict:
    """The device and dtype the config resolves to here, and the engine the weightless `model`
    (a meta-device copy) will run on: what a run or a gate records once it loads."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    return {"engine": expected_engine(model), "device": str(device),
            "dtype": str(dtype).removeprefix("torch.")}


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_allocated(device)
    return budget.available_host_memory()


def check_budget(admission, policy) -> None:
    """Refuse, before anything is written, a run whose shapes cannot fit in memory or on disk."""
    base = policy.model.get_base_model()
    dims = budget.model_dims(base.config.to_dict())
    dtype_bytes = next(base.parameters()).element_size()
    budget.check_fits(admission.config, dims, dtype_bytes, available_memory(policy.device),
                      str(policy.device))
    if not admission.run_dir.exists():
        budget.check_output_writable(admission.run_dir,
                                     budget.checkpoint_bytes(admission.config, dims))
