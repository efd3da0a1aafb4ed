"""`moe-qlora dpo`'s losses against TRL 1.16's own DPOTrainer._compute_loss (helpers.trl_oracle): every loss type
of TRL's fifteen, several at once with loss_weights, every f-divergence, LD-DPO's ld_alpha, WPO's use_weighting
and label_smoothing, on the same per-token log-probability tables.

TRL's side takes the tables through its reference scoring (compute_ref_log_probs, with LD-DPO's split) and its
loss; ours through pair_logps and the micro-batch loss of a step of one micro-batch (dpo.pair_batch_loss), so
what is compared is the whole path from token log-probabilities to the loss. Five pairs whose completions are
of different lengths (chosen longer, shorter, equal), a one-token completion, and a policy that has moved from
the reference, so every margin is away from 0. Tolerance: loss and gradient to 1e-6 relative (fp32, sums of ~40
terms in another order; 1e-5 for the alpha divergence's exp). Each case names a broken control, one option
changed on our side, which must not match. A TRL upgrade that changes a formula or a default fails here.
"""

from __future__ import annotations

import pytest
import torch

from moe_qlora.config.preference import DpoSection
from moe_qlora.train.dpo import StepTotals, pair_batch_loss
from moe_qlora.train.preference_loss import pair_logps

from helpers import trl_oracle

CHOSEN, REJECTED = [3, 1, 5, 4, 2], [4, 3, 2, 4, 6]  # completion lengths: longer, shorter, equal, one token
PROMPT, LENGTH = 2, 9


def completion_mask() -> torch.Tensor:
    """(2P, L): chosen rows, then rejected rows; each a prompt of PROMPT tokens, its completion, padding."""
    lengths = torch.tensor(CHOSEN + REJECTED)
    place = torch.arange(LENGTH)[None, :]
    return ((place >= PROMPT) & (place < PROMPT + lengths[:, None])).long()


def tables(seed: int = 4):
    """The policy's token log-probabilities (a leaf with grad, 0 off the completion), the reference's, and
    log sum_v p_v^2 per position, each (2P, L - 1) as the head gives them for positions 1..L-1."""
    g = torch.Generator().manual_seed(seed)
    mask = completion_mask()[:, 1:].float()
    leaf = (-torch.rand(mask.shape, generator=g) * 2.5 - 0.05).requires_grad_()
    reference = (leaf.detach() + 0.6 * torch.randn(mask.shape, generator=g)).clamp(max=-0.01) * mask
    log_sum_sq = -torch.rand(mask.shape, generator=g) * 2.0
    return leaf, reference, log_sum_sq, mask


def trl_loss(options: dict):
    leaf, reference, log_sum_sq, mask = tables()
    trainer = trl_oracle.dpo_trainer(**options)
    policy = trl_oracle.TokenTables(leaf * mask, log_sum_sq)
    loss = trl_oracle.dpo_loss(trainer, policy, trl_oracle.TokenTables(reference, log_sum_sq), completion_mask())
    loss.backward()
    return loss.detach(), leaf.grad


def our_loss(d: DpoSection):
    leaf, reference, log_sum_sq, mask = tables()
    policy = pair_logps(leaf * mask, mask, ld_alpha=d.ld_alpha, log_sum_sq=log_sum_sq if d.use_weighting else None)
    ref = pair_logps(reference, mask, ld_alpha=d.ld_alpha)
    totals = StepTotals(pairs=len(CHOSEN), chosen_tokens=sum(CHOSEN), micro_batches=1)
    loss, _ = pair_batch_loss(policy, ref, d, totals)
    loss.backward()
    return loss.detach(), leaf.grad


