"""GRPO's objectives and options at parity with TRL 1.16's GRPOTrainer: loss types cispo, sapo, luspo and vespo,
delta, use_bias_correction_kl (on by default in 1.16), the off-policy mask, the entropy quantile and bonus (a
per-micro-batch mean in 1.16, for every loss type), scale_rewards, multi_objective_aggregation and rewards that
abstain (None).

The oracle is TRL's own code: GRPOTrainer._compute_loss of the installed trl (1.16.0, pinned in the test extra),
called on the same log-prob tables, advantages and masks (helpers.trl_oracle), one micro-batch at a time with
its gradient accumulation, against moe-qlora's micro-batch losses summed over the same split. Inputs are random,
with rows of length 1, a fully masked row, a row of advantage 0 and a policy that has moved since sampling
(ratios away from 1). Tolerance: 1e-6 relative, fp32 sums of ~30 terms in another order. Each case names a broken
control: the same config with one option changed on our side, which must not match (so the comparison can fail).
A TRL upgrade that changes a formula fails these tests.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_qlora.config.grpo import GrpoSection
from moe_qlora.train.grpo import BatchTotals, micro_batch_loss, rows_to_run, split_matters
from moe_qlora.train.grpo_loss import Objective
from moe_qlora.train.losses import ChunkedTokenLogProbsAndEntropy, completion_logprobs_and_entropy
from moe_qlora.train.rewards import RewardFunction, batch_moments, group_advantages, rollout_advantages, score

from helpers import trl_oracle

ROWS, TOKENS, MICRO = 6, 5, 3  # two micro-batches of three rows
LENGTHS = [5, 1, 0, 3, 5, 2]  # a row of one token, a fully masked row
MAX_NEW = 6


def section(**options) -> GrpoSection:
    return GrpoSection(rewards=[{"function": "exact_match"}], max_new_tokens=MAX_NEW, **options)


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(TOKENS)[None, :] < torch.tensor(LENGTHS)[:, None]
    logp = (-torch.rand(ROWS, TOKENS, generator=g) * 3).requires_grad_()
    old = logp.detach() + 0.4 * torch.randn(ROWS, TOKENS, generator=g)  # the policy moved since sampling
    ref = logp.detach() + 0.3 * torch.randn(ROWS, TOKENS, generator=g)
    adv = torch.randn(ROWS, generator=g)
    adv[4] = 0.0  # a group whose rewards were all equal
    adv[0] = -abs(adv[0])
    old[0] = logp.detach()[0] - 0.8  # a completion now 2.2x likelier, advantage negative: where delta caps
    entropies = (torch.rand(ROWS, TOKENS, generator=g) * 4).requires_grad_()
    return logp, old, ref, adv, mask, entropies


# ------------------------------------------------------------------------------------------ TRL's own loss


def trl_options(g: GrpoSection, options: dict) -> dict:
    """GRPOConfig keys for a case: the options the case sets, in TRL's names, and the defaults moe-qlora keeps
    apart on purpose passed explicitly (the completion budget, and clip_eps_high: 0.28 with dapo, cispo's cap 5)."""
    names = {"kl_coef": "beta", "clip_eps": "epsilon"}
    config = {names.get(k, k): v for k, v in options.items() if k != "clip_eps_high"}
    return {**config, "epsilon_high": g.clip_eps_high, "max_completion_length": g.max_new_tokens}


def trl_loss(g: GrpoSection, options: dict):
    """TRL 1.16's GRPOTrainer._compute_loss over the micro-batches, gradients accumulated as its Trainer does."""
    logp, old, ref, adv, mask, ent = inputs()
    trainer = trl_oracle.grpo_trainer(ROWS // MICRO, **trl_options(g, options))
    n_glob = int(mask.sum())
    total = sum(
        trl_oracle.grpo_micro_loss(trainer, *part, batch_tokens=n_glob)
        for part in split(logp, old, ref, adv, mask, ent)
    )
    total.backward()
    return total.detach(), logp.grad, ent.grad


def split(*tensors):
    return [[t[i : i + MICRO] for t in tensors] for i in range(0, ROWS, MICRO)]


def our_loss(g: GrpoSection):
    logp, old, ref, adv, mask, ent = inputs()
    total = 0.0
    for lp, o, r, a, m, e in split(logp, old, ref, adv, mask, ent):
        frozen, totals = (o, r if g.kl_coef else None), BatchTotals(int(mask.sum()), ROWS, ROWS // MICRO)
        loss, _ = micro_batch_loss((lp * m, m, e), frozen, a, g, Objective.of(g), totals)
        total = total + loss
    total.backward()
    return total.detach(), logp.grad, ent.grad


CASES = {  # id: (options, the broken control's change)
    "dapo": ({}, {"loss_type": "grpo"}),
    "grpo": ({"loss_type": "grpo"}, {"loss_type": "dapo"}),
    "dr_grpo": ({"loss_type": "dr_grpo"}, {"loss_type": "dapo"}),
    "bnpo": ({"loss_type": "bnpo"}, {"loss_type": "dapo"}),
    "cispo": ({"loss_type": "cispo", "clip_eps_high": 1.1}, {"clip_eps_high": 3.0}),
    "cispo-default-cap": ({"loss_type": "cispo"}, {"clip_eps_high": 0.2}),
    "sapo": ({"loss_type": "sapo"}, {"sapo_temperature_neg": 2.0}),
    "luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, {"loss_type": "grpo"}),
    "luspo-token": ({"loss_type": "luspo"}, {"importance_sampling_level": "sequence"}),
    "luspo-kl-quantile": (
        {"loss_type": "luspo", "importance_sampling_level": "sequence", "kl_coef": 0.1, "top_entropy_quantile": 0.4},
        {"top_entropy_quantile": 1.0},
    ),
    "vespo": ({"loss_type": "vespo"}, {"vespo_k_neg": 1.0}),
    "vespo-sequence-kl": (
        {"loss_type": "vespo", "importance_sampling_level": "sequence", "kl_coef": 0.1},
        {"importance_sampling_level": "token"},
    ),
    "gspo": ({"loss_type": "grpo", "importance_sampling_level": "sequence"}, {"importance_sampling_level": "token"}),
    "delta": ({"delta": 1.5}, {"delta": None}),
    "delta-grpo-sequence": (
        {"loss_type": "grpo", "delta": 1.4, "importance_sampling_level": "sequence"},
        {"delta": None},
    ),
    "kl": ({"kl_coef": 0.1}, {"kl_coef": 0.2}),
    "kl-default-is-bias-corrected": ({"kl_coef": 0.1}, {"use_bias_correction_kl": False}),
    "kl-not-bias-corrected": ({"kl_coef": 0.1, "use_bias_correction_kl": False}, {"use_bias_correction_kl": True}),
    "kl-bias-corrected": ({"kl_coef": 0.1, "use_bias_correction_kl": True}, {"kl_coef": 0.2}),
    "kl-bias-corrected-sequence": (
        {"kl_coef": 0.1, "use_bias_correction_kl": True, "loss_type": "grpo", "importance_sampling_level": "sequence"},
        {"use_bias_correction_kl": False},
    ),
    "off-policy-mask": ({"off_policy_mask_threshold": 0.05}, {"off_policy_mask_threshold": None}),
    "entropy-quantile": ({"top_entropy_quantile": 0.4}, {"top_entropy_quantile": 1.0}),
    "entropy-quantile-grpo-kl": (
        {"loss_type": "grpo", "top_entropy_quantile": 0.4, "kl_coef": 0.1},
        {"top_entropy_quantile": 1.0},
    ),
    "entropy-bonus": ({"entropy_coef": 0.05}, {"entropy_coef": 0.0}),
    "entropy-bonus-grpo-quantile": (
        {"loss_type": "grpo", "entropy_coef": 0.05, "top_entropy_quantile": 0.4},
        {"entropy_coef": 0.0},
    ),
    "entropy-bonus-dapo-quantile": ({"entropy_coef": 0.05, "top_entropy_quantile": 0.4}, {"entropy_coef": 0.0}),
    "entropy-bonus-cispo": ({"loss_type": "cispo", "entropy_coef": 0.05}, {"entropy_coef": 0.1}),
    "entropy-bonus-vespo-quantile": (
        {"loss_type": "vespo", "entropy_coef": 0.05, "top_entropy_quantile": 0.4},
        {"top_entropy_quantile": 1.0},
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradients_match_trls_compute_loss(case):
    options, broken = CASES[case]
    g = section(**options)
    loss, grad, ent_grad = our_loss(g)
    ref_loss, ref_grad, ref_ent_grad = trl_loss(g, options)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7)
    if g.entropy_coef:
        torch.testing.assert_close(ent_grad, ref_ent_grad, rtol=1e-6, atol=1e-7)
    # the broken control: one option changed on our side, and the two must part
    control_loss, control_grad, _ = our_loss(section(**{**options, **broken}))
    assert not torch.allclose(control_grad, ref_grad, rtol=1e-4, atol=1e-6) or not torch.allclose(
        control_loss, ref_loss, rtol=1e-4
    )


def test_the_inputs_exercise_every_branch():
    """Guards the cases above: clipping at both ends, delta, the off-policy mask and the quantile all act on
    these inputs (else a case could pass with its option doing nothing)."""
    logp, old, _, adv, mask, ent = inputs()
    ratio = torch.exp(logp.detach() - old)
    assert (ratio[mask] > 1.5).any() and (ratio[mask] < 0.8).any()
    assert ((ratio > 1.5) & mask & (adv[:, None] < 0)).any()  # delta acts
    seq_kl = ((old - logp.detach()) * mask).sum(1) / mask.sum(1).clamp(min=1)
    assert ((adv < 0) & (seq_kl > 0.05)).any() and ((adv < 0) & (seq_kl <= 0.05)).any()
    assert (adv == 0).any() and (mask.sum(1) == 1).any() and (mask.sum(1) == 0).any()


def test_rows_keep_their_place_in_the_split_where_it_matters():
    """The quantile and the bonus are per micro-batch in TRL, zero-advantage rows included: every row runs."""
    from moe_qlora.data.examples import IGNORE, Example

    rows = [Example([1, 2, 3], [IGNORE, 2, 3], "a", 0.0), Example([1, 2], [IGNORE, 2], "b", 1.0)]
    assert rows_to_run(rows, "dapo", 0.0) == [1]  # control: a zero row leaves when the split does not matter
    for options in ({"top_entropy_quantile": 0.2}, {"entropy_coef": 0.01}, {"loss_type": "bnpo"}):
        g = section(**options)
        assert split_matters(g) and rows_to_run(rows, g.loss_type, 0.0, whole_split=split_matters(g)) == [0, 1]


# ------------------------------------------------------------------------------ the entropy through the head


def test_chunked_logprobs_and_entropy_match_autograd_on_full_logits():
    """The chunked head's log p(target) and entropy, and both gradients, against autograd on the full softmax
    (fp32; 1e-5: logsumexp in another order). Control: the wrong temperature must not match."""
    g = torch.Generator().manual_seed(0)
    n, h, v, scale = 11, 8, 37, 1 / 0.7
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight, targets = torch.randn(v, h, generator=g), torch.randint(0, v, (n,), generator=g)
    g_logp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)

    def reference(s):
        q = torch.log_softmax((hidden @ weight.t()) * s, dim=1)
        return q.gather(1, targets[:, None]).squeeze(1), -(q.exp() * q).sum(1)

    logp, ent = ChunkedTokenLogProbsAndEntropy.apply(hidden, weight, None, targets, scale, 4)
    (grad,) = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), hidden)
    ref_logp, ref_ent = reference(scale)
    (ref_grad,) = torch.autograd.grad((ref_logp * g_logp).sum() + (ref_ent * g_ent).sum(), hidden)
    for ours, theirs in ((logp, ref_logp), (ent, ref_ent), (grad, ref_grad)):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ent, reference(1.0)[1], atol=1e-3)


