"""The guard and drift in a real run on the tiny model, and `measure_drift` against one
unpadded forward per sequence (tests/test_guard.py holds the torch-free half)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import alternating_rewards
from test_policy import perturb_lora_b

from grpogate import pipeline
from grpogate.evidence.audit import audit_run
from grpogate.inputs.policy import load_policy, sampling_weights
from grpogate.sampling import drift
from grpogate.sampling.drift import SWAP_GROUPS, measure_drift
from grpogate.interrupts import StopRequest
from grpogate.inputs.tasks import Problem
from grpogate.pipeline import NullReporter
from grpogate.sampling import retest, rollout
from grpogate.engines import engine_for
from grpogate.engines.reference import ReferenceEngine
from grpogate.sampling.rollout import Completion, encode_prompts, generate_completions
from grpogate.verifiers import get_verifier
from grpogate.training import loop as training


def _reference(policy, completion, temperature: float, baseline: bool) -> torch.Tensor:
    """[tokens, V] log-softmax at temperature from one unpadded forward of the sequence."""
    sequence = completion.prompt_token_ids + completion.completion_token_ids
    with torch.no_grad(), sampling_weights(policy, baseline=baseline):
        logits = policy.model(input_ids=torch.tensor([sequence])).logits[0].float()
    start = len(completion.prompt_token_ids) - 1
    picked = logits[start:start + len(completion.completion_token_ids)]
    return torch.log_softmax(picked / temperature, dim=-1)


@pytest.mark.parametrize("path", ["lean", "model", "torch"])
def test_measure_drift_equals_one_forward_per_sequence(tiny_config, tmp_path, monkeypatch, path):
    """The accelerator's scorer (Llama here) and the reference engine's (any architecture it
    declines); the KL and entropies on the native kernel, or (`torch`) without it."""
    if path == "model":
        monkeypatch.setattr(drift, "engine_for", lambda model: ReferenceEngine())
    if path == "torch":
        monkeypatch.setenv("GRPOGATE_NATIVE", "0")
    policy = load_policy(tiny_config(tmp_path), seed=0)
    assert engine_for(policy.model).name == "cpu"  # the lean and torch paths run the accelerator
    # Prompts and completions of different lengths, more than one batch of them; the prompts
    # share 20 tokens, so the forward's shared prefix (16, a whole width bucket) is cached.
    completions = [Completion(prompt_index=i, sample_index=0,
                              prompt_token_ids=list(range(5, 25)) + [200 + i % 3] * (1 + i % 4),
                              completion_token_ids=list(range(100, 101 + (3 * i) % 7)),
                              text="", hit_max_length=False)
                   for i in range(SWAP_GROUPS + 3)]
    baseline, candidate = measure_drift(policy, completions, completions, 0.7)
    # LoRA B starts at zero: the candidate is the baseline, so every KL is 0.
    assert all(abs(v["kl_to_baseline"]) < 1e-6 for v in candidate)
    perturb_lora_b(policy.model)
    baseline, candidate = measure_drift(policy, completions, completions, 0.7)
    for completion, before, after in zip(completions, baseline, candidate):
        own = _reference(policy, completion, 0.7, baseline=False)
        base = _reference(policy, completion, 0.7, baseline=True)
        kl = (own.exp() * (own - base)).sum(-1).mean().item()
        assert after["kl_to_baseline"] == pytest.approx(kl, rel=1e-4, abs=1e-6)
        assert after["kl_to_baseline"] > 0
        assert after["entropy"] == pytest.approx(-(own.exp() * own).sum(-1).mean().item(),
                                                 rel=1e-4)
        assert before["entropy"] == pytest.approx(-(base.exp() * base).sum(-1).mean().item(),
                                                  rel=1e-4)
    # A torchrun shard re-tests every other prompt: its values are the same numbers, bit for bit.
    shard = completions[1::2]
    assert measure_drift(policy, shard, shard, 0.7) == (baseline[1::2], candidate[1::2])


@pytest.mark.parametrize("path", ["native", "torch", "model"])
def test_the_drift_measured_while_sampling_equals_the_teacher_forced_one(
        tiny_config, tmp_path, monkeypatch, path):
    """The re-test measures the drift in lockstep with sampling (a baseline stepper fed the
    candidate's tokens); on the same completions, `measure_drift`'s teacher-forced forwards
    give the same values (float32: only summation order differs), and a torchrun shard of
    the prompts records the same numbers bit for bit. `model`: a decode stepper that is not
    the lean one (another architecture) leaves the drift to `measure_drift` afterwards."""
    if path == "torch":
        monkeypatch.setenv("GRPOGATE_NATIVE", "0")
    if path == "model":
        monkeypatch.setattr(retest, "engine_for", lambda model: ReferenceEngine())
        monkeypatch.setattr(retest, "DriftStepper", None)  # never built on this path
    config = tiny_config(tmp_path, max_new_tokens=12, eval_group_size=3)
    policy = load_policy(config, seed=0)
    perturb_lora_b(policy.model)
    problems = [Problem(prompt_id=f"p{i}", question=f"What is {i} + {i}?", reference=str(2 * i),
                        source="test") for i in range(5)]
    prompts = encode_prompts(policy.tokenizer, problems, config.resolved_system_prompt(),
                             config.max_prompt_tokens)
    # The random model rarely samples EOS: call a tenth of the vocabulary EOS, so that rows
    # finish at different steps and leave the batch (the stepper's `select`).
    monkeypatch.setattr(rollout, "_eos_ids", lambda model, tokenizer: set(range(0, 49152, 10)))
    sampled = []  # each pass's completions, with their token ids

    def kept(*args, **keywords):
        completions = generate_completions(*args, **keywords)
        sampled.append(completions)
        return completions

    monkeypatch.setattr(retest, "generate_completions", kept)

    def records():
        return retest.retest_both(policy, problems, prompts, get_verifier("gsm8k-final-number-v1"),
                                  config, "candidate", NullReporter(), StopRequest(),
                                  drift=True)[0]

    everything = records()
    baseline = [r for r in everything if r["policy"] == "baseline"]
    candidate = [r for r in everything if r["policy"] == "candidate"]
    assert len(candidate) == 15 and all(r["kl_to_baseline"] > 0 for r in candidate)
    assert len({r["completion_tokens"] for r in candidate}) > 1  # rows left the batch
    forced_baseline, forced_candidate = measure_drift(policy, *sampled, config.temperature)
    for record, forced in zip(baseline, forced_baseline):
        assert record["entropy"] == pytest.approx(forced["entropy"], rel=1e-4, abs=1e-6)
    for record, forced in zip(candidate, forced_candidate):
        assert record["entropy"] == pytest.approx(forced["entropy"], rel=1e-4, abs=1e-6)
        assert record["kl_to_baseline"] == pytest.approx(forced["kl_to_baseline"], rel=1e-4,
                                                         abs=1e-6)
    # Rank 1 of 2 re-tests prompts 1 and 3 (every other one): the same values, bit for bit.
    monkeypatch.setattr(retest, "shard", lambda count, world: [1, 3])
    shard = records()
    assert [r["kl_to_baseline"] for r in shard if r["policy"] == "candidate"] == [
        r["kl_to_baseline"] for r in candidate if r["prompt_id"] in ("p1", "p3")]


def test_a_run_records_the_guard_and_the_drift(tiny_config, tmp_path, monkeypatch):
    monkeypatch.setattr(training, "score_completions", alternating_rewards)
    config = tiny_config(tmp_path, "guard.group_size=2")
    evidence = pipeline.run(config)
    run_dir = Path(evidence["run_dir"])
    guard = evidence["guard"]
    assert guard["enabled"] and guard["prompts"] == 8 and guard["group_size"] == 2
    records = [json.loads(line) for line in
               (run_dir / "guard_completions.jsonl").read_text().splitlines()]
    assert len(records) == 8 * 2 * 2  # prompts x samples x (baseline, candidate)
    problems = [json.loads(line) for line in (run_dir / "problems.jsonl").read_text().splitlines()]
    guard_ids = {p["prompt_id"] for p in problems if p["split"] == "guard"}
    others = {p["prompt_id"] for p in problems if p["split"] != "guard"}
    assert len(guard_ids) == 8 and not guard_ids & others
    assert {r["prompt_id"] for r in records} == guard_ids
    assert evidence["inputs"]["guard_verifier"]["name"] == "reasoning-gym/products"
    retest = [json.loads(line) for line in
              (run_dir / "eval_completions.jsonl").read_text().splitlines()]
    assert all(r["entropy"] >= 0 for r in retest)
    assert all(r["kl_to_baseline"] >= -1e-6 for r in retest if r["policy"] == "candidate")
    drift = evidence["comparison"]["drift"]
    assert drift["kl_to_baseline"] > 0  # the update moved the tiny model
    assert [c["name"] for c in evidence["decision"]["checks"]][-4:] == [
        "guard", "retest_kl", "memory", "artifact"]
    # The training rewards are the test's alternating stand-in, which the audit re-scores with
    # the real verifier; everything of the re-test, the drift and the guard must agree.
    fields = [m["field"] for m in audit_run(run_dir)["mismatches"]]
    assert fields and all(f.startswith(("trajectories.jsonl", "steps[", "rollout."))
                          for f in fields), fields
    assert 'id="guard-drift"' in (run_dir / "report.html").read_text()
