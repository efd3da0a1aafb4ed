"""The preference objectives of `moe-qlora dpo`, per pair, from the summed log-probabilities of each completion.

With l_c, l_r the chosen and rejected completions' log-probabilities (sums over their tokens, or per-token means
for ipo, simpo and orpo) under the policy, and r_c, r_r under the reference, the margin is
    m = (l_c - r_c) - (l_r - r_r),          (simpo: m = l_c - l_r - gamma / beta, no reference)
    sigmoid  -(1 - e) log s(beta m) - e log s(-beta m)                  DPO; e = label_smoothing (cDPO)
    robust   (-(1 - e) log s(beta m) + e log s(-beta m)) / (1 - 2e)     unbiased under label noise e
    hinge    max(0, 1 - beta m)
    ipo      (m - 1 / (2 beta))^2
    simpo    as sigmoid, on simpo's margin
    orpo     -beta log s(log odds(l_c) - log odds(l_r)),  odds(l) = exp(l) / (1 - exp(l))
and the implicit rewards are beta (l - r) on the sums (reference-free: beta l). The step's loss is the mean
over its pairs, plus sft_weight times the chosen completions' mean token NLL (RPO; ORPO's SFT term).

Both completions of a batch of pairs go through one forward: [chosen rows; rejected rows], right-padded, through
the chunked log-prob path (losses.py), never the whole logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_qlora.config.preference import DpoSection
from moe_qlora.data.examples import collate
from moe_qlora.data.preference import PreferencePair
from moe_qlora.train.losses import token_logprobs


@dataclass(frozen=True)
class PairLogps:
    """Per pair (P,), fp32: each completion's summed token log-probability and its number of tokens."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    def scored(self, averaged: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected): the sums, or the per-token means."""
        if not averaged:
            return self.chosen, self.rejected
        return self.chosen / self.chosen_tokens, self.rejected / self.rejected_tokens


@dataclass(frozen=True)
class PairTerms:
    """Per pair (P,): the loss (differentiable), the implicit rewards and, for orpo, the log odds ratio
    (detached)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    log_odds: torch.Tensor | None = None


def preference_losses(policy: PairLogps, reference: PairLogps | None, d: DpoSection) -> PairTerms:
    """Each pair's loss under `d.loss_type` and its rewards; `reference` is None for simpo and orpo. The rewards
    are TRL's: beta times the summed log-ratios (ipo too), or beta times the policy's log-probabilities as the
    loss sees them (reference-free)."""
    chosen, rejected = policy.scored(d.length_averaged)
    beta, e = d.beta, d.label_smoothing
    if d.uses_reference:
        ref_chosen, ref_rejected = reference.scored(d.length_averaged)
        margin = (chosen - ref_chosen) - (rejected - ref_rejected)
        rewards = beta * (policy.chosen - reference.chosen), beta * (policy.rejected - reference.rejected)
    else:
        margin, rewards = chosen - rejected, (beta * chosen, beta * rejected)
    odds = None
    if d.loss_type in ("sigmoid", "simpo"):
        if d.loss_type == "simpo":
            margin = margin - d.simpo_gamma / beta
        losses = -(1 - e) * F.logsigmoid(beta * margin) - e * F.logsigmoid(-beta * margin)
    elif d.loss_type == "robust":
        losses = (-(1 - e) * F.logsigmoid(beta * margin) + e * F.logsigmoid(-beta * margin)) / (1 - 2 * e)
    elif d.loss_type == "hinge":
        losses = torch.relu(1 - beta * margin)
    elif d.loss_type == "ipo":
        losses = (margin - 1 / (2 * beta)) ** 2
    else:  # orpo
        odds = log_odds(chosen) - log_odds(rejected)
        losses = -beta * F.logsigmoid(odds)
    detached = None if odds is None else odds.detach()
    return PairTerms(losses, rewards[0].detach(), rewards[1].detach(), detached)


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
    return {k: float(v) for k, v in sums.items()}


def pair_forward(model, pairs: list[PreferencePair], pad_id: int, *, chunk: int, router_logits: bool = False):
    """One forward of the chosen and the rejected rows of `pairs` together (2P rows): their PairLogps and the
    model's MoE auxiliary loss (a differentiable scalar, or None unless `router_logits` and the family has one)."""
    device = next(model.parameters()).device
    batch = collate([p.chosen for p in pairs] + [p.rejected for p in pairs], pad_id)
    batch = {k: v.to(device) for k, v in batch.items() if k != "weights"}
    extra = {"output_router_logits": True} if router_logits else {}
    logp, mask, out = token_logprobs(model, batch, chunk=chunk, **extra)
    sums, counts = logp.sum(dim=1), mask.sum(dim=1).to(torch.float32)
    n = len(pairs)
    logps = PairLogps(sums[:n], sums[n:], counts[:n], counts[n:])
    return logps, getattr(out, "aux_loss", None) if router_logits else None
