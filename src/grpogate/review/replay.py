"""`grpogate decide RUN --replay N`: regenerate part of the re-test from the delivered artifacts.

The plain audit re-checks every number against the stored records, but a forger who writes
new completions (or swaps in another adapter) and recomputes every reward, summary, version
and hash leaves nothing for it to find. Sampling is deterministic for the same policy, prompts,
seed, batch layout and machine: this module loads the recorded base model, the recorded
baseline adapter and the delivered adapter/, re-runs the run's own re-test function
(`sampling.retest.retest_both`, same settings and seed) on the first eval prompts, and
compares the completions with the stored ones. Where the environment (library versions,
device, dtype, threads) differs from the one the run recorded, bit-identical sampling is not
promised: the agreement is reported and nothing is rejected on it.

This is the only part of `decide` that loads torch, and only when --replay is given.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from grpogate.config import BUNDLED_MODEL, TaskConfig, resume_config
from grpogate.errors import InputError, first_line
from grpogate.evidence.assemble import library_versions
from grpogate.evidence import stopping
from grpogate.evidence.manifest import PROBLEMS_FILE
from grpogate.files import ADAPTER_WEIGHTS, lies_inside, parse_json, read_confined, read_jsonl
from grpogate.inputs.tasks import load_problem_sets, problem_set_hash, stored_sets
from grpogate.inputs.policy import (TRAINABLE, current_version, load_adapter_state, load_policy)
from grpogate.inputs.verifiers import get_verifier
from grpogate.interrupts import StopRequest
from grpogate.pipeline import NullReporter
from grpogate.engines import engine_for, kernels_identity
from grpogate.engines.rows import shared_prefix_length
from grpogate.sampling.retest import retest_both
from grpogate.sampling.rollout import encode_prompts

ENVIRONMENT_KEYS = ("python", "platform", "torch", "transformers", "peft", "safetensors",
                    "torch_threads", "device", "dtype", "native_kernels")


def replay_batch(config) -> int:
    """The eval prompts the run decoded together: a look of the sequential re-test, within
    whole decode batches (stopping.design_of)."""
    design = stopping.design_of(dataclasses.asdict(config)) or {"eval_batch": config.eval_prompts}
    return max(1, min(config.generation_batch_size // config.eval_group_size,
                      design["eval_batch"]))


def replay_prompt_count(config, asked: int, answered: int | None = None) -> int:
    """`asked` rounded up to whole decode batches of the run's layout, within the prompts the
    re-test answered (`answered`; default eval_prompts). Draws are per prompt, but
    reduced-precision kernels (bf16) may still round a row differently in another batch."""
    prompts_per_batch = replay_batch(config)
    limit = config.eval_prompts if answered is None else min(answered, config.eval_prompts)
    return min(limit, math.ceil(asked / prompts_per_batch) * prompts_per_batch)


def replay_retest(run_dir: str | Path, prompts: int) -> dict:
    """Regenerate both policies' re-test completions of the first `prompts` eval prompts.

    Returns {"prompts", "compared", "equal", "environment_matches", "environment_differences",
    "mismatches"}; mismatches (same shape as the audit's) only when the environment matches."""
    run_dir = Path(run_dir)
    try:
        evidence = parse_json(read_confined(run_dir, "evidence.json"),
                              f"{run_dir}/evidence.json")
        evidence["config"], evidence["inputs"], evidence["artifact"]  # noqa: B018 (present?)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise InputError(f"{run_dir}/evidence.json: cannot replay from it "
                         f"({type(error).__name__}: {error})") from None
    if (evidence.get("comparison") or {}).get("skipped"):
        raise InputError(f"{run_dir}: the run stopped before its re-test; there is nothing to "
                         "replay (resume it first)")
    config = resume_config(evidence["config"], f"{run_dir}/evidence.json")
    answered = ((evidence.get("comparison") or {}).get("baseline") or {}).get("prompt_count")
    count = replay_prompt_count(config, prompts,
                                answered if isinstance(answered, int) else None)
    differences = _environment_differences(evidence.get("environment") or {}, config)
    torch.set_num_threads(int((evidence.get("environment") or {}).get("torch_threads")
                              or torch.get_num_threads()))
    policy = _delivered_policy(run_dir, evidence, config)
    recorded_engine, engine = (evidence.get("environment") or {}).get("engine"), engine_for(
        policy.model).identity()
    if recorded_engine is not None and recorded_engine != engine:  # runs before it: not recorded
        differences["engine"] = {"recorded": recorded_engine, "now": engine}
    eval_set = _eval_set(run_dir, evidence)
    # All eval prompts are encoded: the decoder's shared prefix is fixed over the whole set, as
    # in the run (a prefix of only the first prompts could be longer and round differently).
    encoded = encode_prompts(policy.tokenizer, eval_set, config.resolved_system_prompt(),
                             config.max_prompt_tokens)
    verifier = get_verifier(evidence["inputs"]["verifier"]["name"])
    replayed = _in_looks(policy, eval_set, encoded, verifier, config,
                         evidence["artifact"]["new_policy_version"], count)
    stored = {(r.get("policy"), r.get("prompt_id"), r.get("sample_index")): (number, r)
              for number, r in enumerate(read_jsonl(run_dir / "eval_completions.jsonl"), 1)}
    mismatches, equal = [], 0
    for record in replayed:
        number, original = stored.get((record["policy"], record["prompt_id"],
                                       record["sample_index"]), (None, {}))
        same = all(original.get(key) == record[key]
                   for key in ("completion", "completion_tokens", "hit_max_length"))
        equal += same
        if not same:
            where = f"eval_completions.jsonl:{number}" if number else (
                f"eval_completions.jsonl ({record['policy']} {record['prompt_id']} "
                f"sample {record['sample_index']}: missing)")
            mismatches.append({"field": f"replay {where} completion",
                               "recorded": original.get("completion"),
                               "recomputed": record["completion"]})
    return {"prompts": count, "compared": len(replayed), "equal": equal,
            "environment_matches": not differences, "environment_differences": differences,
            "mismatches": mismatches if not differences else []}


