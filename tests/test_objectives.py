"""Every objective against values computed by hand: loss and d loss / d logp.

The shared tiny case: 2 sequences of lengths 2 and 3 (T = 3, the first padded), epsilon 0.2,
epsilon_high 0.28 (clip range [0.8, 1.28]), advantages +1 and -1.
Token ratios r = pi / pi_old: sequence 1 [2.0, 1.0] (2.0 > 1.28, A > 0: clipped);
sequence 2 [0.5, 1.0, 1.2] (0.5 < 0.8, A < 0: clipped).
old log-probs: sequence 1 [-1, -2], sequence 2 [-1, -0.5, -2]; logp = old + ln r.
"""

import math

import pytest
import torch

from grpogate.training.advantages import group_advantages
from grpogate.training.logprobs import picked_logprobs, token_logprobs
from grpogate.training.objectives import (aggregate_loss, high_entropy_mask, kl_penalty,
                                          loss_denominator, mismatch_terms, policy_token_terms,
                                          rollout_correction_weights)

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
OLD = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -0.5, -2.0]])
RATIOS = torch.tensor([[2.0, 1.0, 1.0], [0.5, 1.0, 1.2]])
ADVANTAGES = torch.tensor([1.0, -1.0])
MAX_NEW_TOKENS = 4  # dr_grpo's constant: 2 sequences x 4 = 8
LN2, LN12 = math.log(2.0), math.log(1.2)
S2 = 0.6 ** (1 / 3)  # GSPO ratio of sequence 2: (0.5 * 1.0 * 1.2) ** (1/3) = 0.843433


def loss_and_grad(loss_type: str, level: str, delta: float = 0.0):
    """The update's composition for a step that is one micro-batch."""
    logp = (OLD + torch.log(RATIOS)).requires_grad_(True)
    per_token, _, clipped = policy_token_terms(
        logp, OLD, None, ADVANTAGES, MASK, loss_type=loss_type, level=level, epsilon=0.2,
        epsilon_high=0.28, delta=delta, beta=0.0, kl_estimator="k3")
    denominator = loss_denominator([2, 3], loss_type, MAX_NEW_TOKENS)
    loss = aggregate_loss(per_token, MASK, loss_type) / denominator
    loss.backward()
    return loss.item(), (logp.grad * MASK).tolist(), (clipped & MASK.bool()).tolist()


# Token level, clipped surrogate, per-token loss -min(r A, clip(r) A) and its gradient -A r
# (0 where the clip binds):
#   seq 1 (A=+1): r=2 -> -1.28, grad 0;  r=1 -> -1, grad -1
#   seq 2 (A=-1): r=0.5 -> +0.8, grad 0; r=1 -> +1, grad 1; r=1.2 -> +1.2, grad 1.2
#   token sum = -2.28 + 3.0 = 0.72
TOKEN_CASES = {
    # grpo: mean of sequence means = (-2.28/2 + 3.0/3) / 2 = (-1.14 + 1) / 2 = -0.07;
    #   grads: seq 1 / (2 tokens * 2 seqs), seq 2 / (3 tokens * 2 seqs)
    "grpo": (-0.07, [[0.0, -0.25, 0.0], [0.0, 1 / 6, 0.2]]),
    # bnpo, dapo: token sum / 5 tokens = 0.144; grads / 5
    "bnpo": (0.144, [[0.0, -0.2, 0.0], [0.0, 0.2, 0.24]]),
    "dapo": (0.144, [[0.0, -0.2, 0.0], [0.0, 0.2, 0.24]]),
    # dr_grpo: token sum / (2 * 4) = 0.09; grads / 8
    "dr_grpo": (0.09, [[0.0, -0.125, 0.0], [0.0, 0.125, 0.15]]),
    # cispo: -sg(min(r, 1.28)) A logp, over 5 tokens. weights: [1.28, 1], [0.5, 1, 1.2]
    #   seq 1: -1.28 * (-1 + ln 2) - 1 * (-2);  seq 2: +0.5 * (-1 - ln 2) + 1 * (-0.5) + 1.2 * (-2 + ln 1.2)
    #   grads -w A / 5: [-0.256, -0.2], [0.1, 0.2, 0.24]
    "cispo": ((1.28 * (1 - LN2) + 2 + 0.5 * (-1 - LN2) - 0.5 + 1.2 * (-2 + LN12)) / 5,
              [[-0.256, -0.2, 0.0], [0.1, 0.2, 0.24]]),
}

