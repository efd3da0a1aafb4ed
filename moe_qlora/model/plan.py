"""Will a run fit: budget.py's bytes for one process, spread over `gpus` GPUs.

Under ddp every GPU holds all of it; under fsdp (FSDP2, as distributed.shard_model wraps the model) the experts,
the compute-dtype weights, LoRA, its gradients and the optimizer state are split by dim 0 across the GPUs, the
4-bit linears by output row, and the unsharded parameters of the layers being computed are added.
Communication per optimizer step is counted for both. `moe-qlora plan` prints it (cli).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from torch import nn

from moe_qlora.config.sections import RunConfig, resolve_compute_dtype
from moe_qlora.model.activation_budget import micro_batch_tokens
from moe_qlora.model.budget import (
    DEFAULT_GPU_GIB,
    DTYPE_BYTES,
    LORA_BYTES,
    Plan,
    capability_for_memory,
    classified_weights,
    experts_in_mxfp4,
    four_bit_bytes,
    gradient_bytes,
    lora_tensor_shapes,
    meta_model,
    one_device_plan,
    optimizer_state_bytes,
)
from moe_qlora.model.ep_plan import ep_plan
from moe_qlora.model.families import resolve_targets
from moe_qlora.model.offload_plan import apply_expert_offload
from moe_qlora.moe.mxfp4 import BLOCKSIZE as MXFP4_BLOCKSIZE
from moe_qlora.moe.nf4 import BLOCKSIZE

# Bandwidth one GPU's collectives get, bytes/s each direction: NVLink 4 on an H100 SXM (900 GB/s both ways),
# and a PCIe 4.0 x16 slot (32 GB/s raw, ~25 GB/s achieved).
LINKS = {"NVLink 4": 450e9, "PCIe 4 x16": 25e9}
PARALLEL_MODES = ("auto", "ddp", "fsdp", "ep")


def plan_run(
    cfg: RunConfig,
    *,
    name_or_path: str,
    device: str = "cuda",
    model: nn.Module | None = None,
    gpus: int = 1,
    parallel: str | None = None,
    gpu_gib: float = DEFAULT_GPU_GIB,
    capability: tuple[int, int] | None = None,
) -> Plan:
    """Bytes by kind one GPU holds for the run `cfg` on `gpus` devices of `gpu_gib` GiB each, and what each
    sends per optimizer step. `parallel`: auto, ddp or fsdp (default: cfg.train.parallel). `model`:
    meta_model(name_or_path), when already built (planning many configurations of one model). `capability`:
    the GPUs' (major, minor), which decides the MoE kernels `auto` takes (budget.planned_kernels); None: the GPU
    `gpu_gib` names (budget.capability_for_memory: an H100 from 80 GB, a 24-48 GB card below).
    train.mlp_chunk_tokens auto is resolved here (auto_chunked_plan), as the run resolves it."""
    capability = capability or capability_for_memory(gpu_gib)
    model = model if model is not None else meta_model(name_or_path, cfg.model.trust_remote_code)
    targets = resolve_targets(model, cfg.lora.target_modules)  # round-trips a probe adapter through PEFT: once
    given = dict(model=model, targets=targets, device=device, gpus=gpus, parallel=parallel, gpu_gib=gpu_gib)
    if "auto" in (cfg.train.mlp_chunk_tokens, cfg.train.offload_activations):
        return plan_with_autos(cfg, capability=capability, **given)
    return planned_as_set(cfg, capability=capability, **given)


def planned_as_set(cfg: RunConfig, **given) -> Plan:
    plan = plan_as_given(cfg, **given)
    plan.mlp_chunk_tokens = chunk = cfg.train.mlp_chunk_tokens
    if 0 < chunk < micro_batch_tokens(cfg):
        plan.notes.append(f"train.mlp_chunk_tokens {chunk}: the MoE and MLP rows {chunk} tokens at a time")
    return plan


# The chunks train.mlp_chunk_tokens auto tries, largest first: a chunk's rows shrink with it, while below about
# 1,024 tokens a grouped GEMM's rows per expert get too few to keep the tensor cores busy.
AUTO_MLP_CHUNKS = (16384, 8192, 4096, 2048, 1024)


def auto_settings(cfg: RunConfig, device: str) -> list[tuple[int, bool]]:
    """The (mlp_chunk_tokens, offload_activations) pairs the autos may take, in the order tried: each costs
    something (one more MLP forward a step; host memory and PCIe copies beside the compute), so first neither,
    then chunks from the largest, then the layer inputs on the host with each of those. Off CUDA: neither."""
    t = cfg.train
    auto_chunks = t.mlp_chunk_tokens == "auto"
    if auto_chunks:
        chunks = [0] + [c for c in AUTO_MLP_CHUNKS if c < micro_batch_tokens(cfg)] if device == "cuda" else [0]
    else:
        chunks = [t.mlp_chunk_tokens]
    offload = [False, True] if device == "cuda" and t.gradient_checkpointing else [False]
    offloads = offload if t.offload_activations == "auto" else [t.offload_activations]
    return [(chunk, off) for off in offloads for chunk in chunks]


def plan_with_autos(cfg: RunConfig, **given) -> Plan:
    """The plan with train.mlp_chunk_tokens and train.offload_activations auto resolved (auto_settings): the first
    setting with which the run fits without moving experts to the host; else as set without the autos' help
    (what fits with expert offload keeps the copies it pays for already; what fits in no way is said as it is, with
    the settings that would make it fit)."""
    settings = auto_settings(cfg, given["device"])
    plans = []
    for chunk, offload in settings:
        plan = planned_as_set(with_train(cfg, mlp_chunk_tokens=chunk, offload_activations=offload), **given)
        plans.append(plan)
        if plan.fits and plan.offload is None:
            break
    first, chosen = plans[0], plans[-1]
    if not (chosen.fits and chosen.offload is None):
        return first
    if chosen is not first:
        offload = str(chosen.offload_activations).lower()
        chosen.notes.append(
            f"auto: train.mlp_chunk_tokens {chosen.mlp_chunk_tokens}, train.offload_activations {offload} "
            f"(without them the run would need {first.total / 2**30:,.2f} GiB)"
        )
    return chosen


def with_train(cfg: RunConfig, **train) -> RunConfig:
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=train)})


def plan_as_given(
    cfg: RunConfig,
    *,
    model: nn.Module,
    targets: list[str],
    device: str,
    gpus: int,
    parallel: str | None,
    gpu_gib: float,
    capability: tuple[int, int],
) -> Plan:
    """plan_run's plan of `cfg` with every setting as it says (train.mlp_chunk_tokens a number)."""
    plan = one_device_plan(cfg, model, targets, device=device, capability=capability)
    apply_expert_offload(plan, model, cfg, device=device, gpu_bytes=int(gpu_gib * 2**30))
    plan.gpus, plan.gpu_bytes = gpus, int(gpu_gib * 2**30)
    requested = parallel or cfg.train.parallel
    if requested not in PARALLEL_MODES:
        raise ValueError(f"parallel: {requested!r} is not one of {', '.join(PARALLEL_MODES)}")
    layouts = {
        "fsdp": lambda p: shard_plan(p, sharded_tensors(model, cfg, targets, device=device), cfg, model, device=device),
        "ep": lambda p: (ep_plan if cfg.train.ep_dense == "replicate" else ep_dense_sharded_plan)(
            p,
            sharded_tensors(model, cfg, targets, device=device),
            lora_tensor_shapes(model, cfg, targets),
            model,
            cfg,
            device=device,
        ),
    }
    plan.parallel, why = choose_parallel(requested, plan, layouts, gpus=gpus, gpu_gib=gpu_gib)
    if plan.parallel in layouts:
        layouts[plan.parallel](plan)
    else:
        plan.communication_bytes_per_step = ddp_communication_bytes(plan.bytes["lora"], gpus)
    if gpus > 1 or plan.parallel != "ddp":  # one GPU without sharding: the notes as they always were
        add_parallel_notes(plan, why, cfg, gpu_gib=gpu_gib)
    return plan


