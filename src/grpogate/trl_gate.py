"""Gate a run trained elsewhere (`grpogate gate --from-trl DIR | --candidate DIR`): the second
half of a run.

A TRL `GRPOTrainer` output directory holds a PEFT adapter and the trainer's log, no
trajectories; a candidate from any trainer (`--candidate`) is a PEFT adapter or a full Hugging
Face checkpoint, with no log (inputs/candidate_dir.py). The stages, each one call, in order:
read the directory as data (no pickle is ever opened: inputs/trl_output.py,
inputs/candidate_dir.py) and the log's arithmetic (evidence/trainer_log.py); admission (an
adapter's base model must be the named baseline's, a full checkpoint must be of the baseline's
architecture exactly: inputs/full_candidate.py; the verifier is fixed by name and version, no
eval prompt may appear inside a text the trainer trained on, as the user names them:
inputs/training_prompts.py); load the baseline and put the candidate in the trained policy's
place; the pipeline's own re-test (same seeds, same prompts, paired); assemble the evidence and
write the run directory with the pipeline's own writer (problems, re-test records, evidence,
the manifest last, the report). Nothing is written before admission passes; an adapter of
another base model is not re-tested and is delivered as `reject` naming `baseline_identity`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path


from grpogate.config import RunConfig, validate
from grpogate.errors import InputError
from grpogate.evidence.foreign_audit import TRAINER_STATE_FILE
from grpogate.evidence.trainer_log import (NOT_RECORDED_NOTE, SOURCE_NOTE,
                                            assemble_foreign_evidence, log_steps)
from grpogate.files import (ADAPTER_WEIGHTS, RunDirLock, atomic_write_bytes, create_run_dir,
                            file_mode, fsync_directory, refuse_existing_output,
                            refuse_output_inside_a_run, sha256_path)
from grpogate.inputs import isolation, tasks
from grpogate.inputs.candidate import attach_candidate
from grpogate.inputs.full_candidate import attach_full_candidate
from grpogate.inputs.candidate_dir import (FULL_CHECKPOINT, PEFT_ADAPTER, Candidate,
                                           candidate_version, checkpoint_identity,
                                           finite_weights, read_candidate, stage_candidate)
from grpogate.inputs.policy import (BaseModelSource, check_adapter_dir, default_cache_dir,
                                    load_policy, resolve_base_model)
from grpogate.inputs.trl_output import (ADAPTER_CONFIG, TrlOutput, read_settings_file,
                                        read_trl_output, trl_settings)
from grpogate.inputs.verifiers import get_verifier
from grpogate.interrupts import StopRequest
from grpogate.admission import run_dir_for
from grpogate.delivery import peak_memory, run_environment, write_run_files
from grpogate.pipeline import NullReporter
from grpogate.sampling.sequential import RetestSet, sequential_retest
from grpogate.sampling.rollout import encode_prompts
from grpogate.inputs.training_prompts import checked_isolation, training_problems


@dataclass
class GateRequest:
    """What `grpogate gate` is asked: the foreign directory (a TRL output directory, or a
    candidate from any trainer) and what only the user knows."""

    trl_dir: str = ""
    trl_args: str = ""  # JSON/TOML file of the run's GRPOConfig fields
    num_generations: int | None = None
    train_data: str = ""  # the training dataset file (JSONL rows with TRL's "prompt" column)
    train_from_config: bool = False  # the training prompts are the config's own train split
    candidate: str = ""  # a PEFT adapter folder or a full checkpoint, without a trainer's log


def baseline_identity(named: str, base: BaseModelSource) -> dict:
    """Does the adapter's `base_model_name_or_path` name the baseline's base model? By name
    (the spec, path or public id the baseline was given by), by the directory it was loaded
    from, or by the weights' sha256 of a local model directory it names."""
    result = {"adapter_base_model_name_or_path": named, "baseline": base.identity(),
              "matches": False, "how": "no match: another base model"}
    if named in {base.spec, base.location, base.public_id}:
        return result | {"matches": True, "how": "by name"}
    path = Path(named)
    if path.exists() and path.resolve() == Path(base.load_dir).resolve():
        return result | {"matches": True, "how": "by the directory the baseline loads from"}
    if path.is_dir() and (path / "config.json").is_file() and base.kind == "hf-dir":
        try:  # hashed within bounds, regular files only (model_cache.directory_weights_sha256)
            named_sha = resolve_base_model(str(path), "", Path(base.load_dir)).sha256
        except InputError as error:
            return result | {"how": f"no match: the folder it names is not hashed ({error})"}
        if named_sha == base.sha256:
            return result | {"matches": True, "how": "by the weights' sha256"}
    return result


