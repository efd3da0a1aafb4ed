"""Per-token log-probabilities (and entropies) through the output head in chunks of tokens: SFT's loss, and what
GRPO's objective (grpo_loss.py) is computed on.

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
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from moe_qlora.config.sections import ConfigError
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


def token_logprobs(
    model, batch, *, scale: float = 1.0, chunk: int = 0, entropy: bool = False, sum_sq: bool = False, **model_kwargs
):
    """log p(labels[t+1] | ..t) * s-scaled logits for every position, (B, L-1) fp32, 0 where ignored; the mask;
    and the model output (for its auxiliary loss). chunk > 0: through the head `chunk` tokens at a time.
    entropy: the output also carries `token_entropy`, (B, L-1) fp32, each position's differentiable entropy.
    sum_sq: it carries `token_log_sum_sq`, (B, L-1) fp32, log sum_v p_v^2 at each position, without gradient
    (WPO's weights)."""
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
        if sum_sq:
            out.token_log_sum_sq = chunked_log_sum_sq(hidden.detach(), head.weight, head.bias, scale, chunk)
            out.token_log_sum_sq = out.token_log_sum_sq.view(targets.shape)
    else:
        out = model(**inputs, **model_kwargs)
        logp = _full_logprobs(out.logits[:, :-1], targets.clamp(min=0), scale)
        if entropy:
            q = torch.log_softmax(out.logits[:, :-1].float() * scale, dim=-1)
            out.token_entropy = -(q.exp() * q).sum(dim=-1)
        if sum_sq:
            with torch.no_grad():
                out.token_log_sum_sq = log_sum_sq_probs(out.logits[:, :-1].float() * scale)
    return logp * mask, mask, out


def log_sum_sq_probs(z: torch.Tensor) -> torch.Tensor:
    """log sum_v p_v^2 of softmax(z) over the last dimension: logsumexp(2z) - 2 logsumexp(z)."""
    return torch.logsumexp(2 * z, dim=-1) - 2 * torch.logsumexp(z, dim=-1)


@torch.no_grad()
def chunked_log_sum_sq(hidden, weight, bias, scale: float, chunk: int) -> torch.Tensor:
    """log_sum_sq_probs of the head's logits, `chunk` tokens at a time: hidden (N, H) -> (N,) fp32."""
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        out[start : start + chunk] = log_sum_sq_probs(_chunk_logits(hidden[start : start + chunk], weight, bias, scale))
    return out


def has_router_aux_loss(model) -> bool:
    """Does the family define an MoE auxiliary (load-balancing) loss (transformers returns it as `aux_loss` when
    asked for the router logits)?"""
    return hasattr(model.config, "router_aux_loss_coef")


def router_aux_coefficient(model, setting: float | str) -> float:
    """train.router_aux_loss_coef for `model`: 0 (off), the number, or (`model`) the family's own coefficient
    from its config; ConfigError when it is on for a family without an auxiliary loss."""
    if setting == 0:
        return 0.0
    if not has_router_aux_loss(model):
        raise ConfigError(
            f"train.router_aux_loss_coef: {setting}, but {model.config.model_type} defines no router auxiliary "
            "(load-balancing) loss to train on; set it to 0"
        )
    return float(model.config.router_aux_loss_coef) if setting == "model" else float(setting)


def aux_term(aux: torch.Tensor | None, weight: float) -> torch.Tensor | float:
    """weight x the model's auxiliary loss, what train.router_aux_loss_coef adds to a micro-batch's loss (0 when
    off). On with no auxiliary loss returned (a model class that does not compute it) is an error, never a run
    that silently trains without it."""
    if not weight:
        return 0.0
    if aux is None:
        raise RuntimeError(
            "train.router_aux_loss_coef is set, but the model returned no auxiliary loss with its router logits"
        )
    return weight * aux


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
