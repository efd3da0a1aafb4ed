"""The GRPO loss against values computed by hand: ratio clipping, the KL estimator, normalisation."""

import math

import pytest
import torch

from moe_qlora.grpo import grpo_token_loss, token_weights

LN = math.log


def loss_of(logp, old, ref, adv, mask, *, clip=0.2, clip_high=None, kl=0.0, norm="token", total_seqs=None):
    weights = token_weights(mask, norm, total_tokens=int(mask.sum()), total_sequences=total_seqs or mask.shape[0])
    return grpo_token_loss(logp, old, ref, adv, weights, clip_eps=clip, clip_eps_high=clip_high or clip, kl_coef=kl)


def test_clipped_ratio_by_hand():
    # Token 1: p 0.5 now, 0.4 when sampled -> ratio 1.25. A = +1: min(1.25, clip to 1.2) = 1.2 -> loss -1.2,
    # clipped (no gradient). Token 2: same ratio, A = -1: min(-1.25, -1.2) = -1.25 -> loss +1.25, not clipped.
    # Token 3: ratio 0.5 / 0.8 = 0.625, A = -1: min(-0.625, -0.8) = -0.8 -> loss 0.8, clipped.
    logp = torch.tensor([[LN(0.5)], [LN(0.5)], [LN(0.5)]], requires_grad=True)
    old = torch.tensor([[LN(0.4)], [LN(0.4)], [LN(0.8)]])
    adv = torch.tensor([1.0, -1.0, -1.0])
    mask = torch.ones(3, 1, dtype=torch.bool)
    loss, stats = loss_of(logp, old, None, adv, mask)
    assert loss.item() == pytest.approx((-1.2 + 1.25 + 0.8) / 3, abs=1e-6)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 3, abs=1e-6)
    loss.backward()
    # d/dlogp of -ratio*A = -ratio*A for the unclipped token; zero where clipped.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0], [1.25 / 3], [0.0]]), rtol=0, atol=1e-6)


def test_clip_higher_bound():
    logp = torch.tensor([[LN(0.5)]], requires_grad=True)
    old = torch.tensor([[LN(0.4)]])
    loss, _ = loss_of(logp, old, None, torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool), clip_high=0.28)
    assert loss.item() == pytest.approx(-1.25, abs=1e-6)  # 1.25 < 1.28: not clipped any more


def test_one_pass_is_the_plain_policy_gradient():
    # old_logp None: ratio = 1 in value, and the gradient is A * dlogp (the REINFORCE / rwsft gradient with
    # weight A): loss = -mean(A), grad = -A / N per token.
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    adv = torch.tensor([0.7, -0.3])
    loss, stats = loss_of(logp, None, None, adv, torch.ones(2, 2, dtype=torch.bool))
    assert loss.item() == pytest.approx(-(0.7 * 2 - 0.3 * 2) / 4, abs=1e-7)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.7, -0.7], [0.3, 0.3]]) / 4)
    assert stats["clip_fraction"].item() == 0


def test_kl_k3_by_hand():
    # ref - logp = d: KL = e^d - d - 1. d = ln(0.2) - ln(0.5): 0.4 - ln(0.4) - 1 = 0.316291; with A = 0 only KL.
    logp = torch.tensor([[LN(0.5), LN(0.3)]], requires_grad=True)
    ref = torch.tensor([[LN(0.2), LN(0.3)]])
    loss, stats = loss_of(logp, None, ref, torch.tensor([0.0]), torch.ones(1, 2, dtype=torch.bool), kl=0.1)
    k3 = 0.4 - LN(0.4) - 1
    assert stats["kl"].item() == pytest.approx(k3 / 2, abs=1e-6)  # mean over the 2 tokens; the 2nd is 0
    assert loss.item() == pytest.approx(0.1 * k3 / 2, abs=1e-6)
    loss.backward()
    # d/dlogp (e^(ref-logp) - (ref-logp) - 1) = 1 - e^(ref-logp) = 1 - 0.4 = 0.6 for token 1, 0 for token 2.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.1 * 0.6 / 2, 0.0]]), rtol=0, atol=1e-7)


def test_token_and_sequence_normalisation_by_hand():
    # Completion 1 has 3 tokens, completion 2 has 1 (mask). A = 1 each, ratio 1: per-token loss -1.
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    logp = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([1.0, 1.0])
    token_loss, _ = loss_of(logp, None, None, adv, mask, norm="token")
    token_loss.backward()
    torch.testing.assert_close(logp.grad, -mask.float() / 4)  # every token 1/4
    logp.grad = None
    seq_loss, _ = loss_of(logp, None, None, adv, mask, norm="sequence")
    seq_loss.backward()
    torch.testing.assert_close(logp.grad, -torch.tensor([[1 / 6, 1 / 6, 1 / 6], [1 / 2, 0, 0]]))
    assert token_loss.item() == pytest.approx(-1.0) and seq_loss.item() == pytest.approx(-1.0)


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_micro_batches_sum_to_the_whole_batch(norm):
    torch.manual_seed(0)
    mask = torch.rand(6, 5) > 0.3
    mask[:, 0] = True
    logp = -torch.rand(6, 5) * mask
    old, ref = logp + 0.1 * torch.randn(6, 5), logp + 0.1 * torch.randn(6, 5)
    adv = torch.randn(6)
    tokens = int(mask.sum())

    def part(rows):
        w = token_weights(mask[rows], norm, total_tokens=tokens, total_sequences=6)
        return grpo_token_loss(logp[rows], old[rows], ref[rows], adv[rows], w, clip_eps=0.2, clip_eps_high=0.2,
                               kl_coef=0.05)[0]  # fmt: skip

    whole = part(slice(0, 6))
    split = part(slice(0, 2)) + part(slice(2, 5)) + part(slice(5, 6))
    torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-7)
