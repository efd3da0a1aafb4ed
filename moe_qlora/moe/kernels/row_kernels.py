"""Triton kernels of the grouped layer's row-wise steps, each one pass over its rows in place of a chain of torch
operations that writes and reads back every intermediate: the gate (silu(gate) * up) with the LoRA term added
first, its backward with the routing-weight gradient's dot product, and the combine of each token's K rows.

Shape letters as in triton_kernels.py: S routed rows sorted by expert, T tokens, K slots per token, I the expert
intermediate size (h has 2I columns: gate then up), H the hidden size. Every product is taken in fp32 and each
output rounded once. Launchers and the torch references: rows.py.
"""

import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(
    y_ptr,  # (S, 2I) gate_up output without its LoRA term; h = y + scale * low written back here when STORE_H
    low_ptr,  # (S, 2I) the LoRA term's product, when HAS_LOW
    act_ptr,  # (S, I) out: silu(gate) * up
    scale,  # fp32 LoRA scale
    width,  # I, the columns of gate (and of up)
    stride_y,
    stride_low,
    stride_act,
    HAS_LOW: tl.constexpr,
    STORE_H: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """h = y + scale * low, rounded to y's dtype (what the backward reads), and act = silu(gate) * up of the rounded
    h: the activation the unfused chain gives from the stored h. One program per row and block of I columns."""
    s = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = cols < width
    gate = tl.load(y_ptr + s * stride_y + cols, mask=ok, other=0.0)
    up = tl.load(y_ptr + s * stride_y + width + cols, mask=ok, other=0.0)
    if HAS_LOW:
        low_gate = tl.load(low_ptr + s * stride_low + cols, mask=ok, other=0.0).to(tl.float32)
        low_up = tl.load(low_ptr + s * stride_low + width + cols, mask=ok, other=0.0).to(tl.float32)
        gate = (gate.to(tl.float32) + scale * low_gate).to(y_ptr.dtype.element_ty)
        up = (up.to(tl.float32) + scale * low_up).to(y_ptr.dtype.element_ty)
        if STORE_H:
            tl.store(y_ptr + s * stride_y + cols, gate, mask=ok)
            tl.store(y_ptr + s * stride_y + width + cols, up, mask=ok)
    g = gate.to(tl.float32)
    act = g * tl.sigmoid(g) * up.to(tl.float32)
    tl.store(act_ptr + s * stride_act + cols, act.to(act_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_backward_kernel(
    h_ptr,  # (S, 2I) the gate's input, [gate | up]
    u_ptr,  # (S, I) the activation's gradient before the routing weight (J^T g), without its LoRA term
    low_ptr,  # (S, I) the LoRA term of u (added with scale), when HAS_LOW
    w_ptr,  # (S,) the routing weight of each row
    grad_h_ptr,  # (S, 2I) out: the gate's vector-Jacobian product at u * w
    act_ptr,  # (S, I) out: silu(gate) * up (the LoRA down-projection's weight gradient reads it)
    dot_ptr,  # (S,) fp32 out: <act_s, u_s>, the routing weight's gradient
    scale,  # fp32 LoRA scale of low
    width,  # I, the columns of gate (and of up)
    stride_h,
    stride_u,
    stride_low,
    stride_grad,
    stride_act,
    HAS_LOW: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """With s = sigmoid(gate): act = gate s up; d gate = u w up s (1 + gate (1 - s)) and d up = u w gate s (silu's
    derivative as torch's silu backward writes it); dot = sum over I of act u, act and u rounded to their dtype
    as the unfused chain stores them. One program per row, walking I a block at a time."""
    s = tl.program_id(0).to(tl.int64)
    w = tl.load(w_ptr + s).to(tl.float32)
    acc = tl.zeros((BLOCK_I,), dtype=tl.float32)
    for i0 in range(0, width, BLOCK_I):
        cols = i0 + tl.arange(0, BLOCK_I)
        ok = cols < width
        gate = tl.load(h_ptr + s * stride_h + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + s * stride_h + width + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + s * stride_u + cols, mask=ok, other=0.0)
        if HAS_LOW:
            low = tl.load(low_ptr + s * stride_low + cols, mask=ok, other=0.0).to(tl.float32)
            u = (u.to(tl.float32) + scale * low).to(u_ptr.dtype.element_ty)
        u = u.to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        act = (silu * up).to(act_ptr.dtype.element_ty)
        tl.store(act_ptr + s * stride_act + cols, act, mask=ok)
        acc += act.to(tl.float32) * u
        uw = u * w
        grad_gate = uw * up * sig * (1.0 + gate * (1.0 - sig))
        tl.store(grad_h_ptr + s * stride_grad + cols, grad_gate.to(grad_h_ptr.dtype.element_ty), mask=ok)
        tl.store(grad_h_ptr + s * stride_grad + width + cols, (uw * silu).to(grad_h_ptr.dtype.element_ty), mask=ok)
    tl.store(dot_ptr + s, tl.sum(acc, axis=0))


@triton.jit
def _combine_kernel(
    rows_ptr,  # (S, H) sorted rows
    low_ptr,  # (S, H) their LoRA term's product (added with scale), when HAS_LOW
    inverse_ptr,  # (T * K,) int64: the sorted row of each (token, slot)
    weights_ptr,  # (T * K,) the routing weight of each (token, slot), when WEIGHTED
    out_ptr,  # (T, H) out: sum over slots k of weight * (rows + scale * low) at row inverse[t K + k]
    scale,
    H,
    stride_rows,
    stride_low,
    stride_out,
    K: tl.constexpr,
    HAS_LOW: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """MoE's combine as a gather: each token's K rows summed in slot order in fp32 (no atomics: two runs give the
    same bits), rounded once. One program per token and block of H columns."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(K):
        row = tl.load(inverse_ptr + t * K + k)
        v = tl.load(rows_ptr + row * stride_rows + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_LOW:
            v += scale * tl.load(low_ptr + row * stride_low + cols, mask=ok, other=0.0).to(tl.float32)
        if WEIGHTED:
            v *= tl.load(weights_ptr + t * K + k).to(tl.float32)
        acc += v
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)
