"""Evaluate one policy on its own (`grpogate eval`), and compare two evaluations (`grpogate compare`).

An eval file holds the per-completion records of ONE policy on the eval prompts, the reduced
metrics, and every identity a comparison needs (policy version, eval set hash, verifier version,
sampling seed and settings). Two eval files are comparable pair by pair only when they answer
the same prompts under the same seed with the same verifier; `compare_evaluations` refuses
otherwise rather than report a gain that mixes a policy change with a data or seed change.

With the defaults (the run's profile, seed = run seed + 10,000, eval_group_size) an eval of
the baseline reproduces the run's own re-test of the baseline: same prompts, same batch layout,
same torch seed. Only `evaluate_standalone` needs torch; it imports it lazily, so comparing two
files stays a pure-Python operation.
"""

from __future__ import annotations

import time
from pathlib import Path
from datetime import datetime, timezone
from typing import Any

from grpogate.evidence import metrics
from grpogate.config import RunConfig
from grpogate.errors import InputError
from grpogate.evidence.assemble import library_versions
from grpogate.evidence.manifest import PROBLEMS_FILE
from grpogate.files import read_jsonl
from grpogate.inputs.tasks import load_eval_set

EVAL_FILE_KIND = "grpogate-eval"
EVAL_FILE_VERSION = 1
POLICY_NAME = "policy"  # the `policy` field of every record in an eval file
# Sampling settings that change what a policy can answer; a difference is reported, not refused.
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "max_prompt_tokens",
                 "system_prompt")


def parse_policy_spec(spec: str) -> tuple[str, str]:
    """`BASE[+ADAPTER]` -> (base, adapter or ""). Split at the first "+": model ids and the
    bundled id contain none, an adapter directory may."""
    base, _, adapter = spec.partition("+")
    if not base:
        raise InputError(f"--policy {spec!r}: expected BASE or BASE+ADAPTER_DIR")
    return base, adapter


def parse_tasks_spec(spec: str) -> dict[str, str]:
    """`reasoning-gym:NAME` or `gsm8k:PATH_OR_HF_ID` -> the task-table keys it sets."""
    source, _, rest = spec.partition(":")
    if source == "reasoning-gym" and rest:
        return {"source": source, "name": rest}
    if source in ("gsm8k", "dataset") and rest:
        return {"source": source, "path": rest}
    raise InputError(f"--task {spec!r}: expected reasoning-gym:NAME (e.g. reasoning-gym:chain_sum), "
                     "gsm8k:PATH (a directory with test.jsonl, a .jsonl file or an HF id) or "
                     "dataset:PATH (a parquet, JSONL, CSV or Arrow file or a save_to_disk folder)")


def load_eval_problems(config: RunConfig, exclude_ids: frozenset[str] = frozenset()
                       ) -> tuple[list, dict]:
    """The eval set exactly as a run draws it (skipping `exclude_ids` while drawing)."""
    return load_eval_set(config.task, config.eval_prompts, exclude_ids=exclude_ids)


def trained_prompt_ids(run_dir: str | Path) -> set[str]:
    """Every prompt id a run trained on: the train split of its problems.jsonl and every
    prompt of its trajectories.jsonl (a run directory needs at least one of them)."""
    run_dir = Path(run_dir)
    problems, trajectories = run_dir / PROBLEMS_FILE, run_dir / "trajectories.jsonl"
    if not problems.is_file() and not trajectories.is_file():
        raise InputError(f"--exclude-run {run_dir}: not a run directory (neither "
                         f"{PROBLEMS_FILE} nor trajectories.jsonl)")
    ids = {str(r.get("prompt_id")) for r in read_jsonl(problems) if r.get("split") == "train"} \
        if problems.is_file() else set()
    if trajectories.is_file():
        ids |= {str(r.get("prompt_id")) for r in read_jsonl(trajectories)}
    return ids


