"""Rollout and update on a tiny random-weight Llama: sampling, records, one GRPO step, log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from grpogate.training import objectives
from grpogate.errors import InputError
from grpogate.inputs.policy import load_policy, reference_mode, trainable_parameters
from grpogate.engines.rows import shared_prefix_length
from grpogate.sampling.rollout import (
    SamplingSettings,
    encode_prompts,
    generate_completions,
    score_completions,
    score_rewards,
    trajectory_records,
)
from grpogate.inputs.tasks import Problem, prompt_id
from grpogate.inputs.rewards import build_reward_set, format_reward
from grpogate.training.advantages import UpdateBatch, build_update_batch
from grpogate.training.update import NonFiniteUpdate, UpdateSettings, grpo_update
from helpers import record_ratio_inputs
from reference_logprobs import completion_logprobs, pack_sequences
from grpogate.inputs.verifiers import get_verifier

EOS = 2
G = 4
QUESTIONS = [("What is 3 + 4?", "7"), ("What is 12 + 30?", "42")]


def problems() -> list[Problem]:
    return [Problem(prompt_id(q), q, a, f"test:{i}") for i, (q, a) in enumerate(QUESTIONS)]


@pytest.fixture
def policy(tiny_config, tmp_path):
    return load_policy(tiny_config(tmp_path), seed=0)


@pytest.fixture
def prompts(policy):
    return encode_prompts(policy.tokenizer, problems(), "Answer with a number.", 192)


def eos_biased(policy, bias: float = 9.5):
    """A random 49k-vocabulary model almost never samples EOS in 8 tokens; raise its logit so
    that, at seed 0, some completions stop early and some hit the budget."""
    offset = torch.zeros(policy.model.get_output_embeddings().weight.shape[0])
    offset[EOS] = bias
    return policy.model.get_output_embeddings().register_forward_hook(
        lambda module, inputs, output: output + offset)


def settings(max_new_tokens: int = 8, batch_size: int = 3) -> SamplingSettings:
    return SamplingSettings(max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0,
                            batch_size=batch_size)


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def update_settings(**overrides) -> UpdateSettings:
    values = dict(epsilon=0.2, epsilon_high=0.2, beta=0.02, max_grad_norm=1.0, micro_batch_size=2,
                  groups_per_update=0, loss_type="grpo", temperature=1.0)
    return UpdateSettings(**{**values, **overrides})


def hand_batch(prompts, group_count: int = 2) -> UpdateBatch:
    """G = 2 per group, ragged completions (one ends in EOS), advantages +1 / -1."""
    completions = [[504, 3077, 314, EOS], [905, 28, 17, 1120, 44, 7], [1011, 29], [9063, 17, 9, 4]]
    batch = UpdateBatch([], [], [], [])
    for group in range(group_count):
        for member, advantage in enumerate((0.7071, -0.7071)):
            batch.prompt_token_ids.append(prompts[group % len(prompts)])
            batch.completion_token_ids.append(completions[(2 * group + member) % len(completions)])
            batch.advantages.append(advantage)
            batch.group_index.append(group)
    return batch


# --- rollout ----------------------------------------------------------------------------------


def test_generate_completions_cuts_at_eos_and_flags_the_budget(policy, prompts):
    hook = eos_biased(policy)
    try:
        completions = generate_completions(policy.model, policy.tokenizer, prompts, G, settings(),
                                           seed=0)
    finally:
        hook.remove()
    assert len(completions) == len(prompts) * G
    assert [(c.prompt_index, c.sample_index) for c in completions] == [
        (p, g) for p in range(len(prompts)) for g in range(G)]
    stopped = [c for c in completions if not c.hit_max_length]
    cut = [c for c in completions if c.hit_max_length]
    assert stopped and cut, "the EOS bias should give both outcomes at seed 0"
    for completion in completions:
        ids = completion.completion_token_ids
        assert completion.prompt_token_ids == prompts[completion.prompt_index]
        assert 1 <= len(ids) <= 8
        assert completion.hit_max_length == (EOS not in ids)
        if completion.hit_max_length:
            assert len(ids) == 8
        else:
            assert ids.index(EOS) == len(ids) - 1  # EOS kept, nothing after it
        assert completion.text == policy.tokenizer.decode(ids, skip_special_tokens=True)


def test_same_seed_same_completions_other_seed_differs(policy, prompts):
    def sample(seed, batch_size=3):
        return [c.completion_token_ids
                for c in generate_completions(policy.model, policy.tokenizer, prompts, G,
                                              settings(batch_size=batch_size), seed=seed)]

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first
    policy.model.train()
    sample(7)
    assert policy.model.training  # generate_completions puts the model back as it found it


def test_a_prompt_samples_the_same_alone_or_inside_a_larger_batch(policy, prompts):
    """World-size invariance starts here: each prompt draws from its own generator, seeded by
    (seed, its index), so batch composition never changes its draws — here the second prompt
    alone vs. batched with the first (other prompt length, so other padding), with EOS biased
    so rows leave the batch at different steps in the two layouts."""
    hook = eos_biased(policy, bias=8.0)
    # The second prompt extends the first: alone, its own prefix would be computed once (32
    # tokens), batched with the first only 16; callers fix it over the whole prompt set.
    prompts = [prompts[0], prompts[0] + [1011, 29, 905] * 6]
    shared = shared_prefix_length(prompts)
    assert shared < shared_prefix_length(prompts[1:])
    try:
        batched = generate_completions(policy.model, policy.tokenizer, prompts, G,
                                       settings(batch_size=2 * G), seed=11, shared_prefix=shared)
        alone = generate_completions(policy.model, policy.tokenizer, prompts[1:], G,
                                     settings(batch_size=G), seed=11, prompt_indexes=[1],
                                     shared_prefix=shared)
        other_index = generate_completions(policy.model, policy.tokenizer, prompts[1:], G,
                                           settings(batch_size=G), seed=11, prompt_indexes=[0],
                                           shared_prefix=shared)
    finally:
        hook.remove()
    second = [c for c in batched if c.prompt_index == 1]
    assert len(prompts[0]) != len(prompts[1])
    assert len({len(c.completion_token_ids) for c in batched}) > 1  # rows finished unevenly
    assert [c.completion_token_ids for c in alone] == [c.completion_token_ids for c in second]
    # Bit for bit, the sampler's log-probs included (float32, the shared prefix fixed).
    assert [c.sampler_logprobs for c in alone] == [c.sampler_logprobs for c in second]
    # The seed follows the prompt's index, not its position in the call.
    assert [c.completion_token_ids for c in other_index] != [c.completion_token_ids for c in alone]


def test_trajectory_records_carry_every_identity(policy, prompts):
    completions = generate_completions(policy.model, policy.tokenizer, prompts, G, settings(),
                                       seed=0)
    verifier = get_verifier("reasoning-gym/chain_sum")
    rewards = score_completions(completions, problems(), verifier)
    rewards[1] = 1.0  # a value the tiny model cannot earn, to see it carried through
    reward_set = build_reward_set(
        [{"name": "correctness", "weight": 1.0}, {"name": "format", "weight": 0.5},
         {"name": "overlong", "weight": 2.0}], verifier.version, max_new_tokens=8,
        overlong_buffer_len=4, overlong_penalty_factor=1.0, user_time_limit_seconds=1.0)
    components = score_rewards(completions, problems(), reward_set, rewards)
    records = trajectory_records(completions, components, problems(), run_id="run-a", step=3,
                                 policy_version="p" * 64, verifier_version=verifier.version,
                                 reward_set=reward_set, generation_round=1)
    assert len(records) == len(prompts) * G
    for record, completion, reward in zip(records, completions, rewards):
        assert set(record) == {"step", "round", "prompt_id", "sample_index", "trace_id",
                               "source_policy_version", "verifier_version", "reward_versions",
                               "completion", "completion_tokens", "hit_max_length", "rewards",
                               "reward", "sampler_logprobs"}
        assert record["sampler_logprobs"] == completion.sampler_logprobs
        assert len(record["sampler_logprobs"]) == record["completion_tokens"]
        assert all(value <= 0.0 for value in record["sampler_logprobs"])
        assert record["step"] == 3 and record["round"] == 1
        assert record["prompt_id"] == problems()[completion.prompt_index].prompt_id
        assert record["sample_index"] == completion.sample_index
        assert record["source_policy_version"] == "p" * 64
        assert record["verifier_version"] == verifier.version
        assert record["reward_versions"]["correctness"] == verifier.version
        assert set(record["reward_versions"]) == {"correctness", "format", "overlong"}
        assert record["completion"] == completion.text
        assert record["completion_tokens"] == len(completion.completion_token_ids)
        assert record["hit_max_length"] is completion.hit_max_length
        tokens = record["completion_tokens"]
        # overlong: 0 up to 8 - 4 = 4 tokens, then (4 - tokens) / 4
        overlong = 0.0 if tokens <= 4 else (4 - tokens) / 4
        formatted = format_reward(completion.text)
        assert record["rewards"] == {"correctness": reward, "format": formatted,
                                     "overlong": overlong}
        assert record["reward"] == pytest.approx(reward + 0.5 * formatted + 2.0 * overlong)
    assert rewards[1] == 1.0 and records[1]["rewards"]["correctness"] == 1.0
    assert len({r["trace_id"] for r in records}) == len(records)
    other_step = trajectory_records(completions, components, problems(), run_id="run-a", step=4,
                                    policy_version="p" * 64, verifier_version=verifier.version,
                                    reward_set=reward_set)
    assert not {r["trace_id"] for r in records} & {r["trace_id"] for r in other_step}


def test_encode_prompts_refuses_to_truncate(policy):
    with pytest.raises(InputError, match="max_prompt_tokens"):
        encode_prompts(policy.tokenizer, problems(), "Answer with a number.", 8)


# --- log-probabilities ------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completion_logprobs_match_a_full_log_softmax(policy, prompts, temperature):
    completions = [[504, 3077, 314, 2208, EOS], [905, 28], [1011, 29, 17, 44]]
    batch_prompts = [prompts[0], prompts[1][:-5], prompts[1]]  # ragged left padding
    input_ids, attention_mask, completion_ids, mask = pack_sequences(
        batch_prompts, completions, EOS, torch.device("cpu"))
    # Widths are rounded up to multiples of WIDTH_BUCKET (16): 5 completion columns -> 16, and
    # the prompt block to the next multiple of 16 above the longest prompt.
    width = input_ids.shape[1] - completion_ids.shape[1]
    assert width % 16 == 0 and width >= max(len(p) for p in batch_prompts)
    assert completion_ids.shape == (3, 16) and mask.sum().item() == 11
    with torch.no_grad():
        fast = completion_logprobs(policy.model, input_ids, attention_mask, completion_ids,
                                   temperature, chunk=2)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        full = policy.model(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids).logits
        naive = torch.log_softmax(full.float() / temperature, dim=-1)
        for row, (prompt, completion) in enumerate(zip(batch_prompts, completions)):
            for t, token in enumerate(completion):
                expected = naive[row, width - 1 + t, token]
                assert abs(fast[row, t].item() - expected.item()) < 1e-5
            # The same sequence alone, unpadded: padding must not change any log-prob.
            alone = torch.tensor([prompt + completion])
            logits = policy.model(input_ids=alone).logits.float() / temperature
            single = torch.log_softmax(logits[0], dim=-1)
            for t, token in enumerate(completion):
                expected = single[len(prompt) - 1 + t, token]
                assert abs(fast[row, t].item() - expected.item()) < 1e-4


def test_shared_prompt_forward_equals_one_forward_per_sequence(policy, prompts):
    """Two implementations of the same log-probs agree, values and gradients (verl-style)."""
    from grpogate.training.logprobs import pack_groups, shared_prompt_logprobs

    group_prompts = [prompts[0], prompts[1][:-5]]  # two groups, different prompt lengths
    completions = [[504, 3077, 314, 2208, EOS], [905, 28], [1011, 29, 17, 44],  # group 0
                   [77, EOS], [5, 6, 7, 8, 9, 10], [300, 301, 302]]  # group 1
    per_sequence_prompts = [group_prompts[0]] * 3 + [group_prompts[1]] * 3
    for parameter in trainable_parameters(policy).values():  # a non-zero adapter, so LoRA matters
        parameter.data.normal_(0, 0.05)
    parameters = list(trainable_parameters(policy).values())

    def loss_and_grads(logp, mask):
        loss = (logp * mask).sum()
        grads = torch.autograd.grad(loss, parameters)
        return logp.detach(), grads

    input_ids, attention_mask, completion_ids, mask = pack_sequences(
        per_sequence_prompts, completions, EOS, torch.device("cpu"))
    full_logp, full_grads = loss_and_grads(
        completion_logprobs(policy.model, input_ids, attention_mask, completion_ids, 0.7), mask)
    packed = pack_groups(group_prompts, completions, EOS, torch.device("cpu"))
    group_mask = packed.completion_mask
    shared_logp, shared_grads = loss_and_grads(
        shared_prompt_logprobs(policy.model, packed, 3, 0.7), group_mask)

    assert torch.equal(mask, group_mask)
    assert torch.allclose(full_logp * mask, shared_logp * mask, atol=1e-5)
    # Gradients of magnitude ~1 summed in another order in float32: agree to ~1e-5.
    for full, shared in zip(full_grads, shared_grads):
        assert torch.allclose(full, shared, atol=5e-5, rtol=1e-3)
    assert any(g.abs().sum() > 0 for g in shared_grads)


# --- the update -------------------------------------------------------------------------------


def run_update(policy, batch, optimizer=None, **overrides):
    parameters = list(trainable_parameters(policy).values())
    optimizer = optimizer or torch.optim.AdamW(parameters, lr=1e-3, weight_decay=0.0)
    return grpo_update(policy.model, optimizer, batch, update_settings(**overrides), EOS,
                       lambda: reference_mode(policy), parameters)


def test_one_update_moves_lora_and_never_the_base(policy, prompts):
    before = snapshot(policy.model)
    record = run_update(policy, hand_batch(prompts))
    after = policy.model.state_dict()
    assert record.update_count == 1
    assert record.sequences == 4 and record.tokens == 4 + 6 + 2 + 4
    summary = record.summary()
    assert summary["clip_fraction"] == 0.0  # one step per rollout: ratio is exactly 1
    assert summary["mean_kl"] == pytest.approx(0.0, abs=1e-6)  # B = 0: policy == reference
    assert all(math.isfinite(x) for x in summary["loss"] + summary["grad_norm"])
    base_names = [n for n in before if "lora_" not in n]
    lora_b = [n for n in before if "lora_B" in n]
    assert len(base_names) > 10 and lora_b
    assert all(torch.equal(before[n], after[n]) for n in base_names)
    assert any(not torch.equal(before[n], after[n]) for n in lora_b)


def test_build_update_batch_keeps_only_valid_groups(prompts):
    completions = [[10 + i] for i in range(3 * G)]
    rewards = [1.0, 0.0, 0.0, 0.0] + [0.0] * G + [1.0] * G
    batch = build_update_batch([prompts[0]] * (3 * G), completions, rewards, G)
    assert len(batch) == G and batch.group_count == 1
    assert batch.completion_token_ids == completions[:G]
    # Hand-computed: mean 0.25, unbiased std 0.5 -> (1 - 0.25) / 0.5001, (0 - 0.25) / 0.5001.
    assert batch.advantages == pytest.approx([0.75 / 0.5001] + [-0.25 / 0.5001] * 3)


def test_token_terms_equal_hand_computed_values():
    # ratio 2 (p 0.5 over old 0.25), epsilon 0.2; reference p 0.25 -> k3 KL = 0.5 + ln 2 - 1.
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.25, 0.5]]))
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    kl_expected = 0.5 + math.log(2) - 1
    for advantage, surrogate, clipped in ((1.0, 1.2, True), (-1.0, -2.0, False)):
        per_token, kl, was_clipped = objectives.policy_token_terms(
            logp, old, ref, torch.tensor([advantage]), torch.ones(1, 2), loss_type="grpo",
            level="token", epsilon=0.2, epsilon_high=0.2, delta=0.0, beta=0.1,
            kl_estimator="k3")
        assert kl[0, 0].item() == pytest.approx(kl_expected, abs=1e-6)
        assert kl[0, 1].item() == pytest.approx(0.0, abs=1e-7)
        assert per_token[0, 0].item() == pytest.approx(-(surrogate - 0.1 * kl_expected), abs=1e-6)
        assert per_token[0, 1].item() == pytest.approx(-advantage, abs=1e-6)  # ratio 1, KL 0
        assert was_clipped.tolist() == [[clipped, False]]


def test_empty_batch_takes_no_optimizer_step(policy):
    before = snapshot(policy.model)
    optimizer = torch.optim.AdamW(trainable_parameters(policy).values(), lr=1e-3)
    record = run_update(policy, UpdateBatch([], [], [], []), optimizer)
    assert record.update_count == 0 and record.tokens == 0
    assert not optimizer.state  # AdamW never stepped
    after = policy.model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_one_group_per_update_uses_precomputed_old_logprobs(policy, prompts, monkeypatch):
    seen = record_ratio_inputs(monkeypatch)
    parameters = list(trainable_parameters(policy).values())
    optimizer = torch.optim.AdamW(parameters, lr=5e-2)
    record = run_update(policy, hand_batch(prompts), optimizer, groups_per_update=1,
                        micro_batch_size=8, epsilon=0.01, epsilon_high=0.01)
    assert record.update_count == 2
    assert len(seen) == 2  # one micro-batch per optimizer step
    first_logp, first_old = seen[0]
    second_logp, second_old = seen[1]
    # Step one: the old log-probs are those of the unchanged policy (ratio 1).
    assert torch.allclose(first_logp, first_old, atol=1e-5)
    # Step two: the policy moved, its old log-probs did not (they were fixed before step one).
    assert not torch.allclose(second_logp, second_old, atol=1e-4)
    summary = record.summary()
    assert 0.0 <= summary["clip_fraction"] <= 1.0
    assert summary["clip_fraction"] > 0.0  # lr 5e-2 and epsilon 0.01 push ratios out of range


def test_non_finite_loss_raises_and_leaves_parameters(policy, prompts):
    batch = hand_batch(prompts)
    batch.advantages[1] = float("nan")
    before = snapshot(policy.model)
    optimizer = torch.optim.AdamW(trainable_parameters(policy).values(), lr=1e-3)
    with pytest.raises(NonFiniteUpdate):
        run_update(policy, batch, optimizer)
    assert not optimizer.state
    after = policy.model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_inverse_cdf_sampling_follows_the_distribution_and_the_nucleus():
    from grpogate.sampling.rollout import _sample

    probs = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0])
    logits = torch.log(probs).expand(20_000, -1)  # log 0 = -inf: that token must never appear
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(_sample(logits, 1.0, 1.0, generator), minlength=5).double() / 20_000
    # 20,000 draws: standard error <= sqrt(0.25 / 20000) = 0.0035; allow 4 of them.
    assert torch.allclose(counts, probs.double(), atol=0.014)
    assert counts[4] == 0
    # top_p 0.6: the nucleus is {0, 1} (0.5 < 0.6, then 0.75 crosses it), renormalized 2/3, 1/3.
    nucleus = torch.bincount(_sample(logits, 1.0, 0.6, generator), minlength=5).double() / 20_000
    assert nucleus[2:].sum() == 0
    assert nucleus[0].item() == pytest.approx(2 / 3, abs=0.014)
    # temperature 0.5 squares the probabilities: 0.25, 0.0625, 0.015625 x 2 -> normalized.
    sharp = torch.bincount(_sample(logits, 0.5, 1.0, generator), minlength=5).double() / 20_000
    expected = torch.tensor([0.25, 0.0625, 0.015625, 0.015625, 0.0], dtype=torch.float64)
    assert torch.allclose(sharp, expected / expected.sum(), atol=0.014)


@pytest.mark.parametrize("block", [2, 3, 5])
def test_two_level_sampling_is_exact_across_block_boundaries(block):
    """Blocks of 2 and 3 split the 7-token vocabulary with a ragged last block; block 5 leaves a
    2-token tail. Zero-probability tokens (ids 1 and 6, one of them alone in the tail for
    block 3) are never drawn, and the frequencies follow the distribution."""
    from grpogate.sampling.rollout import _sample

    probs = torch.tensor([0.3, 0.0, 0.2, 0.1, 0.25, 0.15, 0.0])
    logits = torch.log(probs).expand(40_000, -1)
    generator = torch.Generator().manual_seed(1)
    counts = torch.bincount(_sample(logits, 1.0, 1.0, generator, block=block),
                            minlength=7).double() / 40_000
    assert counts[1] == 0 and counts[6] == 0
    # standard error <= sqrt(0.25 / 40000) = 0.0025; allow 4 of them.
    assert torch.allclose(counts, probs.double(), atol=0.01)


def test_sampling_leaves_the_callers_float32_logits_untouched():
    from grpogate.sampling.rollout import _sample

    logits = torch.randn(4, 50)
    before = logits.clone()
    _sample(logits, 0.7, 0.9, torch.Generator().manual_seed(0))
    assert torch.equal(logits, before)


def test_masked_truncated_completion_adds_no_loss(policy, prompts):
    """Row 1 masked (mask_truncated_completions) must equal row 1 carrying zero loss, with the
    sequence_mean denominator counting the 3 contributing sequences instead of 4: with kl 0,
    an advantage of 0 gives row 1 zero loss, so grad(masked) = 4/3 x grad(advantage 0)."""
    parameters = list(trainable_parameters(policy).values())

    def gradients(batch):
        optimizer = torch.optim.AdamW(parameters, lr=0.0)  # grads stay; parameters do not move
        record = grpo_update(policy.model, optimizer, batch,
                             update_settings(beta=0.0, max_grad_norm=1e9), EOS,
                             lambda: reference_mode(policy), parameters)
        return record, [p.grad.clone() for p in parameters]

    masked = hand_batch(prompts)
    masked.contributes = [True, False, True, True]
    zero_advantage = hand_batch(prompts)
    zero_advantage.advantages[1] = 0.0
    record, masked_grads = gradients(masked)
    _, zero_grads = gradients(zero_advantage)
    assert record.masked_sequences == 1 and record.summary()["masked_truncated_sequences"] == 1
    assert record.tokens == 4 + 2 + 4  # row 1's 6 tokens are out of the loss
    assert any(g.abs().sum() > 0 for g in masked_grads)
    for got, reference in zip(masked_grads, zero_grads):
        assert torch.allclose(got, reference * 4 / 3, atol=1e-6, rtol=1e-4)


def test_top_k_and_min_p_truncate_and_the_logprob_is_the_truncated_distributions():
    from grpogate.sampling.rollout import _sample

    # Unsorted on purpose, so the sort-and-gather back to vocabulary ids is exercised.
    probs = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
    logits = torch.log(probs).expand(20_000, -1)
    generator = torch.Generator().manual_seed(3)

    def frequencies(**knobs):
        tokens, logp = _sample(logits, 1.0, knobs.pop("top_p", 1.0), generator,
                               with_logprobs=True, **knobs)
        return torch.bincount(tokens, minlength=5).double() / 20_000, tokens, logp

    # top_k 2: ids 1 (0.4) and 3 (0.3) only, renormalized 4/7 and 3/7; log p = log(p / 0.7).
    counts, tokens, logp = frequencies(top_k=2)
    assert counts[[0, 2, 4]].sum() == 0
    assert counts[1].item() == pytest.approx(4 / 7, abs=0.014)
    assert torch.allclose(logp, torch.log(probs[tokens] / 0.7), atol=1e-6)
    # min_p 0.3: keep p >= 0.3 x 0.4 = 0.12: ids 1, 3, 4 (0.15), mass 0.85.
    counts, tokens, logp = frequencies(min_p=0.3)
    assert counts[[0, 2]].sum() == 0
    assert counts[4].item() == pytest.approx(0.15 / 0.85, abs=0.014)
    assert torch.allclose(logp, torch.log(probs[tokens] / 0.85), atol=1e-6)
    # top_k 3 (ids 1, 3, 4: mass 0.85), then top_p 0.5 of that: 0.4 / 0.85 = 0.47 < 0.5, adding
    # 0.3 / 0.85 crosses it -> {1, 3}; then min_p 0.8 (p >= 0.32) leaves id 1 alone: log p = 0.
    counts, tokens, logp = frequencies(top_k=3, top_p=0.5, min_p=0.8)
    assert counts[1].item() == 1.0 and torch.allclose(logp, torch.zeros(20_000), atol=1e-6)
    # Nothing truncated: the full distribution's log-prob, log p.
    counts, tokens, logp = frequencies()
    assert torch.allclose(logp, torch.log(probs[tokens]), atol=1e-6)


def test_a_truncating_sampler_is_the_ratios_old_policy(policy, prompts, monkeypatch):
    seen = record_ratio_inputs(monkeypatch)
    batch = hand_batch(prompts)
    # The sampler's log-probs under a truncated distribution are higher than the full ones:
    # here every token's is log 0.5, far from what the random model gives.
    batch.old_logprobs = [[math.log(0.5)] * len(c) for c in batch.completion_token_ids]
    run_update(policy, batch, micro_batch_size=8)
    logp, old = seen[0]
    mask = old != logp  # padded positions keep the detached current value (ratio 1)
    assert mask.sum() == 4 + 6 + 2 + 4
    assert torch.allclose(old[mask], torch.full((16,), math.log(0.5)))


@pytest.mark.parametrize("top_p", [1.0, 0.6])
def test_sampled_token_logprobs_are_those_of_the_distribution_sampled_from(top_p):
    """Without truncation, log softmax(logits / T) of the drawn token, the trainer's quantity:
    probabilities 0.5, 0.25, 0.125, 0.125 at T = 1 give ln 0.5, ln 0.25, ln 0.125. A top-p 0.6
    nucleus keeps {0.5, 0.25} (0.5 < 0.6 <= 0.75), renormalized: ln 2/3 and ln 1/3."""
    from grpogate.sampling.rollout import _sample

    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    logits = (torch.log(probs) + 3.0).expand(400, -1)  # a shift changes nothing
    tokens, logprobs = _sample(logits, 1.0, top_p, torch.Generator().manual_seed(0),
                               with_logprobs=True)
    sampled_from = (torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]) if top_p < 1 else probs)
    assert torch.allclose(logprobs, torch.log(sampled_from)[tokens], atol=1e-6)
    assert set(tokens.tolist()) == ({0, 1} if top_p < 1 else {0, 1, 2, 3})
    # T = 0.5 squares and renormalizes: 0.25 / 0.34375 for token 0
    tokens, logprobs = _sample(logits, 0.5, 1.0, torch.Generator().manual_seed(1),
                               with_logprobs=True)
    expected = torch.log(probs ** 2 / (probs ** 2).sum())
    assert torch.allclose(logprobs, expected[tokens], atol=1e-6)
    # the tokens are the same draws as without log-probs
    again = _sample(logits, 0.5, 1.0, torch.Generator().manual_seed(1))
    assert torch.equal(again, tokens)