# Sequence level (GSPO): s1 = sqrt(2 * 1) = 1.41421 > 1.28 with A > 0 -> clipped, no gradient;
# s2 = 0.843433 inside [0.8, 1.28] -> per-token loss s2 on each of its 3 tokens, and
# d s2 / d logp_t = s2 / 3 for each of its tokens.
SEQUENCE_CASES = {
    # grpo: (-1.28 + s2) / 2; grad s2 / 3 / 2
    "grpo": ((-1.28 + S2) / 2, [[0.0, 0.0, 0.0], [S2 / 6] * 3]),
    # bnpo, dapo: (2 * -1.28 + 3 * s2) / 5; grad 3 * (s2 / 3) / 5 = s2 / 5
    "bnpo": ((-2.56 + 3 * S2) / 5, [[0.0, 0.0, 0.0], [S2 / 5] * 3]),
    "dapo": ((-2.56 + 3 * S2) / 5, [[0.0, 0.0, 0.0], [S2 / 5] * 3]),
    # dr_grpo: (-2.56 + 3 s2) / 8; grad s2 / 8
    "dr_grpo": ((-2.56 + 3 * S2) / 8, [[0.0, 0.0, 0.0], [S2 / 8] * 3]),
    # cispo: weights min(s, 1.28) = 1.28 and s2 on every token of the sequence;
    #   -1.28 * (sum logp_1 = -3 + ln 2) + s2 * (sum logp_2 = -3.5 - ln 2 + ln 1.2), over 5
    #   grads -w A / 5: seq 1 -1.28 / 5 = -0.256, seq 2 s2 / 5
    "cispo": ((-1.28 * (-3 + LN2) + S2 * (-3.5 - LN2 + LN12)) / 5,
              [[-0.256, -0.256, 0.0], [S2 / 5] * 3]),
}


def assert_loss_and_grad(loss_type, level, expected):
    """The loss and per-token gradient equal the hand-computed case; returns the clip mask."""
    loss, grad, clipped = loss_and_grad(loss_type, level)
    expected_loss, expected_grad = expected
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    for row, expected_row in zip(grad, expected_grad):
        assert row == pytest.approx(expected_row, abs=1e-6)
    return clipped


@pytest.mark.parametrize("loss_type", sorted(TOKEN_CASES))
def test_token_level_loss_and_gradient_by_hand(loss_type):
    clipped = assert_loss_and_grad(loss_type, "token", TOKEN_CASES[loss_type])
    if loss_type == "cispo":  # only the positive-advantage ratio above 1 + eps_high is capped
        assert clipped == [[True, False, False], [False, False, False]]
    else:
        assert clipped == [[True, False, False], [True, False, False]]


@pytest.mark.parametrize("loss_type", sorted(SEQUENCE_CASES))
def test_sequence_level_loss_and_gradient_by_hand(loss_type):
    clipped = assert_loss_and_grad(loss_type, "sequence", SEQUENCE_CASES[loss_type])
    # the whole of sequence 1 is clipped (its one ratio is above 1.28), none of sequence 2
    assert clipped == [[True, True, False], [False, False, False]]


def test_dual_clip_caps_the_ratio_for_negative_advantages():
    # A = -1, r = 4: without delta -min(-4, -1.28) = 4, grad -A r = 4;
    # delta 3: the unclipped term becomes min(4, 3) * -1 = -3 -> loss 3, grad 0 (capped).
    old = torch.tensor([[0.0]])
    for delta, expected_loss, expected_grad in ((0.0, 4.0, 4.0), (3.0, 3.0, 0.0)):
        logp = torch.tensor([[math.log(4.0)]], requires_grad=True)
        per_token, _, _ = policy_token_terms(
            logp, old, None, torch.tensor([-1.0]), torch.ones(1, 1), loss_type="grpo",
            level="token", epsilon=0.2, epsilon_high=0.28, delta=delta, beta=0.0,
            kl_estimator="k3")
        per_token.sum().backward()
        assert per_token.item() == pytest.approx(expected_loss, abs=1e-6)
        assert logp.grad.item() == pytest.approx(expected_grad, abs=1e-6)


def test_kl_estimators_by_hand():
    # p = 0.5, p_ref = 0.25: log r = ln(p_ref / p) = -ln 2.
    # k1 = -log r = ln 2 = 0.693147; k2 = (ln 2)^2 / 2 = 0.240227; k3 = r - 1 - log r
    # = 0.5 - 1 + ln 2 = 0.193147.
    logp, ref = torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.25]]))
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(LN2, abs=1e-6)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(LN2 ** 2 / 2, abs=1e-6)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + LN2, abs=1e-6)
    with pytest.raises(ValueError, match="k1, k2, k3|known"):
        kl_penalty(logp, ref, "k4")


