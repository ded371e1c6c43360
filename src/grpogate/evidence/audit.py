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
update totals, re-test metrics and paired statistics, effective throughput, status, decision).
Counts must match exactly, floats within audit_files.FLOAT_TOLERANCE; any mismatch makes the decision `reject`, with the field named
(`rollout.reward_groups`, `trajectories.jsonl:17 reward`, `files.evidence.json sha256`).

Pure Python (no torch): anyone can audit a run without loading a model. Token counts are the one
thing taken on trust (re-tokenizing needs the model's tokenizer); they are checked for
consistency with the token budget only. Reading the files, the hashes and the anchored policy
versions are in audit_files.py; the record, step and assembly checks and `audit_run` are here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from grpogate.config import Gates
from grpogate.errors import InputError
from grpogate.evidence import decisions
from grpogate.evidence.assemble import (assemble_evidence, generation_rounds, recorded_facts,
                                       step_summary, update_throughput)
from grpogate.evidence.audit_bounds import BoundedAudit
from grpogate.evidence.audit_files import (Audit, anchored_versions, check_hashes, confined,
                                           no_change_words, numbered_jsonl, read_object, same_value,
                                           stored_problem_sets, unknown_fields)
from grpogate.evidence.manifest import GUARD_FILE, PROBLEMS_FILE
from grpogate.evidence.table_audit import check_table_identity
from grpogate.evidence.rescore import (RescorePlan, announce_cost, audit_reward_set, describe,
                                      rescored_reward, run_limits)
from grpogate.files import confined_file
from grpogate.inputs.tasks import problem_set_hash
from grpogate.inputs.verifiers import get_verifier


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
                  first_index: int = 0, questions: dict | None = None) -> None:
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
        rescored = rescored_reward(audit, where, record, reference, verifier, reward_set, sampled,
                                    (questions or {}).get(str(record.get("prompt_id"))))
        if not same_value(record.get("reward"), rescored):
            audit.mismatch(f"{where} reward", record.get("reward"), rescored)


def check_steps(audit: Audit, evidence: dict, trajectories: list[dict],
                reward_versions: dict | None) -> None:
    """Every step's recorded summary (coverage, components, refill) and rollout contract, from
    that step's trajectory records; `reward_versions` as the audit's reward set has them."""
    group_size = evidence["config"]["group_size"]
    mask_truncated = evidence["config"].get("mask_truncated_completions", False)
    iterations = evidence["config"].get("num_iterations", 1)
    steps = evidence.get("steps") if isinstance(evidence.get("steps"), list) else []
    by_step: dict[Any, list[dict]] = {}  # indexed once: each step's records summed once
    for record in trajectories:
        by_step.setdefault(record.get("step"), []).append(record)
    checked: set = set()
    for index, step in enumerate(steps):
        number = step.get("step")
        key = object() if isinstance(number, (dict, list)) else number  # a list matches none
        if key not in by_step or key in checked:  # a step recorded twice is summed once
            audit.mismatch(f"steps[{index}] (step {number!r} recorded twice)" if key in checked
                           else f"steps[{index}] (no trajectories for step {number!r})")
            continue
        checked.add(key)
        records = by_step[key]
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
    for step_number, records in by_step.items():
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
        # The sequential re-test answers the eval set's first prompts, in its drawn order (the
        # order its looks read); how many is the stopping rule's to say (retest_stopping).
        answered = list(dict.fromkeys(str(r.get("prompt_id")) for r in eval_records
                                      if r.get("policy") == name))
        audit.compare(f"eval_completions.jsonl {name} prompt ids (the eval set's first, in order)",
                      answered, list(eval_prompt_ids)[:len(answered)])
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