CASES = {  # id: (options, in TRL's names and ours, the broken control's change)
    "sigmoid": ({}, {"beta": 0.2}),
    "hinge": ({"loss_type": "hinge", "beta": 2.0}, {"loss_type": "sigmoid"}),
    "ipo": ({"loss_type": "ipo", "beta": 0.5}, {"loss_type": "sigmoid_norm"}),
    "exo_pair": ({"loss_type": "exo_pair", "label_smoothing": 1e-3}, {"label_smoothing": 1e-2}),
    "nca_pair": ({"loss_type": "nca_pair", "beta": 0.5}, {"loss_type": "bco_pair"}),
    "robust": ({"loss_type": "robust", "label_smoothing": 0.1}, {"label_smoothing": 0.2}),
    "bco_pair": ({"loss_type": "bco_pair", "beta": 0.5}, {"loss_type": "nca_pair"}),
    "sppo_hard": ({"loss_type": "sppo_hard", "beta": 1.0}, {"beta": 0.5}),
    "aot": ({"loss_type": "aot", "beta": 0.5, "label_smoothing": 0.1}, {"loss_type": "aot_unpaired"}),
    "aot_unpaired": ({"loss_type": "aot_unpaired", "beta": 0.5}, {"loss_type": "aot"}),
    "apo_zero": ({"loss_type": "apo_zero", "beta": 0.5}, {"loss_type": "apo_down"}),
    "apo_down": ({"loss_type": "apo_down", "beta": 0.5}, {"loss_type": "apo_zero"}),
    "discopop": ({"loss_type": "discopop", "beta": 0.5}, {"discopop_tau": 0.5}),
    "discopop-tau": ({"loss_type": "discopop", "beta": 0.5, "discopop_tau": 0.2}, {"discopop_tau": 0.05}),
    "sft": ({"loss_type": "sft"}, {"loss_type": "sigmoid"}),
    "sigmoid_norm": ({"loss_type": "sigmoid_norm", "beta": 2.0}, {"loss_type": "ipo"}),
    "mpo": (
        {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
        {"loss_weights": [0.8, 0.2, 0.5]},
    ),
    "rpo": ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.3]}, {"loss_weights": [1.0, 1.0]}),
    "several-unweighted": ({"loss_type": ["hinge", "apo_zero", "nca_pair"]}, {"loss_type": ["hinge", "nca_pair"]}),
    "ld_alpha": ({"ld_alpha": 0.5}, {"ld_alpha": 0.9}),
    "ld_alpha-zero-ipo": ({"loss_type": "ipo", "ld_alpha": 0.0}, {"ld_alpha": 1.0}),
    "wpo": ({"use_weighting": True}, {"use_weighting": False}),
    "wpo-robust-ld": (
        {"loss_type": "robust", "label_smoothing": 0.2, "use_weighting": True, "ld_alpha": 0.3},
        {"ld_alpha": None},
    ),
    "forward_kl": ({"f_divergence_type": "forward_kl"}, {"f_divergence_type": "reverse_kl"}),
    "js_divergence": ({"f_divergence_type": "js_divergence"}, {"f_divergence_type": "forward_kl"}),
    "alpha_divergence": ({"f_divergence_type": "alpha_divergence"}, {"f_alpha_divergence_coef": 0.3}),
    "alpha_divergence-0.3-ipo": (
        {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3, "loss_type": "ipo"},
        {"f_divergence_type": "reverse_kl", "f_alpha_divergence_coef": None},
    ),
    "alpha_divergence-1-hinge": (
        {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 1.0, "loss_type": "hinge"},
        {"f_alpha_divergence_coef": 0.9},
    ),
    "js-exo-discopop-sft": (
        {
            "f_divergence_type": "js_divergence",
            "loss_type": ["exo_pair", "discopop", "sft"],
            "loss_weights": [1.0, 0.5, 0.1],
            "label_smoothing": 0.01,
        },
        {"f_divergence_type": "reverse_kl"},
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradient_match_trls_compute_loss(case):
    options, broken = CASES[case]
    ref_loss, ref_grad = trl_loss(options)
    loss, grad = our_loss(DpoSection(**options))
    tol = 1e-5 if "alpha" in case else 1e-6
    torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=tol, atol=1e-8)
    control_loss, control_grad = our_loss(DpoSection(**{**options, **broken}))
    assert not torch.allclose(control_grad, ref_grad, rtol=1e-4, atol=1e-7) or not torch.allclose(
        control_loss, ref_loss, rtol=1e-4
    )


def test_every_trl_loss_type_is_a_case():
    """The cases above cover TRL 1.16's loss types as its DPOConfig lists them (its help text), so a new one in
    a TRL upgrade fails here until it is built and tested."""
    from trl import DPOConfig

    help_text = DPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    trls = {
        kind.strip()
        for kind in help_text.split("Possible values are:")[1]
        .split(". If")[0]
        .replace("`", "")
        .replace("'", "")
        .split(",")
    }
    covered = set()
    for options, _ in CASES.values():
        kinds = options.get("loss_type", "sigmoid")
        covered |= {kinds} if isinstance(kinds, str) else set(kinds)
    assert len(trls) == 15 and trls == covered


