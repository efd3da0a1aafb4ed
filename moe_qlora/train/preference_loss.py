"""The preference objectives of `moe-qlora dpo`, per pair, from the summed log-probabilities of each completion:
TRL 1.16's DPO loss types (several at once, weighted), its f-divergences, LD-DPO and WPO, and SimPO and ORPO.

With l_c, l_r the chosen and rejected completions' summed log-probabilities under the policy and r_c, r_r under
the reference, the log-ratios are u_c = l_c - r_c, u_r = l_r - r_r; the f-divergence turns each into a score
s = f'(exp u) (reverse KL: s = u; forward KL: 1 - exp(-u); Jensen-Shannon: log 2 + log s(u); alpha:
(exp((a - 1) u) - 1) / (a - 1)), and d = s_c - s_r. With n the completion's tokens and e = label_smoothing:
    sigmoid       -(1 - e) log s(beta d) - e log s(-beta d)              DPO (e > 0: conservative DPO)
    hinge         max(0, 1 - beta d)                                     SLiC
    ipo           (s_c / n_c - s_r / n_r - 1 / (2 beta))^2               IPO, on per-token means
    sigmoid_norm  -log s(beta (s_c / n_c - s_r / n_r))
    robust        (-(1 - e) log s(beta d) + e log s(-beta d)) / (1 - 2e)
    exo_pair      q log(q / (1 - e)) + (1 - q) log((1 - q) / e),  q = s(beta d)
    discopop      (1 - m) (-log s(beta d)) + m exp(-beta d),  m = s(beta d / tau)
    nca_pair      -log s(beta u_c) - log s(-beta u_c) / 2 - log s(-beta u_r) / 2
    bco_pair      -log s(beta u_c) - log s(-beta u_r)
    sppo_hard     (u_c - 1 / (2 beta))^2 + (u_r + 1 / (2 beta))^2
    apo_zero      1 - s(beta u_c) + s(beta u_r)
    apo_down      s(beta u_c) + 1 - s(beta (u_c - u_r))
    aot           sigmoid's form on sort(l_c - l_r) - sort(r_c - r_r), over the micro-batch's pairs
    aot_unpaired  sigmoid's form on sort(u_c) - sort(u_r)
Reference-free, on per-token means: simpo -log s(beta (l_c - l_r) - gamma) (smoothed as sigmoid); orpo
-beta log s(log odds(l_c) - log odds(l_r)), odds(l) = exp(l) / (1 - exp(l)).
A pair's loss is the weighted sum of its loss types' (TRL's loss_weights), times WPO's weight with use_weighting;
the step's loss is the mean over its pairs, plus sft_weight times the chosen completions' mean token NLL (TRL's
loss type sft; RPO; ORPO's SFT term). The implicit rewards are beta u (reference-free: beta l as the loss sees it).

LD-DPO (ld_alpha): a completion's summed log-probability counts its tokens past the shorter completion's length
ld_alpha times, in the policy and the reference alike. Both completions of a batch of pairs go through one
forward: [chosen rows; rejected rows], right-padded, through the chunked log-prob path (losses.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_qlora.config.preference import DpoSection
from moe_qlora.data.examples import collate
from moe_qlora.data.preference import PreferencePair
from moe_qlora.train.losses import token_logprobs


@dataclass(frozen=True)
class PairLogps:
    """Per pair (P,), fp32: each completion's summed token log-probability (LD-DPO's weighting applied) and its
    number of tokens; for the policy also the chosen completion's plain sum (the NLL's) and WPO's pair weight."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    chosen_plain: torch.Tensor | None = None
    wpo_weights: torch.Tensor | None = None

    def scored(self, averaged: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected): the sums, or the per-token means."""
        if not averaged:
            return self.chosen, self.rejected
        return self.chosen / self.chosen_tokens, self.rejected / self.rejected_tokens


def pair_logps(logp: torch.Tensor, mask: torch.Tensor, *, ld_alpha=None, log_sum_sq=None) -> PairLogps:
    """PairLogps from token log-probabilities of the [chosen; rejected] rows: logp (2P, T), 0 off the completion;
    mask (2P, T) the completion's tokens; log_sum_sq (2P, T): log sum_v p_v^2 at each token, for WPO's weights."""
    mask = mask.to(logp.dtype)
    counts, plain = mask.sum(dim=1), (logp * mask).sum(dim=1)
    n = logp.shape[0] // 2
    sums = plain
    if ld_alpha is not None:
        # A token's place in its completion; tokens past the pair's shorter completion count ld_alpha times.
        place = mask.cumsum(dim=1)
        shared = torch.minimum(counts[:n], counts[n:]).repeat(2)[:, None]
        tail = (place > shared).to(logp.dtype) * mask
        sums = plain - (1 - ld_alpha) * (logp * tail).sum(dim=1)
    weights = None
    if log_sum_sq is not None:
        with torch.no_grad():
            # WPO: exp of the mean over the completion of log(p_t / sum_v p_v^2), chosen times rejected.
            aligned = ((logp - log_sum_sq) * mask).sum(dim=1) / counts.clamp(min=1)
            weights = aligned[:n].exp() * aligned[n:].exp()
    return PairLogps(sums[:n], sums[n:], counts[:n], counts[n:], plain[:n], weights)


@dataclass(frozen=True)
class PairTerms:
    """Per pair (P,): the loss (differentiable), the implicit rewards and, for orpo, the log odds ratio
    (detached)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    log_odds: torch.Tensor | None = None