def test_beta_scales_the_kl_term_only():
    # ratio 1, A = 1, k3 0.193147 (above), beta 0.1: per-token loss -1 + 0.1 * 0.193147.
    logp, ref = torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.25]]))
    per_token, kl, _ = policy_token_terms(
        logp, logp, ref, torch.tensor([1.0]), torch.ones(1, 1), loss_type="grpo", level="token",
        epsilon=0.2, epsilon_high=0.2, delta=0.0, beta=0.1, kl_estimator="k3",
        weights=torch.zeros(1, 1))  # weights scale the surrogate, never the KL
    assert per_token.item() == pytest.approx(0.1 * (0.5 - 1 + LN2), abs=1e-6)
    assert kl.item() == pytest.approx(0.5 - 1 + LN2, abs=1e-6)


REWARDS = torch.tensor([[0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)


def test_scale_rewards_group_batch_none_by_hand():
    # group 1: mean 0.5, unbiased std sqrt(1/3) = 0.577350; group 2: mean 0.25, std 0.5.
    group = group_advantages(REWARDS, "group")
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert group[0].tolist() == pytest.approx([-a, a, -a, a], abs=1e-12)
    assert group[1].tolist() == pytest.approx([-0.25 / 0.5001] * 3 + [0.75 / 0.5001], abs=1e-12)
    # batch: all 8 rewards, mean 3/8, unbiased variance (5 * 0.375^2 + 3 * 0.625^2) / 7
    # = 1.875 / 7 = 0.267857, std 0.517549; still centred on each group's mean.
    std = math.sqrt(1.875 / 7) + 1e-4
    batch = group_advantages(REWARDS, "batch")
    assert batch[0].tolist() == pytest.approx([-0.5 / std, 0.5 / std] * 2, abs=1e-12)
    assert batch[1].tolist() == pytest.approx([-0.25 / std] * 3 + [0.75 / std], abs=1e-12)
    # none (Dr. GRPO): r - group mean
    assert group_advantages(REWARDS, "none").tolist() == [[-0.5, 0.5, -0.5, 0.5],
                                                          [-0.25, -0.25, -0.25, 0.75]]


def test_rollout_correction_weights_by_hand():
    # pi_old / pi_sampler per token: 0.5 / 0.25 = 2, 0.5 / 0.5 = 1; sequence product 2.
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    sampler = torch.log(torch.tensor([[0.25, 0.5]]))
    mask = torch.ones(1, 2)
    assert rollout_correction_weights(old, sampler, mask, "none", 1.5).tolist() == [[1.0, 1.0]]
    tis = rollout_correction_weights(old, sampler, mask, "token_tis", 1.5)
    assert tis[0].tolist() == pytest.approx([1.5, 1.0])  # min(2, 1.5), min(1, 1.5)
    kept = rollout_correction_weights(old, sampler, mask, "sequence_mask", 3.0)
    assert kept[0].tolist() == pytest.approx([2.0, 2.0])  # product 2 <= cap 3: weight 2
    dropped = rollout_correction_weights(old, sampler, mask, "sequence_mask", 1.5)
    assert dropped.tolist() == [[0.0, 0.0]]  # 2 > cap 1.5: the sequence is masked out


def test_mismatch_terms_by_hand_and_zero_when_equal():
    trainer = torch.log(torch.tensor([[0.5, 0.5]]))
    sampler = torch.log(torch.tensor([[0.25, 0.5]]))
    absolute, k3 = mismatch_terms(trainer, sampler)
    # |ln 0.5 - ln 0.25| = ln 2; k3 with log r = ln 2: 2 - 1 - ln 2 = 0.306853
    assert absolute[0].tolist() == pytest.approx([LN2, 0.0], abs=1e-6)
    assert k3[0].tolist() == pytest.approx([1 - LN2, 0.0], abs=1e-6)
    same_abs, same_k3 = mismatch_terms(trainer, trainer.clone())
    assert same_abs.abs().sum().item() == 0.0 and same_k3.abs().sum().item() == 0.0


def test_high_entropy_mask_keeps_the_top_quantile_of_real_tokens():
    # real entropies 0.1, 0.5 | 0.9, 0.3, 0.7 (the 9.0 is padding). quantile 0.4 keeps the top
    # 40 %: threshold = 0.6-quantile of [0.1, 0.3, 0.5, 0.7, 0.9] = 0.5 + 0.4 * (0.7 - 0.5) = 0.58.
    entropy = torch.tensor([[0.1, 0.5, 9.0], [0.9, 0.3, 0.7]])
    assert high_entropy_mask(entropy, MASK, 0.4).tolist() == [[0, 0, 0], [1, 0, 1]]
    assert torch.equal(high_entropy_mask(entropy, MASK, 1.0), MASK)


def test_token_logprobs_entropy_by_hand():
    # Uniform over 4 tokens: log-prob ln(1/4), entropy ln 4. [1, 0, 0, 0] logits at T = 1:
    # p = (e, 1, 1, 1) / (e + 3), entropy = lse - sum p z = ln(e + 3) - e / (e + 3).
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]])
    entropy: list = []
    logp = token_logprobs(logits, torch.tensor([[2, 0]]), 1.0, chunk=1, entropy=entropy)
    e = math.e
    assert logp[0].tolist() == pytest.approx([-math.log(4), 1 - math.log(e + 3)], abs=1e-6)
    assert entropy[0][0].tolist() == pytest.approx(
        [math.log(4), math.log(e + 3) - e / (e + 3)], abs=1e-6)


