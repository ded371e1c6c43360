"""Advantages, the valid-group filter and the GRPO loss against values computed by hand."""

import math

import pytest
import torch

from grpogate.training.advantages import build_update_batch, group_advantages, valid_group_mask
from grpogate.training.objectives import aggregate_loss, loss_denominator, policy_token_terms


def token_terms(logp, old_logp, ref_logp, advantages, epsilon, beta, mask=None,
                loss_type="grpo"):
    mask = torch.ones_like(logp) if mask is None else mask
    return policy_token_terms(logp, old_logp, ref_logp, advantages, mask, loss_type=loss_type,
                              level="token", epsilon=epsilon, epsilon_high=epsilon, delta=0.0,
                              beta=beta, kl_estimator="k3")


def grpo_loss(logp, old_logp, ref_logp, advantages, mask, epsilon, beta, loss_type):
    """The loss of a step that is one micro-batch: the update's own composition."""
    per_token, _, _ = token_terms(logp, old_logp, ref_logp, advantages, epsilon, beta, mask,
                                  loss_type)
    denominator = loss_denominator(mask.sum(-1).long().tolist(), loss_type, 48)
    return aggregate_loss(per_token, mask, loss_type) / denominator

# The reference groups of the decision tests (test_decisions.py).
REFERENCE_REWARDS = [[0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0],
                     [0.0, 0.0, 1.0, 1.0]]


def test_group_advantages_by_hand():
    # [0,1,0,1]: mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = sqrt(1/3) = 0.57735...
    advantages = group_advantages(torch.tensor(REFERENCE_REWARDS, dtype=torch.float64))
    plus = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # 0.865876...
    assert advantages[0].tolist() == pytest.approx([-plus, plus, -plus, plus], abs=1e-12)
    # all-equal groups: numerator 0 -> advantage exactly 0
    assert advantages[1].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert advantages[2].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert advantages[3].tolist() == pytest.approx([-plus, -plus, plus, plus], abs=1e-12)
    # a single success in 4: mean 0.25, std sqrt((3*0.0625 + 0.5625)/3) = 0.5
    lone = group_advantages(torch.tensor([[0.0, 0.0, 0.0, 1.0]], dtype=torch.float64))
    assert lone[0].tolist() == pytest.approx([-0.25 / 0.5001] * 3 + [0.75 / 0.5001], abs=1e-12)


def test_valid_group_mask_keeps_only_groups_with_reward_variance():
    mask = valid_group_mask(torch.tensor(REFERENCE_REWARDS))
    assert mask.tolist() == [True, False, False, True]


def test_zero_variance_groups_never_reach_the_update_batch():
    rewards = [r for group in REFERENCE_REWARDS for r in group]
    prompts = [[10 + g] for g in range(4) for _ in range(4)]  # prompt token marks its group
    completions = [[100 + i] for i in range(16)]
    batch = build_update_batch(prompts, completions, rewards, group_size=4)
    assert len(batch) == 8 and batch.group_count == 2
    assert {p[0] for p in batch.prompt_token_ids} == {10, 13}  # groups 0 and 3 only
    assert batch.completion_token_ids == [[100], [101], [102], [103], [112], [113], [114], [115]]
    assert batch.group_index == [0, 0, 0, 0, 1, 1, 1, 1]
    plus = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert batch.advantages == pytest.approx([-plus, plus, -plus, plus, -plus, -plus, plus, plus])


def test_incomplete_groups_are_refused():
    with pytest.raises(ValueError, match="complete groups"):
        build_update_batch([[1]] * 5, [[2]] * 5, [0.0, 1.0, 0.0, 1.0, 1.0], group_size=4)


def test_on_policy_loss_is_minus_the_advantage_mean():
    # ratio 1 everywhere: per-token loss = -A. Sequence 1 has 2 tokens (A = 0.5), sequence 2
    # has 1 token (A = -1). sequence_mean: mean(-0.5, +1.0) = 0.25.
    # token_mean: (-0.5 - 0.5 + 1.0) / 3 = 0.
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    advantages = torch.tensor([0.5, -1.0])
    sequence = grpo_loss(logp, logp, None, advantages, mask, 0.2, 0.0, "grpo")
    token = grpo_loss(logp, logp, None, advantages, mask, 0.2, 0.0, "dapo")
    assert sequence.item() == pytest.approx(0.25)
    assert token.item() == pytest.approx(0.0)


def test_clipping_and_k3_kl_by_hand():
    # ratio e^0.5 = 1.648721 on both tokens, eps 0.2.
    # A = +1: min(1.6487, 1.2) = 1.2 -> clipped; A = -1: min(-1.6487, -1.2) = -1.6487 -> not clipped.
    # ref - logp = ln 0.5 -> k3 = 0.5 - ln 0.5 - 1 = 0.193147.
    old = torch.tensor([[-1.0], [-1.0]])
    logp = old + 0.5
    ref = logp + math.log(0.5)
    advantages = torch.tensor([1.0, -1.0])
    per_token, kl, clipped = token_terms(logp, old, ref, advantages, 0.2, 0.1)
    k3 = 0.5 - math.log(0.5) - 1
    assert kl.flatten().tolist() == pytest.approx([k3, k3], abs=1e-6)
    assert clipped.flatten().tolist() == [True, False]
    assert per_token.flatten().tolist() == pytest.approx(
        [-(1.2 - 0.1 * k3), -(-math.exp(0.5) - 0.1 * k3)], abs=1e-6)
    # the whole loss: mean of the two one-token sequences
    mask = torch.ones(2, 1)
    loss = grpo_loss(logp, old, ref, advantages, mask, 0.2, 0.1, "grpo")
    assert loss.item() == pytest.approx(((-1.2 + 0.1 * k3) + (math.exp(0.5) + 0.1 * k3)) / 2, abs=1e-6)


def test_gradient_of_clipped_token_is_zero():
    old = torch.tensor([[0.0]])
    logp = torch.tensor([[0.5]], requires_grad=True)
    loss = grpo_loss(logp, old, None, torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.0, "grpo")
    loss.backward()
    assert logp.grad.item() == 0.0  # above 1+eps with a positive advantage: no push further


def test_micro_batches_sum_to_the_whole_batch_loss():
    # Two micro-batches divided by the step's denominator equal one whole-batch loss.
    torch.manual_seed(0)
    logp = torch.randn(4, 3)
    old = logp + 0.1 * torch.randn(4, 3)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    advantages = torch.tensor([0.7, -0.3, 1.1, -1.5])
    for loss_type in ("grpo", "dapo", "dr_grpo", "cispo"):
        whole = grpo_loss(logp, old, None, advantages, mask, 0.2, 0.0, loss_type)
        denominator = loss_denominator(mask.sum(-1).long().tolist(), loss_type, 48)
        parts = 0.0
        for rows in ([0, 1], [2, 3]):
            per_token, _, _ = token_terms(logp[rows], old[rows], None, advantages[rows], 0.2, 0.0,
                                          mask[rows], loss_type)
            parts += aggregate_loss(per_token, mask[rows], loss_type) / denominator
        assert parts.item() == pytest.approx(whole.item(), abs=1e-6)