def test_the_inputs_exercise_every_branch():
    """Guards the cases: LD-DPO's tail is non-empty on both sides, an equal-length pair has none, the margins
    are away from 0 with both signs, and aot's sorting reorders the pairs."""
    leaf, reference, _, mask = tables()
    plain = pair_logps(leaf.detach() * mask, mask)
    ref = pair_logps(reference, mask)
    margins = (plain.chosen - ref.chosen) - (plain.rejected - ref.rejected)
    assert (margins > 0.1).any() and (margins < -0.1).any()
    cut = pair_logps(leaf.detach() * mask, mask, ld_alpha=0.0)
    assert (cut.chosen != plain.chosen).any() and (cut.rejected != plain.rejected).any()
    assert cut.chosen[3] == plain.chosen[3] and cut.rejected[3] == plain.rejected[3]  # 4 and 4 tokens
    order = torch.argsort(plain.chosen - plain.rejected)
    assert not torch.equal(order, torch.argsort(ref.chosen - ref.rejected))


REFUSED = {  # TRL 1.16 refuses these when its trainer is built; moe-qlora refuses them when the config is read
    "f-divergence-on-a-ratio-loss": ({"loss_type": "bco_pair", "f_divergence_type": "js_divergence"}, "f-divergence"),
    "f-divergence-in-a-list": (
        {"loss_type": ["sigmoid", "nca_pair"], "f_divergence_type": "forward_kl"},
        "f-divergence",
    ),
    "weighting-sorted-pairs": ({"loss_type": "aot", "use_weighting": True}, "sorts the pairs"),
    "weighting-aot_unpaired": ({"loss_type": "aot_unpaired", "use_weighting": True}, "sorts the pairs"),
    "exo-without-smoothing": ({"loss_type": "exo_pair"}, "label_smoothing above 0"),
    "weights-of-the-wrong-length": ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}, "one each"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_trl_refuses_is_refused_for_the_same_reason(case):
    options, reason = REFUSED[case]
    assert trl_oracle.dpo_refusal(**options) is not None  # TRL's own check, so a TRL that lifts it fails here
    with pytest.raises(ValueError, match=reason):
        DpoSection(**options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"loss_type": "sigmoid_norm", "label_smoothing": 0.1}, "would ignore it"),
        ({"f_alpha_divergence_coef": 0.3}, "alpha_divergence's alpha"),
        ({"discopop_tau": 0.1}, "discopop's temperature"),
        ({"loss_type": "simpo", "ld_alpha": 0.5}, "no reference"),
        ({"loss_type": ["simpo", "sigmoid"]}, "each runs alone"),
        ({"loss_type": ["sigmoid", "sft"], "sft_weight": 0.5}, "same term"),
        ({"loss_type": ["sigmoid", "sft"], "use_weighting": True}, "one token mean"),
        ({"loss_type": "robust", "label_smoothing": 0.5}, "below 0.5"),
    ],
)
def test_options_trl_would_ignore_or_compute_wrongly_are_refused(options, message):
    """Beyond TRL's refusals: an option the chosen losses do not read (TRL ignores it silently), robust's
    division by 1 - 2e at e >= 0.5 (TRL only warns), and combinations moe-qlora does not define."""
    with pytest.raises(ValueError, match=message):
        DpoSection(**options)


def test_defaults_are_trl_1_16s():
    """Every shared key's default against DPOConfig's own (simpo's beta 2.0 and orpo's SFT weight 1 are those
    of SimPO's and ORPO's papers: TRL has them in other trainers)."""
    from trl import DPOConfig

    trl, d = trl_oracle.config(DPOConfig), DpoSection()
    ours = {
        "loss_type": d.loss_types,
        "loss_weights": d.loss_weights,
        "beta": d.beta,
        "label_smoothing": d.label_smoothing,
        "f_divergence_type": d.f_divergence_type,
        "ld_alpha": d.ld_alpha,
        "use_weighting": d.use_weighting,
        "f_alpha_divergence_coef": DpoSection(f_divergence_type="alpha_divergence").f_alpha_divergence_coef,
        "discopop_tau": DpoSection(loss_type="discopop").discopop_tau,
    }
    assert ours == {k: getattr(trl, k) for k in ours}
    assert (DpoSection(loss_type="simpo").beta, DpoSection(loss_type="orpo").nll_weight, d.nll_weight) == (2.0, 1.0, 0)
