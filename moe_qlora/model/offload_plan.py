"""What `model.expert_offload` changes in a plan (moe/offload.py runs it): the offloaded layers' NF4 experts leave
the GPU for pinned host memory, a window of `offload_resident_layers` layers stays, and the copies cost PCIe time.

Copies per pass (a forward, or a backward with its recomputes): every offloaded layer but the `resident` ones the
previous pass ended on, so 2 (k - R) layers per micro-batch for k offloaded layers and a window of R.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from moe_qlora.config.sections import RunConfig
from moe_qlora.model.budget import Plan, four_bit_bytes
from moe_qlora.moe.layouts import quantized_stack_names

# Host-to-device bytes/s a pinned copy achieves: PCIe 4.0 x16 (32 GB/s raw) and PCIe 5.0 x16 (64 GB/s raw).
PCIE_LINKS = {"PCIe 4 x16": 25e9, "PCIe 5 x16": 50e9}


@dataclass(frozen=True)
class OffloadPlan:
    layers: int  # offloaded experts modules
    of: int  # experts modules in the model
    host_bytes: int  # pinned host memory they need
    resident_bytes: int  # the window on the GPU: the layer computing and the ones prefetched
    bytes_per_step: int  # host-to-device copies per optimizer step
    flops_per_step: float  # the step's compute, to compare the copies with

    def seconds_per_step(self, link: str) -> float:
        return self.bytes_per_step / PCIE_LINKS[link]

    def break_even_tflops(self, link: str) -> float:
        """The GPU throughput below which the step's compute hides the copies on `link`."""
        return self.flops_per_step / self.seconds_per_step(link) / 1e12 if self.bytes_per_step else float("inf")


def expert_layer_bytes(model: nn.Module, cfg: RunConfig) -> list[int]:
    """NF4 bytes of each experts module's stacks, in model order: the unit offload moves."""
    double_quant = cfg.model.expert_double_quant
    sizes = []
    for module in model.modules():
        if names := quantized_stack_names(module):
            sizes.append(sum(four_bit_bytes(getattr(module, n).numel(), double_quant=double_quant) for n in names))
    return sizes


def window_bytes(offloaded: list[int], resident: int) -> int:
    """The most bytes `resident` offloaded layers take on the GPU at once."""
    return sum(sorted(offloaded, reverse=True)[:resident])


def layers_to_offload(total: int, layers: list[int], resident: int, gpu_bytes: int) -> int | None:
    """The fewest layers (first in model order) whose offload brings `total` within `gpu_bytes`; None if even
    all of them do not."""
    for k in range(len(layers) + 1):
        saved = sum(layers[:k]) - window_bytes(layers[:k], resident)
        if total - saved <= gpu_bytes:
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
    tokens = cfg.train.micro_batch_size * cfg.data.max_seq_len
    passes = 4 if cfg.train.gradient_checkpointing else 3  # forward, backward (2x), and the recompute
    flops = 2.0 * active_parameters(model, cfg) * tokens * passes * cfg.train.grad_accum
    return OffloadPlan(layers=k, of=len(layers), host_bytes=sum(offloaded),
                       resident_bytes=window_bytes(offloaded, resident),
                       bytes_per_step=int(2 * per_pass * cfg.train.grad_accum), flops_per_step=flops)  # fmt: skip


def apply_expert_offload(plan: Plan, model: nn.Module, cfg: RunConfig, *, device: str, gpu_bytes: int) -> None:
    """Move the offloaded layers' experts out of `plan`'s GPU bytes, add the resident window, and say what the
    copies cost. all: every experts module; auto: the fewest that make the plan fit `gpu_bytes`."""
    mode = cfg.model.expert_offload
    if mode == "none":
        return
    if device != "cuda":
        plan.notes.append(f"model.expert_offload: {mode} has nothing to do on the CPU (host memory is the device's)")
        return
    layers = expert_layer_bytes(model, cfg)
    k = len(layers) if mode == "all" else layers_to_offload(plan.total, layers, cfg.model.offload_resident_layers,
                                                            gpu_bytes)  # fmt: skip
    if k is None:
        k = len(layers)
        plan.notes.append("expert_offload auto: even with every MoE layer offloaded the run does not fit")
    if k == 0:
        plan.notes.append("expert_offload auto: the run fits without offloading experts")
        return
    off = offload_plan(model, cfg, layers, k)
    plan.offload = off
    plan.bytes["experts_nf4"] -= off.host_bytes
    plan.bytes["experts_resident"] = off.resident_bytes
    gb = off.bytes_per_step / 1e9
    links = "; ".join(f"{off.seconds_per_step(link):,.2f} s at {link}, hidden by compute while the GPU sustains "
                      f"under {off.break_even_tflops(link):,.0f} TFLOPS" for link in PCIE_LINKS)  # fmt: skip
    window = cfg.model.offload_resident_layers
    plan.notes.append(f"expert_offload {mode}: {k} of {len(layers)} MoE layers' experts in pinned host memory "
                      f"({off.host_bytes / 2**30:,.2f} GiB of host RAM), at most {window} on the GPU "
                      f"({off.resident_bytes / 2**30:,.2f} GiB)")  # fmt: skip
    plan.notes.append(f"expert_offload copies {gb:,.2f} GB host-to-GPU per optimizer step: {links}")
