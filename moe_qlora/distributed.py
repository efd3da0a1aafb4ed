"""Data parallel over several processes (torchrun, accelerate launch): every rank holds the 4-bit model, takes
its slice of each global micro-batch, and the LoRA gradients are summed across ranks before the step.

The step's loss is normalised by the target tokens of the whole global batch (all ranks), so ranks x
micro_batch_size reproduces one process with the same global micro-batch: the sum of per-rank gradients of
sum(token losses) / N_global is the single-process gradient. Gradients are summed with one all_reduce over
a flat buffer (torch.distributed, gloo on CPU, nccl on CUDA), so every rank holds the same gradient and
takes the same clipping and NaN decisions. Rank 0 alone writes logs, checkpoints and the adapter.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


SINGLE = Ranks()


def launched_world_size() -> int:
    """WORLD_SIZE as torchrun and accelerate set it (1 when launched plainly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def join(timeout_s: int) -> Ranks:
    """Join the process group the launcher describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), with a
    timeout so that a rank which dies cannot leave the others waiting for ever."""
    world = launched_world_size()
    if world == 1:
        return SINGLE
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return Ranks(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local_rank)


def leave(ranks: Ranks) -> None:
    if ranks.enabled and dist.is_initialized():
        dist.destroy_process_group()


def device_of(ranks: Ranks) -> torch.device:
    return torch.device("cuda", ranks.local_rank) if torch.cuda.is_available() else torch.device("cpu")


def sum_scalars(ranks: Ranks, *values: float) -> list[float]:
    """Each value summed over ranks (float64 on the collective's device)."""
    if not ranks.enabled:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device_of(ranks))
    dist.all_reduce(t)
    return t.tolist()


def sum_gradients(ranks: Ranks, params: list[torch.Tensor]) -> None:
    """p.grad <- sum over ranks of p.grad, for every trainable tensor (a rank with no rows this step
    contributes zeros), through one flat buffer and one all_reduce."""
    if not ranks.enabled:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g).to(g.dtype)
        offset += n


def any_rank(ranks: Ranks, flag: bool) -> bool:
    """True on every rank when it is true on any (a stop signal one rank saw, a failure)."""
    return bool(sum_scalars(ranks, float(flag))[0]) if ranks.enabled else flag


def raise_together(ranks: Ranks, error: BaseException | None) -> None:
    """Every rank learns whether any failed before the first collective of the run, and all raise the first
    failure's message (so no rank waits for a peer that is gone)."""
    if not ranks.enabled:
        if error is not None:
            raise error
        return
    messages: list = [None] * ranks.world
    dist.all_gather_object(messages, None if error is None else (type(error).__name__, str(error)))
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if not failed:
        return
    if error is not None:
        raise error
    rank, (kind, message) = failed[0]
    raise RankFailed(f"rank {rank} failed ({kind}): {message}")


class RankFailed(RuntimeError):
    """Another rank of the run failed; this one stops with its message."""
