"""Launchers of the Triton kernels and, beside each, the plain-torch reference that is its oracle.

grouped_matmul:          Y[s] = X[row(s)] @ W_e(s) (+ b_e(s)) (+ c P[s] @ L_e(s))   MUL_MAT_ID, NF4 or dense
grouped_matmul_silu_mul: the same on gate_up stacks, also giving silu(gate) * up in the epilogue
grouped_outer_product:   G[e] = sum over rows s of e of a[s] (x) b[s]    OUT_PROD_ID, the LoRA gradients
Rows are sorted by expert (routing.RoutedTokens); `offsets` gives each expert's row range.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from moe_qlora.moe.kernels import tiles
from moe_qlora.moe.mxfp4 import E2M1, MXFP4Stack
from moe_qlora.moe.nf4 import NF4_LEVELS, NF4Stack


@dataclass(frozen=True)
class GroupedWeight:
    """W_e[k, n] of every expert e, read from a dense (E, R, C) tensor or a quantized stack (E, R, C), NF4 or
    MXFP4, with `transpose` saying whether W_e is the stored matrix (k = row) or its transpose (k = column)."""

    data: torch.Tensor  # dense (E, R, C), or the quantized stack's packed bytes
    shape: tuple[int, int, int]  # stored (E, R, C)
    transpose: bool
    quant: NF4Stack | MXFP4Stack | None = None
    key: str | None = None  # the stack's name in a layer ("gate_up", "down"): its decode may be shared by name

    @classmethod
    def dense(cls, w: torch.Tensor, *, transpose: bool) -> GroupedWeight:
        return cls(w, tuple(w.shape), transpose)

    @classmethod
    def quantized(cls, stack: NF4Stack | MXFP4Stack, *, transpose: bool, key: str | None = None) -> GroupedWeight:
        return cls(stack.packed, tuple(stack.shape), transpose, stack, key)

    @property
    def k(self) -> int:
        return self.shape[2] if self.transpose else self.shape[1]

    @property
    def n(self) -> int:
        return self.shape[1] if self.transpose else self.shape[2]

    def strides(self) -> tuple[int, int, int]:
        """(per expert, per k, per n) in elements of the flat stack (quantized: elements, not bytes)."""
        if self.quant is None:
            se, sr, sc = self.data.stride()
        else:
            se, sr, sc = self.shape[1] * self.shape[2], self.shape[2], 1
        return (se, sc, sr) if self.transpose else (se, sr, sc)

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """W_e as a (K, N) tensor (the reference path: one expert dequantized at a time)."""
        w = self.quant.decode(e, e + 1, dtype)[0] if self.quant is not None else self.data[e].to(dtype)
        return w.t() if self.transpose else w


@dataclass(frozen=True)
class LowRank:
    """The LoRA term c * P[s] @ L_e(s) added to a grouped matmul's rows: P (S, R) holds the sorted rows' rank-R
    factor (x A^T in the forward, c g B in the input gradient), L (E, R, N) the experts' other factor."""

    p: torch.Tensor
    weight: GroupedWeight
    scale: float = 1.0


# ------------------------------------------------------------------------------------- torch references


def grouped_matmul_reference(x, weight: GroupedWeight, offsets: list[int], *, gather=None, bias=None, lora=None):
    """Y (S, N) with Y[s] = x[gather[s]] @ W_e + bias[e] + c P[s] @ L_e for the rows s of each expert e.
    x: (T or S, K); lora: LowRank or None."""
    rows = x if gather is None else x.index_select(0, gather)
    y = x.new_zeros(offsets[-1], weight.n)
    for e in range(len(offsets) - 1):
        lo, hi = offsets[e], offsets[e + 1]
        if hi > lo:
            y[lo:hi] = rows[lo:hi] @ weight.expert(e, x.dtype)
            if bias is not None:
                y[lo:hi] += bias[e].to(x.dtype)
            if lora is not None:
                y[lo:hi] += lora.scale * (lora.p[lo:hi] @ lora.weight.expert(e, x.dtype))
    return y


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """transformers' default gating of a gate_up output: silu(gate) * up, gate and up the two halves of h."""
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def grouped_matmul_silu_mul_reference(x, weight, offsets, *, gather=None, bias=None, lora=None, keep_h=True):
    """(h, silu(gate) * up): h (S, 2I) = grouped_matmul_reference(...) on a gate_up stack, or None if not
    keep_h; the activation (S, I)."""
    h = grouped_matmul_reference(x, weight, offsets, gather=gather, bias=bias, lora=lora)
    return (h if keep_h else None), silu_mul(h)


