"""Expert parallelism (train.parallel: ep): every MoE layer's experts split over the ranks, each token's routed rows
sent to the rank holding their expert and the results sent back (moe/expert_dispatch.py); the attention, the
router, the shared experts and the dense layers replicated on every rank as under ddp (their LoRA gradients
summed across ranks by sum_gradients).

Rank r holds experts shard_rows(E)[r] of every layer (torch.chunk's split, the one FSDP2 makes, so loading reads
and quantizes only those: loading.LoadOptions.expert_shard). Its 4-bit stacks and expert biases keep those rows
alone, as plain tensors; its expert LoRA factors are DTensors sharded on dim 0 over the ranks, so the optimizer
steps its rows alone, and checkpoints and the adapter gather them whole (distributed.full_tensor) as under fsdp.

With train.ep_size = G below the world size N, the experts are split over each group of G consecutive ranks (one
node's GPUs, say), and the N/G groups are replicas of each other: a 2D mesh ("replicate", "ep"), the LoRA factors
(Replicate, Shard(0)) on it, the exchange within the group, and the experts' LoRA gradients summed over the
replicas (distributed.sum_gradients), as ddp sums the rest.

With train.ep_dense: fsdp the rest is not replicated but sharded with FSDP2 over all the ranks (shard_dense): its
layers gathered for their forward and backward, its LoRA gradients reduce-scattered.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from moe_qlora.model.distributed import Ranks, device_of, shard_rows
from moe_qlora.moe.expert_dispatch import ExpertShard
from moe_qlora.moe.expert_stacks import UnsupportedExpertsError, experts_modules
from moe_qlora.moe.layer_state import layer_state, read_state
from moe_qlora.moe.stack_surgery import make_stacks_shardable


def expert_group(ranks: Ranks, ep_size: int) -> Ranks:
    """This rank's place in its ep group of `ep_size` consecutive ranks (0: all of them), as a Ranks whose rank and
    world are the group's: what shard_rows needs to name its experts."""
    size = ep_size or ranks.world
    return replace(ranks, rank=ranks.rank % size, world=size)


def describe_groups(ranks: Ranks, ep_size: int) -> str:
    size = ep_size or ranks.world
    if size == ranks.world:
        return f"{size} ranks"
    return f"each group of {size} ranks ({ranks.world // size} groups, replicas of each other)"


def split_experts(model: nn.Module, ranks: Ranks, ep_size: int = 0) -> Ranks:
    """Keep this rank's experts of every experts module of `model` (its LoRA attached), on its device: its share
    of its group's (expert_group); every other tensor stays whole on every rank. Returns `ranks` marked sharded
    (collectives inside each forward and backward: every rank runs each micro-batch) and experts_split."""
    from torch.distributed.device_mesh import init_device_mesh

    device, group = device_of(ranks), expert_group(ranks, ep_size)
    replicas = ranks.world // group.world
    if replicas > 1:
        mesh = init_device_mesh(device.type, (replicas, group.world), mesh_dim_names=("replicate", "ep"))
    else:
        mesh = init_device_mesh(device.type, (group.world,), mesh_dim_names=("ep",))
    modules = experts_modules(model)
    for name, module in modules:
        check_splittable(module, name)
        # NF4 stacks as (E, ...) codes and scales, this rank's rows written, then cut to them: one layer at a time,
        # so one layer's (E, ...) tensors at most are resident (zeroed when small: common.memory.unwritten)
        make_stacks_shardable(module)
        experts = module.moe_lora.gate_up_a.shape[0] if hasattr(module, "moe_lora") else expert_count(module)
        check_every_rank_holds_experts(name, experts, group.world)
        held = shard_rows(experts, group)
        keep_expert_rows(module, name, experts, held, device)
        if hasattr(module, "moe_lora"):
            shard_lora(module.moe_lora, held, mesh, device)
        bounds = tuple(shard_rows(experts, replace(group, rank=r)).start for r in range(group.world)) + (experts,)
        ep_group = mesh.get_group("ep") if replicas > 1 else None
        layer_state(module).expert_shard = ExpertShard(bounds, group.rank, ep_group)
    return replace(ranks, sharded=True, experts_split=True)


