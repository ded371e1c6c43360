"""Gate a run trained elsewhere (`grpogate gate --from-trl DIR`): the second half of a run.

A TRL `GRPOTrainer` output directory holds a PEFT adapter and the trainer's log, no
trajectories. The stages, each one call, in order: read the directory as data (no pickle is
ever opened: inputs/trl_output.py) and the log's arithmetic (evidence/trainer_log.py);
admission (the adapter's base model must be the named baseline's, the verifier is fixed by
name and version, no eval prompt may appear inside a text the trainer trained on, as the user
names them: inputs/training_prompts.py);
load the baseline and put the foreign adapter in the candidate's place; the pipeline's own
re-test (same seeds, same prompts, paired); assemble the evidence and write the run directory
with the pipeline's own writer (problems, re-test records, evidence, the manifest last, the
report). Nothing is written before admission passes; an adapter of another base model is not
re-tested and is delivered as `reject` naming `baseline_identity`.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path


from grpogate.config import RunConfig, validate
from grpogate.errors import InputError
from grpogate.evidence.foreign_audit import TRAINER_STATE_FILE
from grpogate.evidence.trainer_log import SOURCE_NOTE, assemble_foreign_evidence, log_steps
from grpogate.files import (ADAPTER_WEIGHTS, RunDirLock, atomic_directory, atomic_write_bytes,
                            create_run_dir, policy_version, refuse_existing_output,
                            refuse_output_inside_a_run, safetensors_sha256, sha256_path)
from grpogate.inputs import isolation, tasks
from grpogate.inputs.candidate import attach_candidate
from grpogate.inputs.policy import (BaseModelSource, check_adapter_dir, default_cache_dir,
                                    load_policy, resolve_base_model)
from grpogate.inputs.trl_output import (ADAPTER_CONFIG, TrlOutput, read_settings_file,
                                        read_trl_output, trl_settings)
from grpogate.inputs.verifiers import get_verifier
from grpogate.interrupts import StopRequest
from grpogate.admission import run_dir_for
from grpogate.delivery import peak_memory, run_environment, write_run_files
from grpogate.pipeline import NullReporter
from grpogate.sampling.retest import retest_both
from grpogate.sampling.rollout import encode_prompts
from grpogate.inputs.training_prompts import checked_isolation, training_problems


@dataclass
class GateRequest:
    """What `grpogate gate` is asked: the foreign directory and what only the user knows."""

    trl_dir: str
    trl_args: str = ""  # JSON/TOML file of the run's GRPOConfig fields
    num_generations: int | None = None
    train_data: str = ""  # the training dataset file (JSONL rows with TRL's "prompt" column)
    train_from_config: bool = False  # the training prompts are the config's own train split


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
        try:
            named_sha = resolve_base_model(str(path), "", Path(base.load_dir)).sha256
        except InputError:
            return result
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
                                      default_cache_dir(config))
            options = {"revision": base.revision} if base.revision else {}
            tokenizer = AutoTokenizer.from_pretrained(base.load_dir, trust_remote_code=False,
                                                      **options)
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
    found: TrlOutput
    settings: dict
    settings_source: str
    run_dir: Path
    verifier: object
    eval_set: list
    eval_identity: dict
    train: list | None
    train_identity: dict
    isolation: dict
    searched: list  # the (row, text) pairs the isolation check searched


def admit(config: RunConfig, request: GateRequest) -> Admitted:
    """Everything checked before a weight loads or a file is written; InputError otherwise."""
    found = read_trl_output(request.trl_dir)
    declared = read_settings_file(request.trl_args) if request.trl_args else {}
    if request.num_generations is not None:
        declared["num_generations"] = request.num_generations
    where = request.trl_args or "--num-generations"
    settings = trl_settings(found, declared, where)
    log_steps(found.trainer_state, settings, str(found.trainer_state_file))
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
    return Admitted(config, found, settings, where, run_dir, verifier, eval_set, eval_identity,
                    train, train_identity, isolated, searched)


def source_of(admitted: Admitted) -> str:
    return str(admitted.isolation.get("source", ""))


def _guard(admitted: Admitted) -> tuple[list, dict, object]:
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

    records, errors = retest_both(policy, admitted.eval_set, encoded(admitted.eval_set),
                                  admitted.verifier, config, candidate_version, reporter,
                                  StopRequest(), drift=True)
    guard_records, guard_errors = [], 0
    if guard_set:
        guard_records, guard_errors = retest_both(
            policy, guard_set, encoded(guard_set), guard_verifier, config, candidate_version,
            reporter, StopRequest(), group_size=config.guard.group_size, label="guard")
    return records, guard_records, errors + guard_errors


def _copy_inputs(admitted: Admitted, run_dir: Path) -> str:
    """The adapter (its config and weights, byte for byte) and the trainer's log, copied into
    the run; returns the weights' sha256."""
    with atomic_directory(run_dir / "adapter") as staging:
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            shutil.copyfile(admitted.found.adapter_dir / name, staging / name)
    atomic_write_bytes(run_dir / TRAINER_STATE_FILE, admitted.found.trainer_state_file.read_bytes())
    atomic_write_bytes(run_dir / "trajectories.jsonl", b"")  # none exist: the log is all there is
    return sha256_path(run_dir / "adapter" / ADAPTER_WEIGHTS)


