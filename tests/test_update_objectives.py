"""The objectives inside real updates on the tiny model: direction, mu > 1, the OOM retry's rows,
beta = 0, and the sampler-trainer mismatch (float32 shared weights vs the bf16 merged path)."""

from __future__ import annotations


import pytest
import torch

from helpers import record_ratio_inputs

from grpogate.config import load_config
from grpogate.errors import InputError
from grpogate.inputs.policy import load_policy, reference_mode, sampling_weights, trainable_parameters
from grpogate.engines import engine_for
from grpogate.sampling.rollout import SamplingSettings, encode_prompts, generate_completions
from grpogate.training import batching
from grpogate.training import update as update_module
from grpogate.training.advantages import UpdateBatch, build_update_batch
from grpogate.training.update import UpdateSettings, grpo_update, update_with_retry
from grpogate.inputs.tasks import Problem, prompt_id
from reference_logprobs import completion_logprobs, pack_sequences

EOS = 2
QUESTIONS = ["What is 3 + 4?", "What is 12 + 30?"]


@pytest.fixture
def policy(tiny_config, tmp_path):
    return load_policy(tiny_config(tmp_path), seed=0)


@pytest.fixture
def prompts(policy):
    problems = [Problem(prompt_id(q), q, "7", f"test:{i}") for i, q in enumerate(QUESTIONS)]
    return encode_prompts(policy.tokenizer, problems, "Answer with a number.", 192)


def two_groups(prompts) -> UpdateBatch:
    """G = 2, ragged lengths; group 0's longest completion (6) is longer than group 1's (4), so
    micro_batches' sort puts group 1 first: rows and advantages must follow it."""
    completions = [[504, 3077, 314, EOS], [905, 28, 17, 1120, 44, 7], [1011, 29], [9063, 17, 9, 4]]
    advantages = [0.7071, -0.7071, -0.7071, 0.7071]
    return UpdateBatch([prompts[0], prompts[0], prompts[1], prompts[1]], completions, advantages,
                       [0, 0, 1, 1])


def sequence_logprobs(policy, batch: UpdateBatch) -> list[float]:
    """Sum of each completion's log-probs, one whole forward per sequence (the obvious way)."""
    with torch.no_grad():
        ids, attention, completion_ids, mask = pack_sequences(
            batch.prompt_token_ids, batch.completion_token_ids, EOS, torch.device("cpu"))
        logp = completion_logprobs(policy.model, ids, attention, completion_ids, 1.0)
    return (logp * mask).sum(-1).tolist()


def update(policy, batch, lr=1e-3, **settings):
    parameters = list(trainable_parameters(policy).values())
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    values = dict(micro_batch_size=2, temperature=1.0, max_new_tokens=8)
    return grpo_update(policy.model, optimizer, batch, UpdateSettings(**{**values, **settings}),
                       EOS, lambda: reference_mode(policy), parameters)


@pytest.mark.parametrize("loss_type,level,micro", [
    ("grpo", "token", 2), ("dapo", "token", 4), ("dr_grpo", "token", 1),
    ("cispo", "token", 2), ("grpo", "sequence", 2), ("bnpo", "token", 1)])
def test_one_update_raises_positive_and_lowers_negative_sequences(policy, prompts, loss_type,
                                                                  level, micro):
    batch = two_groups(prompts)
    before = sequence_logprobs(policy, batch)
    record = update(policy, batch, loss_type=loss_type, importance_sampling_level=level,
                    micro_batch_size=micro)
    after = sequence_logprobs(policy, batch)
    assert record.update_count == 1
    for advantage, old, new in zip(batch.advantages, before, after):
        assert (new > old) if advantage > 0 else (new < old), (loss_type, advantage, old, new)


def test_two_iterations_see_a_ratio_away_from_one_and_record_the_clip_fraction(
        policy, prompts, monkeypatch):
    seen = record_ratio_inputs(monkeypatch)
    record = update(policy, two_groups(prompts), lr=5e-2, num_iterations=2, micro_batch_size=4,
                    epsilon=0.01, epsilon_high=0.01)
    assert record.update_count == 2 and len(seen) == 2  # one micro-batch per pass
    (first_logp, first_old), (second_logp, second_old) = seen
    assert torch.allclose(first_logp, first_old, atol=1e-5)  # pass 1: the rollout policy
    assert not torch.allclose(second_logp, second_old, atol=1e-3)  # pass 2: it moved
    assert torch.equal(first_old, second_old)  # pi_old is fixed for both passes
    summary = record.summary()
    assert len(summary["clip_fraction_by_iteration"]) == 2
    assert summary["clip_fraction_by_iteration"][0] == 0.0
    assert summary["clip_fraction_by_iteration"][1] > 0.0
    first_ratio, second_ratio = summary["max_abs_log_ratio_by_iteration"]
    assert first_ratio < 1e-5 and second_ratio > 0.01  # epsilon 0.01: clipped means > 0.00995
    # 16 real tokens per pass; the step's fraction is the mean of the two passes'
    assert record.tokens == 2 * (4 + 6 + 2 + 4)
    assert summary["clip_fraction"] == pytest.approx(
        sum(summary["clip_fraction_by_iteration"]) / 2)