def chat_renderer(config: RunConfig):
    """Chat messages -> the text TRL's GRPOTrainer trains on (trl 1.16,
    `GRPOTrainer._tokenize_prompts`: the processing class's `apply_chat_template` with
    `add_generation_prompt=True`), rendered with the baseline's tokenizer: the adapter's base
    model's, which admission requires. The tokenizer loads on the first conversational row (no
    code the model names runs: trust_remote_code=False); a template that fails on a row refuses
    that row, since the text it trains on is then unknown."""
    tokenizer = None

    def render(messages: list, where: str) -> str:
        nonlocal tokenizer
        if tokenizer is None:
            from transformers import AutoTokenizer

            base = resolve_base_model(config.model, config.model_revision,
                                      default_cache_dir(config), weights=False)
            tokenizer = AutoTokenizer.from_pretrained(base.load_dir, trust_remote_code=False)
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
        except Exception as error:  # a Jinja template raises whatever its code raises
            raise InputError(f"{where}: the baseline's chat template cannot render this row "
                             f"({type(error).__name__}: {str(error)[:160]}); the text TRL "
                             "trains on cannot be determined") from None
        if not isinstance(text, str):
            raise InputError(f"{where}: the chat template rendered no text")
        return text

    return render


@dataclass
class Admitted:
    config: RunConfig
    found: Candidate  # the candidate itself (a TRL directory's adapter, or --candidate's)
    trl: TrlOutput | None  # the TRL directory and its log; None: no trainer's log
    settings: dict
    settings_source: str | None
    run_dir: Path
    verifier: object
    eval_set: list
    eval_identity: dict
    train: list | None
    train_identity: dict
    isolation: dict
    searched: list  # the (row, text) pairs the isolation check searched
    source: Path | None = None  # where the candidate was read from, once `found` is its copy


def admit(config: RunConfig, request: GateRequest) -> Admitted:
    """Everything checked before a weight loads or a file is written; InputError otherwise
    (a full checkpoint's architecture, which needs the baseline loaded: `_identify`)."""
    if bool(request.trl_dir) == bool(request.candidate):
        raise InputError("gate: give exactly one of --from-trl DIR (a TRL output directory) and "
                         "--candidate DIR (a PEFT adapter or a Hugging Face checkpoint)")
    trl, settings, where = None, {}, None
    if request.candidate and (request.trl_args or request.num_generations is not None):
        raise InputError("gate: --trl-args and --num-generations describe a TRL run's log; "
                         "--candidate reads no log (use --from-trl for a TRL output directory)")
    if request.candidate:
        found = read_candidate(request.candidate)
    else:
        trl = read_trl_output(request.trl_dir)
        found = Candidate(PEFT_ADAPTER, trl.adapter_dir, trl.adapter_config,
                          [ADAPTER_CONFIG, ADAPTER_WEIGHTS], [ADAPTER_WEIGHTS],
                          trl.pickles_not_loaded)
        settings, where = _trl_settings(trl, request)
        config = validate(dataclasses.replace(config, group_size=settings["num_generations"]))
    run_dir = run_dir_for(config)
    refuse_existing_output(run_dir)
    refuse_output_inside_a_run(run_dir)
    if config.adapter:
        check_adapter_dir(config.adapter)
    try:
        verifier = get_verifier(config.resolved_verifier())
    except ValueError as error:
        raise InputError(f"verifier: {error}") from None
    eval_set, eval_identity = tasks.load_eval_set(config.task, config.eval_prompts)
    train, train_identity, source, searched = training_problems(
        config, request.train_data, request.train_from_config, chat_renderer(config))
    isolated = checked_isolation(train, searched, eval_set, source)
    return Admitted(config, found, trl, settings, where, run_dir, verifier, eval_set,
                    eval_identity, train, train_identity, isolated, searched)


