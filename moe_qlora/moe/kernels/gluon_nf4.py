"""A Hopper (sm_90) NF4 MUL_MAT_ID written in Gluon: the decoded weight is the wgmma's register A operand and a
wgmma stays in flight while the next chunk decodes (issue 67, item 2). Experimental: not yet run on a GPU, and used
by the layer's forward only with MOE_QLORA_GLUON=1 (ops._launch_matmul, where `serves`). Launchers:
`nf4_swapped_matmul` (down: Y plus the LoRA term) and `nf4_swapped_matmul_silu_mul` (gate_up with silu(gate) * up
fused); tests/moe/test_gpu.py checks their numerics, tests/moe/test_gluon_nf4.py what their SASS must show
(scripts/kernel_report.py --gluon).

The product is taken swapped, Y^T (N, T) = W_e (N, K) @ X^T (K, T): a program holds 128 weight rows, two blocks of
64 (one warpgroup's wgmma M each; with the GLU, 64 gate rows and their 64 up rows), and a tile of at most BLOCK_T
routed rows of one expert (the wgmma's N). The LoRA term c P L_e starts the accumulators: one wgmma of K 16 a block
for ranks up to 16. Per K-step of 128:
- the activations (BLOCK_T, 128) arrive by cp.async in one of four shared slots, two steps ahead;
- each thread reads its four weight rows' words a quarter step at a time (one 16-byte load a row) and decodes them
  in the wgmma's A-fragment layout itself (gluon_decode.py: a shift, a `shfl` of the NF4 level from the lane
  holding it, the fp32 scale, one rounding to bf16: bitsandbytes' dequantization bit for bit);
- every 16-wide chunk is one wgmma group a block, the second left in flight while the next chunk decodes: one group
  over a whole step let ptxas decode into one register set and drain each wgmma.
Shapes the launchers take: x (S, K) bf16 rows sorted by expert, a nested-scale NF4 stack (E, N, K) with K % 128 == 0
and N % 128 == 0 (GLU: N / 2 % 64 == 0), tiles (expert, first row, end row) on the device; out (S, N) bf16.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from moe_qlora.moe.kernels.gluon_decode import (
    BLOCK_K,
    BLOCK_N,
    CHUNK_LAYOUT,
    activation_slots,
    async_load,
    chunk_words,
    cta_barrier,
    decode_chunk,
    decode_setup,
    lane_levels_asm,
    lora_factors,
    program_tile,
    step_scales,
    store_outputs,
)
from moe_qlora.moe.kernels.gluon_nf4_sm80 import _nf4_swapped_kernel_sm80
from moe_qlora.moe.nf4 import NF4Stack


@gluon.jit
def _quarter_step(acc, xs, quarter, rows, i_w, scales, shift, levels, PENDING: gl.constexpr, w_l: gl.constexpr,
                  a_l: gl.constexpr):  # fmt: skip
    """A quarter step's two chunks of both row blocks: read their words, then per chunk decode, issue the two
    wgmmas and leave them in flight."""
    acc0, acc1 = acc
    chunks0 = chunk_words(gl.load(rows[0] + i_w * (BLOCK_K // 8) + 4 * quarter))
    chunks1 = chunk_words(gl.load(rows[2] + i_w * (BLOCK_K // 8) + 4 * quarter))
    for j in gl.static_range(2):
        b = xs.slice(32 * quarter + 16 * j, 16, dim=1).permute((1, 0))
        a0 = decode_chunk(chunks0[j], scales[0], shift, levels, w_l, a_l)
        acc0 = warpgroup_mma(a0, b, acc0, is_async=True)
        a1 = decode_chunk(chunks1[j], scales[1], shift, levels, w_l, a_l)
        acc1 = warpgroup_mma(a1, b, acc1, is_async=True)
        # the chunk's second group left in flight (none: drained, the tests' control); leaving both made ptxas 3.6
        # spill 8-24 bytes at 240 registers once the LoRA term was in the kernel
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=PENDING, deps=(acc0, acc1))
    return acc0, acc1


@gluon.jit
def _k_step(acc, i, steps, xs, x_next, rows, scale_ptrs, shift, levels, x_ptrs, PENDING: gl.constexpr,
            w_l: gl.constexpr, a_l: gl.constexpr):  # fmt: skip
    """One K-step of 128 for both blocks of 64 rows: copy step i + 2's activations into x_next, decode step i's
    weights chunk by chunk and multiply them with step i's activations in xs. acc: a pair; rows: (word pointers,
    first block pairs) of each block. The words are read a quarter step at a time: all sixteen a row at the
    step's start took 255 registers and spilled."""
    # Past the last step (the loop runs whole groups of four) the weights of the last step are read again and
    # scaled by 0: no masked loads, whose registers must be zeroed first.
    live = i < steps
    i_w = gl.minimum(i, steps - 1)
    absmax_ptr, absmax2_ptr, code2_ptr, offset2 = scale_ptrs
    s0 = step_scales(absmax_ptr, absmax2_ptr, code2_ptr, offset2, rows[1] + i_w, live)
    s1 = step_scales(absmax_ptr, absmax2_ptr, code2_ptr, offset2, rows[3] + i_w, live)
    async_copy.wait_group(1)
    cta_barrier()  # step i's slot landed for every thread, and every thread is past step i - 1's first wait
    async_load(x_next, x_ptrs + gl.minimum(i + 2, steps - 1) * BLOCK_K)  # past K: a slot no step reads
    async_copy.commit_group()
    fence_async_shared()
    acc = _quarter_step(acc, xs, 0, rows, i_w, (s0[0], s1[0]), shift, levels, PENDING, w_l, a_l)
    acc = _quarter_step(acc, xs, 1, rows, i_w, (s0[0], s1[0]), shift, levels, PENDING, w_l, a_l)
    acc = _quarter_step(acc, xs, 2, rows, i_w, (s0[1], s1[1]), shift, levels, PENDING, w_l, a_l)
    return _quarter_step(acc, xs, 3, rows, i_w, (s0[1], s1[1]), shift, levels, PENDING, w_l, a_l)


