"""Audit a finished run: re-read its files, recompute what can be recomputed, check every hash.

`grpogate decide RUN_DIR` trusts nothing the run says about itself, and runs no code it names
(rescore.py: a user reward is taken as recorded unless the user trusts its code). From the
stored files alone -- each a regular file inside the run directory, opened only after that is
checked -- it re-runs the verifier named in the evidence on every stored completion (training
and re-test), re-scores the built-in training reward components with the run's reward
functions and recomputes every weighted total against the reference answers stored in
problems.jsonl (so no task generator or dataset is needed, and a copied run directory audits
the same), re-checks every step's rollout
contract, checks every hash the manifest records, recomputes the policy versions from the
adapter's own tensors (a forger who swaps adapter/ and recomputes every file hash still has
to name the candidate's version), and rebuilds the whole evidence document
with the run's own `assemble.assemble_evidence` from the stored records (rollout coverage,
update totals, re-test metrics and paired statistics, effective throughput, status, decision). Counts must match exactly, floats
within FLOAT_TOLERANCE; any mismatch makes the decision `reject`, with the field named
(`rollout.reward_groups`, `trajectories.jsonl:17 reward`, `files.evidence.json sha256`).

Pure Python (no torch): anyone can audit a run without loading a model. Token counts are the one
thing taken on trust (re-tokenizing needs the model's tokenizer); they are checked for
consistency with the token budget only.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Callable

from grpogate.config import BUILT_IN_REWARDS, Gates, TaskConfig
from grpogate.errors import InputError
from grpogate.evidence import decisions
from grpogate.evidence.assemble import (assemble_evidence, generation_rounds, recorded_facts,
                                       step_summary, update_throughput)
from grpogate.evidence.manifest import (GUARD_FILE, PROBLEMS_FILE, RUN_FILES, build_manifest,
                                       trace_ids_sha256)
from grpogate.evidence.rescore import (RescorePlan, announce_cost, audit_reward_set, describe,
                                      recorded_value, refuse_excess_records)
from grpogate.files import (ADAPTER_WEIGHTS, confined_file, parse_json, policy_version,
                            read_confined, safetensors_sha256, sha256_path)
from grpogate.inputs.tasks import load_problem_sets, problem_set_hash, stored_sets
from grpogate.inputs.verifiers import get_verifier

FLOAT_TOLERANCE = 1e-9


class Audit:
    """Collects mismatches as {"field", "recorded", "recomputed"}; recorded first, as stored."""

    def __init__(self) -> None:
        self.mismatches: list[dict[str, Any]] = []

    def mismatch(self, field: str, recorded: Any = None, recomputed: Any = None) -> None:
        self.mismatches.append({"field": field, "recorded": recorded, "recomputed": recomputed})

    def compare(self, field: str, recorded: Any, recomputed: Any) -> None:
        """Walk dicts (and lists of dicts) so the deepest differing field is the one named;
        lists of numbers (reward groups, histogram counts) are named as a whole."""
        if isinstance(recomputed, dict):
            if not isinstance(recorded, dict):
                self.mismatch(field, recorded, "an object")
                return
            for key, value in recomputed.items():
                if key not in recorded:
                    self.mismatch(f"{field}.{key}", "missing", value)
                else:
                    self.compare(f"{field}.{key}", recorded[key], value)
        elif (isinstance(recomputed, list) and isinstance(recorded, list)
              and len(recomputed) == len(recorded) and any(isinstance(v, dict) for v in recomputed)):
            for index, (old, new) in enumerate(zip(recorded, recomputed)):
                self.compare(f"{field}[{index}]", old, new)
        elif not same_value(recorded, recomputed):
            self.mismatch(field, recorded, recomputed)


def same_value(recorded: Any, recomputed: Any) -> bool:
    """Exact for counts, bools and strings; within FLOAT_TOLERANCE when a float is involved."""
    if isinstance(recorded, bool) or isinstance(recomputed, bool):
        return type(recorded) is type(recomputed) and recorded == recomputed
    if isinstance(recorded, (int, float)) and isinstance(recomputed, (int, float)):
        if isinstance(recorded, int) and isinstance(recomputed, int):
            return recorded == recomputed
        return math.isclose(recorded, recomputed, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE)
    if isinstance(recorded, list) and isinstance(recomputed, list):
        return len(recorded) == len(recomputed) and all(
            same_value(a, b) for a, b in zip(recorded, recomputed))
    return recorded == recomputed


# --- reading the run ---------------------------------------------------------------------------

def _read_object(path: Path, audit: Audit) -> dict | None:
    """A JSON object file; unreadable content is a mismatch (a tampered file), not a crash.
    InputError when it is not a regular file inside the run directory, and for JSON no reader
    may take one way (duplicate keys) or nested past any grpogate file (parse_json)."""
    try:
        document = parse_json(read_confined(path.parent, path.name).decode("utf-8"), str(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        audit.mismatch(f"{path.name} (not valid JSON: {error})")
        return None
    if not isinstance(document, dict):
        audit.mismatch(f"{path.name} (not a JSON object)")
        return None
    return document


def _numbered_jsonl(path: Path, audit: Audit) -> list[tuple[int, dict]]:
    """(1-based line number, record) for every non-blank line; bad lines become mismatches."""
    try:
        text = read_confined(path.parent, path.name).decode("utf-8")
    except InputError as error:
        audit.mismatch(f"{path.name} ({str(error).removeprefix(path.name + ': ')})")
        return []
    except UnicodeDecodeError:
        audit.mismatch(f"{path.name} (not UTF-8 text)")
        return []
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = parse_json(line, f"{path}:{number}")
        except json.JSONDecodeError:
            audit.mismatch(f"{path.name}:{number} (malformed JSON)")
            continue
        if isinstance(record, dict):
            records.append((number, record))
        else:
            audit.mismatch(f"{path.name}:{number} (not a JSON object)")
    return records


def reload_problem_sets(config: dict, inputs: dict) -> tuple[list, dict, list, dict]:
    """The run's train and eval problems regenerated from its recorded configuration (needs the
    task generator or dataset; `decide --replay` uses it, the audit reads problems.jsonl).

    Calls the run's own `tasks.load_problem_sets` (pure, no torch). A GSM8K split is read from
    the absolute file the run recorded when it exists, so a run configured with a relative path
    can be replayed from any working directory.
    """
    task = TaskConfig(**config["task"])

    def recorded_file(identity_key: str) -> str:
        recorded = (inputs.get(identity_key) or {}).get("file")
        usable = isinstance(recorded, str) and Path(recorded).is_absolute() and Path(recorded).is_file()
        return recorded if usable else ""

    return load_problem_sets(task, config["train_prompts"], config["eval_prompts"],
                             recorded_file("train_set"), recorded_file("eval_set"))


def stored_problem_sets(run_dir: Path, audit: Audit) -> dict[str, list] | None:
    """The run's train, eval and guard problems as problems.jsonl stores them (None: unusable).

    The run directory alone is enough: no task generator or dataset is needed. The file is
    pinned by the manifest like every other; each prompt id is recomputed from its question
    and the sets' hashes are compared with the recorded identities (`_reload_references`).
    """
    numbered = _numbered_jsonl(run_dir / PROBLEMS_FILE, audit)
    if not numbered:
        return None
    try:
        return stored_sets(numbered, PROBLEMS_FILE)
    except InputError as error:
        audit.mismatch(f"{PROBLEMS_FILE} ({error})")
        return None


# --- the checks ---------------------------------------------------------------------------------

def check_hashes(audit: Audit, run_dir: Path, manifest: dict, evidence: dict,
                 trajectories: list[dict]) -> None:
    """Every file the manifest pins, the trace ids, the adapter, and the manifest's summary."""
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    for name, recorded in files.items():
        try:
            path = confined_file(run_dir, name)
        except InputError as error:  # flagged, and never read
            audit.mismatch(f"files.{name} ({str(error).removeprefix(f'{name}: ')})", recorded)
            continue
        if sha256_path(path) != recorded:
            audit.mismatch(f"files.{name} sha256", recorded, sha256_path(path))
    adapter_path = str((evidence.get("artifact") or {}).get("path") or "")
    on_disk = [name for name in RUN_FILES if _confined(run_dir, name)]
    if adapter_path and (run_dir / adapter_path).is_dir():
        on_disk += [f"{adapter_path}/{p.name}" for p in sorted((run_dir / adapter_path).glob("*"))]
    for name in on_disk:
        if name not in files:
            audit.mismatch(f"files.{name} (not recorded in the manifest)")

    identity = manifest.get("trajectory_identity") or {}
    trace_ids = [str(record.get("trace_id")) for record in trajectories]
    audit.compare("manifest.trajectory_identity", identity, {
        "trace_count": len(trace_ids), "trace_ids_sha256": trace_ids_sha256(trace_ids),
        "trajectories_sha256": _file_sha(run_dir / "trajectories.jsonl"),
        "evidence_sha256": _file_sha(run_dir / "evidence.json")})

    weights = _confined(run_dir, f"{adapter_path}/{ADAPTER_WEIGHTS}") if adapter_path else None
    audit.compare("artifact.sha256", (evidence.get("artifact") or {}).get("sha256"),
                  sha256_path(weights) if weights else None)
    # The rest of the manifest is a summary of the evidence: rebuild it and compare.
    try:
        rebuilt = build_manifest(evidence, run_dir, trajectories)
    except (KeyError, TypeError) as error:
        audit.mismatch(f"manifest (cannot be rebuilt from the evidence: missing {error})")
        return
    unknown_fields(audit, "manifest.json", manifest, rebuilt)
    for key in ("files", "trajectory_identity"):
        rebuilt.pop(key)
    audit.compare("manifest", manifest, rebuilt)