def _trl_settings(trl: TrlOutput, request: GateRequest) -> tuple[dict, str]:
    """The GRPO settings a TRL log is read with, and where they were declared; the log's
    arithmetic checked with them."""
    declared = read_settings_file(request.trl_args) if request.trl_args else {}
    if request.num_generations is not None:
        declared["num_generations"] = request.num_generations
    where = request.trl_args or "--num-generations"
    settings = trl_settings(trl, declared, where)
    log_steps(trl.trainer_state, settings, str(trl.trainer_state_file))
    return settings, where


def source_of(admitted: Admitted) -> str:
    return str(admitted.isolation.get("source", ""))


def guard_problems(admitted: Admitted) -> tuple[list, dict, object]:
    """The guard set a grpogate run re-tests too (config [guard]; drawn skipping the given train
    and the eval prompts), its identity and its task's own verifier."""
    config = admitted.config
    guard_set, identity = tasks.load_guard_set(config.guard, admitted.train or [],
                                               admitted.eval_set)
    # Drawn skipping equal prompt ids; a guard prompt inside a training text is seen as well.
    seen = isolation.shared_prompts(admitted.searched, guard_set)
    if seen:
        raise InputError(isolation.describe(seen, source_of(admitted), "guard"))
    try:
        verifier = get_verifier(config.guard.verifier()) if guard_set else None
    except ValueError as error:
        raise InputError(f"guard: {error}") from None
    return guard_set, identity, verifier


def _retest(admitted: Admitted, policy, candidate_version: str, reporter, guard_set: list,
            guard_verifier) -> tuple[list[dict], list[dict], int]:
    """The re-test as a grpogate run's: eval records with their drift, then the guard set."""
    config = admitted.config

    def encoded(problems):
        return encode_prompts(policy.tokenizer, problems, config.resolved_system_prompt(),
                              config.max_prompt_tokens)

    eval_set = RetestSet(admitted.eval_set, encoded(admitted.eval_set), admitted.verifier,
                         config.eval_group_size, "re-test")
    guarded = RetestSet(guard_set, encoded(guard_set), guard_verifier, config.guard.group_size,
                        "guard") if guard_set else None
    return sequential_retest(policy, eval_set, guarded, config, candidate_version, reporter,
                             StopRequest())


def _copy_inputs(admitted: Admitted, run_dir: Path, hashes: dict[str, str]) -> str:
    """The candidate's copy (staged, hashed and loaded: `stage_candidate`) moved into the run
    (`adapter/` for an adapter, `candidate/` for a full checkpoint), and the trainer's log, if
    any, copied; returns the artifact's sha256 (an adapter's weights file; a checkpoint's
    identity), of the bytes copied: `hashes`."""
    found, folder = admitted.found, artifact_folder(admitted.found)
    os.chmod(found.directory, 0o777 & ~(0o666 & ~file_mode()))  # a folder's mode, as mkdir's
    os.rename(found.directory, run_dir / folder)  # the same filesystem: a rename, no copy
    fsync_directory(run_dir)
    if admitted.trl is not None:
        atomic_write_bytes(run_dir / TRAINER_STATE_FILE,
                           admitted.trl.trainer_state_file.read_bytes())
    atomic_write_bytes(run_dir / "trajectories.jsonl", b"")  # none exist: the log is all there is
    if found.kind == FULL_CHECKPOINT:
        return checkpoint_identity(hashes)
    return hashes[ADAPTER_WEIGHTS]


