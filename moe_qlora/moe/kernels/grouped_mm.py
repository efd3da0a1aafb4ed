"""The dequantize + grouped GEMM backend (`model.kernels: grouped_mm`): the same three primitives as ops.py
(grouped_matmul, grouped_matmul_silu_mul, grouped_outer_product) on torch._grouped_mm.

Each NF4 projection is decoded whole into a compute-dtype tensor, then one grouped GEMM runs every expert's rows:
CUTLASS on sm_90, a loop on the CPU. Above `model.dequant_buffer_mb` (the `budget` argument) the stack is decoded a
window of output columns at a time, every expert's, and each window's GEMM runs all rows: the row ranges stay on the
device, so nothing here waits on the host. Only a stack whose windows cannot fall on quant blocks (an MXFP4 one, a
row length that is not whole blocks) is decoded a chunk of experts at a time, which needs each chunk's row range on
the host: one sync per projection call. LoRA is never merged into the decoded weights: its thin products are
grouped GEMMs of their own.

torch._grouped_mm's contract: mat_a (S, K) x mat_b (E, K, N) with offs (E,) int32 cumulative row ends
-> (S, N); or mat_a (M, S) x mat_b (S, N) -> (E, M, N), the sum over each group's rows (ragged K: OUT_PROD_ID).
Every non-unit stride must be a multiple of 16 bytes; narrower operands (tiny test models, rank 4 in bf16)
are zero-padded, which is exact.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from moe_qlora.moe.kernels.ops import GroupedWeight, LowRank, silu_mul
from moe_qlora.moe.nf4 import MAX_DECODE_ELEMENTS, NF4Stack

ALIGN_BYTES = 16


def has_fused_path(capability: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs its CUTLASS kernel on a CUDA GPU of this compute capability: bf16 operands
    and output on sm_90 / sm_100 (GroupedBlas.cpp's fast path). Elsewhere (Ampere, Ada, consumer Blackwell; fp32
    or fp16 anywhere) it falls back to one mm per expert after copying the offsets to the host: a sync and E
    launches per call, which the fused NF4 kernel never pays."""
    return capability[0] in (9, 10) and dtype == torch.bfloat16


