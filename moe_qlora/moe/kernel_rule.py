"""`model.kernels: auto`'s rule, written once: once per model, from the device, the compute dtype, the GPU and
whether triton is installed (resolve_auto); then per layer call, from the mean rows per expert (call_path).

The build (model/kernel_choice.py), the layer (experts.py) and the memory plan (model/budget.py) all read it here,
so the plan counts the buffers of the path the layer takes.
"""

from __future__ import annotations

import importlib.util

import torch

from moe_qlora.moe.kernels.grouped_mm import has_fused_path


def triton_installed() -> bool:
    """Whether triton can be imported here (the `[gpu]` extra), found without importing it."""
    return importlib.util.find_spec("triton") is not None


def resolve_auto(device: str, dtype: torch.dtype, capability: tuple[int, int] | None, *, with_triton: bool) -> str:
    """What `auto` leaves to the layer once the model is built: the torch reference off CUDA; grouped_mm alone
    without triton; triton alone where torch._grouped_mm has no fused kernel (has_fused_path: sm_90 / sm_100 in
    bf16; elsewhere it loops over experts after a host sync); else auto itself, chosen per call (call_path).
    capability: the GPU's (major, minor), read from the device when None and needed."""
    if device != "cuda":
        return "torch"
    if not with_triton:
        return "grouped_mm"
    if not has_fused_path(capability or torch.cuda.get_device_capability(), dtype):
        return "triton"
    return "auto"


def auto_kernels(num_rows: int, num_experts: int, fused_below_rows: int) -> str:
    """The backend of one call under `kernels: auto`, from the mean rows per expert (S / E: known from the
    shapes, so choosing needs no host sync)."""
    return "triton" if num_rows < fused_below_rows * num_experts else "grouped_mm"


def call_path(kernels: str, num_rows: int, num_experts: int, fused_below_rows: int) -> str:
    """The path one layer call of `num_rows` rows (tokens x top-k) takes with `kernels` as resolved (resolve_auto
    for auto): kernels itself, or, where auto was left to the call, the choice by rows per expert."""
    return auto_kernels(num_rows, num_experts, fused_below_rows) if kernels == "auto" else kernels