def refuse_trained_prompts(problems: list, run_dir: str | Path) -> int:
    """InputError when any eval problem is one the run in `run_dir` trained on; else the number
    of the run's training prompts checked against."""
    trained = trained_prompt_ids(run_dir)
    shared = [p for p in problems if p.prompt_id in trained]
    if shared:
        raise InputError(f"--exclude-run {run_dir}: {len(shared)} of {len(problems)} eval prompts "
                         f"were trained on by that run (first: prompt id {shared[0].prompt_id}); "
                         "choose another task.eval_seed, split or task")
    return len(trained)


def _eval_problems(config: RunConfig, exclude_run: str | None,
                   skip_run: str | None) -> tuple[list, dict, dict | None]:
    """The eval problems, their identity, and what was checked against a run's training
    prompts (None when no run was named)."""
    skipped = frozenset(trained_prompt_ids(skip_run)) if skip_run else frozenset()
    problems, eval_identity = load_eval_problems(config, skipped)
    excluded = None
    if exclude_run or skip_run:
        checked = exclude_run or skip_run
        excluded = {"run_dir": str(checked), "skipped_while_drawing": bool(skip_run),
                    "trained_prompts": refuse_trained_prompts(problems, checked), "shared": 0}
    return problems, eval_identity, excluded


def evaluate_standalone(config: RunConfig, policy_spec: str, seed: int, advance=None,
                        exclude_run: str | None = None, skip_run: str | None = None) -> dict:
    """Sample `config.eval_group_size` fresh completions per eval prompt from one policy.

    `config.model` / `config.adapter` name the policy. The policy runs as the pipeline's
    baseline does (adapter disabled, or the loaded adapter as frozen reference), so its
    version is the one a run starting from it would record. `exclude_run`: a run directory
    whose training prompts must not be among the eval prompts (checked before loading).
    `skip_run` (reasoning-gym): draw the eval set skipping that run's training prompts, then
    check as `exclude_run` does.
    """
    from grpogate.sampling.retest import evaluate_policy
    from grpogate.inputs.policy import load_policy, sampling_weights
    from grpogate.sampling.rollout import encode_prompts, sampling_settings
    from grpogate.inputs.verifiers import get_verifier

    try:
        verifier = get_verifier(config.resolved_verifier())
    except ValueError as error:
        raise InputError(f"verifier: {error}") from None
    problems, eval_identity, excluded = _eval_problems(config, exclude_run, skip_run)
    started = time.perf_counter()
    policy = load_policy(config, adapter=config.adapter, seed=config.seed)
    load_seconds = time.perf_counter() - started
    prompts = encode_prompts(policy.tokenizer, problems, config.resolved_system_prompt(),
                             config.max_prompt_tokens)
    started = time.perf_counter()
    records = evaluate_policy(
        policy.model, policy.tokenizer, problems, prompts, policy_name=POLICY_NAME,
        policy_version=policy.baseline_version, verifier=verifier,
        group_size=config.eval_group_size, settings=sampling_settings(config), seed=seed,
        mode=lambda: sampling_weights(policy, baseline=True), advance=advance)
    evaluation_seconds = time.perf_counter() - started
    return {
        "kind": EVAL_FILE_KIND, "version": EVAL_FILE_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "policy": {"spec": policy_spec, "model": policy.base.identity(),
                   "adapter": ({"path": config.adapter, "sha256": policy.baseline_adapter_sha256}
                               if config.adapter else None),
                   "policy_version": policy.baseline_version},
        "verifier": {"name": config.resolved_verifier(), "version": verifier.version},
        "eval_set": eval_identity,
        "excluded_run": excluded,
        "prompt_ids": [problem.prompt_id for problem in problems],
        "seed": seed,
        "group_size": config.eval_group_size,
        "sampling": {"max_new_tokens": config.max_new_tokens, "temperature": config.temperature,
                     "top_p": config.top_p, "top_k": config.top_k, "min_p": config.min_p,
                     "max_prompt_tokens": config.max_prompt_tokens,
                     "system_prompt": config.resolved_system_prompt(),
                     "generation_batch_size": config.generation_batch_size},
        "config": config.to_dict(),
        "environment": library_versions() | {"device": str(policy.device)},
        "seconds": {"load": load_seconds, "evaluation": evaluation_seconds},
        "metrics": metrics.summarize_completions(records, config.eval_group_size,
                                                 config.max_new_tokens),
        "records": records,
    }


