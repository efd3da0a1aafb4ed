"""The grouped layer's backends as one set of operations (grouped_layer.py runs its math through them): the Triton
kernels, dequantize + torch._grouped_mm, or the per-expert torch references; and the small choices a layer call
makes with them (the offsets' form, where rows are gathered, which row steps run, whether LoRA is added apart)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_qlora.moe.routing import RoutedTokens


@dataclass(frozen=True)
class GroupedOps:
    """grouped_matmul, grouped_matmul_silu_mul and grouped_outer_product with kernels.ops' contracts: the
    Triton kernels, the dequantize + torch._grouped_mm backend, or the per-expert torch references.
    host_offsets: the ops take the offsets as a host list (the references loop over experts in Python);
    otherwise as the (E+1,) device tensor, so the layer never waits on the host."""

    matmul: Callable
    matmul_silu_mul: Callable
    outer: Callable
    host_offsets: bool = False
    fused_gather: bool = False  # the matmuls read rows through `gather` at no extra cost (rows_of_tokens)
    # (Y, P L or None): a matmul's LoRA product apart, for the next row step to add (grouped_mm's GEMMs cannot)
    matmul_parts: Callable | None = None
    # the row steps (kernels/rows.py): "triton" (the interpreter off CUDA), "torch", or "device" (triton on CUDA)
    row_kernels: str = "torch"


def grouped_ops(kind: str, dequant_budget: int | None = None, decoded: dict | None = None) -> GroupedOps:
    """The ops of backend `kind`; dequant_budget: grouped_mm's decoded-stack limit in bytes (None: none); decoded:
    where grouped_mm keeps (and finds) the layer step's stacks decoded whole, by name."""
    from moe_qlora.moe.kernels import ops

    if kind == "triton":
        return GroupedOps(
            ops.grouped_matmul,
            ops.grouped_matmul_silu_mul,
            ops.grouped_outer_product,
            fused_gather=True,
            row_kernels="triton",
        )
    if kind == "grouped_mm":
        from moe_qlora.moe.kernels import grouped_mm as gmm

        return GroupedOps(
            functools.partial(gmm.grouped_matmul, budget=dequant_budget, decoded=decoded),
            functools.partial(gmm.grouped_matmul_silu_mul, budget=dequant_budget, decoded=decoded),
            gmm.grouped_outer_product,
            matmul_parts=functools.partial(gmm.grouped_matmul_parts, budget=dequant_budget, decoded=decoded),
            row_kernels="device",
        )
    return GroupedOps(
        ops.grouped_matmul_reference,
        ops.grouped_matmul_silu_mul_reference,
        ops.grouped_outer_product_reference,
        host_offsets=True,
    )


def offsets_for(ops: GroupedOps, rt: RoutedTokens):
    return rt.offsets if ops.host_offsets else rt.offsets_device


def row_steps_by_triton(ops: GroupedOps, t: torch.Tensor) -> bool:
    """Whether the row steps (kernels/rows.py) run their Triton kernels for a layer call on `t`'s device."""
    return ops.row_kernels == "triton" or (ops.row_kernels == "device" and t.is_cuda and _triton_installed())


@functools.cache
def _triton_installed() -> bool:
    from moe_qlora.moe.kernel_rule import triton_installed

    return triton_installed()


def matmul_apart(ops: GroupedOps, x, weight, off, *, gather=None, bias=None, lora=None):
    """(Y, P L or None, c): the matmul with its LoRA term c P L added (kernels that fuse it), or left apart for the
    next row step to add (matmul_parts)."""
    if ops.matmul_parts is None or lora is None:
        return ops.matmul(x, weight, off, gather=gather, bias=bias, lora=lora), None, 0.0
    y, low = ops.matmul_parts(x, weight, off, gather=gather, bias=bias, lora=lora)
    return y, low, lora.scale


def rows_of_tokens(ops: GroupedOps, t: torch.Tensor, token: torch.Tensor):
    """(rows, gather) to pass to the ops for a (T, ·) per-token operand read by several grouped matmuls: the
    Triton kernels gather inside the matmul (t, token); the others get the (S, ·) rows gathered once here
    instead of once per matmul (rows, None)."""
    return (t, token) if ops.fused_gather else (t.index_select(0, token), None)
