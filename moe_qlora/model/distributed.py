"""Data parallel over several processes (torchrun, accelerate launch): every rank holds the 4-bit model, takes
its slice of each global micro-batch, and the LoRA gradients are summed across ranks before the step.

The step's loss is normalised by the target tokens of the whole global batch (all ranks), so ranks x
micro_batch_size reproduces one process with the same global micro-batch: the sum of per-rank gradients of
sum(token losses) / N_global is the single-process gradient. Gradients are summed with one all_reduce over
a flat buffer (torch.distributed, gloo on CPU, nccl on CUDA), so every rank holds the same gradient and
takes the same clipping and NaN decisions. Rank 0 alone writes logs, checkpoints and the adapter.
"""

from __future__ import annotations

import atexit
import math
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    sharded: bool = False  # fsdp or ep: some tensors are DTensor shards, and every rank runs every forward
    experts_split: bool = False  # ep: each rank holds its experts alone (model.expert_parallel)

    @property
    def layout(self) -> str:
        return "ep" if self.experts_split else "fsdp" if self.sharded else "ddp"

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


SINGLE = Ranks()
PARTING_TIMEOUT_S = 30  # how long a rank that failed waits at exit for its peers to print
_parting_at_exit: list[Ranks] = []  # set once every rank raised the same failure


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


def leave(ranks: Ranks, *, together: bool = True) -> None:
    """Leave the process group. `together` (a run that ended normally): wait at a barrier first, so no rank
    tears its group down while a peer is still in a collective with it. After a failure the barrier is skipped:
    the other ranks may never reach it. (The abort once blamed on leaving, "terminate called without an active
    exception", came from the interpreter's finalization: common/process_exit.py.)"""
    if ranks.enabled and dist.is_initialized():
        if together:
            dist.barrier()
        elif _parting_at_exit:
            return  # every rank raised the same failure: they part at exit, once each has printed it
        dist.destroy_process_group()


def _part_after_printing() -> None:
    """At exit, after a failure every rank raised together: wait (at most PARTING_TIMEOUT_S) until every rank
    is here, that is has printed its sentence, then leave the group. Without it the failed rank exits first
    and torchrun's agent stops the others before they print what they got (seen once in CI). gloo's
    monitored_barrier is bounded; under nccl it runs on a gloo group made here, only then (every rank is here:
    each returned from raise_together's gather), so a run that never fails never needs gloo's own rendezvous."""
    if not dist.is_initialized():
        return
    try:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=PARTING_TIMEOUT_S)) if _nccl() else None
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=PARTING_TIMEOUT_S))
    except Exception:  # a peer already gone: nothing left to wait for
        pass
    dist.destroy_process_group()


def _nccl() -> bool:
    return dist.get_backend() == "nccl"


def _part_at_exit(ranks: Ranks) -> None:
    if not _parting_at_exit:
        _parting_at_exit.append(ranks)
        atexit.register(_part_after_printing)


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
    """p.grad <- sum over ranks of p.grad, for every trainable tensor held whole on every rank (a rank with no rows
    this step contributes zeros), through one flat buffer and one all_reduce. A sharded tensor's gradient (a
    DTensor) is already summed within its shard group: FSDP's backward reduce-scattered it (the divide factor is
    1), and an ep rank's experts got its group's rows through the exchange; over groups that replicate each other
    (train.ep_size) it is summed by sum_over_replicas."""
    if not ranks.enabled:
        return
    sum_over_replicas([p for p in params if is_sharded(p)])
    params = [p for p in params if not is_sharded(p)]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g).to(g.dtype)
        offset += n


def replicated_dims(t: torch.Tensor) -> list[int]:
    """The mesh dimensions (of size > 1) a DTensor is replicated over: copies on other ranks of the same rows."""
    return [d for d, p in enumerate(t.placements) if p.is_replicate() and t.device_mesh.size(d) > 1]


def replication(t: torch.Tensor) -> int:
    """How many ranks hold each element of a sharded tensor (1 when only its own shard's rank does, and for a
    tensor that is not a DTensor: the caller counts those)."""
    return math.prod(t.device_mesh.size(d) for d in replicated_dims(t)) if is_sharded(t) else 1


def sum_over_replicas(params: list[torch.Tensor]) -> None:
    """Each DTensor gradient whose parameter is replicated over mesh dimensions (ep groups that replicate each
    other) summed over them in place: each replica computed it from its own ranks' rows alone."""
    for p in params:
        dims = replicated_dims(p)
        if dims and p.grad is None:  # every replica joins each all_reduce, in the same order
            p.grad = torch.zeros_like(p)
        for dim in dims:
            dist.all_reduce(p.grad.to_local(), group=p.device_mesh.get_group(dim))


def any_rank(ranks: Ranks, flag: bool) -> bool:
    """True on every rank when it is true on any (a stop signal one rank saw, a failure)."""
    return bool(sum_scalars(ranks, float(flag))[0]) if ranks.enabled else flag


def from_main(ranks: Ranks, value):
    """Rank 0's `value` (picklable) on every rank: a decision or a sentence all of them must share."""
    if not ranks.enabled:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
    _part_at_exit(ranks)
    if error is not None:
        raise error
    rank, (kind, message) = failed[0]
    raise RankFailed(f"rank {rank} failed ({kind}): {message}")