# --- comparing two eval files (pure) -----------------------------------------------------------

def _checked(document: Any, name: str) -> dict:
    if not isinstance(document, dict) or document.get("kind") != EVAL_FILE_KIND:
        raise InputError(f"{name}: not a grpogate eval file (field \"kind\" is not "
                         f"{EVAL_FILE_KIND!r}); write one with `grpogate eval`")
    for field in ("prompt_ids", "seed", "group_size", "verifier", "sampling", "records", "policy"):
        if field not in document:
            raise InputError(f"{name}: field {field!r} missing")
    return document


def _summary(document: dict, name: str) -> dict:
    """Re-reduce the records (the stored metrics are not trusted) and check their identities."""
    records = document["records"]
    if {str(r.get("prompt_id")) for r in records} != set(document["prompt_ids"]):
        raise InputError(f"{name}: records do not cover exactly the file's prompt_ids")
    if any(r.get("seed") != document["seed"] for r in records):
        raise InputError(f"{name}: a record's seed differs from the file's seed {document['seed']}")
    try:
        return metrics.summarize_completions(records, document["group_size"],
                                             document["sampling"]["max_new_tokens"])
    except (ValueError, KeyError) as error:
        raise InputError(f"{name}: {error}") from None


def compare_evaluations(baseline: Any, candidate: Any, *, names: tuple[str, str] = ("A", "B"),
                        resamples: int = 2000, bootstrap_seed: int = 0,
                        confidence: float = 0.95) -> dict:
    """Candidate (B) minus baseline (A), paired per prompt, with bootstrap intervals and exact
    tests (metrics.paired_comparison). Refuses (InputError) when the prompt ids, seeds,
    verifier versions or group sizes differ: such a gain would not be a policy's gain."""
    a, b = _checked(baseline, names[0]), _checked(candidate, names[1])
    only_a = sorted(set(a["prompt_ids"]) - set(b["prompt_ids"]))
    only_b = sorted(set(b["prompt_ids"]) - set(a["prompt_ids"]))
    if only_a or only_b:
        first = (only_a or only_b)[0]
        raise InputError(f"prompt ids differ: {len(only_a)} only in {names[0]}, {len(only_b)} only "
                         f"in {names[1]} (first: {first}); evaluate both on the same eval set")
    for field, read in (("seed", lambda d: d["seed"]),
                        ("verifier version", lambda d: d["verifier"].get("version")),
                        ("group size", lambda d: d["group_size"])):
        if read(a) != read(b):
            raise InputError(f"{field}s differ: {names[0]} has {read(a)!r}, {names[1]} has "
                             f"{read(b)!r}; a paired comparison needs the same {field}")
    summaries = (_summary(a, names[0]), _summary(b, names[1]))
    warnings = [f"sampling {key} differs: {a['sampling'].get(key)!r} vs {b['sampling'].get(key)!r}"
                for key in SAMPLING_KEYS if a["sampling"].get(key) != b["sampling"].get(key)]

    def side(document: dict, summary: dict, name: str) -> dict:
        return {"name": name, "policy": document["policy"].get("spec"),
                "policy_version": document["policy"].get("policy_version"),
                **{key: summary[key] for key in ("mean_reward", "pass_at_group",
                                                 "max_length_hit_ratio", "length")}}

    return {
        "kind": "grpogate-comparison",
        "baseline": side(a, summaries[0], names[0]),
        "candidate": side(b, summaries[1], names[1]),
        "reward_mean_gain": summaries[1]["mean_reward"] - summaries[0]["mean_reward"],
        "pass_at_group_gain": summaries[1]["pass_at_group"] - summaries[0]["pass_at_group"],
        "seed": a["seed"], "group_size": a["group_size"],
        "verifier_version": a["verifier"].get("version"),
        "paired": metrics.paired_comparison(summaries[0], summaries[1], resamples=resamples,
                                            seed=bootstrap_seed, confidence=confidence),
        "warnings": warnings,
    }
