"""Where a training run puts its model, decided from the whole run config and `plan` before any weight is loaded:
sharded over the ranks or whole on each (train.parallel), and which MoE layers keep their experts in host memory
(model.expert_offload).
"""

from __future__ import annotations

import torch
from rich.console import Console

from moe_qlora.common.memory import available_host_bytes
from moe_qlora.config.sections import ConfigError, RunConfig, check_shardable
from moe_qlora.model.distributed import Ranks, device_of


def parallel_chosen(cfg: RunConfig, ranks: Ranks, model_path: str, console: Console) -> str:
    """train.parallel under several ranks (ddp when alone): as asked, and auto = ddp when `plan` says the run fits
    one device (always on the CPU), else fsdp or ep, the one plan finds fitting and sending fewer bytes. What a
    sharded run cannot do is refused before loading (config.check_shardable)."""
    if not ranks.enabled or cfg.train.parallel == "ddp":
        return "ddp"
    if cfg.train.parallel == "auto" and cfg.model.expert_offload != "none":  # offload is how it fits one GPU
        return "ddp"
    device = device_of(ranks)
    chosen = cfg.train.parallel
    if chosen == "auto":
        if device.type != "cuda":
            return "ddp"
        from moe_qlora.model.budget import this_gpu_capability
        from moe_qlora.model.plan import plan_run

        have = torch.cuda.get_device_properties(device).total_memory
        plan = plan_run(
            cfg,
            name_or_path=model_path,
            device="cuda",
            capability=this_gpu_capability(),
            gpus=ranks.world,
            parallel="auto",
            gpu_gib=have / 2**30,
        )
        chosen = plan.parallel
        why = next((note for note in plan.notes if note.startswith("parallel auto")), f"parallel auto -> {chosen}")
        console.print(f"train.{why} (moe-qlora plan)")
        if chosen == "ddp":
            return "ddp"
    check_shardable(cfg, layout=chosen)  # as the recipe checked it as asked: auto's choice too
    return chosen


def memory_helpers_chosen(
    cfg: RunConfig, ranks: Ranks, model_path: str, console: Console, *, parallel: str = "ddp"
) -> tuple[int, bool]:
    """(train.mlp_chunk_tokens, train.offload_activations) as numbers: as set, or auto as `plan` resolves them for
    this GPU (plan.plan_with_autos: none when the run fits without, and none on the CPU), said when one helps. An
    offload on a GPU whose host has not the memory free for the layer inputs is refused before loading."""
    t = cfg.train
    device = device_of(ranks)
    chunk = 0 if t.mlp_chunk_tokens == "auto" else t.mlp_chunk_tokens
    offload = t.offload_activations is True
    if device.type != "cuda" or not ("auto" in (t.mlp_chunk_tokens, t.offload_activations) or offload):
        return chunk, offload
    from moe_qlora.model.budget import this_gpu_capability
    from moe_qlora.model.plan import plan_run

    gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    plan = plan_run(
        cfg,
        name_or_path=model_path,
        device="cuda",
        gpus=ranks.world if parallel != "ddp" else 1,  # one GPU's share under fsdp or ep
        parallel=parallel,
        gpu_gib=gib,
        capability=this_gpu_capability(),
    )
    if (plan.mlp_chunk_tokens, plan.offload_activations) != (chunk, offload):
        offloads = str(plan.offload_activations).lower()
        console.print(
            f"auto: train.mlp_chunk_tokens {plan.mlp_chunk_tokens}, train.offload_activations {offloads}: without "
            f"them the run would not fit {gib:.1f} GiB (moe-qlora plan)"
        )
    available = available_host_bytes()
    if plan.offload_activations and available is not None and plan.host_activation_bytes > available:
        raise ConfigError(
            f"train.offload_activations: the checkpointed layers' inputs need {size(plan.host_activation_bytes)} "
            f"of host memory; this machine has {size(available)} available. Free memory, or shorten "
            "data.max_seq_len or train.micro_batch_size"
        )
    return plan.mlp_chunk_tokens, plan.offload_activations


def size(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def offloaded_layers(
    cfg: RunConfig, model_path: str, device: str, sharded: bool, gpu_gib: float | None = None
) -> frozenset[str]:
    """model.expert_offload: the experts modules (by name) whose NF4 stacks are stored in host memory. all: every
    one; auto: the fewest `plan` needs to fit this GPU (`gpu_gib`, default the device's), none on the CPU; none
    under FSDP (all on the CPU: every one, host to host). Decided, and the host's memory checked, from
    config.json before any weight is loaded."""
    mode = cfg.model.expert_offload
    if mode == "none" or sharded or (mode == "auto" and device != "cuda"):
        return frozenset()
    from moe_qlora.model.budget import this_gpu_capability
    from moe_qlora.model.plan import plan_run

    if device != "cuda":  # all, on the CPU: the same schedule from host to host (what CPU tests drive)
        from moe_qlora.model.budget import meta_model
        from moe_qlora.model.offload_plan import expert_layers

        return frozenset(name for name, _ in expert_layers(meta_model(model_path)))

    gib = gpu_gib if gpu_gib is not None else torch.cuda.get_device_properties(device).total_memory / 2**30
    plan = plan_run(cfg, name_or_path=model_path, device="cuda", gpu_gib=gib, capability=this_gpu_capability())
    if plan.offload is None:
        return frozenset()
    check_host_memory(plan.offload.host_bytes, plan.offload.layers, mode)
    return frozenset(plan.offload.modules)


def check_host_memory(need: int, layers: int, mode: str) -> None:
    """Refuse an offload whose host blocks would not fit in the memory the host has available now."""
    if (available := available_host_bytes()) is not None and need > available:
        raise ConfigError(
            f"model.expert_offload: {mode} needs {size(need)} of host memory for {layers} MoE layers' "
            f"experts; this machine has {size(available)} available. Free memory, "
            "or offload fewer layers (expert_offload: auto)"
        )