class RankFailed(RuntimeError):
    """Another rank of the run failed; this one stops with its message."""


# --- FSDP2: sharded 4-bit experts -------------------------------------------------------------------------------


def shard_model(model, ranks: Ranks, keep: frozenset = frozenset()) -> Ranks:
    """Shard `model` over the ranks with FSDP2 (torch.distributed.fsdp.fully_shard): one FSDP group per decoder
    layer (the classes in the model's _no_split_modules) and the root for the rest. `keep`: parameters FSDP
    leaves alone (ep's experts, split over the ranks already: expert_parallel.shard_dense).

    Sharded on dim 0: the NF4 expert stacks (by expert) and the other 4-bit linears (by output row), each made
    plain frozen parameters of codes and fp32 scales first (a Params4bit keeps its scales in a quant_state FSDP
    cannot see); every frozen weight in the compute dtype; the LoRA tensors, so their gradients and AdamW
    moments. A layer's parameters are all-gathered for its forward and again for its backward
    (reshard_after_forward). Left whole on every rank: a 4-bit linear whose rows do not hold whole NF4 blocks
    (in_features not a multiple of 64). Gradients are reduce-scattered as sums (divide factor 1): the loss is
    already normalised by the global target count. Returns `ranks` marked sharded.
    """
    import bitsandbytes as bnb
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    from moe_qlora.moe.nf4 import make_linears_shardable
    from moe_qlora.moe.stack_surgery import make_stacks_shardable

    # The root returns the model's output, a view when the loss reads the head's input as logits (losses.py);
    # nothing writes to it in place, which is what the warning is about.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(device_of(ranks).type, (ranks.world,))
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class (_no_split_modules): cannot shard "
            "it layer by layer; use train.parallel: ddp"
        )
    for module in [*layers, model]:  # each layer's tensors made shardable, then cut to this rank's: one layer's
        # (E, ...) placeholders at most are resident (zeroed when small: common.memory.unwritten)
        make_stacks_shardable(module)
        make_linears_shardable(module)
        whole = {p for p in module.parameters() if isinstance(p, bnb.nn.Params4bit)} | set(keep)
        if module is model:
            fully_shard(model, mesh=mesh, ignored_params=whole)
        else:
            fully_shard(module, mesh=mesh, reshard_after_forward=True, ignored_params=whole)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    # GRPO's sampling calls generate, which reaches the layers' forwards (their groups gather themselves) but
    # not the root's: without this the embedding and the head would stay shards inside it
    register_fsdp_forward_method(model, "generate")
    return replace(ranks, sharded=True)


def shard_rows(rows: int, ranks: Ranks) -> range:
    """The rows of dim 0 that FSDP2 keeps on this rank: torch.chunk's split into ceil(rows / world) per rank, the
    last ranks maybe fewer or none (fully_shard's _chunk_with_empty)."""
    per_rank = -(-rows // ranks.world)
    return range(min(rows, ranks.rank * per_rank), min(rows, (ranks.rank + 1) * per_rank))


def is_sharded(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor (an FSDP shard, an ep rank's experts)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded (DTensor) tensor; the tensor itself otherwise."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of a sharded tensor, gathered (a collective: every rank calls it); the tensor otherwise."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """`whole` (the full tensor, present on every rank) laid out as `param` is: this rank's shard of it as a
    DTensor with param's placements when param is sharded (no communication), `whole` on param's device else."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        return whole.to(param.device)
    return distribute_tensor(whole.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


@contextmanager
def whole_trainable(model, ranks: Ranks):
    """Within the block rank 0's trainable parameters are whole (gathered from every rank), so the adapter can be
    written and verified as from one process; the shards are put back after. Only LoRA is gathered, never the
    4-bit weights; one tensor at a time, to the host: no GPU holds more than its shards and one whole tensor
    (DeepSeek-V3's recipe has 9 GiB of expert LoRA, 1.1 per GPU), and the other ranks, which write nothing, drop
    each tensor as it arrives. Nothing inside may run the model."""
    if not ranks.sharded:
        yield model
        return
    from torch.distributed.fsdp import FSDPModule

    # Every FSDP group back to its shards first, on every rank: the root stays gathered after a forward without
    # a backward (an eval), and a state_dict() that rank 0 alone makes (writing the adapter) would reshard it on
    # rank 0 only; the ranks' next forwards would then run different collectives.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    swapped = []
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.requires_grad:
                whole = full_tensor(p.detach())
                if ranks.main:
                    module._parameters[name] = torch.nn.Parameter(whole.cpu(), requires_grad=True)
                    swapped.append((module, name, p))
                del whole
    try:
        yield model
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p


def gather_objects(ranks: Ranks, local: list) -> list:
    """Every rank's list, concatenated in rank order, on every rank (picklable items: rollouts, rewards)."""
    if not ranks.enabled:
        return local
    parts: list = [None] * ranks.world
    dist.all_gather_object(parts, local)
    return [item for part in parts for item in part]


def rank_slice(items: list, ranks: Ranks) -> tuple[int, list]:
    """This rank's contiguous share of `items` (ceil(n / world) each, the last ranks maybe fewer or none) and
    the index of its first item, so that concatenating the shares in rank order gives `items` back."""
    share = -(-len(items) // ranks.world)
    start = min(ranks.rank * share, len(items))
    return start, items[start : start + share]