def unknown_fields(audit: Audit, name: str, recorded: dict, rebuilt: dict) -> None:
    """A top-level field the run's own writer never writes is named: a reader of the file
    must not meet a claim the audit did not check."""
    for key in recorded:
        if key not in rebuilt:
            audit.mismatch(f"{name}: unknown field {key!r}", recorded[key], "absent")


def anchored_versions(audit: Audit, run_dir: Path, evidence: dict) -> dict[str, str]:
    """The policy versions recomputed from the artifacts themselves, not from the hash list.

    A forger who swaps adapter/ for another run's and recomputes every file hash still has to
    name the candidate's version; here it is recomputed from the adapter's own tensors (the
    rule of files.tensors_digest, read without torch) and the base model's recorded identity,
    and the evidence, the manifest and every candidate re-test record must carry it."""
    inputs, artifact = evidence["inputs"], evidence.get("artifact") or {}
    base = (inputs.get("model") or {}).get("sha256")
    versions = {"baseline": inputs.get("baseline_policy_version"),
                "candidate": artifact.get("new_policy_version")}
    weights = _confined(run_dir, f"{artifact.get('path') or 'adapter'}/{ADAPTER_WEIGHTS}")
    if weights is not None:
        versions["candidate"] = _version_of(audit, base, weights,
                                            "artifact (adapter weights unreadable",
                                            versions["candidate"])
    audit.compare("artifact.new_policy_version", artifact.get("new_policy_version"),
                  versions["candidate"])
    baseline_adapter = inputs.get("baseline_adapter")
    baseline_weights = (Path(str(baseline_adapter.get("path"))) / ADAPTER_WEIGHTS
                        if isinstance(baseline_adapter, dict) else None)
    if baseline_adapter is None:
        versions["baseline"] = policy_version(base, None)
    elif baseline_weights is not None and baseline_weights.is_file():
        versions["baseline"] = _version_of(audit, base, baseline_weights,
                                           "inputs.baseline_adapter (unreadable", versions["baseline"])
    # A baseline adapter that is not on this machine cannot be re-hashed: taken as recorded.
    audit.compare("inputs.baseline_policy_version", inputs.get("baseline_policy_version"),
                  versions["baseline"])
    return versions