def test_a_model_gives_the_same_entropy_chunked_and_whole(tiny_policy):
    model, batch = tiny_policy
    whole = completion_logprobs_and_entropy(model, batch, 0.8, chunk=0)
    chunked = completion_logprobs_and_entropy(model, batch, 0.8, chunk=16)
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=1e-4)
    assert (whole[2][whole[1]] > 0).all()


@pytest.fixture(scope="module")
def tiny_policy():
    from moe_qlora.model.loading import LoadOptions, load_model
    from moe_qlora.model.model_path import ensure_tiny

    model = load_model(LoadOptions(str(ensure_tiny("mixtral"))))
    ids = torch.randint(5, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :10] = -100
    return model, {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


# ----------------------------------------------------------------------------------- rewards and advantages


def trl_advantages(per_fn: torch.Tensor, weights: torch.Tensor, group: int, scale: str, aggregation: str):
    """TRL 1.16's advantages from rewards_per_func (N, K) with NaN for None, as _generate_and_score_completions
    computes them (written out: it is not callable without generating), with TRL's own nanstd."""
    from trl.trainer.utils import nanstd

    unscorable = torch.isnan(per_fn).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (per_fn * weights[None]).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, group), dim=1).repeat_interleave(group)
        if scale in ("group", "none"):
            std = torch.stack([nanstd(r) for r in rewards.view(-1, group)]).repeat_interleave(group)
        else:
            std = nanstd(rewards).expand_as(rewards)
        advantages = rewards - mean
        if scale != "none":
            advantages = advantages / (std + 1e-4)
    else:
        grouped = per_fn.view(-1, group, per_fn.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = torch.stack(
            [torch.stack([nanstd(grouped[i, :, k]) for k in range(grouped.shape[2])]) for i in range(grouped.shape[0])]
        )[:, None, :]
        reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, per_fn.shape[1])
        rewards = (reward_k * weights[None]).nansum(dim=1)
        rewards[unscorable] = torch.nan
        advantages = (rewards - torch.nanmean(rewards)) / (nanstd(rewards) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


NAN = math.nan
PER_FN = {  # three groups of four; None (NaN) for samples a function does not score
    "format": [1.0, 0.0, NAN, 1.0, 0.5, 0.5, 0.5, 0.5, NAN, 1.0, 0.0, 0.25],
    "answer": [0.0, 1.0, NAN, 2.0, 1.0, NAN, 3.0, 0.0, NAN, 0.5, 0.5, NAN],
}
WEIGHTS = {"format": 0.5, "answer": 2.0}


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_advantages_match_trls_with_rewards_that_abstain(scale, aggregation):
    g = section(scale_rewards=scale, multi_objective_aggregation=aggregation)
    per_fn = torch.tensor([PER_FN["format"], PER_FN["answer"]]).t()
    expected = trl_advantages(per_fn, torch.tensor([0.5, 2.0]), 4, scale, aggregation)
    functions = [
        RewardFunction(name, lambda p, c, vals=vals, **k: [None if math.isnan(v) else v for v in vals], w, {})
        for (name, vals), w in zip(PER_FN.items(), WEIGHTS.values(), strict=True)
    ]
    totals, scored, errors = score(functions, ["p"] * 12, ["c"] * 12, {})
    assert errors == 0 and math.isnan(totals[2]) and math.isnan(totals[8])  # no function scored them
    ours = rollout_advantages(totals, scored, [4, 4, 4], g, WEIGHTS)
    torch.testing.assert_close(ours.double(), expected.double(), rtol=1e-5, atol=1e-6)
    assert ours[2] == 0 and ours[8] == 0
    # broken control: scoring None as 0 (what moe-qlora did before) moves the advantages
    zeros = {k: [0.0 if math.isnan(v) else v for v in vals] for k, vals in scored.items()}
    as_zero = rollout_advantages(
        [sum(WEIGHTS[k] * zeros[k][i] for k in zeros) for i in range(12)], zeros, [4, 4, 4], g, WEIGHTS
    )
    assert not torch.allclose(as_zero.double(), expected.double(), atol=1e-3)


def test_scale_rewards_takes_trls_old_booleans_and_batch_uses_the_whole_batchs_std():
    assert section(scale_rewards=True).scale_rewards == "group"
    assert section(scale_rewards=False).scale_rewards == "none"
    r = torch.tensor([1.0, 2.0, 3.0, 10.0, 30.0, 20.0], dtype=torch.float64)
    mean, std = batch_moments(r)
    assert mean == pytest.approx(11.0) and std == pytest.approx(float(r.std(unbiased=True)))
    batch = group_advantages(r, [3, 3], scale="batch", eps=1e-4, batch_std=std)
    group = group_advantages(r, [3, 3], scale="group", eps=1e-4)
    torch.testing.assert_close(batch[:3].double(), torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64) / (std + 1e-4))
    assert not torch.allclose(batch, group)  # control: the group's std gives other advantages


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"delta": 1.2}, r"must be above 1 \+ clip_eps_high"),
        ({"loss_type": "sapo", "delta": 2.0}, "has none"),
        ({"use_bias_correction_kl": True}, "kl_coef: 0"),
        ({"top_entropy_quantile": 0.0}, "greater than 0"),
    ],
)
def test_options_an_objective_would_ignore_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        section(**options)