@pytest.fixture(params=["native", "torch"])
def head(request, monkeypatch):
    """The log-prob head on the native kernels (where this machine builds them) or in torch."""
    from grpogate.engines.cpu import native
    if request.param == "torch":
        monkeypatch.setenv("GRPOGATE_NATIVE", "0")
    elif native.native_kernels(torch.float32, torch.device("cpu")) is None:
        pytest.skip("no C++ compiler with OpenMP on this machine: only the torch head runs")
    return request.param


def test_token_logprobs_chunks_give_the_unchunked_values_and_gradients(head):
    """Either head, chunks of 1, 2 or all 5 positions: the same log-probs as a full log-softmax
    and the same gradient (a position's is onehot - p over the temperature). Hand case at
    T = 2, logits [0, ln 3 * 2] picking token 1: z / T = [0, ln 3], p = [1/4, 3/4], log-prob
    ln(3/4), d logp / d logits = (onehot - p) / T = [-1/8, 1/8]."""
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 7, (2, 5), generator=torch.Generator().manual_seed(1))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[..., None]).squeeze(-1)
    for chunk in (1, 2, 5):
        x = logits.clone().requires_grad_(True)
        logp = token_logprobs(x, tokens, 0.7, chunk)
        (grad,) = torch.autograd.grad(logp.sum(), x)
        y = logits.clone().requires_grad_(True)
        (reference,) = torch.autograd.grad(
            torch.log_softmax(y / 0.7, -1).gather(-1, tokens[..., None]).sum(), y)
        assert torch.allclose(logp, expected, atol=1e-6)
        assert torch.allclose(grad, reference, atol=1e-6)
    x = torch.tensor([[[0.0, 2 * math.log(3)]]], requires_grad=True)
    logp = token_logprobs(x, torch.tensor([[1]]), 2.0, chunk=1)
    assert logp.item() == pytest.approx(math.log(3 / 4), abs=1e-6)
    (grad,) = torch.autograd.grad(logp.sum(), x)
    assert grad[0, 0].tolist() == pytest.approx([-1 / 8, 1 / 8], abs=1e-6)


def test_picked_logprobs_share_a_position_among_the_tokens_it_predicts(head):
    """Either head. Positions [2, 0, 0, 3, 1] of 4 (position 0 predicts two tokens, as a
    group's last prompt position predicts every completion's first): values, entropies and
    gradient equal a full log-softmax's, in M's order, for chunks of 1, 3 and 4. Hand case at
    T = 1, one position with logits [0, ln 3] predicting tokens 1 and 0: log-probs ln(3/4)
    and ln(1/4), p = [1/4, 3/4]; gradient of their sum: onehot(1) + onehot(0) - 2p =
    [1 - 1/2, 1 - 3/2] = [1/2, -1/2]; entropy -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623 for both."""
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    index = torch.tensor([2, 0, 0, 3, 1])
    tokens = torch.tensor([5, 1, 4, 0, 2])
    full = torch.log_softmax(logits / 0.7, -1)
    expected = full[index, tokens]
    expected_entropy = -(full.exp() * full).sum(-1)[index]
    y = logits.clone().requires_grad_(True)
    (reference,) = torch.autograd.grad(torch.log_softmax(y / 0.7, -1)[index, tokens].sum(), y)
    for chunk in (1, 3, 4):
        x = logits.clone().requires_grad_(True)
        entropy = []
        logp = picked_logprobs(x, index, tokens, 0.7, chunk, entropy)
        (grad,) = torch.autograd.grad(logp.sum(), x)
        assert torch.allclose(logp, expected, atol=1e-6)
        assert torch.allclose(entropy[0], expected_entropy, atol=1e-6)
        assert torch.allclose(grad, reference, atol=1e-6)
    x = torch.tensor([[0.0, math.log(3)]], requires_grad=True)
    entropy = []
    logp = picked_logprobs(x, torch.tensor([0, 0]), torch.tensor([1, 0]), 1.0, 1, entropy)
    assert logp.tolist() == pytest.approx([math.log(3 / 4), math.log(1 / 4)], abs=1e-6)
    assert entropy[0].tolist() == pytest.approx([0.5623351, 0.5623351], abs=1e-6)
    (grad,) = torch.autograd.grad(logp.sum(), x)
    assert grad[0].tolist() == pytest.approx([0.5, -0.5], abs=1e-6)