@gluon.jit
def _lora_term(factors, p_smem, acc_l: gl.constexpr, BLOCK_T: gl.constexpr):
    """(64, BLOCK_T) fp32 L_e^T P^T of a block: one wgmma of K = R_PAD (16 for ranks up to 16)."""
    return warpgroup_mma(factors, p_smem.permute((1, 0)), gl.zeros([64, BLOCK_T], gl.float32, acc_l))


@gluon.jit
def _nf4_swapped_kernel(
    x_ptr, gather_ptr, out_ptr, act_ptr, w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset2,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr, p_ptr, l_ptr, lora_scale,
    S, K, R, words_we, words_row, stride_xs, stride_os, stride_as, stride_pm, stride_le, stride_lr,
    stride_ln,
    LEVELS_ASM: gl.constexpr, BLOCK_T: gl.constexpr, ROW_STEP: gl.constexpr, R_PAD: gl.constexpr, GLU: gl.constexpr,
    STORE_Y: gl.constexpr, PENDING: gl.constexpr, UP_OFFSET: gl.constexpr, HAS_GATHER: gl.constexpr,
):  # fmt: skip
    """Block 0 holds weight rows n0 = program * ROW_STEP.., block 1 rows n0 + UP_OFFSET.. (the next 64, or with GLU
    the up rows of the gate rows in block 0). R_PAD > 0: the LoRA term lora_scale P[rows] @ L_e added in fp32."""
    e, start, end, n0, up0 = program_tile(tile_expert_ptr, tile_start_ptr, tile_end_ptr, ROW_STEP, UP_OFFSET)
    if start >= end:  # a spare tile of the upper-bound grid (ops.expert_tiles)
        return
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_T, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    w_l: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, CHUNK_LAYOUT))  # (n, h)

    rows, shift, levels = decode_setup(w_ptr, e, n0, up0, words_we, words_row, LEVELS_ASM)
    scale_ptrs = (absmax_ptr, absmax2_ptr, code2_ptr, offset2)
    steps = gl.cdiv(K, BLOCK_K)
    x_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_T, BLOCK_K], gl.bfloat16)
    slots, x_ptrs = activation_slots(x_ptr, gather_ptr, start, S, steps, stride_xs, x_sl, BLOCK_T, HAS_GATHER)
    x0, x1, x2, x3 = slots
    acc0 = gl.zeros([64, BLOCK_T], gl.float32, acc_l)
    acc1 = gl.zeros([64, BLOCK_T], gl.float32, acc_l)
    # The LoRA term first, as the accumulators' start: after the K loop its wgmma and a second accumulator made
    # ptxas serialize every wgmma of the kernel (the sum's order is all that changes).
    if R_PAD > 0:  # the tile's P rows (BLOCK_T, R_PAD) through shared memory, the MMA's B operand
        p_l: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (R_PAD // 8), R_PAD // 8], [4, 1], [1, 0])
        pt = gl.minimum(start + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, p_l)), S - 1)
        pr = gl.arange(0, R_PAD, layout=gl.SliceLayout(0, p_l))
        p_rows = gl.load(p_ptr + pt.to(gl.int64)[:, None] * stride_pm + pr[None, :], mask=(pr < R)[None, :], other=0.0)
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_T, R_PAD], gl.bfloat16)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_T, R_PAD], p_sl, p_rows.to(gl.bfloat16))
        fence_async_shared()
        l0 = lora_factors(l_ptr, e, n0, R, stride_le, stride_lr, stride_ln, a_l, R_PAD)
        acc0 = lora_scale * _lora_term(l0, p_smem, acc_l, BLOCK_T)
        l1 = lora_factors(l_ptr, e, up0, R, stride_le, stride_lr, stride_ln, a_l, R_PAD)
        acc1 = lora_scale * _lora_term(l1, p_smem, acc_l, BLOCK_T)
    acc = (acc0, acc1)
    for i in range(0, steps, 4):
        acc = _k_step(acc, i, steps, x0, x2, rows, scale_ptrs, shift, levels, x_ptrs, PENDING, w_l, a_l)
        acc = _k_step(acc, i + 1, steps, x1, x3, rows, scale_ptrs, shift, levels, x_ptrs, PENDING, w_l, a_l)
        acc = _k_step(acc, i + 2, steps, x2, x0, rows, scale_ptrs, shift, levels, x_ptrs, PENDING, w_l, a_l)
        acc = _k_step(acc, i + 3, steps, x3, x1, rows, scale_ptrs, shift, levels, x_ptrs, PENDING, w_l, a_l)
    acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=acc)
    async_copy.wait_group(0)

    store_outputs(acc0, acc1, out_ptr, act_ptr, n0, up0, start, end, stride_os, stride_as, acc_l, BLOCK_T, GLU, STORE_Y)


