"""The padding-free layout of a micro-batch (logprobs.pack_row / packed_logprobs): its layout
by hand, and its log-probs and LoRA gradients against one whole forward per sequence."""

from __future__ import annotations

import pytest
import torch

from grpogate.inputs.policy import load_policy, reference_mode, trainable_parameters
from grpogate.sampling.rollout import encode_prompts
from grpogate.training.logprobs import (
    common_prefix_length,
    pack_groups,
    pack_row,
    packed_logprobs,
    shared_prompt_logprobs,
)
from reference_logprobs import completion_logprobs, pack_sequences

EOS = 2
CPU = torch.device("cpu")


@pytest.fixture
def policy(tiny_config, tmp_path):
    policy = load_policy(tiny_config(tmp_path), seed=0)
    for parameter in trainable_parameters(policy).values():  # a non-zero adapter: LoRA matters
        parameter.data.normal_(0, 0.05)
    return policy


@pytest.fixture
def prompts(policy):
    from grpogate.inputs.tasks import Problem, prompt_id

    questions = [("What is 3 + 4?", "7"), ("What is 12 + 30?", "42")]
    problems = [Problem(prompt_id(q), q, a, f"test:{i}") for i, (q, a) in enumerate(questions)]
    return encode_prompts(policy.tokenizer, problems, "Answer with a number.", 192)


def test_pack_row_layout_by_hand():
    # prompts [1 2 3] and [1 2 4 5] share the prefix [1 2]; G = 2 completions each.
    packed = pack_row([[1, 2, 3], [1, 2, 4, 5]], [[10, 11], [12], [13, 14, 15], [16]], 2, 0, CPU)
    # Row: prefix 1 2 | suffix 3 | c0 input 10 | c1 (no input: 1 token) | suffix 4 5 | c2 13 14
    #      | c3 (none) -> 2 + 1 + 1 + 2 + 2 = 8 real positions, padded to 16.
    assert packed.real_tokens == 8
    assert packed.input_ids[0, :8].tolist() == [1, 2, 3, 10, 4, 5, 13, 14]
    assert packed.input_ids.shape == (1, 16)
    # positions restart per sequence: c0's input 10 is token 3 of [1 2 3 10]; c2's 13, 14 are
    # tokens 4, 5 of [1 2 4 5 13 14].
    assert packed.position_ids[0, :8].tolist() == [0, 1, 2, 3, 2, 3, 4, 5]
    allowed = packed.allowed
    assert allowed[3, :4].tolist() == [True, True, True, True]  # 10 sees prefix, 3, itself
    assert allowed[4, :5].tolist() == [True, True, False, False, True]  # 4 skips group 0
    assert allowed[7, :8].tolist() == [True, True, False, False, True, True, True, True]
    assert not allowed[:8, 8:].any() and not allowed[8:, :8].any()  # padding apart
    # Logits: 3 predicts c0[0] and c1[0]; 10 predicts c0[1]; 5 predicts c2[0] and c3[0];
    # 13, 14 predict c2[1], c2[2] -> positions 2, 3, 5, 6, 7 (5 logits for 7 tokens).
    assert packed.logit_positions.tolist() == [2, 3, 5, 6, 7]
    predicted = packed.logit_positions[packed.logit_index].tolist()
    assert list(zip(packed.rows.tolist(), packed.columns.tolist(), predicted)) == [
        (0, 0, 2), (0, 1, 3), (1, 0, 2), (2, 0, 5), (2, 1, 6), (2, 2, 7), (3, 0, 5)]
    # Segments: the prefix [0, 2) sees itself; group 0 at [2, 4) and group 1 at [4, 8) see the
    # prefix and their own span; the padding [8, 16) sees itself.
    assert [(a, b, keys.tolist()) for a, b, keys in packed.segments] == [
        (0, 2, [0, 1]), (2, 4, [0, 1, 2, 3]), (4, 8, [0, 1, 4, 5, 6, 7]),
        (8, 16, list(range(8, 16)))]
    # Every pair the mask allows lies inside its query's segment.
    inside = torch.zeros_like(allowed)
    for a, b, keys in packed.segments:
        inside[a:b, keys] = True
    assert not (allowed & ~inside).any()


def test_common_prefix_leaves_every_prompt_a_token():
    assert common_prefix_length([[1, 2, 3], [1, 2, 3, 4]]) == 2
    assert common_prefix_length([[5, 6], [1, 2]]) == 0
    assert common_prefix_length([[1, 2, 3]]) == 2


def _loss_and_grads(logp, mask, parameters):
    loss = (logp * mask).sum()
    return logp.detach(), torch.autograd.grad(loss, parameters)


