"""GRPO's objective on a micro-batch's token log-probabilities, in TRL's terms: the normalisation of each loss type
(token_weights), the policy term of each loss type (clipped ratio, CISPO, SAPO, VESPO...), per-token or
per-sequence importance sampling, the off-policy mask, the top-entropy mask, the k3 KL to the reference and the
entropy bonus.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Loss types whose token losses are summed over the whole rollout batch's completion tokens (TRL: divided by the
# generation batch's token count), and those averaged per completion first.
TOKEN_MEAN_TYPES = ("dapo", "cispo", "vespo")
SEQUENCE_MEAN_TYPES = ("grpo", "sapo")
# Loss types with PPO's clipped surrogate (and so `delta`); the others weight log pi by a detached factor
# (cispo, vespo) or a soft gate (sapo).
CLIPPED_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def token_weights(
    mask: torch.Tensor,
    loss_type: str,
    *,
    total_tokens: int,
    total_sequences: int,
    max_new_tokens: int = 0,
    micro_batches: int = 1,
) -> torch.Tensor:
    """Each completion token's share of the rollout batch's loss, as TRL's loss types define it. mask: (B, T).

    dapo, cispo, vespo: 1 / (completion tokens of the whole batch); grpo, sapo: 1 / (tokens of its completion *
    completions of the batch); dr_grpo: 1 / (completions * max_new_tokens), a constant, so long completions are
    not discounted; bnpo: 1 / (completion tokens of this micro-batch * micro-batches), which depends on how the
    batch is split, as in TRL; luspo: 1 / completions, so a completion's (sequence-level) loss counts once per
    token, i.e. times its length (LUSPO). Totals are over the whole rollout batch: except for bnpo, splitting it
    into micro-batches does not change the gradient."""
    mask = mask.float()
    if loss_type in TOKEN_MEAN_TYPES:
        return mask / total_tokens
    if loss_type in SEQUENCE_MEAN_TYPES:
        return mask / (mask.sum(dim=1, keepdim=True).clamp(min=1) * total_sequences)
    if loss_type == "dr_grpo":
        return mask / (total_sequences * max_new_tokens)
    if loss_type == "bnpo":
        return mask / (mask.sum().clamp(min=1) * micro_batches)
    if loss_type == "luspo":
        return mask / total_sequences
    raise ValueError(f"unknown loss_type {loss_type!r}")


def entropy_weights(mask: torch.Tensor, *, micro_batches: int) -> torch.Tensor:
    """Each kept token's share of the entropy bonus, as TRL 1.16 normalises it for every loss type: this
    micro-batch's mean entropy over the tokens the bonus covers, averaged over the step's micro-batches (TRL:
    divided by the gradient accumulation steps). The bonus is a mean token entropy, whatever the policy term's
    normaliser. mask: (B, T), the completion tokens the bonus covers (the top-entropy tokens under
    top_entropy_quantile)."""
    mask = mask.float()
    return mask / (mask.sum().clamp(min=1) * micro_batches)


def log_ratios(logp, old, weights, level: str) -> torch.Tensor:
    """log(pi / pi_old) per token (B, T); at the sequence level (GSPO) each completion's tokens share its mean
    log-ratio over its own tokens, so the ratio is the length-normalised sequence likelihood ratio."""
    log_ratio = logp - old
    if level == "token":
        return log_ratio
    mask = (weights != 0).to(logp)
    per_sequence = (log_ratio * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    return per_sequence.expand_as(logp)


@dataclass(frozen=True)
class PolicyTerm:
    """The loss type's per-token policy term and its knobs (grpo section keys, TRL's names)."""

    loss_type: str = "dapo"
    clip_eps: float = 0.2
    clip_eps_high: float = 0.2  # cispo: the absolute cap of its importance weight
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    @classmethod
    def of(cls, g) -> PolicyTerm:
        """From a GrpoSection."""
        return cls(
            g.loss_type,
            g.clip_eps,
            g.clip_eps_high or g.clip_eps,
            g.delta,
            g.sapo_temperature_pos,
            g.sapo_temperature_neg,
            g.vespo_k_pos,
            g.vespo_lambda_pos,
            g.vespo_k_neg,
            g.vespo_lambda_neg,
        )


def vespo_weights(log_ratio: torch.Tensor, mask: torch.Tensor, a: torch.Tensor, term: PolicyTerm) -> torch.Tensor:
    """VESPO's per-completion weight phi(W) = W^k exp(lambda (1 - W)), W the sequence's likelihood ratio
    (the product over its tokens, log clamped to [ln 1e-8, 20]); (k, lambda) by the advantage's sign. phi(1) = 1.
    log_ratio, mask: (B, T); a: (B, 1). Returns (B, 1), no gradient."""
    with torch.no_grad():
        log_w = (log_ratio.clamp(-20.0, 20.0) * mask).sum(dim=1, keepdim=True).clamp(math.log(1e-8), 20.0)
        nonneg = a >= 0
        k = torch.where(nonneg, term.vespo_k_pos, term.vespo_k_neg)
        lam = torch.where(nonneg, term.vespo_lambda_pos, term.vespo_lambda_neg).clamp(min=1e-4)
        return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def policy_term(logp, old, ratio, a, mask, term: PolicyTerm) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token policy loss (B, T), tokens whose ratio was clipped (B, T) bool).

    ratio: pi / pi_old per token (B, T), with grad (token or sequence level); a: (B, 1) advantages.
    clipped types: -min(min(r, delta) A, clip(r, 1 - eps, 1 + eps_high) A) (delta: INTELLECT-2's cap);
    cispo: -sg(min(r, eps_high)) A log pi (MiniMax-M1); sapo: -sigmoid(tau (r - 1)) 4 / tau A, tau by the sign
    of A (SAPO); vespo: -sg(phi(W)) A log pi (VESPO)."""
    if term.loss_type in CLIPPED_TYPES:
        clipped = torch.clamp(ratio, 1 - term.clip_eps, 1 + term.clip_eps_high) * a
        capped = ratio.clamp(max=term.delta) if term.delta is not None else ratio
        unclipped = capped * a
        # A token is clipped where the clipped term is the smaller one: its gradient is zero there.
        return -torch.minimum(unclipped, clipped), clipped < unclipped
    if term.loss_type == "cispo":
        weight = ratio.clamp(max=term.clip_eps_high).detach()
        return -weight * a * logp, (ratio > term.clip_eps_high) & (a > 0)
    if term.loss_type == "sapo":
        tau = torch.where(a > 0, term.sapo_temperature_pos, term.sapo_temperature_neg)
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a, torch.zeros_like(mask)
    if term.loss_type == "vespo":
        phi = vespo_weights(logp.detach() - old, mask.to(logp), a, term)
        return -phi * a * logp, torch.zeros_like(mask)
    raise ValueError(f"unknown loss_type {term.loss_type!r}")