def artifact_folder(found: Candidate) -> str:
    return "candidate" if found.kind == FULL_CHECKPOINT else "adapter"


def _identify(admitted: Admitted, policy) -> dict:
    """Admission of the candidate against the loaded baseline: an adapter names its base model
    (a mismatch is delivered as `reject`); a full checkpoint is of the baseline's architecture
    exactly (else InputError) and is put in the candidate's place here."""
    found = admitted.found
    if found.kind == PEFT_ADAPTER:
        return baseline_identity(found.base_model_name, policy.base)
    attach_full_candidate(policy, found)
    return {"baseline": policy.base.identity(), "matches": True,
            "how": "a full checkpoint of the baseline's architecture: its config.json and every "
                   "tensor's name, shape and dtype"}


def _staging_folder(run_dir: Path) -> Path:
    """A fresh folder (mode 0700) beside the run directory, on its filesystem, for the
    candidate's copy until the run directory is made (nothing is written in it before then)."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{run_dir.name}.candidate-", dir=run_dir.parent))


def gate(config: RunConfig, request: GateRequest, reporter=None) -> dict:
    """Admit, re-test and deliver a foreign run; returns the evidence (also on disk). The
    candidate is copied and hashed first, and the copy is what is checked, loaded and
    delivered; a run that stops before delivery leaves no copy behind."""
    reporter = reporter or NullReporter()
    admitted = admit(config, request)
    staging, source = _staging_folder(admitted.run_dir), admitted.found.directory
    try:
        found, hashes = stage_candidate(admitted.found, staging)
        return _gate_copy(dataclasses.replace(admitted, found=found, source=source), hashes,
                          reporter)
    except InputError as error:  # named by the user's folder, not by its copy's
        raise InputError(str(error).replace(str(staging), str(source))) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # moved into the run when delivered


def _gate_copy(admitted: Admitted, hashes: dict[str, str], reporter) -> dict:
    """`gate` on the candidate's copy, whose files hash to `hashes`."""
    config, found = admitted.config, admitted.found
    finite = finite_weights(found.directory, found.weights)
    started = time.perf_counter()
    policy = load_policy(config, adapter=config.adapter, seed=config.seed)
    identity = _identify(admitted, policy)
    load_seconds = time.perf_counter() - started
    version = candidate_version(found, policy.base.sha256, hashes)
    guard_set, guard_identity, guard_verifier = guard_problems(admitted)
    records, guard_records, errors, evaluation_seconds = [], [], 0, 0.0
    failed_checks = ([] if identity["matches"] else ["baseline_identity"]) + (
        ["finite_weights"] if finite["non_finite_tensors"] else [])
    if not failed_checks:
        if found.kind == PEFT_ADAPTER:
            attach_candidate(policy, found.directory)
        started = time.perf_counter()
        records, guard_records, errors = _retest(admitted, policy, version, reporter,
                                                 guard_set, guard_verifier)
        evaluation_seconds = time.perf_counter() - started
    run_dir = admitted.run_dir
    create_run_dir(run_dir)
    with RunDirLock(run_dir):
        artifact_sha = _copy_inputs(admitted, run_dir, hashes)
        facts = _facts(admitted, policy, failed_checks, version, artifact_sha, errors,
                       {"load": load_seconds, "evaluation": evaluation_seconds,
                        "total": load_seconds + evaluation_seconds})
        facts["inputs"] |= {"guard_set": guard_identity, "guard_verifier": (
            {"name": config.guard.verifier(), "version": guard_verifier.version}
            if guard_verifier is not None else None)}
        facts["foreign"] = _foreign(admitted, identity, hashes)
        facts["foreign"]["admission"]["finite_weights"] = finite
        evidence = assemble_foreign_evidence(
            facts, config.to_dict(), admitted.trl.trainer_state if admitted.trl else None,
            records, guard_records)
        problems = tasks.problem_records(config.task, admitted.train or [], admitted.eval_set,
                                         config.guard, guard_set)
        write_run_files(run_dir, evidence, problems, records, [], reporter, guard_records)
    evidence["run_dir"] = str(run_dir)
    return evidence