def _version_of(audit: Audit, base: Any, weights: Path, field: str, recorded: Any) -> Any:
    """The policy version of `base` + the adapter tensors in `weights`; an unreadable file is a
    mismatch named `field` and the recorded version stands (so it is not reported twice)."""
    try:
        return policy_version(base, safetensors_sha256(weights))
    except InputError as error:
        audit.mismatch(f"{field}: {error})")
        return recorded


def _file_sha(path: Path) -> str | None:
    found = _confined(path.parent, path.name)
    return sha256_path(found) if found else None


def _confined(run_dir: Path, name: str) -> Path | None:
    """`run_dir/name` when it is a regular file inside the run directory, else None (not read)."""
    try:
        return confined_file(run_dir, name)
    except InputError:
        return None


def _budget_consistent(record: dict, max_new_tokens: Any) -> bool:
    """A completion that hit the budget has exactly max_new_tokens tokens; one below it did not."""
    tokens, hit = record.get("completion_tokens"), record.get("hit_max_length")
    if not (isinstance(tokens, int) and isinstance(hit, bool) and isinstance(max_new_tokens, int)):
        return False
    return tokens == max_new_tokens if hit else tokens <= max_new_tokens


def check_records(audit: Audit, file_name: str, numbered: list[tuple[int, dict]], verifier,
                  references: dict[str, str] | None,
                  expected: Callable[[dict], dict[str, Any]],
                  max_new_tokens: Any, reward_set=None, plan: RescorePlan | None = None,
                  first_index: int = 0, questions: dict[str, str] | None = None) -> None:
    """Per line: the prompt belongs to the set, identities match, the reward re-scores equal.
    With `reward_set` (training records), every component is re-scored with the run's own
    reward functions (those it takes as recorded excepted) and `reward` must be their weighted
    total; without it (the re-test), `reward` is the correctness verifier's alone. Records
    outside `plan`'s sample (record `first_index` + position) keep their verifier and user-code
    values as recorded; everything else about them is still checked."""
    for position, (number, record) in enumerate(numbered):
        where = f"{file_name}:{number}"
        for key, value in expected(record).items():
            if record.get(key) != value:
                audit.mismatch(f"{where} {key}", record.get(key), value)
        if not _budget_consistent(record, max_new_tokens):
            audit.mismatch(f"{where} hit_max_length", record.get("hit_max_length"),
                           f"consistent with {record.get('completion_tokens')!r} tokens of "
                           f"max_new_tokens={max_new_tokens!r}")
        logprobs = record.get("sampler_logprobs")
        if logprobs is not None and (not isinstance(logprobs, list)
                                     or len(logprobs) != record.get("completion_tokens")):
            audit.mismatch(f"{where} sampler_logprobs", f"{len(logprobs)!r} values" if
                           isinstance(logprobs, list) else logprobs,
                           f"one per completion token ({record.get('completion_tokens')!r})")
        if references is None or verifier is None:
            continue
        reference = references.get(str(record.get("prompt_id")))
        if reference is None:
            audit.mismatch(f"{where} prompt_id", record.get("prompt_id"), "a prompt of the set")
            continue
        sampled = plan is None or plan.covers(first_index + position)
        rescored = _rescored_reward(audit, where, record, reference, verifier, reward_set, sampled,
                                    (questions or {}).get(str(record.get("prompt_id")), ""))
        if not same_value(record.get("reward"), rescored):
            audit.mismatch(f"{where} reward", record.get("reward"), rescored)


