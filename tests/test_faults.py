"""Faults during a run: NaN/inf updates, verifier exceptions, out-of-memory updates.

Each fault is injected by monkeypatching one function; the run must end with evidence and a
manifest, the right status, and a decision that names `execution` when the update did not
finish — and the adapter that is kept must be the last good one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import alternating_rewards

from grpogate import admission, pipeline
from grpogate.training import loop as training
from grpogate.training import objectives
from grpogate.training import update as update_module
from grpogate.files import read_jsonl
from grpogate.inputs.policy import (current_version, load_adapter_state, load_policy, policy_version,
                             reference_mode, tensors_sha256, trainable_parameters)
from grpogate.sampling.rollout import encode_prompts
from grpogate.training.advantages import UpdateBatch
from grpogate.training.update import (UpdateFailed, UpdateSettings, grpo_update, is_out_of_memory,
                                      update_with_retry)

OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def saved_adapter_version(run_dir: Path, evidence: dict) -> str:
    """The policy version of the adapter file on disk, computed from its tensors."""
    base_sha = evidence["inputs"]["model"]["sha256"]
    return policy_version(base_sha, tensors_sha256(load_adapter_state(run_dir / "adapter")))


def assert_finished_with(evidence: dict, status: str) -> Path:
    run_dir = Path(evidence["run_dir"])
    assert evidence["status"] == status
    assert evidence["decision"]["decision"] == "reject"
    assert "execution" in evidence["decision"]["failed_checks"]
    assert (run_dir / "manifest.json").is_file()
    assert not (run_dir / "checkpoints").exists()
    return run_dir


# --- NaN / inf ---------------------------------------------------------------------------------


def test_a_non_finite_loss_keeps_the_last_good_adapter(tiny_config, tmp_path, monkeypatch):
    # One optimizer step per valid group (2 per rollout step). The 4th loss is NaN: step 1's
    # first optimizer step has already changed the adapter when its second one fails, so the
    # adapter must be rolled back to the end of step 0 — the policy that sampled step 1.
    real_aggregate, calls = objectives.aggregate_loss, []

    def nan_on_fourth(per_token, mask, aggregation):
        calls.append(1)
        loss = real_aggregate(per_token, mask, aggregation)
        return loss * float("nan") if len(calls) == 4 else loss

    monkeypatch.setattr(training, "score_completions", alternating_rewards)
    monkeypatch.setattr(objectives, "aggregate_loss", nan_on_fourth)
    evidence = pipeline.run(tiny_config(tmp_path, groups_per_update=1))
    run_dir = assert_finished_with(evidence, "non_finite_update")
    assert evidence["failure"]["step"] == 1 and "non-finite loss" in evidence["failure"]["message"]
    assert [s["step"] for s in evidence["steps"]] == [0]
    assert evidence["update"]["update_count"] == 2  # step 0's two; step 1's one was rolled back
    sampled_step_1 = {r["source_policy_version"] for r in read_jsonl(run_dir / "trajectories.jsonl")
                      if r["step"] == 1}
    assert sampled_step_1 == {evidence["artifact"]["new_policy_version"]}
    assert saved_adapter_version(run_dir, evidence) == evidence["artifact"]["new_policy_version"]
    assert evidence["artifact"]["new_policy_version"] != evidence["steps"][0]["policy_version"]


# --- verifier errors ---------------------------------------------------------------------------


class ExplodingScorer:
    def score_answer(self, answer, entry):
        raise ZeroDivisionError("scorer bug on a strange completion")


def test_verifier_exceptions_score_zero_and_are_counted_per_stage(tiny_config, tmp_path,
                                                                  monkeypatch):
    real_get_verifier = admission.get_verifier

    def exploding(name):
        verifier = real_get_verifier(name)
        verifier._dataset = ExplodingScorer()
        return verifier

    # Every completion reaches the scorer (the random model rarely writes a number).
    monkeypatch.setattr("grpogate.inputs.verifiers.extract_final_answer", lambda completion: "7")
    monkeypatch.setattr(admission, "get_verifier", exploding)
    evidence = pipeline.run(tiny_config(tmp_path, eval_prompts=2))
    assert evidence["rollout"]["verifier_errors"] == 4 * 4  # 4 train prompts x G = 4
    # The re-test stage counts its verifiers' errors together: the eval set's, 2 policies x 2
    # prompts x 2 samples, and the smoke profile's guard set's, 2 policies x 8 problems x G = 4.
    assert evidence["comparison"]["verifier_errors"] == 2 * 2 * 2 + 2 * 8 * 4
    assert evidence["rollout"]["mean_reward"] == 0.0
    assert {r["reward"] for r in read_jsonl(Path(evidence["run_dir"]) / "trajectories.jsonl")} == {0.0}
    assert_finished_with(evidence, "no_effective_update")


# --- out of memory -----------------------------------------------------------------------------


@pytest.fixture
def policy(tiny_config, tmp_path):
    return load_policy(tiny_config(tmp_path), seed=0)


def batch_of_two_groups(policy) -> UpdateBatch:
    prompt = encode_prompts(policy.tokenizer, [_problem()], "Answer with a number.", 192)[0]
    generator = torch.Generator().manual_seed(0)
    batch = UpdateBatch([], [], [], [])
    for index in range(8):
        length = 3 + index % 4
        batch.prompt_token_ids.append(prompt)
        batch.completion_token_ids.append(torch.randint(10, 5000, (length,),
                                                        generator=generator).tolist())
        batch.advantages.append(0.8 if index % 2 else -0.8)
        batch.group_index.append(index // 4)
    return batch


def _problem():
    from grpogate.inputs.tasks import Problem, prompt_id

    return Problem(prompt_id("What is 3 + 4?"), "What is 3 + 4?", "7", "test:0")


SETTINGS = UpdateSettings(epsilon=0.2, epsilon_high=0.2, beta=0.02, max_grad_norm=1.0, micro_batch_size=8,
                          groups_per_update=1, loss_type="grpo", temperature=1.0)


def trainable_copy(policy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainable_parameters(policy).values()]


def call(policy, optimizer, batch, retried: list | None = None):
    on_retry = (lambda error, size: retried.append(size)) if retried is not None else None
    return update_with_retry(policy.model, optimizer, batch, SETTINGS,
                             policy.tokenizer.pad_token_id, lambda: reference_mode(policy),
                             trainable_parameters(policy).values(), on_retry=on_retry)


def test_out_of_memory_is_recognised():
    assert is_out_of_memory(OUT_OF_MEMORY("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate: "
                                         "out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_an_oom_retries_once_at_half_the_micro_batch_without_a_double_step(
        policy, tiny_config, tmp_path, monkeypatch):
    batch = batch_of_two_groups(policy)
    # The expected result: one clean update at micro_batch_size 4 from the same start.
    twin = load_policy(tiny_config(tmp_path), seed=0)
    twin_optimizer = torch.optim.AdamW(trainable_parameters(twin).values(), lr=1e-2)
    expected = grpo_update(twin.model, twin_optimizer, batch,
                           dataclasses.replace(SETTINGS, micro_batch_size=4),
                           twin.tokenizer.pad_token_id, lambda: reference_mode(twin),
                           trainable_parameters(twin).values())

    real_update, sizes = update_module.grpo_update, []

    def oom_after_applying_the_first_time(model, optimizer, batch, settings, *args):
        sizes.append(settings.micro_batch_size)
        record = real_update(model, optimizer, batch, settings, *args)  # steps really applied
        if len(sizes) == 1:
            raise OUT_OF_MEMORY("CUDA out of memory. Tried to allocate 1.00 GiB")
        return record

    monkeypatch.setattr(update_module, "grpo_update", oom_after_applying_the_first_time)
    optimizer = torch.optim.AdamW(trainable_parameters(policy).values(), lr=1e-2)
    retried = []
    record, used = call(policy, optimizer, batch, retried=retried)
    assert sizes == [8, 4] and retried == [4] and used.micro_batch_size == 4
    assert record.update_count == expected.update_count == 2
    # Two optimizer steps in all, not four: the first attempt's steps were rolled back.
    assert {int(state["step"]) for state in optimizer.state.values()} == {2}
    for got, want in zip(trainable_parameters(policy).values(), trainable_parameters(twin).values()):
        assert torch.equal(got, want)


def test_a_second_oom_fails_clearly_and_leaves_the_adapter(policy, monkeypatch):
    batch = batch_of_two_groups(policy)
    real_update, calls = update_module.grpo_update, []

    def always_oom(model, optimizer, batch, settings, *args):
        calls.append(settings.micro_batch_size)
        real_update(model, optimizer, batch, settings, *args)
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(update_module, "grpo_update", always_oom)
    optimizer = torch.optim.AdamW(trainable_parameters(policy).values(), lr=1e-2)
    before, version = trainable_copy(policy), current_version(policy)
    with pytest.raises(UpdateFailed, match="micro_batch_size 8 and again at 4"):
        call(policy, optimizer, batch)
    assert calls == [8, 4]
    assert all(torch.equal(a, b) for a, b in zip(before, trainable_parameters(policy).values()))
    assert current_version(policy) == version
    assert not optimizer.state


def test_other_update_errors_propagate_after_the_rollback(policy, monkeypatch):
    real_update = update_module.grpo_update

    def broken(model, optimizer, batch, settings, *args):
        real_update(model, optimizer, batch, settings, *args)
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(update_module, "grpo_update", broken)
    optimizer = torch.optim.AdamW(trainable_parameters(policy).values(), lr=1e-2)
    before = trainable_copy(policy)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        call(policy, optimizer, batch_of_two_groups(policy))
    assert all(torch.equal(a, b) for a, b in zip(before, trainable_parameters(policy).values()))


def test_a_run_whose_update_keeps_running_out_of_memory_is_rejected(tiny_config, tmp_path,
                                                                    monkeypatch):
    def always_oom(*args, **kwargs):
        raise OUT_OF_MEMORY("CUDA out of memory. Tried to allocate 3.00 GiB")

    monkeypatch.setattr(training, "score_completions", alternating_rewards)
    monkeypatch.setattr(update_module, "grpo_update", always_oom)
    evidence = pipeline.run(tiny_config(tmp_path))
    run_dir = assert_finished_with(evidence, "update_failed")
    assert evidence["failure"]["step"] == 0
    assert "out of memory" in evidence["failure"]["message"]
    assert evidence["update"]["oom_retries"] == 1 and evidence["update"]["update_count"] == 0
    # Nothing was applied: the delivered adapter is the policy that sampled step 0.
    step_0 = {r["source_policy_version"] for r in read_jsonl(run_dir / "trajectories.jsonl")}
    assert step_0 == {evidence["artifact"]["new_policy_version"]}


def test_a_run_recovers_from_one_oom_and_keeps_the_smaller_micro_batch(tiny_config, tmp_path,
                                                                       monkeypatch):
    real_update, sizes = update_module.grpo_update, []

    def oom_once(model, optimizer, batch, settings, *args):
        sizes.append(settings.micro_batch_size)
        if len(sizes) == 1:
            raise OUT_OF_MEMORY("CUDA out of memory")
        return real_update(model, optimizer, batch, settings, *args)

    monkeypatch.setattr(training, "score_completions", alternating_rewards)
    monkeypatch.setattr(update_module, "grpo_update", oom_once)
    evidence = pipeline.run(tiny_config(tmp_path))
    assert evidence["status"] == "ok"
    assert sizes == [8, 4, 4]  # the retry, then step 1 starts at the smaller size
    assert evidence["update"]["oom_retries"] == 1 and evidence["update"]["micro_batch_size"] == 4
    assert [s["micro_batch_size"] for s in evidence["steps"]] == [4, 4]
    assert evidence["update"]["update_count"] == 2
