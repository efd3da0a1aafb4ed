"""The losses: per-token log-probabilities through the output head in chunks of tokens (SFT's loss), and GRPO's
clipped policy-gradient loss on them (at the end).

Chunked, the (tokens, vocab) logits never exist whole. For vocab 151,936 at 4k tokens the full fp32 logits
alone are 2.3 GiB, plus their softmax and gradient.

Forward, per chunk c of N tokens: z = (h_c W^T + b) * s (fp32), logp_t = z_t[y_t] - logsumexp(z_t).
Backward, the chunk's logits recomputed: d logp_t / d z_t = onehot(y_t) - softmax(z_t), so
d h_c = ((onehot - p) * g_c * s) W. Only h, W and the targets are kept; within a chunk one fp32 (c, V)
buffer holds logits, then softmax, then gradient, plus logsumexp's temporary: ~8 bytes x c x V at peak.
The head is frozen (never a LoRA target here), so no weight gradient is formed.

Models that change logits after the head (soft-capping, a logits scale) would be computed wrongly: the first
call on a model compares the chunked path with the model's own logits on a short slice and falls back to
the full logits, saying why, if they differ.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_qlora.data.examples import IGNORE

log = logging.getLogger(__name__)

CHECK_TOKENS = 32
CHECK_TOL = 1e-4  # fp32 summation order of the logsumexp; a wrong head transform is off by O(1)


class ChunkedTokenLogProbs(torch.autograd.Function):
    """hidden (N, H), weight (V, H), bias (V,) or None, targets (N,) in [0, V) -> log p(target) (N,), fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale: float, chunk: int):
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            z = _chunk_logits(hidden[start : start + chunk], weight, bias, scale)
            y = targets[start : start + chunk]
            out[start : start + chunk] = z.gather(1, y[:, None]).squeeze(1) - torch.logsumexp(z, dim=1)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.scale, ctx.chunk = scale, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        for start in range(0, hidden.shape[0], ctx.chunk):
            z = _chunk_logits(hidden[start : start + ctx.chunk], weight, bias, ctx.scale)
            g = grad_out[start : start + ctx.chunk, None]
            # In place, so one (chunk, V) fp32 buffer serves as logits, softmax and gradient:
            # dz = (onehot - softmax(z)) * g * s.
            dz = z.sub_(torch.logsumexp(z, dim=1, keepdim=True)).exp_().mul_(-g)
            dz.scatter_add_(1, targets[start : start + ctx.chunk, None], g)
            if ctx.scale != 1.0:
                dz.mul_(ctx.scale)
            grad_hidden[start : start + ctx.chunk] = dz.to(weight.dtype) @ weight
        return grad_hidden, None, None, None, None, None


