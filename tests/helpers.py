"""Helpers shared by the test files that drive real runs."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256(path: Path) -> str:
    """A file's sha256, computed here rather than by grpogate, so hash checks are independent."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def alternating_rewards(completions, problems, verifier) -> list[float]:
    """Stands in for the training verifier: even samples 1, odd 0, so every group is valid and
    every optimizer step runs even on a random model that never earns a real reward."""
    return [1.0 if c.sample_index % 2 == 0 else 0.0 for c in completions]


def record_ratio_inputs(monkeypatch) -> list:
    """Spy on the objective: every call appends (log-probs, old log-probs), detached copies, so
    a test sees the ratio each micro-batch was really computed from."""
    from grpogate.training import objectives

    seen, real_terms = [], objectives.policy_token_terms

    def spy(logp, old_logp, *args, **kwargs):
        seen.append((logp.detach().clone(), old_logp.detach().clone()))
        return real_terms(logp, old_logp, *args, **kwargs)

    monkeypatch.setattr(objectives, "policy_token_terms", spy)
    return seen


def bf16_packed_row(tiny_config, tmp_path, prompts, completions):
    """The tiny model in bfloat16 with a non-zero adapter, and a packed row of `prompts` with
    G = 2 `completions` each -> (policy, row, run): run() gives the row's detached log-probs
    and the LoRA gradients of their sum over the completion tokens."""
    import torch

    from grpogate.inputs.policy import load_policy, trainable_parameters
    from grpogate.training.logprobs import micro_batch_logprobs, pack_row

    policy = load_policy(tiny_config(tmp_path, dtype="bfloat16"), seed=0)
    parameters = list(trainable_parameters(policy).values())
    for parameter in parameters:
        parameter.data.normal_(0, 0.05)
    row = pack_row(prompts, completions, 2, 2, torch.device("cpu"))

    def run():
        logp = micro_batch_logprobs(policy.model, row, 2, 0.7)
        return logp.detach(), torch.autograd.grad((logp * row.completion_mask).sum(), parameters)

    return policy, row, run


def relative_distance(ours, theirs) -> float:
    """|ours - theirs| / |theirs| over lists of tensors, in float32."""
    total = sum(t.float().norm() ** 2 for t in theirs) ** 0.5
    apart = sum((a.float() - b.float()).norm() ** 2 for a, b in zip(ours, theirs)) ** 0.5
    assert total > 0
    return float(apart / total)


def key_pair(directory: Path) -> tuple[Path, Path]:
    """A fresh P-256 key pair in `directory` (key.pem, key.pub) for `grpogate sign` / --verify-key."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    private = ec.generate_private_key(ec.SECP256R1())
    (directory / "key.pem").write_bytes(private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    (directory / "key.pub").write_bytes(private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return directory / "key.pem", directory / "key.pub"


def hub_cache(model_dir: Path, cache: Path, repo_id: str, names=None,
              config_changes: dict | None = None) -> str:
    """`model_dir`'s files (or those `names`) laid out in `cache` as huggingface_hub's cache
    holds a download of `repo_id`: blobs named by their sha256, snapshots/<commit>/ of links to
    them, refs/main naming the commit (no newline, as huggingface_hub writes it); config.json
    with `config_changes` applied. -> the commit (a made-up 40-hex id, derived from the files'
    bytes, so that two layouts of one model agree)."""
    import json
    import os

    names = sorted(names if names is not None else (p.name for p in Path(model_dir).iterdir()
                                                    if p.is_file()))
    files = {name: (Path(model_dir) / name).read_bytes() for name in names}
    if config_changes:
        files["config.json"] = json.dumps(json.loads(files["config.json"]) | config_changes
                                          ).encode()
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    repo = Path(cache) / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1("".join(digests[name] for name in names).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / digests[name]
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return commit