def _rescored_reward(audit: Audit, where: str, record: dict, reference: str, verifier,
                     reward_set, sampled: bool, question: str = "") -> float:
    """The record's reward recomputed: the verifier's (re-run when `sampled`, else as recorded)
    alone, or with `reward_set` the weighted total of every component, the components compared
    with the recorded ones. Values taken as recorded must be numbers within the value bound."""
    recorded = record.get("rewards") if isinstance(record.get("rewards"), dict) else {}
    if sampled:
        correctness = verifier.score(record.get("completion"), reference)
    elif reward_set is not None:
        correctness = recorded_value(audit, f"{where} rewards.correctness",
                                     recorded.get("correctness"))
    else:
        correctness = recorded_value(audit, f"{where} reward", record.get("reward"))
    if reward_set is None:
        return correctness
    taken = [name for name in reward_set.weights if name not in BUILT_IN_REWARDS
             and (name in reward_set.as_recorded or not sampled)]
    # A user component may record None ("not applicable", a TRL-style function's answer).
    values = {name: recorded_value(audit, f"{where} rewards.{name}", recorded.get(name),
                                   allow_none=True) for name in taken}
    tokens = record.get("completion_tokens")
    components = reward_set.score(record.get("completion"), reference,
                                  tokens if isinstance(tokens, int) else 0, correctness,
                                  question=question, recorded=values, taken=taken)
    audit.compare(f"{where} rewards", record.get("rewards"), components)
    return reward_set.total(components)


