"""AdamW with gclip against a step computed by hand; the global-norm clip."""

import pytest
import torch

from moe_qlora.train.optim import ClippedAdamW, clip_global_norm

LR, B1, B2, EPS, WD = 0.1, 0.9, 0.99, 1e-8, 0.01


def hand_adamw(p, grads, gclip):
    """Decoupled-weight-decay Adam written out: each element clamped to [-gclip, gclip] first."""
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    p = p.clone()
    for t, g in enumerate(grads, 1):
        if gclip > 0:
            g = g.clamp(-gclip, gclip)
        p = p * (1 - LR * WD)
        m = B1 * m + (1 - B1) * g
        v = B2 * v + (1 - B2) * g * g
        m_hat, v_hat = m / (1 - B1**t), v / (1 - B2**t)
        p = p - LR * m_hat / (v_hat.sqrt() + EPS)
    return p


GRADS = [torch.tensor([3.0, -0.5, 0.2, -7.0]), torch.tensor([0.1, 4.0, -2.0, 0.3])]


def run_optimizer(gclip):
    p = torch.nn.Parameter(torch.tensor([1.0, -1.0, 0.5, 0.0]))
    opt = ClippedAdamW([p], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, gclip=gclip, foreach=False)
    for g in GRADS:
        p.grad = g.clone()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("gclip", [0.0, 1.0, 0.25])
def test_two_steps_match_hand_computed_adamw(gclip):
    expected = hand_adamw(torch.tensor([1.0, -1.0, 0.5, 0.0]), GRADS, gclip)
    torch.testing.assert_close(run_optimizer(gclip), expected, rtol=1e-6, atol=1e-7)


def test_gclip_changes_the_update_of_outlier_elements():
    """Broken control: without the clamp the second step differs exactly where |g| > gclip."""
    clipped, unclipped = run_optimizer(1.0), run_optimizer(0.0)
    differs = (clipped - unclipped).abs() > 1e-4
    assert differs.tolist() == [True, True, True, True]  # each element saw |g| > 1 at one of the two steps
    with pytest.raises(AssertionError):
        torch.testing.assert_close(unclipped, hand_adamw(torch.tensor([1.0, -1.0, 0.5, 0.0]), GRADS, 1.0))


def test_negative_gclip_is_refused():
    with pytest.raises(ValueError, match="gclip"):
        ClippedAdamW([torch.nn.Parameter(torch.zeros(1))], gclip=-1.0)


def test_global_norm_clip_reports_pre_clip_norm_and_scales():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    assert clip_global_norm([p], 1.0) == pytest.approx(5.0)
    assert float(p.grad.norm()) == pytest.approx(1.0, rel=1e-5)