def choose_parallel(requested: str, plan: Plan, layouts: dict, *, gpus: int, gpu_gib: float) -> tuple[str, str]:
    """(ddp, fsdp or ep, why). auto, as the trainer decides it (placement.parallel_chosen): ddp when the one-device
    plan fits one GPU of `gpu_gib` GiB; when it does not, of fsdp and ep (`layouts`: each turns a copy of the plan
    into one GPU's) the one that fits and sends fewer bytes per step; on one GPU there is nothing to split."""
    if requested != "auto":
        return requested, f"parallel: {requested}"
    if gpus == 1:
        return "ddp", "parallel auto: one GPU, one process"
    need = plan.total / 2**30
    if plan.fits:
        return "ddp", f"parallel auto -> ddp: the whole run ({need:,.2f} GiB) fits one {gpu_gib:g} GiB GPU"
    options = {}
    for name, apply in layouts.items():
        options[name] = copy.deepcopy(plan)
        apply(options[name])
    fsdp, ep = options["fsdp"], options["ep"]
    pick = "ep" if ep.fits and ep.communication_bytes_per_step < fsdp.communication_bytes_per_step else "fsdp"
    sent = ", ".join(f"{k} {v.communication_bytes_per_step / 1e9:,.2f} GB" for k, v in options.items())
    return pick, (
        f"parallel auto -> {pick}: the whole run ({need:,.2f} GiB) does not fit one {gpu_gib:g} GiB GPU; sent by "
        f"each GPU per step: {sent}"
    )