def check_steps(audit: Audit, evidence: dict, trajectories: list[dict],
                reward_versions: dict | None) -> None:
    """Every step's recorded summary (coverage, components, refill) and rollout contract, from
    that step's trajectory records; `reward_versions` as the audit's reward set has them."""
    group_size = evidence["config"]["group_size"]
    mask_truncated = evidence["config"].get("mask_truncated_completions", False)
    iterations = evidence["config"].get("num_iterations", 1)
    steps = evidence.get("steps") if isinstance(evidence.get("steps"), list) else []
    for index, step in enumerate(steps):
        records = [r for r in trajectories if r.get("step") == step.get("step")]
        if not records:
            audit.mismatch(f"steps[{index}] (no trajectories for step {step.get('step')!r})")
            continue
        try:
            audit.compare(f"steps[{index}]", step,
                          step_summary(records, group_size, mask_truncated, iterations))
            if "tokens_forwarded" in step:  # absent from evidence written before the counts
                audit.compare(f"steps[{index}]", step, update_throughput(
                    step["tokens"], step["tokens_forwarded"], step["tokens_forwarded_real"],
                    step["update_seconds"]))
            recorded_rounds = step.get("generation_rounds") or []
            rounds = generation_rounds(records, group_size, evidence["config"]["seed"],
                                       step.get("step"))
            if len(recorded_rounds) != len(rounds):
                audit.mismatch(f"steps[{index}].generation_rounds (count)",
                               len(recorded_rounds), len(rounds))
            else:  # per round: seed, prompts and valid groups; the seconds are taken as recorded
                audit.compare(f"steps[{index}].generation_rounds", recorded_rounds, rounds)
        except (ValueError, KeyError, TypeError, OverflowError) as error:
            audit.mismatch(f"trajectories.jsonl step {step.get('step')!r} ({error})")
    # Contract: re-check every step's groups against that step's recorded policy version.
    versions = {s.get("step"): s.get("policy_version") for s in steps}
    admitted = bool(trajectories)
    verifier_version = evidence["inputs"]["verifier"]["version"]
    for step_number in dict.fromkeys(r.get("step") for r in trajectories):
        records = [r for r in trajectories if r.get("step") == step_number]
        expected_version = versions.get(step_number, records[0].get("source_policy_version"))
        admitted &= decisions.check_step_contract(records, expected_version, verifier_version,
                                                  group_size, reward_versions)["admitted"]
    audit.compare("contract.admitted", (evidence.get("contract") or {}).get("admitted"), admitted)


def check_retest_records(audit: Audit, evidence: dict, eval_records: list[dict],
                         eval_prompt_ids: list[str] | None, guard_records: list[dict] = (),
                         guard_prompt_ids: list[str] | None = None) -> None:
    """A skipped re-test has no records and a run that says so; a held one covers the eval set
    (and the guard set, when the guard was on)."""
    comparison = evidence.get("comparison") or {}
    if comparison.get("skipped") is True:
        # A run stopped before its re-test records zeros; they are only honest if the run
        # says it did not finish and no re-test completion exists.
        if evidence.get("status") == "ok":
            audit.mismatch("comparison.skipped (a run with status ok must have a re-test)", True)
        for name, records in (("eval_completions.jsonl", eval_records),
                              (GUARD_FILE, guard_records)):
            if records:
                audit.mismatch(f"{name} (records of a skipped re-test)", len(records), 0)
        return
    if eval_prompt_ids is None:
        return
    for name in ("baseline", "candidate"):
        answered = sorted({str(r.get("prompt_id")) for r in eval_records if r.get("policy") == name})
        audit.compare(f"eval_completions.jsonl {name} prompt ids", answered, sorted(eval_prompt_ids))
    for name in ("baseline", "candidate") if guard_prompt_ids else ():
        answered = sorted({str(r.get("prompt_id")) for r in guard_records
                           if r.get("policy") == name})
        audit.compare(f"{GUARD_FILE} {name} prompt ids", answered, sorted(guard_prompt_ids))


def check_assembly(audit: Audit, evidence: dict, trajectories: list[dict],
                   eval_records: list[dict], guard_records: list[dict] = ()) -> None:
    """Rebuild the evidence document from the recorded facts and the stored records with the
    run's own function; every derived field must come out as recorded (the guard's paired
    statistics and the re-test drift included)."""
    compare_rebuilt(audit, evidence, lambda: assemble_evidence(
        recorded_facts(evidence), evidence["config"], evidence.get("steps") or [], trajectories,
        eval_records, guard_records))