class ChunkedTokenLogProbsAndEntropy(torch.autograd.Function):
    """As ChunkedTokenLogProbs, and each position's entropy H = -sum_v p_v log p_v of the s-scaled
    distribution, both differentiable (GRPO's entropy bonus): (N,) fp32 each.

    With q = log softmax(z), p = exp(q): dH/dz_v = -p_v (q_v + H), so a chunk's logit gradient is
    dz = onehot(y) g - p (g + g_H (q + H)), one (chunk, V) fp32 buffer for q and p."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale: float, chunk: int):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        for start in range(0, n, chunk):
            q = torch.log_softmax(_chunk_logits(hidden[start : start + chunk], weight, bias, scale), dim=1)
            logp[start : start + chunk] = q.gather(1, targets[start : start + chunk, None]).squeeze(1)
            entropy[start : start + chunk] = -(q.exp() * q).sum(dim=1)
        ctx.save_for_backward(hidden, weight, bias, targets, entropy)
        ctx.scale, ctx.chunk = scale, chunk
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        n = hidden.shape[0]
        grad_logp = grad_logp if grad_logp is not None else torch.zeros(n, device=hidden.device)
        grad_entropy = grad_entropy if grad_entropy is not None else torch.zeros(n, device=hidden.device)
        for start in range(0, n, ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            q = torch.log_softmax(_chunk_logits(hidden[rows], weight, bias, ctx.scale), dim=1)
            g, g_h = grad_logp[rows, None], grad_entropy[rows, None]
            dz = q.add(entropy[rows, None]).mul_(g_h).add_(g).mul_(q.exp()).neg_()
            dz.scatter_add_(1, targets[rows, None], g)
            if ctx.scale != 1.0:
                dz.mul_(ctx.scale)
            grad_hidden[rows] = dz.to(weight.dtype) @ weight
        return grad_hidden, None, None, None, None, None


def _chunk_logits(h, weight, bias, scale):
    """(c, V) fp32 logits of one chunk, a fresh buffer the caller may overwrite."""
    z = F.linear(h, weight, bias)
    z = z.float() if z.dtype != torch.float32 else z
    return z.mul_(scale) if scale != 1.0 else z


@contextmanager
def _head_as_identity(model):
    """Within the block the model's output head returns its input, so the model's 'logits' are the hidden
    states the head would see (after any scaling the model applies before it)."""
    head = model.get_output_embeddings()
    head.forward = lambda x: x
    try:
        yield head
    finally:
        del head.forward


def _full_logprobs(logits, targets, scale):
    z = logits.float() * scale
    return -F.cross_entropy(z.reshape(-1, z.shape[-1]), targets.reshape(-1), reduction="none").view(targets.shape)


def chunked_loss_matches(model, batch) -> str | None:
    """None if the chunked path equals the model's own logits on a short slice of `batch`; else why not."""
    head = model.get_output_embeddings()
    if head is None or not isinstance(head, torch.nn.Linear) or head.weight.requires_grad:
        return "the output head is not a frozen nn.Linear"
    ids = batch["input_ids"][:1, :CHECK_TOKENS]
    mask = batch["attention_mask"][:1, :CHECK_TOKENS] if batch.get("attention_mask") is not None else None
    targets = ids[:, 1:]
    training = model.training
    model.eval()  # no dropout: the two forwards must see the same function
    try:
        with torch.no_grad(), torch.random.fork_rng():  # and the run's RNG stream is left as it was
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
            full = _full_logprobs(logits, targets, 1.0)
            with _head_as_identity(model):
                hidden = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
    finally:
        model.train(training)
    if hidden.shape[-1] != head.in_features:
        return "the model does not feed its head's input through as logits"
    with torch.no_grad():
        chunked = ChunkedTokenLogProbs.apply(
            hidden.reshape(-1, hidden.shape[-1]), head.weight, head.bias, targets.reshape(-1), 1.0, 16
        ).view(targets.shape)
    err = float((chunked - full).abs().max())
    return None if err <= CHECK_TOL else f"its logits differ from the head's output by {err:.3g} (a logit transform?)"


def token_logprobs(model, batch, *, scale: float = 1.0, chunk: int = 0, entropy: bool = False, **model_kwargs):
    """log p(labels[t+1] | ..t) * s-scaled logits for every position, (B, L-1) fp32, 0 where ignored; the mask;
    and the model output (for its auxiliary loss). chunk > 0: through the head `chunk` tokens at a time.
    entropy: the output also carries `token_entropy`, (B, L-1) fp32, each position's differentiable entropy."""
    targets = batch["labels"][:, 1:]
    mask = targets != IGNORE
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask"), "use_cache": False}
    if batch.get("position_ids") is not None:
        # Packed rows: no 2D mask, so transformers builds the block-diagonal causal mask from the positions
        # (sdpa / eager) or runs variable-length flash attention.
        inputs.update(attention_mask=None, position_ids=batch["position_ids"])
    if chunk and _chunking_allowed(model, batch):
        head = model.get_output_embeddings()
        with _head_as_identity(model):
            out = model(**inputs, **model_kwargs)
        hidden = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])
        flat_targets = targets.clamp(min=0).reshape(-1)
        if entropy:
            logp, ent = ChunkedTokenLogProbsAndEntropy.apply(hidden, head.weight, head.bias, flat_targets, scale, chunk)
            out.token_entropy = ent.view(targets.shape)
        else:
            logp = ChunkedTokenLogProbs.apply(hidden, head.weight, head.bias, flat_targets, scale, chunk)
        logp = logp.view(targets.shape)
    else:
        out = model(**inputs, **model_kwargs)
        logp = _full_logprobs(out.logits[:, :-1], targets.clamp(min=0), scale)
        if entropy:
            q = torch.log_softmax(out.logits[:, :-1].float() * scale, dim=-1)
            out.token_entropy = -(q.exp() * q).sum(dim=-1)
    return logp * mask, mask, out