def reload_problem_sets(config: dict, inputs: dict) -> tuple[list, dict, list, dict]:
    """The run's train and eval problems regenerated from its recorded configuration (needs the
    task generator or dataset; `decide --replay` uses it, the audit reads problems.jsonl).

    Calls the run's own `tasks.load_problem_sets` (pure, no torch). A GSM8K split is read from
    the absolute file the run recorded when it exists, so a run configured with a relative path
    can be replayed from any working directory.
    """
    # A run recorded before eval pools drew its eval set in generation order (eval_pool 0).
    task = TaskConfig(**{"eval_pool": 0, **config["task"]})

    def recorded_file(identity_key: str) -> str:
        recorded = (inputs.get(identity_key) or {}).get("file")
        usable = isinstance(recorded, str) and Path(recorded).is_absolute() and Path(recorded).is_file()
        return recorded if usable else ""

    return load_problem_sets(task, config["train_prompts"], config["eval_prompts"],
                             recorded_file("train_set"), recorded_file("eval_set"))



# --- the checks ---------------------------------------------------------------------------------

def _in_looks(policy, eval_set: list, encoded: list, verifier, config, candidate_version: str,
              count: int) -> list[dict]:
    """Both policies' completions of the first `count` eval prompts, decoded in the run's looks
    (the same rows together, the same shared prefix): the baseline's records, then the
    candidate's."""
    by_policy: dict[str, list] = {"baseline": [], "candidate": []}
    batch = replay_batch(config)
    for start in range(0, count, batch):
        records, _ = retest_both(policy, eval_set, encoded, verifier, config, candidate_version,
                                 NullReporter(), StopRequest(),
                                 shared_prefix=shared_prefix_length(encoded),
                                 indexes=range(start, min(start + batch, count)))
        for record in records:
            by_policy[record["policy"]].append(record)
    return by_policy["baseline"] + by_policy["candidate"]