def check_splittable(module: nn.Module, name: str) -> None:
    """Refuse an experts module whose rows cannot be computed apart from the others' (experts that take every
    token, weighted before the experts: an adopted layout such as Llama-4's) or whose stacks live on the host."""
    state = read_state(module)
    if state.adopted or state.top_k is not None:
        raise UnsupportedExpertsError(
            f"{name} ({type(module).__name__}) weights its tokens before its experts and takes every token; "
            "train.parallel: ep cannot split it by expert: use fsdp or ddp"
        )
    if state.offload is not None:
        raise UnsupportedExpertsError(f"{name}: model.expert_offload keeps its experts on the host; ep splits them")


def check_every_rank_holds_experts(name: str, experts: int, world: int) -> None:
    """Refuse a split that leaves a rank without an expert (torch.chunk's ceil(E/N) a rank: 8 over 6 is 2, 2, 2, 2,
    0, 0): its experts' kernels would run on empty stacks, a path never run on a GPU."""
    per_rank = -(-experts // world)
    if experts < world or per_rank * (world - 1) >= experts:
        empty = world - -(-experts // per_rank)
        raise UnsupportedExpertsError(
            f"{name}: {experts} experts over {world} ranks leave {empty} rank(s) without an expert "
            f"(ceil({experts}/{world}) = {per_rank} a rank); train.parallel: ep needs a world size that gives "
            "every rank some, e.g. one dividing the experts"
        )


def expert_count(module: nn.Module) -> int:
    return next(p.shape[0] for p in module._parameters.values() if p is not None)


def keep_expert_rows(module: nn.Module, name: str, experts: int, held: range, device: torch.device) -> None:
    """Every parameter of the experts module (codes, scales, MXFP4 blocks, biases: experts on dim 0) cut to the
    rows `held`, a contiguous copy on `device`; the stacks' shapes said so."""
    for key, p in list(module._parameters.items()):
        if p is None:
            continue
        if p.dim() == 0 or p.shape[0] != experts:
            raise UnsupportedExpertsError(
                f"{name}.{key} {tuple(p.shape)} does not hold its {experts} experts on dim 0: "
                "train.parallel: ep cannot split it"
            )
        rows = p.detach()[held.start : held.stop].to(device).contiguous()
        module._parameters[key] = nn.Parameter(rows, requires_grad=p.requires_grad)
    state = layer_state(module)
    if state.shardable_shapes is not None:
        state.shardable_shapes = {k: (len(held), *shape[1:]) for k, shape in state.shardable_shapes.items()}


def shard_lora(lora: nn.Module, held: range, mesh, device: torch.device) -> None:
    """The expert LoRA factors as DTensors on `mesh` (("replicate",) "ep"): sharded on dim 0 within a group,
    replicated over the groups, this rank's local part the rows `held` (their values unchanged: every rank drew
    the same whole factors from the run's seed)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    for key, p in list(lora._parameters.items()):
        local = p.detach()[held.start : held.stop].to(device).contiguous()
        placements = [Replicate(), Shard(0)] if mesh.ndim == 2 else [Shard(0)]
        whole = DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape, stride=p.stride())
        lora._parameters[key] = nn.Parameter(whole, requires_grad=p.requires_grad)


def shard_dense(model: nn.Module, ranks: Ranks) -> Ranks:
    """After split_experts (train.ep_dense: fsdp): everything but the experts (attention, routers, shared experts,
    dense layers, embeddings, head, and their LoRA) sharded with FSDP2 over all the ranks, one FSDP group a decoder
    layer, as distributed.shard_model does for fsdp; each experts module's tensors (its split stacks and LoRA) left
    to ep. The dense LoRA gradients are then reduce-scattered by FSDP's backward instead of all-reduced."""
    from moe_qlora.model.distributed import shard_model

    experts = frozenset(p for _, module in experts_modules(model) for p in module.parameters())
    return shard_model(model, ranks, keep=experts)