def _chunking_allowed(model, batch) -> bool:
    """Checked once per model: the chunked path must equal the model's own logits."""
    verdict = getattr(model, "_moe_qlora_chunked_loss", None)
    if verdict is None:
        reason = chunked_loss_matches(model, batch)
        if reason is not None:
            log.warning("chunked loss off for %s: %s; computing full logits", type(model).__name__, reason)
        verdict = reason is None
        model._moe_qlora_chunked_loss = verdict
    return verdict


# ---------------------------------------------------------------------------------------------- GRPO's loss


def completion_logprobs(model, batch: dict[str, torch.Tensor], temperature: float, *, chunk: int = 0):
    """log p(token) of every completion token at the sampling temperature, and the mask of those tokens.

    batch: input_ids, labels (IGNORE outside completions), attention_mask, (B, L). Returns (B, L-1) each;
    position t scores labels[t + 1] from the logits at t.
    """
    logp, mask, _ = token_logprobs(model, batch, scale=1.0 / temperature, chunk=chunk)
    return logp, mask


def completion_logprobs_and_entropy(model, batch: dict[str, torch.Tensor], temperature: float, *, chunk: int = 0):
    """completion_logprobs, and the entropy of each position's temperature-scaled next-token distribution
    (B, L-1), differentiable (the entropy bonus) and taken at every position (masked by the caller)."""
    logp, mask, out = token_logprobs(model, batch, scale=1.0 / temperature, chunk=chunk, entropy=True)
    return logp, mask, out.token_entropy


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


def entropy_weights(mask: torch.Tensor, loss_type: str, *, total_tokens: int, micro_batches: int) -> torch.Tensor:
    """Each kept token's share of the entropy bonus, as TRL normalises it: the batch's token mean for dapo, cispo
    and vespo (divided by every completion token, kept or not); else this micro-batch's mean over its kept
    tokens, averaged over micro-batches. mask: (B, T), the completion tokens the bonus covers."""
    mask = mask.float()
    if loss_type in TOKEN_MEAN_TYPES:
        return mask / total_tokens
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


def grpo_token_loss(
    logp,
    old_logp,
    ref_logp,
    advantages,
    weights,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_coef: float = 0.0,
    level: str = "token",
    term: PolicyTerm | None = None,
    bias_correction_kl: bool = False,
    off_policy_threshold: float | None = None,
    keep: torch.Tensor | None = None,
    entropies: torch.Tensor | None = None,
    bonus_weights: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO objective of a micro-batch as a loss to minimise, and its statistics (summed over tokens with the
    same weights: add them up over micro-batches). In TRL's order: the policy term, the off-policy mask, the
    entropy mask (`keep`), then + kl_coef * KL (masked by neither), summed with `weights`; minus the entropy bonus.

    logp: (B, T) current policy, with grad. old_logp (the sampling policy), ref_logp: (B, T) or None.
    advantages: (B,). weights: (B, T) from `token_weights` (0 off the completions). level: importance sampling
    per token or per sequence (GSPO). term: the loss type (default: the clipped objective with clip_eps,
    clip_eps_high). bias_correction_kl: the KL times the ratio (DeepSeek-V3.2's unbiased estimate).
    keep: (B, T) bool, the tokens of the top entropy quantile. entropies: (B, T), with grad when entropy_coef is
    set; bonus_weights: from `entropy_weights`.
    """
    if term is None:
        term = PolicyTerm(clip_eps=clip_eps, clip_eps_high=clip_eps_high if clip_eps_high is not None else clip_eps)
    a = advantages.to(logp)[:, None]
    mask = weights != 0
    old = logp.detach() if old_logp is None else old_logp
    ratio = torch.exp(log_ratios(logp, old, weights, level))
    per_token, clipped = policy_term(logp, old, ratio, a, mask, term)
    stats = {"clip_fraction": (weights * clipped.float()).sum().detach()}
    if off_policy_threshold is not None and old_logp is not None:
        per_token = per_token * off_policy_keep(logp, old_logp, a, mask.to(logp), off_policy_threshold)
    if keep is not None:
        per_token = per_token * keep.to(logp)
    if kl_coef and ref_logp is not None:
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1
        if bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + kl_coef * kl
        stats["kl"] = (weights * kl).sum().detach()
    loss = (per_token * weights).sum()
    if entropies is not None:
        stats["entropy_sum"] = (entropies.detach() * mask).sum()
    if entropy_coef and entropies is not None:
        stats["policy_loss"] = loss.detach()
        loss = loss - entropy_coef * (entropies * bonus_weights).sum()
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