@dataclass(frozen=True)
class Margins:
    """What the reference loss types are computed from, per pair (P,): the log-ratios to the reference u, their
    f-divergence scores s, the completions' token counts n, and the policy's and reference's sums l and r."""

    chosen_ratio: torch.Tensor
    rejected_ratio: torch.Tensor
    chosen_score: torch.Tensor
    rejected_score: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    policy: PairLogps
    reference: PairLogps

    @property
    def delta(self) -> torch.Tensor:
        return self.chosen_score - self.rejected_score

    @property
    def mean_delta(self) -> torch.Tensor:
        """The scores' difference as per-token means (ipo, sigmoid_norm)."""
        return self.chosen_score / self.chosen_tokens.clamp(min=1) - self.rejected_score / self.rejected_tokens.clamp(
            min=1
        )


def divergence_score(log_ratio: torch.Tensor, d: DpoSection) -> torch.Tensor:
    """f'(exp u) for the f-divergence of d (f-DPO): the score a log-ratio u to the reference enters the loss as."""
    kind = d.f_divergence_type
    if kind == "reverse_kl":
        return log_ratio
    if kind == "forward_kl":
        return 1 - torch.exp(-log_ratio)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(log_ratio)
    alpha = d.f_alpha_divergence_coef
    if abs(alpha - 1.0) < 1e-6:  # the limit alpha -> 1 is reverse KL
        return log_ratio
    # exp clamped at 80 so it stays finite in fp32 (as TRL does)
    return (torch.exp(((alpha - 1.0) * log_ratio).clamp(max=80.0)) - 1.0) / (alpha - 1.0)


def smoothed_sigmoid(x: torch.Tensor, e: float) -> torch.Tensor:
    """-(1 - e) log s(x) - e log s(-x): DPO's loss on a scaled margin x, with a share e of flipped labels."""
    if not e:
        return -F.logsigmoid(x)
    return -(1 - e) * F.logsigmoid(x) - e * F.logsigmoid(-x)


def reference_pair_loss(kind: str, m: Margins, d: DpoSection) -> torch.Tensor:
    """One reference loss type's loss per pair (P,)."""
    beta, e = d.beta, d.label_smoothing
    if kind == "sigmoid":
        return smoothed_sigmoid(beta * m.delta, e)
    if kind == "hinge":
        return torch.relu(1 - beta * m.delta)
    if kind == "ipo":
        return (m.mean_delta - 1 / (2 * beta)) ** 2
    if kind == "sigmoid_norm":
        return -F.logsigmoid(beta * m.mean_delta)
    if kind == "robust":
        return (-(1 - e) * F.logsigmoid(beta * m.delta) + e * F.logsigmoid(-beta * m.delta)) / (1 - 2 * e)
    if kind == "exo_pair":
        x = beta * m.delta
        return torch.sigmoid(x) * (F.logsigmoid(x) - math.log1p(-e)) + torch.sigmoid(-x) * (
            F.logsigmoid(-x) - math.log(e)
        )
    if kind == "discopop":
        x = beta * m.delta
        mix = torch.sigmoid(x / d.discopop_tau)
        return -F.logsigmoid(x) * (1 - mix) + torch.exp(-x) * mix
    return ratio_pair_loss(kind, m, d)


def ratio_pair_loss(kind: str, m: Margins, d: DpoSection) -> torch.Tensor:
    """The loss types on the two log-ratios separately, or on sorted margins (reverse KL only)."""
    beta, e = d.beta, d.label_smoothing
    chosen, rejected = beta * m.chosen_ratio, beta * m.rejected_ratio
    if kind == "nca_pair":
        return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)
    if kind == "bco_pair":
        return -F.logsigmoid(chosen) - F.logsigmoid(-rejected)
    if kind == "sppo_hard":
        return (m.chosen_ratio - 0.5 / beta) ** 2 + (m.rejected_ratio + 0.5 / beta) ** 2
    if kind == "apo_zero":
        return 1 - torch.sigmoid(chosen) + torch.sigmoid(rejected)
    if kind == "apo_down":
        return torch.sigmoid(chosen) + 1 - torch.sigmoid(beta * (m.chosen_ratio - m.rejected_ratio))
    if kind == "aot":
        policy, ref = m.policy.chosen - m.policy.rejected, m.reference.chosen - m.reference.rejected
        delta = torch.sort(policy, dim=0).values - torch.sort(ref, dim=0).values
        return -F.logsigmoid(beta * delta) * (1 - e) - F.logsigmoid(-beta * delta) * e
    if kind == "aot_unpaired":
        delta = torch.sort(m.chosen_ratio, dim=0).values - torch.sort(m.rejected_ratio, dim=0).values
        return -F.logsigmoid(beta * delta) * (1 - e) - F.logsigmoid(-beta * delta) * e
    raise ValueError(f"unknown DPO loss type {kind!r}")


