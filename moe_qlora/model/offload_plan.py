"""What `model.expert_offload` changes in a plan (moe/offload.py runs it): the offloaded layers' NF4 experts leave
the GPU for page-locked host memory, a window of `offload_resident_layers` layers stays, and the copies cost PCIe time.

Copies per pass (a forward, or a backward with its recomputes): every offloaded layer but the `resident` ones the
previous pass ended on, so 2 (k - R) layers per micro-batch for k offloaded layers and a window of R.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from moe_qlora.config.sections import RunConfig
from moe_qlora.model.activation_budget import micro_batch_tokens
from moe_qlora.model.budget import Plan, experts_in_mxfp4, four_bit_bytes
from moe_qlora.moe.layouts import quantized_stack_names
from moe_qlora.moe.nf4 import BLOCKSIZE, NESTED_BLOCKSIZE
from moe_qlora.moe.offload import ALIGN

# Host-to-device bytes/s a pinned copy achieves: PCIe 4.0 x16 (32 GB/s raw) and PCIe 5.0 x16 (64 GB/s raw).
PCIE_LINKS = {"PCIe 4 x16": 25e9, "PCIe 5 x16": 50e9}


@dataclass(frozen=True)
class OffloadPlan:
    layers: int  # offloaded experts modules
    of: int  # experts modules in the model
    host_bytes: int  # page-locked host memory they take: one block per layer, as moe/offload.py lays it out
    resident_bytes: int  # the window on the GPU: offload_resident_layers buffers of the largest layer's block
    bytes_per_step: int  # host-to-device copies per optimizer step
    flops_per_step: float  # the step's compute, to compare the copies with
    modules: tuple[str, ...] = ()  # the offloaded experts modules, by name

    def seconds_per_step(self, link: str) -> float:
        return self.bytes_per_step / PCIE_LINKS[link]

    def break_even_tflops(self, link: str) -> float:
        """The GPU throughput below which the step's compute hides the copies on `link`."""
        return self.flops_per_step / self.seconds_per_step(link) / 1e12 if self.bytes_per_step else float("inf")


def expert_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules with NF4 stacks, in model order: the unit offload moves."""
    return [(name, m) for name, m in model.named_modules() if quantized_stack_names(m)]


def expert_layer_bytes(model: nn.Module, cfg: RunConfig) -> list[int]:
    """Bytes of each experts module's stacks in one offload block (moe/offload.py's LayerLayout: codes, block
    scales and, with double quantization, their scales and code table, each aligned to ALIGN bytes)."""
    double_quant = cfg.model.expert_double_quant
    return [
        sum(block_bytes(getattr(m, n).numel(), double_quant=double_quant) for n in quantized_stack_names(m))
        for _, m in expert_layers(model)
    ]


def nf4_layer_bytes(model: nn.Module, cfg: RunConfig) -> list[int]:
    """NF4 bytes of each experts module's stacks as the plan's experts_nf4 counts them on the GPU."""
    double_quant = cfg.model.expert_double_quant
    return [
        sum(four_bit_bytes(getattr(m, n).numel(), double_quant=double_quant) for n in quantized_stack_names(m))
        for _, m in expert_layers(model)
    ]


def block_bytes(numel: int, *, double_quant: bool) -> int:
    blocks = numel // BLOCKSIZE
    parts = (
        [numel // 2, blocks, 4 * math.ceil(blocks / NESTED_BLOCKSIZE), 4 * 256]
        if double_quant
        else [numel // 2, 4 * blocks]
    )
    return sum(-(-p // ALIGN) * ALIGN for p in parts)


def window_bytes(offloaded: list[int], resident: int) -> int:
    """Device bytes of the window: `resident` buffers (never more than the layers), each the largest layer's."""
    return min(resident, len(offloaded)) * max(offloaded, default=0)


# What `expert_offload: auto` leaves free of the GPU's memory: the caching allocator keeps more than the allocated
# peak (its rounding, blocks freed but held), and a plan that fills the card to the byte runs out at the first
# step whose rows fragment it. The "fits" of scripts/will_it_fit.py and of the recipes' headers leaves the same.
OFFLOAD_HEADROOM_BYTES = 512 * 2**20