def grouped_outer_product_reference(a, b, offsets: list[int], *, gather=None):
    """G (E, M, N) fp32 with G[e] = a_e^T b_e over the rows of expert e. a: (T or S, M), b: (S, N)."""
    rows = a if gather is None else a.index_select(0, gather)
    out = torch.zeros(len(offsets) - 1, a.shape[1], b.shape[1], dtype=torch.float32, device=a.device)
    for e in range(len(offsets) - 1):
        lo, hi = offsets[e], offsets[e + 1]
        if hi > lo:
            out[e] = rows[lo:hi].float().t() @ b[lo:hi].float()
    return out


# ------------------------------------------------------------------------------------------ launchers


def tile_bound(num_rows: int, num_experts: int, block_m: int, group_m: int = 1) -> int:
    """The most BLOCK_M-row tiles S rows sorted over E experts can fill, rounded up to whole groups of group_m:
    the row tiles of a grouped launch's grid."""
    bound = -(-num_rows // block_m) + min(num_experts, num_rows)
    return -(-bound // max(group_m, 1)) * max(group_m, 1)


def expert_tiles(offsets: torch.Tensor, num_rows: int, block_m: int, group_m: int = 1) -> torch.Tensor:
    """(num_tiles, 3) int32 (expert, first row, end row) of each BLOCK_M-row tile, built on the device.

    The grid size must not depend on the data (no host sync), so it is the upper bound
    ceil(S / BLOCK_M) + min(E, S) (each expert with rows, at most S of them, wastes at most one partial
    tile), rounded up to whole groups of group_m: tile_bound(S, E, BLOCK_M, group_m). Tile i belongs to the expert whose
    cumulative tile count first exceeds i, and tiles past the last one are (0, 0, 0), which the kernel
    skips at once. offsets: (E+1,) int64 device tensor."""
    counts = offsets[1:] - offsets[:-1]
    tiles_per_expert = (counts + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles_per_expert, 0)
    num_experts = counts.shape[0]
    tile = torch.arange(tile_bound(num_rows, num_experts, block_m, group_m), device=offsets.device)
    expert = torch.searchsorted(tile_ends, tile, right=True)
    valid = expert < num_experts
    expert = expert.clamp(max=num_experts - 1)
    first = offsets[expert] + (tile - (tile_ends[expert] - tiles_per_expert[expert])) * block_m
    end = offsets[expert + 1]
    zero = torch.zeros_like(first)
    return torch.stack(
        [torch.where(valid, expert, zero), torch.where(valid, first, zero), torch.where(valid, end, zero)], dim=1
    ).to(torch.int32)


def device_offsets(offsets, device) -> torch.Tensor:
    """(E+1,) int64 offsets on `device`: a device tensor as is, a host list (the tests' form) copied once."""
    if isinstance(offsets, torch.Tensor):
        return offsets
    return _offsets_tensor(tuple(offsets), str(device))


def _num_rows(offsets, x, gather) -> int:
    if not isinstance(offsets, torch.Tensor):
        return offsets[-1]
    return gather.shape[0] if gather is not None else x.shape[0]


@functools.cache
def _levels(device: str, mxfp4: bool = False) -> torch.Tensor:
    """The 16 values a code decodes to: NF4's levels, or MXFP4's e2m1 values (cached tensors are made real even
    when first asked under a fake mode: a cached fake one would reach a later real launch)."""
    with unset_fake_temporarily():
        return torch.tensor(E2M1 if mxfp4 else NF4_LEVELS, dtype=torch.float32, device=device)


# What Triton's autotuner times anew.
_MATMUL_TUNE_KEYS = "K N R rows_class BLOCK_M W_NF4 NESTED MXFP4 GATHER GLU HAS_LORA K_PACKED N_PACKED SWAP_AB PHASE"
_MATMUL_TUNE_KEYS = _MATMUL_TUNE_KEYS.split()


@functools.cache
def _autotuned_matmul(arch: int, candidates: tuple[tiles.MatmulConfig, ...]):
    """_grouped_matmul_kernel under Triton's autotuner over `candidates` (those of `arch`'s list that serve the
    launch), timed once per key (shapes and variant) on first use; the kernel only writes its outputs, so
    repeated timing runs are harmless."""
    import triton

    from moe_qlora.moe.kernels.triton_kernels import _grouped_matmul_kernel

    configs = [
        triton.Config({"BLOCK_N": c.block_n, "BLOCK_K": c.block_k}, num_warps=c.num_warps, num_stages=c.num_stages)
        for c in candidates
    ]
    return triton.autotune(configs=configs, key=_MATMUL_TUNE_KEYS)(_grouped_matmul_kernel)


def _launch_matmul(x, weight: GroupedWeight, offsets, *, gather, bias, lora, glu: bool, keep_y: bool):
    """Run _grouped_matmul_kernel; returns (Y or None, act or None)."""
    from moe_qlora.moe.kernels import triton_kernels

    configs = tiles.matmul_plan(x.device, x.dtype)
    # fp32 on its own config (tiles.FP32_CONFIG): not swapped, not tall
    fp32 = x.dtype == torch.float32 and tiles.kernel_settings().fp32_own_config
    n = weight.n // 2 if glu else weight.n
    num_rows = _num_rows(offsets, x, gather)
    y = x.new_empty(num_rows, weight.n) if keep_y else None
    act = x.new_empty(num_rows, n) if glu else None
    if num_rows == 0:
        return y, act
    if tiles.kernel_settings().gluon and x.is_cuda:  # the experimental Gluon kernels, where they serve
        from moe_qlora.moe.kernels import gluon_nf4

        if gluon_nf4.serves_launch(x, weight, gather=gather, bias=bias, lora=lora, glu=glu):
            listed = expert_tiles(device_offsets(offsets, x.device), num_rows, 64).t().contiguous()
            return gluon_nf4.forward(x, weight, listed, y, act, gather=gather, lora=lora)
    q = weight.quant
    mxfp4 = isinstance(q, MXFP4Stack)
    nested = q is not None and q.nested is not None
    scales = (q.scales if mxfp4 else q.absmax) if q is not None else x
    absmax, absmax2, code2, offset2 = (q.absmax, *q.nested) if nested else (scales, x, x, 0.0)
    se, sk, sn = weight.strides()
    lp, lw, rank, lse, lsr, lsn = (
        (lora.p, lora.weight.data, lora.weight.k, *lora.weight.strides()) if lora else (x, x, 0, 0, 0, 0)
    )
    out, act_out = (y if y is not None else act), (act if act is not None else x)
    # NF4 read along its contiguous dim as whole 4-byte words: each column (K_PACKED, the forward) or row
    # (N_PACKED, through the transposed experts) of a tile starts on a quant block, and with every candidate
    # the path is chosen over a tile step stays within one.
    narrow = tiles.path_candidates(configs, x.device)
    words = q is not None and q.packed.is_contiguous() and q.packed.storage_offset() % 4 == 0 and se % q.blocksize == 0

    def packed_steps(c, along_n: bool) -> bool:
        """c's step packs and never runs past the packed dim's end: implied for NF4 (a step divides the 64-code
        block, and the dim is whole blocks), not for MXFP4's steps of several 32-code blocks (in = 96, say)."""
        whole_steps = weight.n % c.block_n == 0 if along_n else weight.k % c.block_k == 0
        return c.packs(q.blocksize, along_n, mxfp4) and whole_steps

    k_packed = words and sk == 1 and sn % q.blocksize == 0 and all(packed_steps(c, False) for c in narrow)
    n_packed = words and not glu and sn == 1 and sk % q.blocksize == 0 and all(packed_steps(c, True) for c in narrow)
    w = weight.data.view(torch.int32) if k_packed or n_packed else weight.data
    swap = (
        (k_packed or n_packed)
        and tiles.block_override() is None
        and not fp32
        and num_rows <= tiles.SWAP_AB_MAX_ROWS * weight.shape[0]
    )
    tall = not fp32 and tiles.takes_tall_tiles(num_rows, weight.shape[0], swap)
    configs = tiles.launch_candidates(configs, x.device, k_packed=k_packed, glu=glu, swap=swap, tall=tall)
    if (k_packed or n_packed) and not all(packed_steps(c, n_packed) for c in configs):
        # the path was chosen over the narrow candidates; a launched one whose step spans two quant blocks
        # would decode a whole step with one block's scale
        raise RuntimeError(f"packed NF4 path chosen, but a candidate's step spans quant blocks: {configs}")
    bm = tiles.SWAP_AB_BLOCK_M if swap else configs[0].block_m  # the candidates share their class's BLOCK_M
    row_tiles = tile_bound(num_rows, weight.shape[0], bm)  # before padding to whole groups
    group = max(tiles.group_m(bm, weight.k, x.element_size()) or row_tiles, -(-row_tiles // 65535))  # z <= 65,535
    tile_map = expert_tiles(device_offsets(offsets, x.device), num_rows, bm, group)
    groups = tile_map.shape[0] // group
    default = configs[0]
    n_blocks = -(-n // default.block_n)
    # the split from the tiles before their padding to whole groups (the same split as before grouping)
    split = tiles.split_k(row_tiles * n_blocks, -(-weight.k // default.block_k))
    if split > 1:  # both launches must agree on the blocks: the default config, not autotuned
        configs = configs[:1]
    if len(configs) > 1:
        kernel, meta = _autotuned_matmul(tiles.target_arch(x.device), tuple(configs)), {}
    else:
        kernel = triton_kernels._grouped_matmul_kernel
        meta = dict(
            BLOCK_N=default.block_n, BLOCK_K=default.block_k, num_warps=default.num_warps, num_stages=default.num_stages
        )
    ws = (
        x.new_empty(
            tile_map.shape[0] * n_blocks * split * (2 if glu else 1) * bm * default.block_n, dtype=torch.float32
        )
        if split > 1
        else x
    )
    args = (
        x,
        gather if gather is not None else tile_map,
        tile_map,
        w,
        _levels(str(x.device), mxfp4),
        absmax,
        absmax2,
        code2,
        float(offset2),
        bias if bias is not None else x,
        lp,
        lw,
        float(lora.scale if lora else 0.0),
        out,
        act_out,
        ws,
        weight.k,
        n,
        rank,
        x.stride(0),
        x.stride(1),
        se,
        sk,
        sn,
        se // 8,
        sk // 8,
        sn // 8,
        bias.stride(0) if bias is not None else 0,
        lp.stride(0),
        lp.stride(1),
        lse,
        lsr,
        lsn,
        out.stride(0),
        out.stride(1),
        act_out.stride(0),
        act_out.stride(1),
        tiles.rows_class(num_rows, weight.shape[0]),
    )
    flags = dict(
        W_NF4=q is not None,
        NESTED=nested,
        MXFP4=mxfp4,
        GATHER=gather is not None,
        HAS_BIAS=bias is not None,
        HAS_LORA=lora is not None,
        GLU=glu,
        STORE_Y=keep_y,
        K_PACKED=k_packed,
        N_PACKED=n_packed,
        SWAP_AB=swap,
        SPLIT_K=split,
        EVEN_K=all(weight.k % c.block_k == 0 for c in configs),
        BLOCKSIZE=q.blocksize if q else 64,
        IEEE=x.dtype == torch.float32,
        DOT_FP32=tiles.interpreted(),
        BLOCK_M=bm,
        **meta,
    )
    # one program per (row tile, N block), launched a group of row tiles at a time (triton_kernels._output_block)
    if split == 1:
        kernel[lambda m: (group, -(-n // m["BLOCK_N"]), groups)](*args, PHASE=0, **flags)
    else:  # partial sums over each split's K-steps, then their sum in split order and the epilogue
        kernel[(group, n_blocks * split, groups)](*args, PHASE=1, **flags)
        kernel[(group, n_blocks, groups)](*args, PHASE=2, **flags)
    return y, act


def grouped_matmul(x, weight: GroupedWeight, offsets: list[int], *, gather=None, bias=None, lora=None):
    """Triton MUL_MAT_ID; same contract as grouped_matmul_reference. NF4 tiles are decoded in registers and
    the LoRA term is added in the epilogue."""
    return _launch_matmul(x, weight, offsets, gather=gather, bias=bias, lora=lora, glu=False, keep_y=True)[0]


def grouped_matmul_silu_mul(x, weight, offsets, *, gather=None, bias=None, lora=None, keep_h=True):
    """Triton gate_up projection with silu(gate) * up fused into its epilogue; same contract as
    grouped_matmul_silu_mul_reference. Without keep_h (no backward to come) h is never written."""
    return _launch_matmul(x, weight, offsets, gather=gather, bias=bias, lora=lora, glu=True, keep_y=keep_h)


@functools.lru_cache(maxsize=16)
def _offsets_tensor(offsets: tuple[int, ...], device: str) -> torch.Tensor:
    with unset_fake_temporarily():
        return torch.tensor(offsets, dtype=torch.int64, device=device)


def grouped_outer_product(a, b, offsets: list[int], *, gather=None):
    """Triton OUT_PROD_ID; same contract as grouped_outer_product_reference."""
    from moe_qlora.moe.kernels.triton_kernels import _grouped_outer_product_kernel

    bm, bn, bs = tiles.block_override() or (tiles.OUTER_BLOCKS_FP32 if a.dtype == torch.float32 else tiles.OUTER_BLOCKS)
    num_experts, m, n = len(offsets) - 1, a.shape[1], b.shape[1]
    out = torch.empty(num_experts, m, n, dtype=torch.float32, device=a.device)
    offs = device_offsets(offsets, a.device)
    grid = (num_experts, -(-m // bm) * -(-n // bn))
    _grouped_outer_product_kernel[grid](
        a,
        gather if gather is not None else offs,
        b,
        offs,
        out,
        m,
        n,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        GATHER=gather is not None,
        IEEE=a.dtype == torch.float32,
        DOT_FP32=tiles.interpreted(),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_S=bs,
    )
    return out