def preference_losses(policy: PairLogps, reference: PairLogps | None, d: DpoSection) -> PairTerms:
    """Each pair's loss under d's loss types and its rewards; `reference` is None for simpo and orpo. The
    rewards are TRL's: beta times the summed log-ratios, or beta times the policy's log-probabilities as the loss
    sees them (reference-free)."""
    if not d.uses_reference:
        return reference_free_losses(policy, d)
    chosen_ratio, rejected_ratio = policy.chosen - reference.chosen, policy.rejected - reference.rejected
    m = Margins(
        chosen_ratio,
        rejected_ratio,
        divergence_score(chosen_ratio, d),
        divergence_score(rejected_ratio, d),
        policy.chosen_tokens,
        policy.rejected_tokens,
        policy,
        reference,
    )
    losses = torch.zeros_like(chosen_ratio)
    for kind, weight in d.pair_losses:
        losses = losses + weight * reference_pair_loss(kind, m, d)
    if d.use_weighting:
        losses = losses * policy.wpo_weights
    return PairTerms(losses, d.beta * chosen_ratio.detach(), d.beta * rejected_ratio.detach())


def reference_free_losses(policy: PairLogps, d: DpoSection) -> PairTerms:
    """simpo's and orpo's losses per pair, on the per-token mean log-probabilities."""
    chosen, rejected = policy.scored(averaged=True)
    beta = d.beta
    rewards = (beta * chosen).detach(), (beta * rejected).detach()
    if d.reference_free == "simpo":
        margin = chosen - rejected - d.simpo_gamma / beta
        return PairTerms(smoothed_sigmoid(beta * margin, d.label_smoothing), *rewards)
    odds = log_odds(chosen) - log_odds(rejected)
    return PairTerms(-beta * F.logsigmoid(odds), *rewards, odds.detach())


def log_odds(logp: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) from log p < 0: log p - log(1 - exp(log p)), with expm1 (exact near p = 0 and p = 1;
    log p is clamped just below 0, where the odds are infinite)."""
    logp = logp.clamp(max=-1e-7)
    return logp - torch.log(-torch.expm1(logp))


def pair_statistics(terms: PairTerms, policy: PairLogps) -> dict[str, float]:
    """Sums over the pairs of what TRL logs per step as means: the rewards, their margin and accuracy (a tie
    counts as wrong), the policy's summed log-probabilities of each completion, and orpo's log odds."""
    chosen, rejected = terms.chosen_rewards, terms.rejected_rewards
    sums = {
        "rewards/chosen": chosen.sum(),
        "rewards/rejected": rejected.sum(),
        "rewards/margins": (chosen - rejected).sum(),
        "rewards/accuracies": (chosen > rejected).sum(),
        "logps/chosen": policy.chosen.detach().sum(),
        "logps/rejected": policy.rejected.detach().sum(),
    }
    if terms.log_odds is not None:
        sums.update(log_odds_ratio=F.logsigmoid(terms.log_odds).sum(), log_odds_chosen=terms.log_odds.sum())
    if policy.wpo_weights is not None:
        sums["wpo_weight"] = policy.wpo_weights.sum()
    return {k: float(v) for k, v in sums.items()}


def pair_forward(
    model, pairs: list[PreferencePair], pad_id: int, *, chunk: int, ld_alpha=None, wpo=False, router_logits=False
):
    """One forward of the chosen and the rejected rows of `pairs` together (2P rows): their PairLogps (LD-DPO's
    weighting with ld_alpha, WPO's weights with wpo) and the model's MoE auxiliary loss (a differentiable scalar,
    or None unless `router_logits` and the family has one)."""
    device = next(model.parameters()).device
    batch = collate([p.chosen for p in pairs] + [p.rejected for p in pairs], pad_id)
    batch = {k: v.to(device) for k, v in batch.items() if k != "weights"}
    extra = {"output_router_logits": True} if router_logits else {}
    logp, mask, out = token_logprobs(model, batch, chunk=chunk, sum_sq=wpo, **extra)
    logps = pair_logps(logp, mask, ld_alpha=ld_alpha, log_sum_sq=out.token_log_sum_sq if wpo else None)
    return logps, getattr(out, "aux_loss", None) if router_logits else None