def test_packed_forward_equals_one_forward_per_sequence(policy, prompts):
    """Values and LoRA gradients of the packed row against the obvious forward (verl-style),
    two groups with different prompt lengths and ragged completions, and the padded layout."""
    group_prompts = [prompts[0], prompts[1][:-5]]
    completions = [[504, 3077, 314, 2208, EOS], [905, 28], [1011, 29, 17, 44],
                   [77, EOS], [5, 6, 7, 8, 9, 10], [300]]
    parameters = list(trainable_parameters(policy).values())
    input_ids, attention_mask, completion_ids, mask = pack_sequences(
        [group_prompts[0]] * 3 + [group_prompts[1]] * 3, completions, EOS, CPU)
    full_logp, full_grads = _loss_and_grads(completion_logprobs(
        policy.model, input_ids, attention_mask, completion_ids, 0.7), mask, parameters)
    row = pack_row(group_prompts, completions, 3, EOS, CPU)
    assert common_prefix_length(group_prompts) > 5  # the system prompt is shared
    entropy = []
    packed_logp, packed_grads = _loss_and_grads(
        packed_logprobs(policy.model, row, 0.7, entropy=entropy), row.completion_mask, parameters)
    padded = pack_groups(group_prompts, completions, EOS, CPU)
    padded_entropy = []
    padded_logp, _ = _loss_and_grads(shared_prompt_logprobs(
        policy.model, padded, 3, 0.7, entropy=padded_entropy), padded.completion_mask, parameters)

    assert torch.equal(row.completion_mask, mask)
    # float32, the same sums in another order: log-probs (magnitude ~11) agree to 1e-5.
    assert torch.allclose(full_logp * mask, packed_logp * mask, atol=1e-5)
    assert (packed_logp * (1 - mask)).abs().max() == 0  # padding is exactly 0
    for full, packed in zip(full_grads, packed_grads):
        assert torch.allclose(full, packed, atol=5e-5, rtol=1e-3)
    assert any(g.abs().sum() > 0 for g in packed_grads)
    assert torch.allclose(entropy[0] * mask, padded_entropy[0] * mask, atol=1e-4)
    assert torch.allclose(padded_logp * mask, packed_logp * mask, atol=1e-5)


def test_packed_reference_forward_is_the_baseline(policy, prompts):
    """Under reference_mode (adapter off) the packed row gives the baseline's log-probs."""
    completions = [[504, 3077], [905, 28, 17]]
    input_ids, attention_mask, completion_ids, mask = pack_sequences(
        [prompts[0]] * 2, completions, EOS, CPU)
    with torch.no_grad(), reference_mode(policy):
        full = completion_logprobs(policy.model, input_ids, attention_mask, completion_ids, 1.0)
        packed = packed_logprobs(policy.model, pack_row([prompts[0]], completions, 2, EOS, CPU), 1.0)
        with_adapter_off = full.clone()
    with torch.no_grad():
        trained = packed_logprobs(policy.model, pack_row([prompts[0]], completions, 2, EOS, CPU), 1.0)
    assert torch.allclose(with_adapter_off * mask, packed * mask, atol=1e-5)
    assert (trained - packed).abs().max() > 1e-3  # the adapter really was off


# --- the update in either layout ------------------------------------------------------------

# Prompts of 20 and 15 tokens sharing a 10-token prefix; G = 2, completions of 4, 2 / 6, 1.
HAND_PROMPTS = [list(range(100, 120)), list(range(100, 110)) + list(range(300, 305))]
HAND_COMPLETIONS = [[5, 6, 7, EOS], [8, 9], [10, 11, 12, 13, 14, 15], [16]]


def hand_batch():
    from grpogate.training.advantages import UpdateBatch

    return UpdateBatch([HAND_PROMPTS[0]] * 2 + [HAND_PROMPTS[1]] * 2, HAND_COMPLETIONS,
                       [0.7071, -0.7071, 0.7071, -0.7071], [0, 0, 1, 1])