def compare_rebuilt(audit: Audit, evidence: dict, rebuild: Callable[[], dict]) -> None:
    """Every field of the evidence `rebuild()` assembles must be as recorded; one that cannot
    be rebuilt (ValueError, including InputError, KeyError, TypeError) is a mismatch."""
    try:
        rebuilt = rebuild()
    except (ValueError, KeyError, TypeError, OverflowError) as error:
        audit.mismatch(f"evidence (cannot be rebuilt from the stored records: "
                       f"{type(error).__name__} {error})")
        return
    unknown_fields(audit, "evidence.json", evidence, rebuilt)
    rebuilt.pop("decision")  # re-decided below, from the evidence as recorded
    for key, value in rebuilt.items():
        audit.compare(key, evidence.get(key), value)


# --- the whole audit ----------------------------------------------------------------------------

def _read_run(audit: Audit, run_dir: Path, guard_expected: bool) -> tuple[dict, list, list, list]:
    """The manifest (empty when missing) and the numbered trajectory, re-test and guard
    records (the guard file is read when it exists or the run's config says it must)."""
    manifest: dict = {}
    if (run_dir / "manifest.json").is_file():
        manifest = _read_object(run_dir / "manifest.json", audit) or {}
    else:
        audit.mismatch("manifest.json (missing: the run did not complete)")
    guard = (_numbered_jsonl(run_dir / GUARD_FILE, audit)
             if guard_expected or (run_dir / GUARD_FILE).exists() else [])
    return (manifest, _numbered_jsonl(run_dir / "trajectories.jsonl", audit),
            _numbered_jsonl(run_dir / "eval_completions.jsonl", audit), guard)


def _guard_expected(evidence: dict) -> bool:
    """A guard file must exist when the config's guard was on and the re-test ran."""
    guard = evidence["config"].get("guard")
    skipped = (evidence.get("comparison") or {}).get("skipped") is True
    return (isinstance(guard, dict) and type(guard.get("prompts")) is int
            and guard["prompts"] > 0 and not skipped)


def _reload_references(audit: Audit, evidence: dict, run_dir: Path
                       ) -> tuple[dict[str, dict] | None, dict | None]:
    """Reference answers by prompt id of the stored train, eval and guard sets, and the train
    set's questions (what a TRL-style reward function is given) (None: unavailable).

    Each set must hash (the run's own `problem_set_hash`) to the identity the evidence records
    and hold as many problems as the config asked for."""
    stored = stored_problem_sets(run_dir, audit)
    if stored is None:
        return None, None
    config = evidence["config"]
    guard = config.get("guard") if isinstance(config.get("guard"), dict) else {}
    sizes = {"train": config["train_prompts"], "eval": config["eval_prompts"],
             "guard": max(0, guard.get("prompts", 0))}
    for split, size in sizes.items():
        recorded = evidence["inputs"].get(f"{split}_set") or {}
        if split != "guard" or size:
            audit.compare(f"inputs.{split}_set.problem_set_sha256",
                          recorded.get("problem_set_sha256"), problem_set_hash(stored[split]))
        audit.compare(f"{PROBLEMS_FILE} {split}_set size", size, len(stored[split]))
    return ({split: {p.prompt_id: p.reference for p in problems}
             for split, problems in stored.items()},
            {p.prompt_id: p.question for p in stored["train"]})


def _check_all_records(audit: Audit, evidence: dict, numbered: dict[str, list],
                       references: dict[str, dict] | None, verifier, reward_set,
                       policy_versions: dict[str, str], plan: RescorePlan,
                       train_questions: dict | None) -> None:
    """Every stored completion re-scored: training, re-test and guard records (the first two
    within `plan`'s sample)."""
    refs = references or {}  # None: problems.jsonl unusable, the rewards cannot be re-scored
    _check_run_records(audit, evidence, numbered["trajectories"], numbered["eval"],
                       refs.get("train"), refs.get("eval"), verifier, reward_set, policy_versions,
                       plan, train_questions)
    if numbered["guard"]:
        guard_verifier = _guard_verifier(audit, evidence)
        check_records(audit, GUARD_FILE, numbered["guard"], guard_verifier, refs.get("guard"),
                      lambda r: {"verifier_version": (evidence["inputs"].get("guard_verifier")
                                                      or {}).get("version"),
                                 "seed": evidence["seeds"]["eval"],
                                 "policy_version": policy_versions.get(
                                     r.get("policy"), "the baseline or candidate version")},
                      evidence["config"]["max_new_tokens"])