def swapped_launch(
    x, stack: NF4Stack, tiles, out, block_t=64, pending=1, arch=None, *, lora=None, act=None, gather=None
):
    """(kernel, grid, args, kwargs) of one launch: what `nf4_swapped_matmul` runs and the AOT test compiles, for
    sm_`arch` (default: the current GPU's; below 90, gluon_nf4_sm80's kernel). tiles: (expert, first row, end row)
    int32 tensors of equal length, each tile at most block_t rows. lora: ops.LowRank (P (S, R) bf16, L a dense
    GroupedWeight (E, R, N), R <= 64). act: GLU, the (S, I) output of silu(gate) * up from a gate_up stack
    (N = 2 I); out (S, N) may then be None (the pre-activations not kept). gather (S,): sorted row s reads
    x[gather[s]] (x (T, K), T tokens), as the gate_up launch does."""
    E, N, K = stack.shape
    rows_step = 64 if act is not None else BLOCK_N.value
    rows_split = N // 2 if act is not None else N
    rank = lora.p.shape[1] if lora is not None else 0
    if (
        stack.nested is None
        or stack.blocksize != 64
        or rows_split % rows_step
        or K % BLOCK_K.value
        or x.dtype != torch.bfloat16
        or rank > 64
        or (lora is not None and lora.weight.quant is not None)
        or E * N * K // 8 >= 2**31
    ):
        raise ValueError(
            "the Gluon NF4 kernel takes bf16 rows, a nested-scale stack of blocksize 64 with K % 128 == 0 and N %"
            f" 128 == 0 (GLU: N / 2 % 64 == 0), and a dense LoRA of rank <= 64; got {x.dtype}, blocksize"
            f" {stack.blocksize}, nested {stack.nested is not None}, (E, N, K) = {stack.shape}, rank {rank}"
            " (and fewer than 2^31 words of codes)"
        )
    absmax2, code2, offset2 = stack.nested
    dummy = x
    p, l_weight, scale = (lora.p, lora.weight, float(lora.scale)) if lora is not None else (dummy, None, 0.0)
    l_strides = l_weight.strides() if l_weight is not None else (0, 0, 0)
    rows = gather.numel() if gather is not None else x.shape[0]
    args = (x, gather if gather is not None else dummy, out if out is not None else dummy)
    args += (act if act is not None else dummy, stack.packed.view(torch.int32))
    args += (stack.absmax.view(torch.int16), absmax2, code2, float(offset2), *tiles, p)
    args += (l_weight.data if l_weight is not None else dummy, scale, rows, K, rank)
    args += (N * K // 8, K // 8, x.stride(0))
    args += (out.stride(0) if out is not None else 0, act.stride(0) if act is not None else 0, p.stride(0))
    args += l_strides
    kwargs = dict(
        LEVELS_ASM=lane_levels_asm(),
        BLOCK_T=block_t,
        ROW_STEP=rows_step,
        R_PAD=0 if rank == 0 else max(16, 1 << (rank - 1).bit_length()),  # a power of two: arange, layouts
        GLU=act is not None,
        STORE_Y=out is not None,
        PENDING=pending,
        UP_OFFSET=N // 2 if act is not None else 64,
        HAS_GATHER=gather is not None,
        num_warps=4,
    )
    grid = (tiles[0].numel(), rows_split // rows_step)
    if arch is None:
        major, minor = torch.cuda.get_device_capability(x.device)
        arch = 10 * major + minor
    # At most 240 registers (two CTAs an SM) on sm_90, where ptxas took 250 left alone. On sm_80 a cap makes
    # ptxas spill the plain launch (32-56 bytes at 232-255; 181 registers uncapped), and without one Triton 3.9's
    # ptxas held the fused GLU epilogue at 168 and spilled 8 bytes (240: none).
    if arch < 90:
        return _nf4_swapped_kernel_sm80, grid, args, dict(kwargs, maxnreg=240) if act is not None else kwargs
    return _nf4_swapped_kernel, grid, args, dict(kwargs, maxnreg=240)


def nf4_swapped_matmul(x, stack: NF4Stack, tiles, block_t: int = 64, arch: int | None = None, *, lora=None):
    """out (S, N) bf16: row s of x (S, K) times expert e's W_e^T (K, N) for the tile (e, first, end) holding s,
    plus lora.scale P[s] @ L_e (a row no tile holds is left unwritten). arch: whose kernel (default the GPU's; 80
    runs the mma_v2 kernel, which an sm_90 GPU runs too)."""
    out = torch.empty(x.shape[0], stack.shape[1], dtype=torch.bfloat16, device=x.device)
    if tiles[0].numel() > 0:
        kernel, grid, args, kwargs = swapped_launch(x, stack, tiles, out, block_t, arch=arch, lora=lora)
        kernel[grid](*args, **kwargs)
    return out


def nf4_swapped_matmul_silu_mul(x, stack: NF4Stack, tiles, block_t=64, arch=None, *, lora=None, keep_h=True,
                                gather=None):  # fmt: skip
    """(h (S, 2 I) or None, act (S, I) = silu(gate) * up): nf4_swapped_matmul over a gate_up stack (gate rows
    first) with transformers' gating fused into the epilogue; with gather, sorted row s is token gather[s] of x."""
    rows, n = (gather.numel() if gather is not None else x.shape[0]), stack.shape[1]
    h = torch.empty(rows, n, dtype=torch.bfloat16, device=x.device) if keep_h else None
    act = torch.empty(rows, n // 2, dtype=torch.bfloat16, device=x.device)
    if tiles[0].numel() > 0:
        kernel, grid, args, kwargs = swapped_launch(
            x, stack, tiles, h, block_t, arch=arch, lora=lora, act=act, gather=gather
        )
        kernel[grid](*args, **kwargs)
    return h, act


def tiles_of_offsets(offsets: list[int], block_t: int, device) -> tuple[torch.Tensor, ...]:
    """(expert, first row, end row) int32 of every tile of at most block_t sorted rows, from the host offsets
    (E + 1,) of each expert's rows: an expert without rows has no tile."""
    experts, starts, ends = [], [], []
    for e, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        for first in range(lo, hi, block_t):
            experts.append(e), starts.append(first), ends.append(min(first + block_t, hi))
    return tuple(torch.tensor(v, dtype=torch.int32, device=device) for v in (experts, starts, ends))


def serves(x, weight, *, gather, bias, lora, glu: bool, capability: tuple[int, int]) -> bool:
    """Whether these kernels compute an ops._launch_matmul launch: a forward (W_e the stored matrix transposed) over
    a nested-scale NF4 stack of blocksize 64 in bf16 on sm_80 to sm_90, no bias, K % 128 == 0 and N % 128 == 0
    (GLU: N / 2 % 64 == 0), a dense LoRA of rank <= 64 with its P in bf16 rows."""
    q = weight.quant
    if not ((8, 0) <= tuple(capability) < (10, 0)) or x.dtype != torch.bfloat16 or x.stride(-1) != 1:
        return False
    if not isinstance(q, NF4Stack) or q.nested is None or q.blocksize != 64 or not weight.transpose or bias is not None:
        return False
    rows_ok = weight.n % 2 == 0 and (weight.n // 2) % 64 == 0 if glu else weight.n % BLOCK_N.value == 0
    if weight.k % BLOCK_K.value or not rows_ok or not q.packed.is_contiguous():
        return False
    if gather is not None and gather.stride(0) != 1:
        return False
    # the int32 and int16 views of the codes and scales, 16-byte copies of x's rows, block pairs counted in int32
    views_ok = q.packed.storage_offset() % 4 == 0 and q.absmax.is_contiguous() and q.absmax.storage_offset() % 2 == 0
    if not views_ok or x.data_ptr() % 16 or x.stride(0) % 8 or q.packed.numel() // 4 >= 2**31:
        return False
    return lora is None or (
        lora.weight.quant is None and lora.p.shape[1] <= 64 and lora.p.dtype == torch.bfloat16 and lora.p.stride(1) == 1
    )


def serves_launch(x, weight, *, gather, bias, lora, glu: bool) -> bool:
    """`serves` on x's GPU."""
    return serves(
        x, weight, gather=gather, bias=bias, lora=lora, glu=glu, capability=torch.cuda.get_device_capability(x.device)
    )


def forward(x, weight, listed, y, act, *, gather, lora, block_t: int = 64):
    """ops._launch_matmul's (Y or None, act or None) by these kernels (tiles.KernelSettings.gluon, where
    `serves_launch`). listed: (3, tiles) int32 (expert, first row, end row) of block_t rows, spare ones empty
    (ops.expert_tiles); y (S, N) and act (S, N / 2, the GLU): the launch's outputs, allocated by the caller."""
    kernel, grid, args, kwargs = swapped_launch(
        x, weight.quant, tuple(listed), y, block_t, lora=lora, act=act, gather=gather
    )
    kernel[grid](*args, **kwargs)
    return y, act
