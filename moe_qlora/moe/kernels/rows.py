"""The grouped layer's row-wise steps, each as one operation: the Triton kernel of row_kernels.py on a GPU (or in
Triton's interpreter), beside the torch reference that is its oracle and the CPU's implementation.

silu_mul:          h = y + c low (in place), act = silu(gate) * up           (S, 2I) -> (S, I)
silu_mul_backward: act, <act, u>, and the gate's vjp at u w (u = u + c low)  (S, 2I), (S, I) -> (S, 2I), (S, I), (S,)
combine:           out[t] = sum_k w[t, k] (rows + c low)[inverse[t K + k]]   (S, H) -> (T, H)

Each is a torch.library custom op with a fake implementation: torch.compile and fake tensors see one operation (one
launch on a GPU: scripts/layer_traffic.py counts it so), and the grouped layer's own op calls it like any other.
`use_triton` says which implementation runs; the kernels compute in fp32 and round each output once, and so do the
references, which therefore match them to fp32 rounding.
"""

from __future__ import annotations

import torch

# Rows per piece of a reference's fp32 work: its fp32 copies of the (rows, 2I) operands stay near 64 MiB each.
_CHUNK_ELEMENTS = 1 << 24


def _row_pieces(num_rows: int, width: int) -> list[tuple[int, int]]:
    step = max(1, _CHUNK_ELEMENTS // max(width, 1))
    return [(lo, min(lo + step, num_rows)) for lo in range(0, num_rows, step)]


def _block(width: int, most: int = 1024) -> int:
    import triton

    return min(most, triton.next_power_of_2(max(width, 16)))


# --------------------------------------------------------------------------------------- the gate, forward


def silu_mul_reference(y: torch.Tensor, low: torch.Tensor | None, scale: float, store_h: bool) -> torch.Tensor:
    """act (S, I) = silu(gate) * up of h = y + scale * low rounded to y's dtype; h written into y when store_h."""
    width = y.shape[1] // 2
    act = y.new_empty(y.shape[0], width)
    for lo, hi in _row_pieces(y.shape[0], y.shape[1]):
        h = y[lo:hi] if low is None else (y[lo:hi].float() + scale * low[lo:hi].float()).to(y.dtype)
        if low is not None and store_h:
            y[lo:hi] = h
        gate, up = h.float().chunk(2, dim=-1)
        act[lo:hi] = (torch.nn.functional.silu(gate) * up).to(y.dtype)
    return act


@torch.library.custom_op("moe_qlora::silu_mul", mutates_args=("y",))
def silu_mul(y: torch.Tensor, low: torch.Tensor | None, scale: float, store_h: bool, use_triton: bool) -> torch.Tensor:
    """silu_mul_reference's contract, by the Triton kernel when use_triton."""
    if not use_triton:
        return silu_mul_reference(y, low, scale, store_h)
    from moe_qlora.moe.kernels.row_kernels import _silu_mul_kernel

    width = y.shape[1] // 2
    act = y.new_empty(y.shape[0], width)
    if y.shape[0] == 0:
        return act
    block = _block(width)
    low_ = low if low is not None else y
    _silu_mul_kernel[(y.shape[0], -(-width // block))](
        y,
        low_,
        act,
        float(scale),
        width,
        y.stride(0),
        low_.stride(0),
        act.stride(0),
        HAS_LOW=low is not None,
        STORE_H=store_h,
        BLOCK_I=block,
    )
    return act


@silu_mul.register_fake
def _silu_mul_fake(y, low, scale, store_h, use_triton):
    return y.new_empty(y.shape[0], y.shape[1] // 2)


# -------------------------------------------------------------------------------------- the gate, backward


def silu_mul_backward_reference(h, u, low, scale: float, w):
    """(grad h (S, 2I), act (S, I), dot (S,) fp32) for h = [gate | up], u (S, I) (+ scale * low, rounded to u's
    dtype) and the rows' routing weights w (S,): act = silu(gate) up; dot = <act, u>; grad h = the gate's vjp at
    u w, silu's derivative s (1 + gate (1 - s)) with s = sigmoid(gate)."""
    width = u.shape[1]
    grad_h, act = torch.empty_like(h), u.new_empty(u.shape)
    dot = torch.empty(u.shape[0], dtype=torch.float32, device=u.device)
    for lo, hi in _row_pieces(h.shape[0], h.shape[1]):
        gate, up = h[lo:hi].float().chunk(2, dim=-1)
        rows_u = u[lo:hi] if low is None else (u[lo:hi].float() + scale * low[lo:hi].float()).to(u.dtype)
        rows_u = rows_u.float()
        sig = torch.sigmoid(gate)
        silu = gate * sig
        act[lo:hi] = (silu * up).to(u.dtype)
        dot[lo:hi] = (act[lo:hi].float() * rows_u).sum(-1)
        uw = rows_u * w[lo:hi].float()[:, None]
        grad_h[lo:hi, :width] = (uw * up * sig * (1 + gate * (1 - sig))).to(h.dtype)
        grad_h[lo:hi, width:] = (uw * silu).to(h.dtype)
    return grad_h, act, dot


@torch.library.custom_op("moe_qlora::silu_mul_backward", mutates_args=())
def silu_mul_backward(
    h: torch.Tensor, u: torch.Tensor, low: torch.Tensor | None, scale: float, w: torch.Tensor, use_triton: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """silu_mul_backward_reference's contract, by the Triton kernel when use_triton."""
    if not use_triton:
        return silu_mul_backward_reference(h, u, low, scale, w)
    from moe_qlora.moe.kernels.row_kernels import _silu_mul_backward_kernel

    grad_h, act = torch.empty_like(h), u.new_empty(u.shape)
    dot = torch.empty(u.shape[0], dtype=torch.float32, device=u.device)
    if h.shape[0] == 0:
        return grad_h, act, dot
    low_ = low if low is not None else u
    _silu_mul_backward_kernel[(h.shape[0],)](
        h,
        u,
        low_,
        w,
        grad_h,
        act,
        dot,
        float(scale),
        u.shape[1],
        h.stride(0),
        u.stride(0),
        low_.stride(0),
        grad_h.stride(0),
        act.stride(0),
        HAS_LOW=low is not None,
        BLOCK_I=_block(u.shape[1]),
    )
    return grad_h, act, dot


@silu_mul_backward.register_fake
def _silu_mul_backward_fake(h, u, low, scale, w, use_triton):
    return torch.empty_like(h), u.new_empty(u.shape), u.new_empty(u.shape[0], dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ combine


def combine_reference(rows, low, scale: float, inverse, weights, top_k: int) -> torch.Tensor:
    """(T, H): out[t] = sum over k of weights[t, k] * (rows + scale * low)[inverse[t K + k]] in fp32, rounded once
    to rows' dtype; weights (T, K) or None (a plain sum)."""
    out = rows.new_empty(inverse.shape[0] // top_k, rows.shape[1])
    tokens_per_piece = max(1, _CHUNK_ELEMENTS // max(top_k * rows.shape[1], 1))
    for t0 in range(0, out.shape[0], tokens_per_piece):
        t1 = min(t0 + tokens_per_piece, out.shape[0])
        index = inverse[t0 * top_k : t1 * top_k]
        v = rows.index_select(0, index).float()
        if low is not None:
            v += scale * low.index_select(0, index).float()
        v = v.view(t1 - t0, top_k, -1)
        if weights is not None:
            v = v * weights[t0:t1].float().unsqueeze(-1)
        out[t0:t1] = v.sum(1).to(rows.dtype)
    return out


@torch.library.custom_op("moe_qlora::combine", mutates_args=())
def combine(
    rows: torch.Tensor,
    low: torch.Tensor | None,
    scale: float,
    inverse: torch.Tensor,
    weights: torch.Tensor | None,
    top_k: int,
    use_triton: bool,
) -> torch.Tensor:
    """combine_reference's contract, by the Triton kernel when use_triton."""
    if not use_triton:
        return combine_reference(rows, low, scale, inverse, weights, top_k)
    from moe_qlora.moe.kernels.row_kernels import _combine_kernel

    tokens, hidden = inverse.shape[0] // top_k, rows.shape[1]
    out = rows.new_empty(tokens, hidden)
    if tokens == 0:
        return out
    block = _block(hidden)
    low_ = low if low is not None else rows
    weights_ = weights.reshape(-1) if weights is not None else inverse
    _combine_kernel[(tokens, -(-hidden // block))](
        rows,
        low_,
        inverse,
        weights_,
        out,
        float(scale),
        hidden,
        rows.stride(0),
        low_.stride(0),
        out.stride(0),
        K=top_k,
        HAS_LOW=low is not None,
        WEIGHTED=weights is not None,
        BLOCK_H=block,
    )
    return out


@combine.register_fake
def _combine_fake(rows, low, scale, inverse, weights, top_k, use_triton):
    return rows.new_empty(inverse.shape[0] // top_k, rows.shape[1])