def off_policy_keep(logp, sampled, a, mask, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask, (B, 1): a completion with a negative advantage whose mean
    log(pi_sampled / pi) over its tokens exceeds `threshold` leaves the policy term."""
    kl = (sampled - logp.detach()) * mask
    mean_kl = kl.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    return ((a >= 0) | (mean_kl <= threshold)).to(logp)


@dataclass(frozen=True)
class Objective:
    """What of the grpo section the loss needs beyond the rows: the policy term (its loss type and knobs), the KL
    to the reference, the importance-sampling level, the off-policy mask and the entropy bonus (TRL's names)."""

    term: PolicyTerm = PolicyTerm()
    kl_coef: float = 0.0
    level: str = "token"  # importance sampling per token, or per sequence (GSPO)
    bias_correction_kl: bool = False  # the KL times the ratio (DeepSeek-V3.2's unbiased estimate)
    off_policy_threshold: float | None = None
    entropy_coef: float = 0.0

    @classmethod
    def of(cls, g) -> Objective:
        """From a GrpoSection."""
        return cls(
            PolicyTerm.of(g),
            g.kl_coef,
            g.importance_sampling_level,
            g.use_bias_correction_kl,
            g.off_policy_mask_threshold,
            g.entropy_coef,
        )

    @classmethod
    def clipped(cls, clip_eps: float = 0.2, clip_eps_high: float | None = None, **rest) -> Objective:
        """The clipped objective (loss type dapo) with these clip bounds (high: clip_eps when None)."""
        high = clip_eps if clip_eps_high is None else clip_eps_high
        return cls(PolicyTerm(clip_eps=clip_eps, clip_eps_high=high), **rest)


@dataclass
class MicroBatchTerms:
    """One micro-batch's tensors for the loss. logp: (B, T) current policy, with grad. old_logp (the sampling
    policy), ref_logp: (B, T) or None. advantages: (B,). weights: (B, T) from `token_weights` (0 off the
    completions). keep: (B, T) bool, the tokens of the top entropy quantile. entropies: (B, T), with grad when the
    entropy bonus is on; bonus_weights: from `entropy_weights`."""

    logp: torch.Tensor
    old_logp: torch.Tensor | None
    ref_logp: torch.Tensor | None
    advantages: torch.Tensor
    weights: torch.Tensor
    keep: torch.Tensor | None = None
    entropies: torch.Tensor | None = None
    bonus_weights: torch.Tensor | None = None


def grpo_token_loss(
    batch: MicroBatchTerms, objective: Objective = Objective()
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO objective of a micro-batch as a loss to minimise, and its statistics (summed over tokens with the
    same weights: add them up over micro-batches). In TRL's order: the policy term, the off-policy mask, the
    entropy mask (`keep`), then + kl_coef * KL (masked by neither), summed with `weights`; minus the entropy bonus.
    """
    b, o = batch, objective
    logp, weights = b.logp, b.weights
    a = b.advantages.to(logp)[:, None]
    mask = weights != 0
    old = logp.detach() if b.old_logp is None else b.old_logp
    ratio = torch.exp(log_ratios(logp, old, weights, o.level))
    per_token, clipped = policy_term(logp, old, ratio, a, mask, o.term)
    stats = {"clip_fraction": (weights * clipped.float()).sum().detach()}
    if o.off_policy_threshold is not None and b.old_logp is not None:
        per_token = per_token * off_policy_keep(logp, b.old_logp, a, mask.to(logp), o.off_policy_threshold)
    if b.keep is not None:
        per_token = per_token * b.keep.to(logp)
    if o.kl_coef and b.ref_logp is not None:
        delta = b.ref_logp - logp
        kl = torch.exp(delta) - delta - 1
        if o.bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + o.kl_coef * kl
        stats["kl"] = (weights * kl).sum().detach()
    loss = (per_token * weights).sum()
    if b.entropies is not None:
        stats["entropy_sum"] = (b.entropies.detach() * mask).sum()
    if o.entropy_coef and b.entropies is not None:
        stats["policy_loss"] = loss.detach()
        loss = loss - o.entropy_coef * (b.entropies * b.bonus_weights).sum()
    stats["loss"] = loss.detach()
    return loss, stats


def top_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """The completion tokens whose entropy is at or above the (1 - quantile) quantile of this micro-batch's
    completion tokens (Beyond the 80/20 Rule; TRL's top_entropy_quantile): (B, T) bool, ties kept."""
    active = entropies.detach()[mask].float()
    if active.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(active, 1 - quantile)
    return ((entropies.detach() * mask) >= threshold) & mask