def gate(config: RunConfig, request: GateRequest, reporter=None) -> dict:
    """Admit, re-test and deliver a foreign run; returns the evidence (also on disk)."""
    reporter = reporter or NullReporter()
    admitted = admit(config, request)
    config = admitted.config
    started = time.perf_counter()
    policy = load_policy(config, adapter=config.adapter, seed=config.seed)
    load_seconds = time.perf_counter() - started
    identity = baseline_identity(admitted.found.base_model_name, policy.base)
    candidate_version = policy_version(policy.base.sha256, safetensors_sha256(
        admitted.found.adapter_dir / ADAPTER_WEIGHTS))
    guard_set, guard_identity, guard_verifier = _guard(admitted)
    records, guard_records, errors, evaluation_seconds = [], [], 0, 0.0
    if identity["matches"]:
        attach_candidate(policy, admitted.found.adapter_dir)
        started = time.perf_counter()
        records, guard_records, errors = _retest(admitted, policy, candidate_version, reporter,
                                                 guard_set, guard_verifier)
        evaluation_seconds = time.perf_counter() - started
    run_dir = admitted.run_dir
    create_run_dir(run_dir)
    with RunDirLock(run_dir):
        adapter_sha = _copy_inputs(admitted, run_dir)
        facts = _facts(admitted, policy, identity, candidate_version, adapter_sha, errors,
                       {"load": load_seconds, "evaluation": evaluation_seconds,
                        "total": load_seconds + evaluation_seconds})
        facts["inputs"] |= {"guard_set": guard_identity, "guard_verifier": (
            {"name": config.guard.verifier(), "version": guard_verifier.version}
            if guard_verifier is not None else None)}
        evidence = assemble_foreign_evidence(facts, config.to_dict(),
                                             admitted.found.trainer_state, records, guard_records)
        problems = tasks.problem_records(config.task, admitted.train or [], admitted.eval_set,
                                         config.guard, guard_set)
        write_run_files(run_dir, evidence, problems, records, [], reporter, guard_records)
    evidence["run_dir"] = str(run_dir)
    return evidence


def _facts(admitted: Admitted, policy, identity: dict, candidate_version: str, adapter_sha: str,
           verifier_errors: int, seconds: dict) -> dict:
    config, found = admitted.config, admitted.found
    reward_names = sorted({name for entry in found.trainer_state["log_history"] for name in entry
                           if name.startswith("rewards/") and name.endswith("/mean")})
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
        "foreign": {
            "trainer": "trl", "directory": str(found.directory),
            "adapter_dir": str(found.adapter_dir), "trainer_state_file": str(found.trainer_state_file),
            "trainer_state_sha256": sha256_path(found.trainer_state_file),
            "pickles_not_loaded": found.pickles_not_loaded,
            "pickles_note": "pickles (training_args.bin, optimizer.pt, ...) are never loaded: "
                            "loading one can run code; the settings come from trainer_state.json "
                            "and the user",
            "settings": admitted.settings, "settings_source": admitted.settings_source,
            "rollout_source": SOURCE_NOTE,
            "admission": {"baseline_identity": identity, "isolation": admitted.isolation}},
        "contract": {"admitted": identity["matches"],
                     "failed_checks": [] if identity["matches"] else ["baseline_identity"],
                     "note": "a foreign run has no trajectories: admission checks the adapter's "
                             "base model and the eval set's isolation"},
        "seconds": seconds, "retest_verifier_errors": verifier_errors,
        "retest_skipped": not identity["matches"],
        "resources": peak_memory(policy.device) | {
            "measured": "the gate's re-test on this machine; the foreign training's memory is "
                        "not in its log"},
        "artifact": {"path": "adapter", "sha256": adapter_sha,
                     "source_policy_version": policy.baseline_version,
                     "new_policy_version": candidate_version},
    }
