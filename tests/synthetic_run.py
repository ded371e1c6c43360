"""A small, internally consistent run directory written without a model.

The records are hand-written, but everything derived from them goes through the same functions
the pipeline uses (problem loading, the verifier, metrics.rollout_summary / summarize_completions
/ paired_comparison through assemble.assemble_evidence, decisions.decide_run,
manifest.build_manifest, atomic writes), so the audit and the report see what a real run writes.

Layout: GSM8K-format JSONL with 4 train and 2 eval problems; 2 steps of 2 prompts x G=4;
re-test with 4 samples per eval prompt. Train reward groups [1,0,0,1] [0,0,0,0] | [1,1,1,1]
[0,1,0,0] (2 of 4 valid); eval rewards baseline [0,0,0,0] [1,0,0,0], candidate [1,0,1,0]
[1,1,0,0]. Two eval prompts can never resolve a gain under the default's paired sign-flip
test (its smallest p-value is 1/4), so the fixture records the point-estimate rule
(require_significant_gain = false) unless a test passes the switch; the decision is `accept`.

Drift (the same for both eval prompts): samples 0..3 have 6, 7, 8 and 16 tokens; the baseline's
mean per-token entropy per sample is 0.9, 0.8, 0.7, 0.6, the candidate's 0.5 throughout, and
the candidate's mean per-token KL to the baseline 0.1, 0.2, 0.3, 0.4. Token-weighted:
KL = (0.1*6 + 0.2*7 + 0.3*8 + 0.4*16) / 37 = 10.8 / 37 = 0.29189...; baseline entropy
(0.9*6 + 0.8*7 + 0.7*8 + 0.6*16) / 37 = 26.2 / 37 = 0.70810...; candidate entropy 0.5.

Guard: off unless `guard_rewards` gives both policies' rewards per guard prompt (products,
two one-digit factors, the default guard task; "Answer: <n>" completions, rewards 1 or 0).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from pathlib import Path

from grpogate.evidence.assemble import assemble_evidence, step_summary, update_throughput
from grpogate.evidence.manifest import build_manifest
from grpogate.config import Gates, GuardConfig, RunConfig, TaskConfig, validate
from grpogate.files import (atomic_write_bytes, atomic_write_json, jsonl_bytes, policy_version,
                            safetensors_sha256)
from grpogate.inputs.rewards import reward_set_from_config
from grpogate.inputs.tasks import load_guard_set, load_problem_sets, problem_records
from grpogate.inputs.verifiers import get_verifier

TRAIN_QUESTIONS = [("Ann has 3 apples and buys 4 more. How many?", 7),
                   ("A box holds 12 pens; 5 are taken. How many remain?", 7),
                   ("Tom reads 6 pages a day for 3 days. How many pages?", 18),
                   ("A bus carries 40 people; 15 get off. How many stay?", 25)]
EVAL_QUESTIONS = [("Sue bakes 9 cakes and sells 2. How many are left?", 7),
                  ("A farm has 8 cows and 11 hens. How many animals?", 19)]
TRAIN_REWARDS = [[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0]]
EVAL_REWARDS = {"baseline": [[0, 0, 0, 0], [1, 0, 0, 0]],
                "candidate": [[1, 0, 1, 0], [1, 1, 0, 0]]}
MAX_NEW_TOKENS = 16
POINT_ESTIMATE = {"require_significant_gain": False}
BASELINE_ENTROPY = [0.9, 0.8, 0.7, 0.6]
CANDIDATE_ENTROPY = [0.5, 0.5, 0.5, 0.5]
CANDIDATE_KL = [0.1, 0.2, 0.3, 0.4]


def _drift(name: str, sample: int) -> dict:
    if name == "baseline":
        return {"entropy": BASELINE_ENTROPY[sample]}
    return {"entropy": CANDIDATE_ENTROPY[sample], "kl_to_baseline": CANDIDATE_KL[sample]}


def _version(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def safetensors_bytes(tensors: dict[str, list[float]]) -> bytes:
    """A float32 safetensors file written by hand (the format: 8-byte little-endian header
    length, JSON header, packed data), so the synthetic adapter is a real one without torch."""
    header, data = {}, b""
    for name, values in tensors.items():
        blob = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": [len(values)],
                        "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


SYNTHETIC_ADAPTER = {"base_model.model.layers.0.q_proj.lora_A.weight": [0.5, -1.0],
                     "base_model.model.layers.0.q_proj.lora_B.weight": [0.25, 2.0]}


def _write_jsonl(path: Path, rows: list[tuple[str, int]]) -> None:
    path.write_text("".join(json.dumps({"question": q, "answer": f"Work.\n#### {a}"}) + "\n"
                            for q, a in rows), encoding="utf-8")


def _completion(answer: int, correct: int, sample: int) -> tuple[str, int, bool]:
    """Text, token count and budget hit; the last sample of every group hits the budget."""
    text = f"So the total is {answer if correct else answer + 1}."
    hit = sample == 3
    return text, MAX_NEW_TOKENS if hit else 6 + sample, hit


def _guard_records(guard_set, guard_rewards: dict, versions: dict, verifier, seed: int) -> list:
    """Both policies' guard completions: "Answer: <reference>" when the reward is 1, else
    the reference + 1 (which the products scorer gives 0)."""
    records = []
    for name, version in versions.items():
        for problem, rewards in zip(guard_set, guard_rewards[name]):
            for sample, correct in enumerate(rewards):
                text = f"Answer: {int(problem.reference) + (0 if correct else 1)}"
                records.append({
                    "policy": name, "policy_version": version, "prompt_id": problem.prompt_id,
                    "sample_index": sample,
                    "trace_id": _version(f"guard-{name}|{problem.prompt_id}|{sample}")[:24],
                    "seed": seed, "verifier_version": verifier.version, "completion": text,
                    "completion_tokens": 4, "hit_max_length": False,
                    "reward": verifier.score(text, problem.reference)})
    return records




def write_synthetic_run(root: Path, guard_rewards: dict | None = None, **gates) -> Path:
    """Write data and a finished run under `root`; returns the run directory. `guard_rewards`:
    {"baseline": [[r, ...] per guard prompt], "candidate": [...]} turns the guard on."""
    data = root / "data"
    data.mkdir(parents=True)
    _write_jsonl(data / "train.jsonl", TRAIN_QUESTIONS)
    _write_jsonl(data / "test.jsonl", EVAL_QUESTIONS)
    run_dir = root / "run"
    config = validate(RunConfig(
        out=str(run_dir), label="synthetic", profile="synthetic",
        task=TaskConfig(source="gsm8k", path=str(data)), train_prompts=4, eval_prompts=2,
        prompts_per_step=2, group_size=4, eval_group_size=4, max_new_tokens=MAX_NEW_TOKENS,
        gates=dataclasses.replace(Gates(), **{**POINT_ESTIMATE, **gates}),
        guard=GuardConfig(prompts=len(guard_rewards["baseline"]) if guard_rewards else 0,
                          group_size=len(guard_rewards["baseline"][0]) if guard_rewards else 4)))
    train, train_id, eval_set, eval_id = load_problem_sets(config.task, config.train_prompts,
                                                           config.eval_prompts)
    guard_set, guard_id = load_guard_set(config.guard, train, eval_set)
    verifier = get_verifier(config.resolved_verifier())
    reward_set = reward_set_from_config(config.to_dict(), verifier.version, importable=None)
    answers = {q: a for q, a in TRAIN_QUESTIONS + EVAL_QUESTIONS}
    run_dir.mkdir()

    trajectories, steps = [], []
    for step in range(config.steps):
        version = _version(f"step-{step}")
        records = []
        for offset in range(config.prompts_per_step):
            index = step * config.prompts_per_step + offset
            problem = train[index]
            for sample, correct in enumerate(TRAIN_REWARDS[index]):
                text, tokens, hit = _completion(answers[problem.question], correct, sample)
                reward = verifier.score(text, problem.reference)
                records.append({
                    "step": step, "round": 0, "prompt_id": problem.prompt_id,
                    "sample_index": sample,
                    "trace_id": _version(f"train|{step}|{problem.prompt_id}|{sample}")[:24],
                    "source_policy_version": version, "verifier_version": verifier.version,
                    "reward_versions": dict(reward_set.versions),
                    "completion": text, "completion_tokens": tokens, "hit_max_length": hit,
                    "rewards": {"correctness": reward}, "reward": reward})
        summary = step_summary(records, config.group_size)
        generated = summary["generated_tokens"]
        steps.append({
            "step": step, "policy_version": version, **summary,
            "generation_rounds": [{"round": 0, "seed": config.seed + step, "prompts": 2,
                                   "valid_groups": summary["valid_group_count"],
                                   "generation_seconds": 1.0, "verification_seconds": 0.01}],
            "refill_generation_seconds": 0.0,
            "generation_tokens_per_second": generated / 1.0, "rollout_seconds": 1.0,
            "verification_seconds": 0.01, "update_seconds": 0.5, "update_count": 1,
            "sequences": 4, "masked_truncated_sequences": 0, "loss": [0.1], "grad_norm": [0.5 + step],
            "tokens_forwarded": 64, "tokens_forwarded_real": 40,
            **update_throughput(summary["tokens"], 64, 40, 0.5),
            "mean_kl": 0.001 * (step + 1), "clip_fraction": 0.01 * step})
        trajectories += records
    atomic_write_bytes(run_dir / "trajectories.jsonl", jsonl_bytes(trajectories))
    seconds = {"load": 0.5, "rollout": 2.0, "verification": 0.02, "update": 1.0,
               "evaluation": 3.0, "checkpoint": 0.1, "total": 7.0}

    adapter = run_dir / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 4}\n')
    (adapter / "adapter_model.safetensors").write_bytes(safetensors_bytes(SYNTHETIC_ADAPTER))
    adapter_sha = hashlib.sha256(safetensors_bytes(SYNTHETIC_ADAPTER)).hexdigest()
    # The versions a real run records: no baseline adapter, and the delivered adapter's tensors.
    baseline_version = policy_version(_version("base"), None)
    candidate_version = policy_version(_version("base"),
                                       safetensors_sha256(adapter / "adapter_model.safetensors"))
    eval_records = []
    for name, version in (("baseline", baseline_version), ("candidate", candidate_version)):
        for problem, rewards in zip(eval_set, EVAL_REWARDS[name]):
            for sample, correct in enumerate(rewards):
                text, tokens, hit = _completion(answers[problem.question], correct, sample)
                eval_records.append({
                    "policy": name, "policy_version": version, "prompt_id": problem.prompt_id,
                    "sample_index": sample,
                    "trace_id": _version(f"eval-{name}|{problem.prompt_id}|{sample}")[:24],
                    "seed": config.seed + 10_000, "verifier_version": verifier.version,
                    "completion": text, "completion_tokens": tokens, "hit_max_length": hit,
                    "reward": verifier.score(text, problem.reference), **_drift(name, sample)})
    guard_verifier = get_verifier(config.guard.verifier())
    guard_records = _guard_records(guard_set, guard_rewards, {
        "baseline": baseline_version, "candidate": candidate_version}, guard_verifier,
        config.seed + 10_000) if guard_rewards else []

    facts = {
        "run_label": "synthetic", "created": "2026-01-01T00:00:00+00:00", "loop_status": "ok",
        "failure": None, "interruption": None, "resumes": [],
        "environment": {"python": "3.11", "device": "cpu"},
        "inputs": {
            "model": {"spec": "synthetic", "kind": "hf-dir", "location": "/nowhere",
                      "sha256": _version("base"), "revision": ""},
            "baseline_adapter": None, "baseline_manifest": None,
            "baseline_policy_version": baseline_version,
            "verifier": {"name": config.resolved_verifier(), "version": verifier.version},
            "rewards": reward_set.describe(),
            "train_set": train_id, "eval_set": eval_id, "guard_set": guard_id,
            "guard_verifier": ({"name": config.guard.verifier(), "version": guard_verifier.version}
                               if guard_rewards else None)},
        "contract": {"admitted": True, "failed_checks": []}, "seconds": seconds,
        "verifier_errors": verifier.error_count, "reward_errors": 0, "retest_verifier_errors": 0,
        "retest_skipped": False, "micro_batch_size": config.micro_batch_size, "oom_retries": 0,
        "resources": {"device": "cpu", "peak_allocated_bytes": 10**9, "peak_reserved_bytes": 10**9,
                      "peak_rss_bytes": 10**9},
        "artifact": {"path": "adapter", "sha256": adapter_sha,
                     "source_policy_version": baseline_version,
                     "new_policy_version": candidate_version},
    }
    evidence = assemble_evidence(facts, config.to_dict(), steps, trajectories, eval_records,
                                 guard_records)
    atomic_write_bytes(run_dir / "problems.jsonl", jsonl_bytes(
        problem_records(config.task, train, eval_set, config.guard, guard_set)))
    atomic_write_bytes(run_dir / "eval_completions.jsonl", jsonl_bytes(eval_records))
    if guard_records:
        atomic_write_bytes(run_dir / "guard_completions.jsonl", jsonl_bytes(guard_records))
    atomic_write_json(run_dir / "evidence.json", evidence)
    atomic_write_json(run_dir / "manifest.json", build_manifest(evidence, run_dir, trajectories))
    return run_dir