def test_forward_cost_by_hand():
    from grpogate.training.batching import ForwardShape, forward_cost

    shape = ForwardShape(per_token=1000, per_pair=10, per_logit=100)
    # padded: prompts 2 x round_up(20, 16) = 2 x 32 = 64 positions, completions
    # 4 x (16 - 1) = 60 -> 124 positions; pairs 2 x 32^2 + 4 x 15 x (32 + 15) = 2048 + 2820
    # = 4868; logits 4 x 16 = 64 -> 124,000 + 48,680 + 6,400 = 179,080.
    assert forward_cost(HAND_PROMPTS, HAND_COMPLETIONS, shape, "padded") == 179_080
    # packed: prefix 10 + suffixes 10 + 5 + inputs 3 + 1 + 5 + 0 = 34 -> 48 positions;
    # pairs 48^2 = 2304; logits 13 tokens - 4 first tokens + 2 shared positions = 11
    # -> 48,000 + 23,040 + 1,100 = 72,140.
    assert forward_cost(HAND_PROMPTS, HAND_COMPLETIONS, shape, "packed") == 72_140
    # No padding to drop (a 16-token prompt, 8 completions of exactly 16) and costly attention:
    # padded 16 + 8 x 15 = 136 positions, pairs 16^2 + 8 x 15 x 31 = 3,976, 128 logits
    # -> 136,000 + 3,976,000 + 12,800 = 4,124,800; packed 15 + 1 + 120 = 136 -> 144 positions,
    # 144^2 = 20,736 pairs, 128 - 8 + 1 = 121 logits -> 144,000 + 20,736,000 + 12,100.
    heavy = ForwardShape(per_token=1000, per_pair=1000, per_logit=100)
    prompt, completions = [list(range(16))], [list(range(50, 66))] * 8
    assert forward_cost(prompt, completions, heavy, "padded") == 4_124_800
    assert forward_cost(prompt, completions, heavy, "packed") == 20_892_100


def _update(policy, layout: str):
    from grpogate.training.update import UpdateSettings, grpo_update

    parameters = list(trainable_parameters(policy).values())
    start = [p.detach().clone() for p in parameters]
    optimizer = torch.optim.SGD(parameters, lr=1.0)  # the step is the gradient itself
    settings = UpdateSettings(micro_batch_size=4, beta=0.02, temperature=1.0, max_new_tokens=8,
                              max_grad_norm=1e9, layout=layout)
    record = grpo_update(policy.model, optimizer, hand_batch(), settings, EOS,
                         lambda: reference_mode(policy), parameters)
    steps = [(p.detach() - s) for p, s in zip(parameters, start)]
    with torch.no_grad():
        for p, s in zip(parameters, start):
            p.copy_(s)
    return record, steps


def test_update_in_either_layout_takes_the_same_step_and_counts_its_tokens(policy):
    padded, padded_steps = _update(policy, "padded")
    packed, packed_steps = _update(policy, "packed")
    assert padded.tokens == packed.tokens == 4 + 2 + 6 + 1  # the loss's tokens: 13
    # One micro-batch, policy and reference forwards (beta > 0), so x 2:
    # padded 2 x 32 prompt + 4 x 15 completion columns = 124 per forward; real 20 + 15 prompt
    # tokens + 3 + 1 + 5 + 0 completion inputs = 44.
    assert (padded.forwarded_tokens, padded.forwarded_real_tokens) == (248, 88)
    # packed: 10 prefix + 10 + 5 suffix + 9 inputs = 34 real, padded to 48.
    assert (packed.forwarded_tokens, packed.forwarded_real_tokens) == (96, 68)
    summary = packed.summary()
    assert (summary["tokens_forwarded"], summary["tokens_forwarded_real"]) == (96, 68)
    assert padded.losses == pytest.approx(packed.losses, abs=1e-6)
    assert padded.kl_sum == pytest.approx(packed.kl_sum, abs=1e-6)
    # SGD at lr 1: the parameter change is the gradient, summed in another order (float32).
    assert any(s.abs().max() > 1e-6 for s in padded_steps)
    for a, b in zip(padded_steps, packed_steps):
        assert torch.allclose(a, b, atol=5e-6, rtol=1e-3)


def test_auto_layout_takes_the_cheaper_estimate():
    from grpogate.training.advantages import UpdateBatch
    from grpogate.training.batching import ForwardShape, pack_rows
    from grpogate.training.logprobs import PackedGroups, PackedRow

    light = ForwardShape(per_token=1000, per_pair=10, per_logit=100)  # 179,080 vs 72,140 above
    assert isinstance(pack_rows(hand_batch(), [0, 1, 2, 3], EOS, CPU, "auto", light), PackedRow)
    heavy = ForwardShape(per_token=1000, per_pair=1000, per_logit=100)  # 4,124,800 vs 20,892,100
    dense = UpdateBatch([list(range(16))] * 8, [list(range(50, 66))] * 8, [0.5, -0.5] * 4, [0] * 8)
    assert isinstance(pack_rows(dense, list(range(8)), EOS, CPU, "auto", heavy), PackedGroups)