def layers_to_offload(total: int, layers: list[int], resident: int, gpu_bytes: int) -> int | None:
    """The fewest layers (first in model order) whose offload brings `total` within `gpu_bytes` less
    OFFLOAD_HEADROOM_BYTES; None if even all of them do not."""
    for k in range(len(layers) + 1):
        saved = sum(layers[:k]) - window_bytes(layers[:k], resident)
        if total - saved <= gpu_bytes - OFFLOAD_HEADROOM_BYTES:
            return k
    return None


def active_parameters(model: nn.Module, cfg: RunConfig) -> float:
    """Parameters one token goes through: all but the experts, and top_k / E of those."""
    text = model.config.get_text_config()
    top_k = getattr(text, "num_experts_per_tok", None) or getattr(text, "moe_top_k", None) or 1
    total, experts = 0, 0.0
    for module in model.modules():
        names = quantized_stack_names(module)
        for pname, p in module.named_parameters(recurse=False):
            if pname in names:
                experts += p.numel() * min(1.0, top_k / p.shape[0])
            else:
                total += p.numel()
    return total + experts


def offload_plan(model: nn.Module, cfg: RunConfig, layers: list[int], k: int) -> OffloadPlan:
    resident = cfg.model.offload_resident_layers
    offloaded = layers[:k]
    per_pass = sum(offloaded) * max(k - resident, 0) / k if k else 0
    tokens = micro_batch_tokens(cfg)
    passes = 4 if cfg.train.gradient_checkpointing else 3  # forward, backward (2x), and the recompute
    flops = 2.0 * active_parameters(model, cfg) * tokens * passes * cfg.train.grad_accum
    names = tuple(name for name, _ in expert_layers(model))[:k]
    return OffloadPlan(
        layers=k,
        of=len(layers),
        host_bytes=sum(offloaded),
        resident_bytes=window_bytes(offloaded, resident),
        bytes_per_step=int(2 * per_pass * cfg.train.grad_accum),
        flops_per_step=flops,
        modules=names,
    )


def apply_expert_offload(plan: Plan, model: nn.Module, cfg: RunConfig, *, device: str, gpu_bytes: int) -> None:
    """Move the offloaded layers' experts out of `plan`'s GPU bytes, add the resident window, and say what the
    copies cost. all: every experts module; auto: the fewest that make the plan fit `gpu_bytes`."""
    mode = cfg.model.expert_offload
    if mode == "none":
        return
    if device != "cuda":
        plan.notes.append(f"model.expert_offload: {mode} has nothing to do on the CPU (host memory is the device's)")
        return
    if experts_in_mxfp4(model, cfg):  # as loading refuses it
        plan.notes.append(
            f"model.expert_offload: {mode} is not built for MXFP4 experts (loading refuses it): planned without; "
            "model.expert_format nf4 offloads NF4 experts"
        )
        return
    layers = expert_layer_bytes(model, cfg)
    k = (
        len(layers)
        if mode == "all"
        else layers_to_offload(plan.total, layers, cfg.model.offload_resident_layers, gpu_bytes)
    )
    if k is None:
        k = len(layers)
        plan.notes.append("expert_offload auto: even with every MoE layer offloaded the run does not fit")
    if k == 0:
        plan.notes.append("expert_offload auto: the run fits without offloading experts")
        return
    off = offload_plan(model, cfg, layers, k)
    plan.offload = off
    plan.bytes["experts_nf4"] -= sum(nf4_layer_bytes(model, cfg)[:k])
    plan.bytes["experts_resident"] = off.resident_bytes
    gb = off.bytes_per_step / 1e9
    links = "; ".join(
        f"{off.seconds_per_step(link):,.2f} s at {link}, hidden by compute while the GPU sustains "
        f"under {off.break_even_tflops(link):,.0f} TFLOPS"
        for link in PCIE_LINKS
    )
    window = cfg.model.offload_resident_layers
    plan.notes.append(
        f"expert_offload {mode}: {k} of {len(layers)} MoE layers' experts in pinned host memory "
        f"({off.host_bytes / 2**30:,.2f} GiB of host RAM), at most {window} on the GPU "
        f"({off.resident_bytes / 2**30:,.2f} GiB)"
    )
    plan.notes.append(f"expert_offload copies {gb:,.2f} GB host-to-GPU per optimizer step: {links}")
