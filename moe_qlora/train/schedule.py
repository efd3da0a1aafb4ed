"""The learning-rate schedule: linear warmup over train.warmup_steps, then train.schedule (constant, linear or
cosine) down to 0 at the run's last update, as a LambdaLR that is stepped once per optimizer update.

Every count here is of optimizer updates, never of a recipe's steps: a method that takes several updates per
step (GRPO's grpo.passes) converts once (Recipe.schedule_after), so that the schedule a run starts with and the
one a resumed run is put back on are the same curve.
"""

from __future__ import annotations

import math

import torch


def lr_multiplier(update: int, *, total_updates: int, warmup_updates: int, schedule: str) -> float:
    """Factor on the base LR at optimizer update `update` (0-based): linear warmup over `warmup_updates`, then
    constant, or linear or cosine decay reaching 0 at `total_updates`. A warmup as long as the run or longer (a
    smoke test of a few steps: --set train.max_steps=3) is clamped to it: the LR reaches its peak at the last
    update, as transformers' and TRL's schedules let a short run do, instead of refusing the run."""
    warmup_updates = min(warmup_updates, total_updates)
    if warmup_updates and update < warmup_updates:
        return (update + 1) / warmup_updates
    if schedule == "constant":
        return 1.0
    span = max(1, total_updates - warmup_updates)
    progress = min(1.0, (update - warmup_updates) / span)
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_schedule(optimizer, train_cfg, *, total_updates: int, done_updates: int = 0):
    """train.schedule over `total_updates` optimizer updates, as it stands after `done_updates` of them (0: a
    run's start), with the optimizer's LRs set to that point. train.warmup_steps counts optimizer updates."""
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda update: lr_multiplier(
            update, total_updates=total_updates, warmup_updates=train_cfg.warmup_steps, schedule=train_cfg.schedule
        ),
    )
    schedule.last_epoch = done_updates  # LambdaLR's name for the updates taken
    for group, base, factor in zip(optimizer.param_groups, schedule.base_lrs, schedule.lr_lambdas, strict=True):
        group["lr"] = base * factor(done_updates)
    schedule._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() and a checkpoint read
    return schedule
