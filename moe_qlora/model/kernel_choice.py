"""Which MoE kernels a run uses (model.kernels): resolved once, when the model is built, from the device, the dtype
and what is installed, and the line the run prints about it.
"""

from __future__ import annotations

import torch

from moe_qlora.config.sections import ConfigError
from moe_qlora.moe.kernel_rule import resolve_auto, triton_installed
from moe_qlora.moe.kernels import tiles


def resolve_kernels(choice: str, device: str, dtype: torch.dtype, capability: tuple[int, int] | None = None) -> str:
    """model.kernels to what runs. auto by the rule the layer and the plan read (kernel_rule.resolve_auto): the
    per-call choice between Triton and grouped_mm on CUDA where torch._grouped_mm has its CUTLASS kernel (sm_90 /
    sm_100 in bf16), Triton alone on the other GPUs (the 24 GB cards) and dtypes, grouped_mm alone without
    triton, the torch reference on the CPU. torch and grouped_mm run anywhere; triton is refused without triton,
    or off CUDA outside Triton's interpreter. capability: the GPU's (major, minor), read from the device when None."""
    interpreted = tiles.interpreted()  # TRITON_INTERPRET, read once with the kernel settings
    if choice == "auto":
        return resolve_auto(device, dtype, capability, with_triton=triton_installed())
    if choice in ("torch", "grouped_mm"):
        return choice
    if device != "cuda" and not interpreted:  # installing triton would not help here: say what runs instead
        raise ConfigError(
            f"model.kernels: triton runs on an NVIDIA GPU, and this run is on the {device}: set model.kernels: auto "
            "(the torch reference here, the Triton kernels on a GPU)"
        )
    if not triton_installed():
        raise ConfigError("model.kernels: triton, but triton is not installed: pip install -e '.[gpu]' (it needs CUDA)")
    return choice


def describe_kernels(kernels: str, fused_below_rows: int, choice: str) -> str:
    """The line a run prints once: what runs the MoE layers, and why when model.kernels is auto."""
    if kernels == "auto":
        return f"auto per layer call: triton below {fused_below_rows} rows per expert, grouped_mm at or above"
    if choice == "auto" and kernels == "triton":
        return (
            "triton (model.kernels: auto; torch._grouped_mm has no fused kernel for this GPU and dtype, only a "
            "loop over experts with host syncs)"
        )
    return kernels + (" (model.kernels: auto)" if choice == "auto" else "")