def _guard_verifier(audit: Audit, evidence: dict):
    """The guard task's own verifier, rebuilt from the config; its version must be recorded."""
    name = f"reasoning-gym/{evidence['config']['guard']['task']}"
    recorded = evidence["inputs"].get("guard_verifier") or {}
    try:
        verifier = get_verifier(name)
    except ValueError as error:
        audit.mismatch(f"inputs.guard_verifier.name ({error})", recorded.get("name"))
        return None
    audit.compare("inputs.guard_verifier", recorded, {"name": name, "version": verifier.version})
    return verifier


def _check_run_records(audit: Audit, evidence: dict, numbered_trajectories, numbered_eval,
                       train_refs, eval_refs, verifier, reward_set,
                       policy_versions: dict[str, str], plan: RescorePlan,
                       train_questions=None) -> None:
    versions = {s.get("step"): s.get("policy_version") for s in evidence.get("steps") or []}
    verifier_version = evidence["inputs"]["verifier"]["version"]
    max_new_tokens = evidence["config"]["max_new_tokens"]
    check_records(audit, "trajectories.jsonl", numbered_trajectories, verifier, train_refs,
                  lambda r: {"verifier_version": verifier_version,
                             "source_policy_version": versions.get(
                                 r.get("step"), r.get("source_policy_version"))},
                  max_new_tokens, reward_set, plan, questions=train_questions)
    check_records(audit, "eval_completions.jsonl", numbered_eval, verifier, eval_refs,
                  lambda r: {"verifier_version": verifier_version,
                             "seed": evidence["seeds"]["eval"],
                             "policy_version": policy_versions.get(
                                 r.get("policy"), "the baseline or candidate version")},
                  max_new_tokens, plan=plan, first_index=len(numbered_trajectories))


