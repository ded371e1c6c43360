"""The manifest: written last, its existence means the run completed; it pins every file by hash.

A manifest is also a valid baseline for the next run (`--baseline-manifest`), which is why its
adapter path is relative and may not escape the manifest's directory.
"""

from __future__ import annotations

from pathlib import Path

from grpogate.errors import InputError
from grpogate.files import (ADAPTER_WEIGHTS, confined_file, policy_version, read_json,
                            safetensors_sha256, sha256_bytes, sha256_path)

MANIFEST_VERSION = 1
PROBLEMS_FILE = "problems.jsonl"  # every train and eval problem: what `decide` re-scores against
GUARD_FILE = "guard_completions.jsonl"  # both policies' re-test completions on the guard set
# trainer_state.json: a gated foreign run's copy of the trainer's log (grpogate gate --from-trl).
RUN_FILES = ("evidence.json", "trajectories.jsonl", "eval_completions.jsonl", PROBLEMS_FILE,
             GUARD_FILE, "trainer_state.json")


def trace_ids_sha256(trace_ids: list[str]) -> str:
    return sha256_bytes("\n".join(trace_ids).encode())


def build_manifest(evidence: dict, run_dir: Path, trajectories: list[dict], *,
                   hashed: bool = True) -> dict:
    """Summarize the run and pin every file by hash; call after all other files are final.
    Only regular files inside the run directory are read (the audit rebuilds a manifest from a
    directory someone else wrote). `hashed=False` lists the files without reading them (each
    hash None): the audit compares the summary alone, having hashed each file once itself."""
    adapter_dir = run_dir / evidence["artifact"]["path"]
    names = [*RUN_FILES, *(f"{evidence['artifact']['path']}/{file.name}" for file in
                           (sorted(adapter_dir.glob("*")) if adapter_dir.is_dir() else []))]
    files = {}
    for name in names:
        try:
            path = confined_file(run_dir, name)
            files[name] = sha256_path(path) if hashed else None
        except InputError:
            continue  # absent, or not a file of the run: not pinned (the audit names it)
    comparison = evidence["comparison"]
    rollout = evidence["rollout"]
    trace_ids = [record["trace_id"] for record in trajectories]
    return {
        "manifest_version": MANIFEST_VERSION,
        "run_label": evidence["run_label"],
        "created": evidence["created"],
        "decision": evidence["decision"]["decision"],
        "failed_checks": evidence["decision"]["failed_checks"],
        "status": evidence["status"],
        "model": evidence["inputs"]["model"],
        "source_policy_version": evidence["inputs"]["baseline_policy_version"],
        "new_policy_version": evidence["artifact"]["new_policy_version"],
        "verifier_version": evidence["inputs"]["verifier"]["version"],
        "adapter": {"path": evidence["artifact"]["path"], "sha256": evidence["artifact"]["sha256"]},
        "rollback_source": {
            "policy_version": evidence["inputs"]["baseline_policy_version"],
            "model": evidence["inputs"]["model"],
            "adapter": evidence["inputs"]["baseline_adapter"],
        },
        "quality": {
            "baseline": {k: comparison["baseline"][k] for k in ("mean_reward", "pass_at_group")},
            "candidate": {k: comparison["candidate"][k] for k in ("mean_reward", "pass_at_group")},
            "reward_mean_gain": comparison["reward_mean_gain"],
            "pass_at_group_gain": comparison["pass_at_group_gain"],
        },
        "rollout": {k: rollout[k] for k in ("group_count", "valid_group_count", "valid_group_ratio",
                                             "total_trajectories", "effective_trajectory_count",
                                             "max_length_hit_ratio")},
        "trajectory_identity": {
            "group_count": rollout["group_count"],
            "trace_count": len(trace_ids),
            "trace_ids_sha256": trace_ids_sha256(trace_ids),
            "trajectories_sha256": files.get("trajectories.jsonl"),
            "evidence_sha256": files.get("evidence.json"),
        },
        "files": files,
    }


def read_baseline_manifest(path: str) -> dict:
    """Admit a baseline manifest: decision accept, adapter inside its directory, hash matching.

    The file hash alone proves nothing against a forger who recomputed it: the policy version
    is recomputed from the adapter's own tensors and the model identity and must equal the
    manifest's `new_policy_version` (the loaded policy is held to it again after loading).
    Returns {"model", "revision", "adapter", "policy_version"} (adapter = absolute directory or "").
    """
    file = Path(path)
    if not file.is_file():
        raise InputError(f"{path}: no such baseline manifest")
    manifest = read_json(file)
    if not isinstance(manifest, dict):
        raise InputError(f"{path}: a baseline manifest is a JSON object")
    if manifest.get("decision") != "accept":
        raise InputError(f"{path}: field \"decision\" is {manifest.get('decision')!r}; "
                         "only an accepted policy can be a baseline")
    model = manifest.get("model")
    location = (model.get("spec") or model.get("location")) if isinstance(model, dict) else model
    if not isinstance(location, str) or not location:
        raise InputError(f"{path}: field \"model\" must name the base model (model.location)")
    revision = model.get("revision", "") if isinstance(model, dict) else ""
    adapter = manifest.get("adapter") or {}
    if not isinstance(adapter, dict):
        raise InputError(f"{path}: field \"adapter\" must be an object with path and sha256")
    adapter_dir = ""
    if adapter.get("path"):
        root = file.parent.resolve()
        candidate = (root / str(adapter["path"])).resolve()
        if not candidate.is_relative_to(root):
            raise InputError(f"{path}: field \"adapter.path\" escapes the manifest's directory")
        try:  # a regular file inside the manifest's directory, checked before it is opened
            weights = confined_file(root, f"{adapter['path']}/{ADAPTER_WEIGHTS}")
        except InputError as error:
            raise InputError(f"{path}: field \"adapter.path\": {error}") from None
        actual = sha256_path(weights)
        if actual != adapter.get("sha256"):
            raise InputError(f"{path}: field \"adapter.sha256\" is {adapter.get('sha256')!r} but "
                             f"the adapter file hashes to {actual}")
        adapter_dir = str(candidate)
    claimed = manifest.get("new_policy_version")
    base_sha256 = model.get("sha256") if isinstance(model, dict) else None
    anchored = policy_version(base_sha256, safetensors_sha256(weights) if adapter_dir else None)
    if claimed != anchored:
        raise InputError(f"{path}: field \"new_policy_version\" is {claimed!r} but the adapter's "
                         f"tensors and model.sha256 give {anchored}; the manifest does not "
                         "describe this adapter")
    return {"model": location, "revision": revision or "", "adapter": adapter_dir,
            "policy_version": anchored}
