"""One GPU's bytes and its traffic under expert parallelism (train.parallel: ep, model/expert_parallel.py), from
the one-device plan and the tensors plan.sharded_tensors lists.

Split over the G GPUs of a group (train.ep_size of them, all by default; the groups replicas of each other): every
MoE layer's 4-bit experts (ceil(E/G) experts a GPU, stored as codes and fp32 scales, 4.5 bits a weight, as under
fsdp), their LoRA, its gradients and AdamW state. Whole on every GPU: the rest (the attention, the routers, the
shared experts, the dense layers, their LoRA), as under ddp. Added: the exchange's buffers of one MoE layer call.
Traffic: each MoE layer call sends its routed rows to the experts' GPUs of its group and gets the results back, in
the forward, again in the backward (the gradients), and again when checkpointing recomputes the forward; the
whole tensors' LoRA gradients are all-reduced over all GPUs once a step, and the experts' over the replica groups.
"""

from __future__ import annotations

import math

from torch import nn

from moe_qlora.config.sections import ConfigError, RunConfig, resolve_compute_dtype
from moe_qlora.model.activation_budget import micro_batch_tokens
from moe_qlora.model.budget import DTYPE_BYTES, LORA_BYTES, Plan, gradient_bytes, optimizer_state_bytes
from moe_qlora.moe.expert_stacks import experts_modules

EXPERT_KINDS = ("experts_nf4", "experts_mxfp4")


def routed_row_bytes(model: nn.Module, cfg: RunConfig, *, device: str) -> tuple[int, int]:
    """(bytes of one micro-batch's routed rows on one GPU: tokens x top-k x hidden in the compute dtype, MoE
    layers)."""
    config = model.config
    hidden = config.hidden_size
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "experts_per_token", 2)
    compute = DTYPE_BYTES[resolve_compute_dtype(cfg.model.compute_dtype, device)]
    return micro_batch_tokens(cfg) * top_k * hidden * compute, len(experts_modules(model))


def expert_group_size(cfg: RunConfig, gpus: int) -> int:
    """The GPUs each MoE layer's experts are split over: train.ep_size, or all `gpus`; refused unless it divides
    them."""
    size = cfg.train.ep_size or gpus
    if gpus % size:
        raise ConfigError(f"train.ep_size: {size} does not divide the {gpus} GPUs planned: use a divisor of {gpus}")
    return size


def ep_communication_bytes(plan: Plan, lora_shapes, model: nn.Module, cfg: RunConfig, *, device: str) -> int:
    """Bytes one GPU sends per optimizer step under ep over plan.gpus GPUs in groups of G (expert_group_size):
    (G-1)/G of its routed rows leave it (balanced routing), twice per exchange (the rows out, the results back),
    in the forward, the backward and, with gradient checkpointing, the recomputed forward; for every MoE layer and
    micro-batch. Then one ring all-reduce of the LoRA gradients held whole (2 (N-1)/N of them), and one of its
    experts' LoRA gradients over the R = N/G replica groups (2 (R-1)/R)."""
    n = plan.gpus
    group = expert_group_size(cfg, n)
    replicas = n // group
    rows, layers = routed_row_bytes(model, cfg, device=device)
    passes = 3 if cfg.train.gradient_checkpointing else 2
    exchange = 2 * passes * layers * rows * (group - 1) // group
    whole_lora = sum(math.prod(shape) for _, shape in lora_shapes if len(shape) != 3) * LORA_BYTES
    split = lora_numel_per_gpu([(k, s) for k, s in lora_shapes if len(s) == 3], group)
    expert_lora = sum(split) * LORA_BYTES
    reduce = 2 * (n - 1) * whole_lora // n + 2 * (replicas - 1) * expert_lora // replicas
    return cfg.train.grad_accum * exchange + reduce


def lora_numel_per_gpu(lora_shapes, gpus: int) -> list[int]:
    """Elements of each LoRA tensor one GPU holds: the per-expert stacks (E, ., .) ceil(E/N) experts, the rest whole."""
    return [
        -(-shape[0] // gpus) * math.prod(shape[1:]) if len(shape) == 3 else math.prod(shape) for _, shape in lora_shapes
    ]


def ep_plan(plan: Plan, tensors, lora_shapes, model: nn.Module, cfg: RunConfig, *, device: str) -> None:
    """Turn the one-device `plan` into one GPU's bytes under ep over plan.gpus GPUs (see the module's text).
    tensors: plan.sharded_tensors' list (the expert stacks' codes and scales among them); lora_shapes:
    budget.lora_tensor_shapes'."""
    n = expert_group_size(cfg, plan.gpus)
    for kind in EXPERT_KINDS:
        if kind in plan.bytes:
            plan.bytes[kind] = sum(t.shard_bytes(n) for t in tensors if t.kind == kind)
    numels = lora_numel_per_gpu(lora_shapes, n)
    plan.bytes.update(
        lora=sum(numels) * LORA_BYTES,
        gradients=gradient_bytes(sum(numels), model, cfg),
        optimizer=sum(optimizer_state_bytes(k, cfg.train.optimizer) for k in numels),
    )
    rows, _ = routed_row_bytes(model, cfg, device=device)
    plan.bytes["exchange_buffers"] = 4 * rows  # rows sent, received, computed and returned, of one layer call
    plan.communication_bytes_per_step = ep_communication_bytes(plan, lora_shapes, model, cfg, device=device)