def audit_run(run_dir: str | Path, *, trusted_rewards: list[str] = (),
              max_rescore: int | None = None,
              announce: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Audit one run directory. Returns {"run_dir", "recorded_decision", "decision", "agrees",
    "mismatches", "checks", "rescoring"}; `decision` is `reject` whenever anything mismatches,
    else the decision `decide_run` recomputes from the evidence. InputError when there is no
    evidence.json at all, when a path the run names leaves the run directory or is not a regular
    file, or when it holds more records than its config runs; an unreadable evidence.json is a
    mismatch like any other tampering. User reward code runs only for `trusted_rewards`;
    `max_rescore` caps the records re-scored; `announce` hears the cost of a long re-scoring
    before it starts (rescore.py)."""
    run_dir = Path(run_dir)
    if not _confined(run_dir, "evidence.json"):
        raise InputError(f"{run_dir}: not a run directory (no evidence.json, or not a regular "
                         "file)")
    audit = Audit()
    evidence = _read_object(run_dir / "evidence.json", audit)
    if evidence is None or not isinstance(evidence.get("config"), dict):
        if evidence is not None:
            audit.mismatch("evidence.json (no config: not a grpogate evidence file)")
        return {"run_dir": str(run_dir), "recorded_decision": None, "decision": "reject",
                "agrees": False, "mismatches": audit.mismatches, "checks": []}
    check_adapter_dir(run_dir, evidence)
    manifest, *files = _read_run(audit, run_dir, _guard_expected(evidence))
    numbered = dict(zip(("trajectories", "eval", "guard"), files))
    refuse_excess_records(evidence["config"], {"trajectories.jsonl": len(numbered["trajectories"]),
                                               "eval_completions.jsonl": len(numbered["eval"]),
                                               GUARD_FILE: len(numbered["guard"])})
    trajectories, eval_records, guard_records = (
        [record for _, record in numbered[name]] for name in ("trajectories", "eval", "guard"))
    # The guard's records are always re-scored (their count is bounded by the config above).
    plan = RescorePlan.choose(len(trajectories) + len(eval_records), max_rescore)
    reward_set = None
    try:
        if manifest:
            check_hashes(audit, run_dir, manifest, evidence, trajectories)
        versions = anchored_versions(audit, run_dir, evidence)
        references, train_questions = _reload_references(audit, evidence, run_dir)
        verifier = _verifier(audit, evidence)
        if verifier is not None:
            reward_set = audit_reward_set(audit, evidence, verifier, run_dir, list(trusted_rewards))
            announce_cost(announce, verifier, reward_set, plan)
        _check_all_records(audit, evidence, numbered, references, verifier, reward_set, versions,
                           plan, train_questions)
        check_steps(audit, evidence, trajectories,
                    reward_set.versions if reward_set is not None else None)
        check_retest_records(audit, evidence, eval_records,
                             list(references["eval"]) if references else None, guard_records,
                             list(references["guard"]) if references else None)
        check_assembly(audit, evidence, trajectories, eval_records, guard_records)
    except (KeyError, TypeError, AttributeError) as error:
        # A field the audit needs is missing or of the wrong type: unreadable evidence.
        audit.mismatch(f"evidence (malformed: {type(error).__name__} {error})")

    return {**verdict(audit, run_dir, evidence), "rescoring": describe(reward_set, plan)}


def verdict(audit: Audit, run_dir: Path, evidence: dict) -> dict[str, Any]:
    """Re-decide from the evidence as recorded; any mismatch found makes it `reject`."""
    recomputed = decisions.decide_run(evidence, (evidence.get("config") or {}).get("gates"))
    audit.compare("decision", evidence.get("decision"), recomputed)
    recorded = (evidence.get("decision") or {}).get("decision") if isinstance(
        evidence.get("decision"), dict) else None
    return {
        "run_dir": str(run_dir), "recorded_decision": recorded,
        "decision": "reject" if audit.mismatches else recomputed["decision"],
        "agrees": not audit.mismatches and recomputed["decision"] == recorded,
        "mismatches": audit.mismatches, "checks": recomputed["checks"],
        "non_default_gates": non_default_gates(evidence),
        "gain_rule": decisions.gain_rule((evidence.get("config") or {}).get("gates")),
        "gain_rule_line": decisions.gain_rule_line((evidence.get("config") or {}).get("gates")),
    }


def check_adapter_dir(run_dir: Path, evidence: dict) -> None:
    """The delivered adapter folder the evidence names (artifact.path) is a folder inside the
    run directory holding only regular files; InputError before any of it is opened (a path
    to /etc or to a folder holding a FIFO would be hashed, or hang the audit)."""
    name = (evidence.get("artifact") or {}).get("path") if isinstance(
        evidence.get("artifact"), dict) else None
    if name is None:
        return
    base = run_dir.resolve()
    folder = (base / str(name)).resolve()
    if not isinstance(name, str) or not name or Path(name).is_absolute() or not (
            folder.is_relative_to(base) and folder != base):
        raise InputError(f"{run_dir}/evidence.json: field artifact.path {name!r} is not a "
                         "folder inside the run directory")
    if not folder.is_dir():
        return  # a missing adapter is a mismatch of the hashes, named there
    for entry in sorted(folder.iterdir()):
        if not entry.resolve().is_relative_to(base):
            continue  # a link out of the run: flagged by check_hashes, never read
        try:
            confined_file(run_dir, f"{name}/{entry.name}")
        except InputError:
            raise InputError(f"{entry}: not a file; a run's {name}/ holds only the adapter's "
                             "files (remove it, or this is not a grpogate run directory)") from None


def non_default_gates(evidence: dict) -> dict[str, dict]:
    """{gate: {"value", "default"}} for every gate the run changed from the defaults.

    A gate is part of what a run claims: a forger can loosen one, re-decide and re-hash, and
    the audit then agrees. Printing what differs from the defaults lets a reader see it."""
    recorded = (evidence.get("config") or {}).get("gates")
    recorded = recorded if isinstance(recorded, dict) else {}
    defaults = dataclasses.asdict(Gates())
    return {name: {"value": recorded[name], "default": default}
            for name, default in defaults.items()
            if name in recorded and not same_value(recorded[name], default)}


def _verifier(audit: Audit, evidence: dict):
    recorded = evidence["inputs"]["verifier"]
    try:
        verifier = get_verifier(recorded["name"])
    except ValueError as error:
        audit.mismatch(f"inputs.verifier.name ({error})", recorded.get("name"))
        return None
    audit.compare("inputs.verifier.version", recorded.get("version"), verifier.version)
    return verifier
