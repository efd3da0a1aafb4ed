"""AdamW with element-wise gradient clipping (`gclip`), global-norm clipping, and the LR schedule.

Order per step: global norm measured (logged pre-clip) -> optional global-norm scaling -> each element
clamped to [-gclip, gclip] -> torch's AdamW moment update. The clamp bounds what one outlier element can
do to the second moment, which a global-norm clip (one scalar for all) cannot.
"""

from __future__ import annotations

import math

import torch


class ClippedAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose step first clamps every gradient element to [-gclip, gclip] (0 disables)."""

    def __init__(self, params, *, gclip: float = 0.0, **kwargs):
        if gclip < 0:
            raise ValueError(f"gclip must be >= 0, got {gclip}")
        super().__init__(params, **kwargs)
        self.gclip = gclip

    @torch.no_grad()
    def step(self, closure=None):
        if self.gclip > 0:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.clamp_(-self.gclip, self.gclip)
        return super().step(closure)


def clip_global_norm(params, max_norm: float) -> float:
    """The gradients' global L2 norm before clipping; scales them to max_norm when above (0 disables)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    if max_norm > 0 and norm > max_norm:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return float(norm)


def lr_multiplier(step: int, *, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Factor on the base LR at optimizer step `step` (0-based): linear warmup, then constant/linear/cosine to 0."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(params, train_cfg) -> ClippedAdamW:
    return ClippedAdamW(
        params,
        lr=train_cfg.lr,
        betas=tuple(train_cfg.betas),
        eps=train_cfg.eps,
        weight_decay=train_cfg.weight_decay,
        gclip=train_cfg.gclip,
        foreach=False,
    )