def _pad_to(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """t zero-padded along `dim` to a multiple of `multiple` elements (t itself when already there)."""
    extra = -t.shape[dim] % multiple
    if not extra:
        return t
    pad = [0, 0] * (t.dim() - dim - 1) + [0, extra]
    return F.pad(t, pad)


def _elems(t: torch.Tensor) -> int:
    return max(1, ALIGN_BYTES // t.element_size())


def gmm_rows(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """(S, K) rows times (E, K, N) per-expert weights: (S, N), the rows ends[e-1]:ends[e] through expert e.
    Pads K and N to the 16-byte alignment torch._grouped_mm requires (zeros: exact)."""
    n = weights.shape[2]
    align = _elems(rows)
    if rows.shape[1] % align:
        rows, weights = _pad_to(rows, 1, align), _pad_to(weights, 1, align)
    if n % align:
        weights = _pad_to(weights, 2, align)
    if not (weights.stride(2) == 1 or weights.stride(1) == 1):
        weights = weights.contiguous()
    out = torch._grouped_mm(rows.contiguous(), weights, offs=ends)
    return out if out.shape[1] == n else out[:, :n]


def gmm_outer(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """(S, M) and (S, N) sorted rows: (E, M, N) with out[e] = a_e^T b_e over expert e's rows (ragged K)."""
    m, n = a.shape[1], b.shape[1]
    align = _elems(a)
    a, b = _pad_to(a, 1, align).contiguous(), _pad_to(b, 1, align).contiguous()
    out = torch._grouped_mm(a.t(), b, offs=ends)  # a.t(): (M, S) column-major, the layout ragged K needs
    # An expert without rows must get exactly zero; on sm_100 this mode leaves such groups unwritten (garbage,
    # possibly NaN: pytorch/pytorch#172439), so they are filled (masked_fill, not a product, which keeps NaN).
    empty = _EMPTY_GROUPS.get(ends)
    if empty is None:
        empty = _EMPTY_GROUPS[ends] = ends == torch.cat([ends.new_zeros(1), ends[:-1]])
    return out[:, :m, :n].masked_fill(empty[:, None, None], 0.0)


# Per layer call, made once: the int32 row ends torch._grouped_mm takes, by the (E+1,) offsets they come from, and
# which groups are empty, by those ends. Keyed by identity and held weakly: the routing plan keeps its offsets (and
# so these) from the forward to the end of the backward, and a layer call's dozen GEMMs share them (each was a
# launch of its own).
_ENDS = WeakIdKeyDictionary()
_EMPTY_GROUPS = WeakIdKeyDictionary()


def _ends(offsets: torch.Tensor) -> torch.Tensor:
    ends = _ENDS.get(offsets)
    if ends is None:
        ends = _ENDS[offsets] = offsets[1:].to(torch.int32)
    return ends


def _expert_of_rows(offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    rows = torch.arange(num_rows, device=offsets.device)
    return torch.searchsorted(offsets[1:], rows, right=True)


def _whole_stack(weight: GroupedWeight, dtype: torch.dtype, decoded: dict | None) -> torch.Tensor:
    """W_e of every expert as (E, K, N): an NF4 stack decoded whole, or taken from `decoded` (stored layout, by the
    weight's key) where this layer step decoded it already, and put there when `decoded` is given."""
    if decoded is None or weight.key is None or weight.quant is None:
        return _dense_experts(weight, 0, weight.shape[0], dtype)
    stored = decoded.get(weight.key)
    if stored is None:
        stored = decoded[weight.key] = weight.quant.decode(0, weight.shape[0], dtype)
    return stored.transpose(1, 2) if weight.transpose else stored


def _dense_experts(weight: GroupedWeight, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """W_e as (hi - lo, K, N) for experts lo..hi-1: NF4 decoded into a fresh buffer, dense ones viewed."""
    if weight.quant is not None:
        stored = weight.quant.decode(lo, hi, dtype)
    else:
        stored = weight.data[lo:hi].to(dtype)
    return stored.transpose(1, 2) if weight.transpose else stored


def dequant_budget_bytes(megabytes: float | None) -> int | None:
    """model.dequant_buffer_mb in bytes; None (no limit) for null or 0."""
    return int(megabytes * 2**20) if megabytes else None


def experts_per_chunk(num_experts: int, expert_bytes: int, budget: int | None) -> int:
    """Experts decoded at once under a `budget` of bytes (model.dequant_buffer_mb): all of them without one,
    else as many as fit, at least one."""
    if not budget:
        return num_experts
    return max(1, min(num_experts, budget // expert_bytes))


def window_granule(shape: tuple[int, int, int], transpose: bool, blocksize: int) -> int | None:
    """The output columns of W_e (N) a decode window of a stored (E, R, C) NF4 stack is a multiple of, so that it is
    whole quant blocks of every expert; None when no window is (a stored row that is not whole blocks read along N).
    Forward (transposed): N is the stored rows, and g rows of C codes fill whole blocks when g C is a multiple
    of the blocksize. Input gradient: N is the stored columns, each row's run of them whole blocks."""
    cols = shape[2]
    if transpose:
        return blocksize // math.gcd(cols, blocksize)
    return blocksize if cols % blocksize == 0 else None


def window_width(shape: tuple[int, int, int], transpose: bool, blocksize: int, itemsize: int, budget: int):
    """Columns of W_e decoded at once under `budget` bytes (a multiple of window_granule and of 16 bytes, at least
    one such step, at most bitsandbytes' element count per call), or None when the stack cannot be windowed."""
    granule = window_granule(shape, transpose, blocksize)
    if granule is None:
        return None
    granule = math.lcm(granule, ALIGN_BYTES // itemsize)  # whole 16-byte rows: no padding copy in gmm_rows
    column = shape[0] * (shape[2] if transpose else shape[1])  # one output column's elements over every expert
    fits = min(budget // (column * itemsize), MAX_DECODE_ELEMENTS // column)
    return max(granule, fits // granule * granule)


def window_columns(weight: GroupedWeight, itemsize: int, budget: int) -> int | None:
    """window_width of `weight`; None for dense and MXFP4 weights (decoded a chunk of experts at a time)."""
    if not isinstance(weight.quant, NF4Stack):
        return None
    return window_width(weight.shape, weight.transpose, weight.quant.blocksize, itemsize, budget)


def decode_peak_bytes(shape, transpose: bool, blocksize: int, itemsize: int, budget: int | None, rows: int) -> int:
    """The most bytes one projection of `rows` rows through a stored (E, R, C) NF4 stack holds for its decode: the
    whole decoded stack within `budget`; above it a window with its gathered codes and fp32 scales, the stack's
    fp32 scales decoded once, and the window's GEMM output before it is copied into place (what the plan
    counts as dequant_buffer)."""
    experts, stored_rows, cols = shape
    numel = experts * stored_rows * cols
    width = (
        window_width(shape, transpose, blocksize, itemsize, budget) if budget and numel * itemsize > budget else None
    )
    if width is None:
        return numel * itemsize
    window = numel // (stored_rows if transpose else cols) * width
    gathered = window // 2 + window // blocksize * 4
    return window * itemsize + gathered + numel // blocksize * 4 + rows * width * itemsize


def _project(rows, weight: GroupedWeight, offsets: torch.Tensor, budget: int | None, decoded: dict | None = None):
    """rows (S, K) sorted by expert -> (S, N) through each row's expert weight; an NF4 stack of more than
    `budget` bytes in the rows' dtype is decoded a window of columns at a time (_project_by_windows), or when it
    cannot be, a chunk of experts at a time (_project_by_experts). decoded: stacks decoded whole, shared by name
    (_whole_stack)."""
    num_experts = weight.shape[0]
    whole = num_experts * weight.k * weight.n * rows.element_size()
    if weight.quant is None or not budget or whole <= budget:
        return gmm_rows(rows, _whole_stack(weight, rows.dtype, decoded), _ends(offsets))
    width = window_columns(weight, rows.element_size(), budget)
    if width is not None:
        return _project_by_windows(rows, weight, offsets, width)
    return _project_by_experts(rows, weight, offsets, budget)


def _project_by_windows(rows, weight: GroupedWeight, offsets: torch.Tensor, width: int) -> torch.Tensor:
    """_project with W decoded `width` output columns at a time for every expert: one grouped GEMM of all rows
    per window, written into its columns of the output. The block scales are decoded once for every window;
    the windows' number comes from the shapes alone, so nothing waits on the host."""
    stack: NF4Stack = weight.quant
    scales = stack.experts_absmax(0, stack.num_experts)
    out = rows.new_empty(rows.shape[0], weight.n)
    ends = _ends(offsets)
    for first in range(0, weight.n, width):
        end = min(first + width, weight.n)
        if weight.transpose:  # W_e = stored^T: its columns are the stored rows
            window = stack.decode_rows(first, end, rows.dtype, scales).transpose(1, 2)
        else:
            window = stack.decode_columns(first, end, rows.dtype, scales)
        out[:, first:end] = gmm_rows(rows, window, ends)
    return out


def _project_by_experts(rows, weight: GroupedWeight, offsets: torch.Tensor, budget: int) -> torch.Tensor:
    """_project with W decoded a chunk of experts at a time (a stack no window fits): each chunk's rows are a
    data-dependent range, read on the host."""
    num_experts = weight.shape[0]
    expert_bytes = weight.shape[1] * weight.shape[2] * rows.element_size()
    chunk = experts_per_chunk(num_experts, expert_bytes, budget)
    host = offsets.tolist()  # the chunked mode's one sync: each chunk owns a data-dependent row range
    out = rows.new_empty(rows.shape[0], weight.n)
    for lo in range(0, num_experts, chunk):
        hi = min(lo + chunk, num_experts)
        first, last = host[lo], host[hi]
        if last > first:
            ends = (offsets[lo + 1 : hi + 1] - first).to(torch.int32)
            out[first:last] = gmm_rows(rows[first:last], _dense_experts(weight, lo, hi, rows.dtype), ends)
    return out


def grouped_matmul(
    x,
    weight: GroupedWeight,
    offsets: torch.Tensor,
    *,
    gather=None,
    bias=None,
    lora: LowRank | None = None,
    budget: int | None = None,
    decoded: dict | None = None,
):
    """Y (S, N) = x[gather] @ W_e + bias[e] + c P @ L_e per expert e's rows; ops.grouped_matmul_reference's
    contract with `offsets` an (E+1,) device tensor. budget: decoded-stack limit in bytes (None: none); decoded:
    the layer step's stacks decoded whole, shared by name."""
    y, low = grouped_matmul_parts(
        x, weight, offsets, gather=gather, bias=bias, lora=lora, budget=budget, decoded=decoded
    )
    return y if low is None else y.add_(low, alpha=lora.scale)


def grouped_matmul_parts(
    x, weight: GroupedWeight, offsets: torch.Tensor, *, gather=None, bias=None, lora=None, budget=None, decoded=None
):
    """grouped_matmul's two GEMM outputs apart: (x[gather] @ W_e + bias[e], P @ L_e or None), so that the row step
    that reads Y next adds c times the second on its way (kernels/rows.py) instead of a pass of its own."""
    rows = x if gather is None else x.index_select(0, gather)
    y = _project(rows, weight, offsets, budget, decoded)
    if bias is not None:
        y += bias.to(y.dtype).index_select(0, _expert_of_rows(offsets, y.shape[0]))
    if lora is None:
        return y, None
    return y, gmm_rows(
        lora.p.to(y.dtype), _dense_experts(lora.weight, 0, lora.weight.shape[0], y.dtype), _ends(offsets)
    )


def grouped_matmul_silu_mul(
    x, weight, offsets, *, gather=None, bias=None, lora=None, keep_h=True, budget=None, decoded=None
):
    """(h or None, silu(gate) * up) on a gate_up stack; grouped_matmul_silu_mul_reference's contract."""
    h = grouped_matmul(x, weight, offsets, gather=gather, bias=bias, lora=lora, budget=budget, decoded=decoded)
    return (h if keep_h else None), silu_mul(h)


def grouped_outer_product(a, b, offsets: torch.Tensor, *, gather=None):
    """G (E, M, N) fp32, G[e] = a_e^T b_e over expert e's rows (OUT_PROD_ID); grouped_outer_product_reference's
    contract. bf16 operands accumulate in fp32 inside the GEMM and round once at its output."""
    rows = a if gather is None else a.index_select(0, gather)
    return gmm_outer(rows, b.to(rows.dtype), _ends(offsets)).float()