def _eval_set(run_dir: Path, evidence: dict) -> list:
    """The run's eval problems: a dataset task's from the run directory's problems.jsonl (the
    table it was drawn from may have changed or gone; the directory is what decide trusts),
    hashed against the recorded identity; a generated or GSM8K task's regenerated."""
    if (evidence["config"].get("task") or {}).get("source") != "dataset":
        return reload_problem_sets(evidence["config"], evidence["inputs"])[2]
    numbered = list(enumerate(read_jsonl(run_dir / PROBLEMS_FILE), 1))
    # A gated foreign run names no training problems unless the user gave them (isolation).
    eval_set = stored_sets(numbered, PROBLEMS_FILE,
                           allow_empty_train=bool(evidence.get("foreign")))["eval"]
    recorded = (evidence["inputs"].get("eval_set") or {}).get("problem_set_sha256")
    if problem_set_hash(eval_set) != recorded:
        raise InputError(f"{run_dir}/{PROBLEMS_FILE}: its eval set does not hash to the "
                         "recorded inputs.eval_set.problem_set_sha256; cannot replay from it")
    return eval_set


def _environment_differences(recorded: dict, config) -> dict:
    """{key: {"recorded", "now"}} for every environment fact that bit-identity depends on."""
    from grpogate.inputs.policy import resolve_device, resolve_dtype

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    now = library_versions() | {
        "torch_threads": recorded.get("torch_threads"), "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "native_kernels": kernels_identity(dtype, device)}
    return {key: {"recorded": recorded.get(key), "now": now.get(key)}
            for key in ENVIRONMENT_KEYS if recorded.get(key) != now.get(key)}


def _brought_along(value: str, run_dir: Path) -> bool:
    """A model or adapter path (not the bundled model's name, not empty) inside the run
    directory: what a run directory brings along is never loaded."""
    return value not in ("", BUNDLED_MODEL) and lies_inside(value, run_dir)


def _recorded_sources(run_dir: Path, evidence: dict) -> tuple[str, str, str, str]:
    """(model, its evidence field, revision, baseline adapter path or "") as the evidence
    records them. InputError when one is not a string or names a path inside the run
    directory: a replay loads the user's own model and baseline, never ones the run directory
    brings along."""
    where = f"{run_dir}/evidence.json"
    inputs = evidence["inputs"] if isinstance(evidence["inputs"], dict) else {}
    model = inputs.get("model") if isinstance(inputs.get("model"), dict) else {}
    field = "inputs.model.spec" if model.get("spec") else "inputs.model.location"
    spec, revision = model.get("spec") or model.get("location"), model.get("revision") or ""
    baseline = inputs.get("baseline_adapter") or {}
    adapter = (baseline.get("path") or "") if isinstance(baseline, dict) else None
    for name, value in ((field, spec), ("inputs.model.revision", revision),
                        ("inputs.baseline_adapter.path", adapter)):
        if not isinstance(value, str) or (name == field and not value):
            raise InputError(f"{where}: field {name}: expected a name or path, got {value!r}")
        if name != "inputs.model.revision" and _brought_along(value, run_dir):
            raise InputError(f"{where}: field {name}: {value} is inside the run directory; "
                             "--replay loads only a model and baseline adapter of your own")
    return spec, field, revision, adapter


def refuse_sources_inside(config, run_dir: Path) -> None:
    """InputError when the run's stored config names a model or baseline adapter inside the
    run directory: tools that rebuild a run from its config (the benchmarks) load the user's
    own model and baseline, never ones the run directory brings along."""
    for name in ("model", "adapter"):
        value = getattr(config, name)
        if isinstance(value, str) and _brought_along(value, run_dir):
            raise InputError(f"{run_dir}/evidence.json: field config.{name}: {value} is inside "
                             "the run directory; only a model and baseline adapter of your own "
                             "are loaded")


def _delivered_policy(run_dir: Path, evidence: dict, config):
    """The recorded base model and baseline, with the delivered adapter as the trained one.
    No code the model names runs (load_policy), the model cache is the user's own (not the
    recorded cache_dir), and any failure to load is an InputError naming the evidence field."""
    spec, field, revision, adapter = _recorded_sources(run_dir, evidence)
    if adapter and not Path(adapter).is_dir():
        raise InputError(f"{adapter}: the run's baseline adapter is not on this machine; "
                         "--replay needs it")
    recorded = dataclasses.replace(config, model=spec, model_revision=revision, adapter="",
                                   baseline_manifest="", cache_dir="")
    try:
        policy = load_policy(recorded, adapter=adapter, seed=config.seed)
    except Exception as error:  # a recorded model that does not load is this input's fault
        detail = (str(error) if isinstance(error, InputError) else
                  f"does not load ({type(error).__name__}: {first_line(error)})")
        named = f" with inputs.baseline_adapter.path {adapter}" if adapter else ""
        raise InputError(f"{run_dir}/evidence.json: --replay of field {field} {spec}{named}: "
                         f"{detail}") from None
    artifact = run_dir / str(evidence["artifact"]["path"])
    try:
        return _with_delivered_adapter(policy, run_dir, artifact, evidence)
    except InputError:
        raise
    except Exception as error:  # the delivered adapter is the run directory's data
        from grpogate.inputs.candidate_dir import FULL_CHECKPOINT

        kind = (evidence.get("foreign") or {}).get("candidate_kind")
        what = artifact if kind == FULL_CHECKPOINT else f"{artifact}/{ADAPTER_WEIGHTS}"
        raise InputError(f"{what}: does not load onto the recorded model "
                         f"({type(error).__name__}: {first_line(error)})") from None


def _with_delivered_adapter(policy, run_dir: Path, artifact: Path, evidence: dict):
    """The policy with the delivered adapter `artifact` as its trained one, of the recorded
    version."""
    if evidence.get("foreign"):
        return _with_foreign_candidate(policy, artifact, evidence)
    from peft import set_peft_model_state_dict

    delivered = load_adapter_state(artifact)
    outcome = set_peft_model_state_dict(policy.model, delivered, adapter_name=TRAINABLE)
    if getattr(outcome, "unexpected_keys", None):
        raise InputError(f"{run_dir}/adapter/{ADAPTER_WEIGHTS}: tensors the run's LoRA does not "
                         f"have (e.g. {outcome.unexpected_keys[0]})")
    version = current_version(policy)
    if version != evidence["artifact"]["new_policy_version"]:
        raise InputError(f"{run_dir}: the delivered adapter loads as policy {version}, not the "
                         f"recorded {evidence['artifact']['new_policy_version']}")
    return policy


def _with_foreign_candidate(policy, artifact: Path, evidence: dict):
    """A gated foreign candidate, of the kind the evidence records, from the run's own copy
    (read as data, as a delivered adapter is): an adapter keeps its own LoRA shape; a full
    checkpoint is checked against the recorded baseline's architecture and swapped in for the
    candidate's pass. Its version must be the recorded one."""
    from grpogate.inputs.candidate import attach_candidate
    from grpogate.inputs.candidate_dir import (FULL_CHECKPOINT, candidate_version, file_hashes,
                                               read_candidate)
    from grpogate.inputs.full_candidate import attach_full_candidate

    if evidence["foreign"].get("candidate_kind") != FULL_CHECKPOINT:
        version = attach_candidate(policy, artifact)
    else:
        candidate = read_candidate(artifact)
        if candidate.kind != FULL_CHECKPOINT:
            raise InputError(f"{artifact}: not a full checkpoint, as the evidence records")
        attach_full_candidate(policy, candidate)
        version = candidate_version(candidate, policy.base.sha256,
                                    file_hashes(candidate.directory, candidate.files))
    if version != evidence["artifact"]["new_policy_version"]:
        raise InputError(f"{artifact}: the delivered candidate loads as policy {version}, not "
                         f"the recorded {evidence['artifact']['new_policy_version']}")
    return policy


def apply_replay(audit: dict, replayed: dict) -> dict:
    """Fold a replay into an audit: any replay mismatch makes the decision `reject`."""
    audit = {**audit, "replay": replayed}
    if replayed["mismatches"]:
        audit.update(mismatches=audit["mismatches"] + replayed["mismatches"], decision="reject",
                     agrees=False)
    return audit


def replay_summary(replayed: dict) -> str:
    line = (f"replay: {replayed['prompts']} eval prompt(s), both policies: "
            f"{replayed['equal']}/{replayed['compared']} completions equal to the stored ones")
    if replayed["environment_matches"]:
        return line + " (environment as recorded)"
    changed = ", ".join(f"{key} {value['recorded']!r} -> {value['now']!r}"
                        for key, value in replayed["environment_differences"].items())
    return line + f"; environment differs from the recorded one ({changed}): agreement " \
                  "reported, not required"
