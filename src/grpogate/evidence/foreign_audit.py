"""Audit a gated foreign run (`grpogate gate --from-trl | --candidate`): what can be re-checked,
and what cannot.

Re-checked, with the audit's own functions: every file hash the manifest pins (the candidate,
the copied trainer_state.json, the re-test records, the problems), the candidate's policy
version (an adapter's from its tensors; a full checkpoint's from the files_digest of its
config.json and weight files, as copied into `candidate/`: inputs/candidate_dir.py), every
re-test completion re-scored by the verifier, the eval set's hash, and the whole evidence
rebuilt by the gate's own `assemble_foreign_evidence` from the stored log (if any) and records:
the rollout and update figures are recomputed from the log's numbers (the arithmetic), the
comparison and paired statistics from the re-test records, and the decision. The candidate's
kind is read from the evidence (`foreign.candidate_kind`); nothing the run names is imported
or run. Not re-checkable, and said so in the result: whether the log describes the training
that produced the candidate (there are no trajectories), and the GRPO settings the user
declared; without a log, the training itself. Pure Python (no torch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpogate.errors import InputError
from grpogate.evidence.table_audit import check_table_identity
from grpogate.evidence.audit import (_verifier, audit_run, check_adapter_dir, check_guard_records,
                                     check_records, check_retest_records, compare_rebuilt,
                                     guard_expected, read_run, verdict)
from grpogate.evidence.audit_files import (Audit, anchored_versions, check_hashes, confined,
                                           numbered_jsonl, read_object)
from grpogate.evidence.manifest import GUARD_FILE, PROBLEMS_FILE
from grpogate.evidence.audit_bounds import BoundedAudit
from grpogate.evidence.rescore import record_limits
from grpogate.evidence.trainer_log import assemble_foreign_evidence, foreign_facts
from grpogate.files import parse_json, policy_version, read_confined, tolerated
from grpogate.inputs.candidate_dir import FULL_CHECKPOINT, checkpoint_identity, finite_weights
from grpogate.inputs.tasks import problem_set_hash, stored_sets

TRAINER_STATE_FILE = "trainer_state.json"  # the foreign log, copied byte for byte into the run
NOT_CHECKABLE = ("the rollout figures come from the trainer's own log; with no stored "
                 "trajectories, whether that log describes the training that produced the "
                 "adapter, and the GRPO settings declared to read it, are taken as recorded")
NO_LOG = ("the candidate came without its trainer's log: nothing about its training (groups, "
          "updates, truncation, throughput) is recorded; the decision rests on the re-test, "
          "the guard and the re-test KL")
NO_LOG_READ = object()  # _stored_log: the run records no log (not: a log that failed to read)


def is_foreign(run_dir: str | Path) -> bool:
    """Whether the run directory's evidence says it is a gated foreign run (unreadable: no;
    too large: FileTooLarge, exit 2, as for every reader)."""
    evidence = None
    # confined and bounded as every run-directory read (no FIFO wait, no deep nesting)
    with tolerated(InputError, OSError, UnicodeDecodeError, json.JSONDecodeError):
        evidence = parse_json(read_confined(run_dir, "evidence.json"),
                              "evidence.json")
    return isinstance(evidence, dict) and isinstance(evidence.get("foreign"), dict)


def audit_any(run_dir: str | Path, **options) -> dict[str, Any]:
    """`grpogate decide`: the foreign audit for a gated foreign run, else the run audit (with
    `options`: trusted_rewards, max_rescore, announce; a foreign run has no training records
    to re-score)."""
    return audit_foreign_run(run_dir) if is_foreign(run_dir) else audit_run(run_dir, **options)


def _stored_log(audit: Audit, run_dir: Path, evidence: dict) -> dict | object | None:
    """The copied trainer_state.json, parsed; NO_LOG_READ when the evidence records no log
    (then a trainer_state.json in the run is a mismatch); None when it does not read."""
    if evidence["foreign"].get("trainer_state_sha256") is None:
        if confined(run_dir, TRAINER_STATE_FILE) is not None:  # a stat, no byte read
            audit.mismatch(f"{TRAINER_STATE_FILE} (in the run, but the evidence records no "
                           "trainer's log)")
        return NO_LOG_READ
    with tolerated() as failed:  # read_object opens only a regular file inside the run
        state = read_object(run_dir / TRAINER_STATE_FILE, audit)
    if failed.error:  # flagged, and never read
        reason = str(failed.error).removeprefix(TRAINER_STATE_FILE + ": ")
        audit.mismatch(f"{TRAINER_STATE_FILE} ({reason})")
        return None
    audit.compare("foreign.trainer_state_sha256", evidence["foreign"].get("trainer_state_sha256"),
                  audit.sha256(run_dir, TRAINER_STATE_FILE))  # of the bytes just parsed
    return state


def _check_problems(audit: Audit, run_dir: Path, evidence: dict) -> dict | None:
    """Eval and guard references by prompt id ({"eval", "guard"}); the stored sets must hash
    to the recorded identities and be disjoint (stored_sets refuses an overlap)."""
    numbered = numbered_jsonl(run_dir / PROBLEMS_FILE, audit)
    try:
        sets = stored_sets(numbered, PROBLEMS_FILE, allow_empty_train=True)
    except InputError as error:
        audit.mismatch(f"{PROBLEMS_FILE} ({error})")
        return None
    for split in ("eval", "guard") if sets["guard"] else ("eval",):
        audit.compare(f"inputs.{split}_set.problem_set_sha256",
                      (evidence["inputs"].get(f"{split}_set") or {}).get("problem_set_sha256"),
                      problem_set_hash(sets[split]))
    isolation = evidence["foreign"]["admission"]["isolation"]
    audit.compare("foreign.admission.isolation.train_prompts", isolation.get("train_prompts"),
                  len(sets["train"]) if isolation.get("checked") else 0)
    return {split: {p.prompt_id: p.reference for p in sets[split]} for split in ("eval", "guard")}


def _check_assembly(audit: Audit, evidence: dict, log: dict | None, eval_records: list[dict],
                    guard_records: list[dict]) -> None:
    """The gate's own assembly from the stored log (None: none recorded) and records: every
    field as recorded."""
    compare_rebuilt(audit, evidence, lambda: assemble_foreign_evidence(
        foreign_facts(evidence), evidence["config"], log, eval_records, guard_records))


def _candidate_version(audit: Audit, run_dir: Path, evidence: dict) -> str | None:
    """A full checkpoint's policy version, recomputed from its files as copied into the run
    (artifact.path: check_adapter_dir has held it to a folder of regular files inside the run):
    files_digest of every file there but the index must be the recorded artifact.sha256, and
    each must hash as `foreign.files` recorded it at the source. None for an adapter (its
    version is read from its tensors by anchored_versions)."""
    foreign, artifact = evidence["foreign"], evidence["artifact"]
    if foreign.get("candidate_kind") != FULL_CHECKPOINT:
        return None
    folder = run_dir / str(artifact["path"])
    hashes = {}
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        with tolerated() as failed:  # hashed once: check_hashes took the same files
            hashes[path.name] = audit.sha256(run_dir, f"{artifact['path']}/{path.name}")
        if failed.error:
            audit.mismatch(f"{artifact['path']}/{path.name} ({failed.error})")
    audit.compare("foreign.files", foreign.get("files"), hashes)
    identity = checkpoint_identity(hashes)
    audit.compare("artifact.sha256", artifact.get("sha256"), identity)
    return policy_version(identity, None)


def _check_finite_weights(audit: Audit, run_dir: Path, evidence: dict) -> None:
    """The admission's finite-weights check, recomputed by its own function from the weight
    files as copied into the run (artifact.path); a run recorded before the check has none."""
    admission = evidence["foreign"]["admission"]
    if "finite_weights" not in admission:
        return
    folder = str(evidence["artifact"]["path"])
    weights = sorted(path.name for path in (run_dir / folder).glob("*.safetensors")
                     if confined(run_dir, f"{folder}/{path.name}") is not None)
    with tolerated() as failed:
        recomputed = finite_weights(run_dir / folder, weights)
    if failed.error:
        audit.mismatch(f"foreign.admission.finite_weights ({failed.error})")
        return
    audit.compare("foreign.admission.finite_weights", admission["finite_weights"], recomputed)


def audit_foreign_run(run_dir: str | Path) -> dict[str, Any]:
    """The result has the shape of `audit_run`'s, plus "not_checkable" (a sentence). A re-test
    file with more records than the recorded config allows is refused as it is read."""
    run_dir = Path(run_dir)
    audit = BoundedAudit()
    evidence = read_object(run_dir / "evidence.json", audit)
    if evidence is None:
        raise InputError(f"{run_dir}/evidence.json: unreadable")
    check_adapter_dir(run_dir, evidence)
    limits = record_limits(evidence["config"])
    audit.limit_records(run_dir, {name: limits[name]
                                  for name in ("eval_completions.jsonl", GUARD_FILE)})
    manifest, _, numbered_eval, numbered_guard = read_run(audit, run_dir, guard_expected(evidence))
    eval_records = [record for _, record in numbered_eval]
    guard_records = [record for _, record in numbered_guard]
    try:
        full = evidence["foreign"].get("candidate_kind") == FULL_CHECKPOINT
        if full:  # its weight files are hashed within a checkpoint's bounds
            audit.shards = f"{evidence['artifact']['path']}/"
        if manifest:
            check_hashes(audit, run_dir, manifest, evidence, [], adapter=not full)
        versions = anchored_versions(audit, run_dir, evidence,
                                     _candidate_version(audit, run_dir, evidence))
        _check_finite_weights(audit, run_dir, evidence)
        log = _stored_log(audit, run_dir, evidence)
        check_table_identity(audit, evidence)
        refs = _check_problems(audit, run_dir, evidence) or {}
        verifier = _verifier(audit, evidence)
        check_records(audit, "eval_completions.jsonl", numbered_eval, verifier, refs.get("eval"),
                      lambda r: {"verifier_version": evidence["inputs"]["verifier"]["version"],
                                 "seed": evidence["seeds"]["eval"],
                                 "policy_version": versions.get(r.get("policy"), "a policy")},
                      evidence["config"]["max_new_tokens"])
        check_guard_records(audit, evidence, numbered_guard, refs.get("guard"), versions)
        check_retest_records(audit, evidence, eval_records,
                             list(refs["eval"]) if refs else None, guard_records,
                             list(refs["guard"]) if refs.get("guard") else None)
        if log is not None:
            _check_assembly(audit, evidence, None if log is NO_LOG_READ else log, eval_records,
                            guard_records)
    except (KeyError, TypeError, AttributeError) as error:
        audit.mismatch(f"evidence (malformed: {type(error).__name__} {error})")
    return verdict(audit, run_dir, evidence) | {
        "not_checkable": NO_LOG if _recorded_no_log(evidence) else NOT_CHECKABLE}


def _recorded_no_log(evidence: dict) -> bool:
    foreign = evidence.get("foreign")
    return isinstance(foreign, dict) and foreign.get("trainer_state_sha256") is None