def ddp_communication_bytes(lora_bytes: int, gpus: int) -> int:
    """Bytes one rank sends per optimizer step under ddp: one ring all-reduce of the fp32 LoRA gradients
    (distributed.sum_gradients), 2 (N-1)/N of the buffer (a reduce-scatter and an all-gather)."""
    return 2 * (gpus - 1) * lora_bytes // gpus


@dataclass(frozen=True)
class ShardedTensor:
    """A tensor FSDP2 shards on dim 0: `rows` rows of `row_numel` elements of `elem_bytes` bytes each, in the
    FSDP group `group` (a decoder layer's module name; "" for the root)."""

    group: str
    kind: str
    rows: int
    row_numel: int
    elem_bytes: int
    experts: bool = False  # a LoRA stack of an experts module, (E, ., .): split by ep, not by FSDP

    def shard_numel(self, gpus: int) -> int:
        """Elements one rank holds: FSDP2 pads dim 0 to a multiple of the ranks, so each has ceil(rows / N)."""
        return -(-self.rows // gpus) * self.row_numel

    def shard_bytes(self, gpus: int) -> int:
        return self.shard_numel(gpus) * self.elem_bytes


def decoder_layer_names(model: nn.Module) -> list[str]:
    """Module names of the decoder layers, one FSDP group each: the modules of the classes the model names in
    _no_split_modules, as distributed.shard_model wraps them."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    return [name for name, m in model.named_modules() if type(m).__name__ in classes]


def fsdp_group(name: str, layers: list[str]) -> str:
    """The FSDP group that manages parameter or module `name`: the innermost decoder layer holding it, else the
    root ("")."""
    holding = [layer for layer in layers if name == layer or name.startswith(layer + ".")]
    return max(holding, key=len, default="")


def rows_and_row_numel(shape: tuple[int, ...]) -> tuple[int, int]:
    """(dim 0, elements per dim-0 row) of a shape; a scalar is one row of one."""
    return (shape[0], math.prod(shape[1:])) if len(shape) else (1, 1)


def sharded_tensors(model: nn.Module, cfg: RunConfig, targets: list[str], *, device: str) -> list[ShardedTensor]:
    """Every tensor FSDP shards (distributed.shard_model). Each NF4 expert stack becomes two, experts on dim 0
    (stack_surgery.make_stacks_shardable): uint8 codes, half a byte a weight, and fp32 block scales, one per 64
    weights (nested scales decoded): 4.5 bits a weight whatever model.expert_double_quant says. So does each
    4-bit linear whose rows hold whole NF4 blocks, output rows on dim 0 (nf4.make_linears_shardable); the others
    are not here: they stay whole. Then the weights kept in the compute dtype and the fp32 LoRA tensors."""
    compute = DTYPE_BYTES[resolve_compute_dtype(cfg.model.compute_dtype, device)]
    layers = decoder_layer_names(model)
    tensors = []
    mxfp4 = experts_in_mxfp4(model, cfg)
    for name, kind, p in classified_weights(model, device=device):
        group = fsdp_group(name, layers)
        if kind == "experts_nf4":
            experts, per_expert = rows_and_row_numel(tuple(p.shape))
            if mxfp4:  # the published blocks and exponent bytes, experts on dim 0 as loaded
                tensors.append(ShardedTensor(group, "experts_mxfp4", experts, per_expert // 2, 1))
                tensors.append(ShardedTensor(group, "experts_mxfp4", experts, per_expert // MXFP4_BLOCKSIZE, 1))
            else:
                tensors.append(ShardedTensor(group, kind, experts, per_expert // 2, 1))
                tensors.append(ShardedTensor(group, kind, experts, per_expert // BLOCKSIZE, 4))
        elif kind == "linear_4bit" and p.shape[1] % BLOCKSIZE == 0:
            tensors.append(ShardedTensor(group, kind, p.shape[0], p.shape[1] // 2, 1))
            tensors.append(ShardedTensor(group, kind, p.shape[0], p.shape[1] // BLOCKSIZE, 4))
        elif kind == "other":
            tensors.append(ShardedTensor(group, kind, *rows_and_row_numel(tuple(p.shape)), compute))
    for module_name, shape in lora_tensor_shapes(model, cfg, targets):
        numel = rows_and_row_numel(shape)
        tensors.append(ShardedTensor(fsdp_group(module_name, layers), "lora", *numel, LORA_BYTES, len(shape) == 3))
    return tensors


def unsharded_group_bytes(tensors: list[ShardedTensor], gpus: int) -> dict[str, int]:
    """Bytes of each FSDP group's parameters when all-gathered: N padded shards of each of its tensors."""
    groups: dict[str, int] = {}
    for t in tensors:
        groups[t.group] = groups.get(t.group, 0) + gpus * t.shard_bytes(gpus)
    return groups


def fsdp_communication_bytes(tensors: list[ShardedTensor], gpus: int, grad_accum: int) -> int:
    """Bytes one rank sends per optimizer step under fsdp, ring collectives moving (N-1)/N of each whole buffer.
    Every micro-batch: each decoder layer's parameters are all-gathered twice (for its forward, and again for
    its backward: reshard_after_forward), the root's once (FSDP2 keeps the root unsharded from its forward to
    the end of the backward), and the fp32 LoRA gradients are reduce-scattered once."""
    per_micro_batch = 0
    for group, whole in unsharded_group_bytes(tensors, gpus).items():
        gathers = 2 if group else 1
        per_micro_batch += gathers * (gpus - 1) * whole // gpus
    lora_whole = sum(gpus * t.shard_bytes(gpus) for t in tensors if t.kind == "lora")
    per_micro_batch += (gpus - 1) * lora_whole // gpus
    return grad_accum * per_micro_batch


def shard_plan(plan: Plan, tensors: list[ShardedTensor], cfg: RunConfig, model: nn.Module, *, device: str) -> None:
    """Turn the one-device `plan` into one rank's bytes under fsdp over plan.gpus ranks. Sharded: experts,
    4-bit linears (by row), compute-dtype weights, LoRA, its gradients and optimizer state (one rank's shard of
    each tensor). Whole: 4-bit linears whose rows split NF4 blocks, activations (eager attention's matrices too),
    loss, runtime, the decode buffer, the MoE backward's rows, the autotuner's flush buffer. Added:
    all_gather_buffers, the unsharded parameters of the largest decoder layer twice (the one computing and the
    next, prefetched), and root_unsharded, the root's (embeddings, final norm, head), held from the forward to the
    end of the backward."""
    n = plan.gpus
    kinds = ("experts_nf4", "experts_mxfp4", "linear_4bit", "other")
    shard = {kind: sum(t.shard_bytes(n) for t in tensors if t.kind == kind) for kind in kinds}
    whole_linears = [
        p.numel()
        for _, kind, p in classified_weights(model, device=device)
        if kind == "linear_4bit" and p.shape[1] % BLOCKSIZE
    ]
    lora = [t for t in tensors if t.kind == "lora"]
    lora_numel = sum(t.shard_numel(n) for t in lora)
    groups = unsharded_group_bytes(tensors, n)
    layers = [whole for group, whole in groups.items() if group]
    if "experts_mxfp4" in plan.bytes:
        plan.bytes["experts_mxfp4"] = shard["experts_mxfp4"]
    plan.bytes.update(
        experts_nf4=shard["experts_nf4"],
        linear_4bit=shard["linear_4bit"]
        + sum(four_bit_bytes(k, double_quant=cfg.model.linear_double_quant) for k in whole_linears),
        other=shard["other"],
        lora=lora_numel * LORA_BYTES,
        gradients=gradient_bytes(lora_numel, model, cfg),
        optimizer=sum(optimizer_state_bytes(t.shard_numel(n), cfg.train.optimizer) for t in lora),
        all_gather_buffers=2 * max(layers, default=0),
        root_unsharded=groups.get("", 0),
    )
    plan.communication_bytes_per_step = fsdp_communication_bytes(tensors, n, cfg.train.grad_accum)


def ep_dense_sharded_plan(plan: Plan, tensors, lora_shapes, model: nn.Module, cfg: RunConfig, *, device: str) -> None:
    """train.parallel: ep with train.ep_dense: fsdp: ep_plan's experts and their LoRA (split within each group)
    beside shard_plan's bytes and traffic for the rest (sharded over all plan.gpus GPUs)."""
    rest = [t for t in tensors if t.kind not in ("experts_nf4", "experts_mxfp4") and not t.experts]
    ep_plan(plan, tensors, [(k, s) for k, s in lora_shapes if len(s) == 3], model, cfg, device=device)
    sharded = copy.deepcopy(plan)
    shard_plan(sharded, rest, cfg, model, device=device)
    for kind in ("linear_4bit", "other", "all_gather_buffers", "root_unsharded"):
        plan.bytes[kind] = sharded.bytes[kind]
    for kind in ("lora", "gradients", "optimizer"):
        plan.bytes[kind] += sharded.bytes[kind]
    plan.communication_bytes_per_step += sharded.communication_bytes_per_step


def add_parallel_notes(plan: Plan, why: str, cfg: RunConfig, *, gpu_gib: float) -> None:
    """What the mode holds on each GPU, whether it fits, and what its communication costs per step."""
    n, gb = plan.gpus, plan.communication_bytes_per_step / 1e9
    gpus = f"{n} GPU" + ("s" if n > 1 else "")
    plan.notes.append(why)
    if plan.parallel == "ddp":
        plan.notes.append(
            f"ddp over {gpus}: each holds all of the above; the fp32 LoRA gradients are all-reduced once a step"
        )
    elif plan.parallel == "ep":
        group = cfg.train.ep_size or n
        groups = f" in {n // group} groups of {group} (train.ep_size), replicas of each other" if group < n else ""
        plan.notes.append(
            f"ep over {gpus}{groups}: each holds its share of every MoE layer's 4-bit experts (4.5 bits a weight: fp32 "
            "scales), their LoRA, gradients and optimizer state; the rest whole; exchange_buffers: one MoE layer "
            "call's rows sent, received, computed and returned"
        )
        plan.notes.append(
            "communication: each MoE layer call's routed rows out and back in the forward, the backward and the "
            "checkpointed forward's recompute (balanced routing assumed), and the whole tensors' LoRA gradients"
            + (", and the experts' LoRA gradients over the groups" if groups else "")
        )
        if cfg.train.ep_dense == "fsdp":
            plan.notes.append(
                f"train.ep_dense: fsdp: the rest sharded over the {n} GPUs as under fsdp (all_gather_buffers: two "
                "decoder layers' non-expert parameters unsharded; root_unsharded: embeddings, final norm and head), "
                "its layers all-gathered in the forward and the backward, its LoRA gradients reduce-scattered"
            )
    else:
        plan.notes.append(
            f"fsdp over {gpus}, one FSDP group a decoder layer: 4-bit experts and linears (4.5 bits "
            "a weight: fp32 scales, not double-quantized), compute-dtype weights, LoRA, gradients and "
            "optimizer state sharded"
        )
        plan.notes.append(
            "all_gather_buffers: two decoder layers unsharded (one prefetched); root_unsharded: "
            "embeddings, final norm and head, whole from the forward to the backward's end"
        )
    if plan.parallel != "ddp" and cfg.train.optimizer != "adamw":
        plan.notes.append(
            f"train refuses train.optimizer: {cfg.train.optimizer} under {plan.parallel} (bitsandbytes state "
            "is not sharded): use adamw"
        )
    verdict = "fits" if plan.fits else "does not fit"
    plan.notes.append(f"per GPU {plan.total / 2**30:,.2f} GiB: {verdict} in {gpu_gib:g} GiB")
    seconds = ", ".join(
        f"{plan.communication_bytes_per_step / rate:,.3f} s at {link} ({rate / 1e9:g} GB/s)"
        for link, rate in LINKS.items()
    )
    plan.notes.append(f"communication per optimizer step: {gb:,.2f} GB sent by each GPU; {seconds}")