def _foreign(admitted: Admitted, identity: dict, hashes: dict) -> dict:
    """The evidence's `foreign` section: where the candidate came from, its kind, the log (if
    any) and the settings it was read with, what was never loaded, and the admission."""
    found, trl = admitted.found, admitted.trl
    common = {"candidate_kind": found.kind, "pickles_not_loaded": found.pickles_not_loaded,
              "settings": admitted.settings, "settings_source": admitted.settings_source,
              "admission": {"baseline_identity": identity, "isolation": admitted.isolation}}
    if trl is None:
        return common | {
            "trainer": "an unnamed trainer", "directory": str(admitted.source or found.directory),
            "files": hashes,
            "trainer_state_file": None, "trainer_state_sha256": None,
            "pickles_note": "pickles (*.bin, *.pt, *.pth, *.pkl) are never loaded: loading one "
                            "can run code; the weights load from safetensors alone",
            "rollout_source": NOT_RECORDED_NOTE}
    return common | {
        "trainer": "trl", "directory": str(trl.directory), "adapter_dir": str(trl.adapter_dir),
        "trainer_state_file": str(trl.trainer_state_file),
        "trainer_state_sha256": sha256_path(trl.trainer_state_file),
        "pickles_note": "pickles (training_args.bin, optimizer.pt, ...) are never loaded: "
                        "loading one can run code; the settings come from trainer_state.json "
                        "and the user",
        "rollout_source": SOURCE_NOTE}


def _facts(admitted: Admitted, policy, failed_checks: list[str], candidate_version: str,
           artifact_sha: str, verifier_errors: int, seconds: dict) -> dict:
    config, trl = admitted.config, admitted.trl
    reward_names = sorted({name for entry in trl.trainer_state["log_history"] for name in entry
                           if name.startswith("rewards/") and name.endswith("/mean")}
                          if trl is not None else ())
    return {
        "run_label": config.label or admitted.run_dir.name,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "environment": run_environment(policy),
        "inputs": {
            "model": policy.base.identity(),
            "baseline_adapter": ({"path": config.adapter, "sha256": policy.baseline_adapter_sha256}
                                 if config.adapter else None),
            "baseline_manifest": None, "baseline_policy_version": policy.baseline_version,
            "verifier": {"name": config.resolved_verifier(), "version": admitted.verifier.version},
            # What the foreign trainer rewarded, by the names its log gives; the decision reads
            # the re-test's verifier alone.
            "rewards": [{"name": name[len("rewards/"):-len("/mean")], "source": "trainer_log"}
                        for name in reward_names],
            "train_set": admitted.train_identity, "eval_set": admitted.eval_identity},
        "contract": {"admitted": not failed_checks, "failed_checks": failed_checks,
                     "note": "a run trained elsewhere has no trajectories: admission checks the "
                             "candidate's baseline (an adapter's base model, a checkpoint's "
                             "architecture), that its weights are finite, and the eval set's "
                             "isolation"},
        "seconds": seconds, "retest_verifier_errors": verifier_errors,
        "retest_skipped": bool(failed_checks),
        "resources": peak_memory(policy.device) | {
            "measured": "the gate's re-test on this machine; the foreign training's memory is "
                        "not in its log"},
        "artifact": {"path": artifact_folder(admitted.found), "sha256": artifact_sha,
                     "source_policy_version": policy.baseline_version,
                     "new_policy_version": candidate_version},
    }