def test_beta_zero_runs_no_reference_forward(policy, prompts):
    entered = []

    def counting_reference():
        entered.append(1)
        return reference_mode(policy)

    parameters = list(trainable_parameters(policy).values())
    for beta, expected in ((0.0, 0), (0.02, 2)):  # two micro-batches of 2
        entered.clear()
        grpo_update(policy.model, torch.optim.AdamW(parameters, lr=1e-3), two_groups(prompts),
                    UpdateSettings(micro_batch_size=2, beta=beta, temperature=1.0), EOS,
                    counting_reference, parameters)
        assert len(entered) == expected


def test_the_oom_retry_really_forwards_fewer_rows(policy, prompts, monkeypatch):
    """micro_batch_size 2 = G: the retry at 1 must split each group, not forward it whole."""
    forwarded = []
    real = update_module.micro_batch_logprobs

    def spy(model, packed, per_prompt, *args, **kwargs):  # either layout: (prompts, completions)
        rows = packed.completion_ids.shape[0]
        forwarded.append((rows // per_prompt, rows))
        if len(forwarded) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return real(model, packed, per_prompt, *args, **kwargs)

    monkeypatch.setattr(update_module, "micro_batch_logprobs", spy)
    parameters = list(trainable_parameters(policy).values())
    settings = UpdateSettings(micro_batch_size=2, beta=0.0, temperature=1.0)
    record, used = update_with_retry(policy.model, torch.optim.AdamW(parameters, lr=1e-3),
                                     two_groups(prompts), settings, EOS,
                                     lambda: reference_mode(policy), parameters)
    assert forwarded[0] == (1, 2)  # the first try: one prompt, its 2 completions
    assert used.micro_batch_size == 1 and record.update_count == 1
    assert forwarded[1:] == [(1, 1)] * 4  # the retry: one prompt and one completion per forward
    assert record.sequences == 4


def test_micro_batches_never_exceed_the_micro_batch_size(prompts):
    batch = two_groups(prompts)
    rows = list(range(4))
    assert batching.micro_batches(batch, rows, 1) == [[2], [3], [0], [1]]  # group 1 first
    assert batching.micro_batches(batch, rows, 2) == [[2, 3], [0, 1]]
    assert batching.micro_batches(batch, rows, 4) == [[2, 3, 0, 1]]


# --- the sampler-trainer mismatch ---------------------------------------------------------------


def sampled_batch(policy, prompts, group_size=4) -> UpdateBatch:
    """Real completions with the sampler's log-probs, every group valid (alternating rewards)."""
    settings = SamplingSettings(max_new_tokens=8, temperature=1.0, top_p=1.0, batch_size=16)
    with sampling_weights(policy):
        completions = generate_completions(policy.model, policy.tokenizer, prompts, group_size,
                                           settings, seed=3, stepper=engine_for(policy.model).stepper(policy.model))
    return build_update_batch([c.prompt_token_ids for c in completions],
                              [c.completion_token_ids for c in completions],
                              [float(i % 2) for i in range(len(completions))], group_size,
                              sampler_logprobs=[c.sampler_logprobs for c in completions])


def test_mismatch_is_exactly_zero_when_the_sampler_logprobs_are_the_trainers(policy, prompts):
    """Fed the trainer's own log-probs (same packing, same forward), every mismatch is 0.0
    exactly: also proves each row meets its own sampler values after the micro-batch sort."""
    batch = sampled_batch(policy, prompts)
    own: dict[int, list[float]] = {}
    step = update_module._Step(policy.model, batch, UpdateSettings(temperature=1.0), EOS,
                               lambda: reference_mode(policy), torch.device("cpu"), {})
    with torch.no_grad():
        for micro in batching.micro_batches(batch, list(range(len(batch))), 4):
            logp = step.logprobs(step.pack(micro), micro)  # the layout the update will choose
            for row, index in enumerate(micro):
                own[index] = logp[row, :len(batch.completion_token_ids[index])].tolist()
    batch.sampler_logprobs = [own[i] for i in range(len(batch))]
    summary = update(policy, batch, micro_batch_size=4).summary()
    assert summary["mismatch_tokens"] == sum(len(c) for c in batch.completion_token_ids)
    assert summary["mismatch_mean_abs_logp"] == 0.0
    assert summary["mismatch_max_abs_logp"] == 0.0
    assert summary["mismatch_k3_kl"] == 0.0
    # a misaligned row (two rows' values swapped) is seen
    batch.sampler_logprobs[0], batch.sampler_logprobs[5] = own[5], own[0]
    swapped = update(policy, batch, micro_batch_size=4).summary()
    assert swapped["mismatch_max_abs_logp"] > 0.0


def test_float32_sampler_agrees_with_the_trainer_to_rounding(policy, prompts):
    # The sampler's prefill + one-token decode steps and the trainer's prompt + completion
    # forward are different kernels: in float32 they agree to rounding, not bit for bit.
    summary = update(policy, sampled_batch(policy, prompts), micro_batch_size=4).summary()
    assert summary["mismatch_tokens"] > 0
    assert summary["mismatch_max_abs_logp"] < 1e-4
    # k3 ~ (delta log p)^2 / 2: positive and tiny, computed in float64 so it does not cancel
    assert 0.0 < summary["mismatch_k3_kl"] < 1e-8


def test_bf16_merged_sampler_differs_from_the_trainer_and_is_recorded(tiny_config, tmp_path):
    policy = load_policy(tiny_config(tmp_path, dtype="bfloat16"), seed=0)
    for parameter in trainable_parameters(policy).values():  # a non-zero adapter to merge
        parameter.data.normal_(0, 0.05)
    problems = [Problem(prompt_id(q), q, "7", f"test:{i}") for i, q in enumerate(QUESTIONS)]
    prompts = encode_prompts(policy.tokenizer, problems, "Answer with a number.", 192)
    summary = update(policy, sampled_batch(policy, prompts), micro_batch_size=4).summary()
    assert summary["mismatch_tokens"] > 0
    assert summary["mismatch_mean_abs_logp"] > 1e-4  # bf16 rounding of W + BA vs W x + B(A x)
    assert summary["mismatch_max_abs_logp"] >= summary["mismatch_mean_abs_logp"]
    assert summary["mismatch_k3_kl"] > 0.0


def test_token_tis_reweights_the_update_by_the_capped_sampler_ratio(policy, prompts):
    """Sampler log-probs 1 nat below the trainer's: pi_old / pi_sampler = e = 2.718 per token,
    capped at 2: every token's gradient is exactly 2x the uncorrected one; sequence_mask with
    cap 2 drops every sequence (their products exceed 2), so no gradient at all."""
    parameters = list(trainable_parameters(policy).values())

    def gradients(batch, **settings):
        for parameter in parameters:
            parameter.grad = None
        step = update_module._Step(policy.model, batch, UpdateSettings(
            micro_batch_size=4, beta=0.0, temperature=1.0, **settings), EOS,
            lambda: reference_mode(policy), torch.device("cpu"), {})
        record = update_module.UpdateRecord()
        record.pass_tokens.append(0), record.pass_clipped.append(0)
        record.pass_max_abs_log_ratio.append(0.0)
        rows = list(range(len(batch)))
        denominators = update_module._denominators(step, rows, [rows])
        update_module._backward_micro_batch(step, rows, denominators[0], record)
        return [p.grad.clone() for p in parameters if p.grad is not None]

    with torch.no_grad():
        for parameter in parameters:
            parameter.data.normal_(0, 0.05)
    batch = sampled_batch(policy, prompts, group_size=2)
    batch.sampler_logprobs = [[value - 1.0 for value in row] for row in batch.sampler_logprobs]
    plain = gradients(batch)
    tis = gradients(batch, rollout_correction="token_tis", rollout_correction_cap=2.0)
    masked = gradients(batch, rollout_correction="sequence_mask", rollout_correction_cap=2.0)
    assert plain and any(g.abs().sum() > 0 for g in plain)
    for base, corrected in zip(plain, tis):
        assert torch.allclose(corrected, 2 * base, rtol=1e-3, atol=1e-7)
    assert all(g.abs().sum() == 0 for g in masked)


# --- configuration -------------------------------------------------------------------------------


def test_objective_knobs_load_from_set_and_bad_values_are_refused():
    config = load_config("smoke", overrides=[
        "loss_type=dapo", "epsilon_high=0.28", "num_iterations=2", "scale_rewards=none",
        "kl_estimator=k1", "importance_sampling_level=sequence", "delta=3",
        "top_entropy_quantile=0.2", "rollout_correction=token_tis", "beta=0"])
    assert (config.loss_type, config.epsilon_high, config.num_iterations) == ("dapo", 0.28, 2)
    settings = UpdateSettings.from_config(config)
    assert settings.epsilon_high == 0.28 and settings.delta == 3.0 and settings.beta == 0.0
    assert UpdateSettings.from_config(load_config("smoke")).epsilon_high == 0.2  # unset: epsilon
    for override, message in (
            ("loss_type=ppo", "loss_type must be one of grpo, bnpo, dapo, dr_grpo, cispo"),
            ("kl_estimator=k4", "kl_estimator must be one of k1, k2, k3"),
            ("scale_rewards=std", "scale_rewards must be one of group, batch, none"),
            ("importance_sampling_level=turn", "importance_sampling_level must be one of token"),
            ("rollout_correction=tis", "rollout_correction must be one of none, token_tis"),
            ("max_grad_norm=0", "max_grad_norm must be > 0"),
            ("delta=1.1", "delta must be 0 \\(off\\) or > 1 \\+ epsilon_high"),
            ("num_iterations=0", "num_iterations must be >= 1"),
            ("top_entropy_quantile=0", "top_entropy_quantile must be in"),
            ("clip_epsilon=0.2", "'clip_epsilon' was renamed to epsilon"),
            ("kl_coef=0.1", "'kl_coef' was renamed to beta"),
            ("loss_aggregation=token_mean", "renamed to loss_type")):
        with pytest.raises(InputError, match=message):
            load_config("smoke", overrides=[override])