def read_run(audit: Audit, run_dir: Path, guard_expected: bool) -> tuple[dict, list, list, list]:
    """The manifest (empty when missing) and the numbered trajectory, re-test and guard
    records (the guard file is read when it exists or the run's config says it must)."""
    manifest: dict = {}
    if (run_dir / "manifest.json").is_file():
        manifest = read_object(run_dir / "manifest.json", audit) or {}
    else:
        audit.mismatch("manifest.json (missing: the run did not complete)")
    guard = (numbered_jsonl(run_dir / GUARD_FILE, audit)
             if guard_expected or (run_dir / GUARD_FILE).exists() else [])
    return (manifest, numbered_jsonl(run_dir / "trajectories.jsonl", audit),
            numbered_jsonl(run_dir / "eval_completions.jsonl", audit), guard)


def guard_expected(evidence: dict) -> bool:
    """A guard file must exist when the config's guard was on and the re-test ran."""
    guard = evidence["config"].get("guard")
    skipped = (evidence.get("comparison") or {}).get("skipped") is True
    return (isinstance(guard, dict) and type(guard.get("prompts")) is int
            and guard["prompts"] > 0 and not skipped)


def _reload_references(audit: Audit, evidence: dict, run_dir: Path
                       ) -> tuple[dict[str, dict] | None, dict | None]:
    """Reference answers by prompt id of the stored train, eval and guard sets, and the train
    set's problems (question and columns: what a TRL-style reward is given) (None: unavailable).

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
            {p.prompt_id: p for p in stored["train"]})


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
    check_guard_records(audit, evidence, numbered["guard"], refs.get("guard"), policy_versions)


def check_guard_records(audit: Audit, evidence: dict, numbered_guard: list,
                        guard_refs: dict | None, policy_versions: dict[str, str]) -> None:
    """The guard set's records re-scored with the guard task's own verifier (a grpogate run and
    a gated foreign run alike)."""
    if numbered_guard:
        guard_verifier = _guard_verifier(audit, evidence)
        check_records(audit, GUARD_FILE, numbered_guard, guard_verifier, guard_refs,
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
    file, when its config's counts are implausible (rescore.run_limits) or a file holds more
    records than they allow (refused as it is read, audit_files.numbered_jsonl), and when
    evidence.json is not a JSON object with a config (nothing to re-decide from). Any other
    file that does not read is a mismatch like any other tampering (the first
    MAX_LISTED_MISMATCHES are listed). User reward code runs only for `trusted_rewards`;
    `max_rescore` caps the records re-scored; `announce` hears the cost of a long re-scoring
    before it starts (rescore.py)."""
    run_dir = Path(run_dir)
    if not confined(run_dir, "evidence.json"):
        raise InputError(f"{run_dir}: not a run directory (no evidence.json, or not a regular "
                         "file)")
    audit = BoundedAudit()
    evidence = read_object(run_dir / "evidence.json", audit)
    if evidence is None or not isinstance(evidence.get("config"), dict):
        # Nothing to re-decide from: not a readable run directory (exit 2), not a decision.
        reason = ("no config: not a grpogate evidence file" if evidence is not None else
                  audit.mismatches[0]["field"].removeprefix("evidence.json (").removesuffix(")"))
        raise InputError(f"{run_dir}/evidence.json: unreadable ({reason}); not a readable run "
                         "directory")
    check_adapter_dir(run_dir, evidence)
    audit.limit_records(run_dir, run_limits(evidence))  # checked before anything is built
    manifest, *files = read_run(audit, run_dir, guard_expected(evidence))
    numbered = dict(zip(("trajectories", "eval", "guard"), files))
    trajectories, eval_records, guard_records = (
        [record for _, record in numbered[name]] for name in ("trajectories", "eval", "guard"))
    # The guard's records are always re-scored (their count is bounded by the config above).
    plan = RescorePlan.choose(len(trajectories) + len(eval_records), max_rescore)
    reward_set = None
    try:
        if manifest:
            check_hashes(audit, run_dir, manifest, evidence, trajectories)
        versions = anchored_versions(audit, run_dir, evidence)
        check_table_identity(audit, evidence)
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
        "no_change": no_change_words(evidence, run_dir),
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