def test_defaults_are_trl_1_16s_but_the_kept_differences():
    """Every objective key's default against GRPOConfig's own, but those docs/training.md names as kept apart:
    the upper clip (0.28 with dapo; cispo's cap 5, TRL falls back to epsilon 0.2), the group size and the
    completion budget."""
    from trl import GRPOConfig

    trl = trl_oracle.config(GRPOConfig)
    g, with_kl = section(), section(kl_coef=0.1)
    same_name = (
        "loss_type",
        "scale_rewards",
        "multi_objective_aggregation",
        "delta",
        "off_policy_mask_threshold",
        "top_entropy_quantile",
        "entropy_coef",
        "importance_sampling_level",
        "mask_truncated_completions",
        "temperature",
        "top_p",
        "sapo_temperature_pos",
        "sapo_temperature_neg",
        "vespo_k_pos",
        "vespo_lambda_pos",
        "vespo_k_neg",
        "vespo_lambda_neg",
    )
    ours = {k: getattr(g, k) for k in same_name}
    ours.update(beta=g.kl_coef, epsilon=g.clip_eps, num_iterations=g.passes)
    ours["use_bias_correction_kl"] = with_kl.use_bias_correction_kl
    assert ours == {k: getattr(trl, k) for k in ours}
    assert g.use_bias_correction_kl is False  # no KL term to correct
    assert (trl.epsilon_high, g.clip_eps_high, section(loss_type="cispo").clip_eps_high) == (None, 0.28, 5.0)
    budget = GrpoSection.model_fields["max_new_tokens"].default
    assert (g.group_size, trl.num_generations, budget, trl.max_completion_length) == (4, 8, 32, 512)


def test_settings_trl_warns_about_are_computed_with_its_note():
    """luspo at the token level and vespo at the sequence level are computed as TRL 1.16 computes them (the
    cases above); moe-qlora prints TRL's advice beside them, and none for the papers' setups."""
    assert "importance_sampling_level: sequence" in " ".join(section(loss_type="luspo").advice())
    assert "KL" in " ".join(section(loss_type="vespo", importance_sampling_level="sequence").advice())
    assert "length" in " ".join(section(importance_sampling_level="sequence").advice())  # dapo
    assert section(loss_type="luspo", importance_sampling_level="sequence").advice() == []
    assert section(loss_type="grpo", importance_sampling_level="sequence").advice() == []
