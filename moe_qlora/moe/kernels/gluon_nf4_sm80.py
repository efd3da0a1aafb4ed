"""The Gluon NF4 MUL_MAT_ID of gluon_nf4.py for sm_80 / sm_86 / sm_89 (A100, RTX 3090 / 4090): the same decode into
the A fragment (mma.m16n8k16's register layout is the wgmma's), fed to `mma_v2` (HMMA) from registers; the
activations go through shared memory by cp.async as there and reach the MMA by ldmatrix. Experimental: not yet run
on a GPU; gluon_nf4.swapped_launch picks it for arch < 90.

A program holds 128 weight rows (two blocks of 64: each warp has 16 rows of each) and BLOCK_T routed rows; each
16-wide chunk's activation fragment is read once and multiplied with both blocks.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from moe_qlora.moe.kernels.gluon_decode import (
    BLOCK_K,
    CHUNK_LAYOUT,
    activation_slots,
    async_load,
    chunk_words,
    cta_barrier,
    decode_chunk,
    decode_setup,
    lora_factors,
    program_tile,
    step_scales,
    store_outputs,
)


@gluon.jit
def _quarter_step(acc, xs, quarter, rows, i_w, scales, shift, levels, w_l: gl.constexpr, a_l: gl.constexpr,
                  b_l: gl.constexpr):  # fmt: skip
    """A quarter step's two chunks of both row blocks: read their words, then per chunk load the activations'
    fragment (ldmatrix) and decode and multiply each block's weights."""
    acc0, acc1 = acc
    chunks0 = chunk_words(gl.load(rows[0] + i_w * (BLOCK_K // 8) + 4 * quarter))
    chunks1 = chunk_words(gl.load(rows[2] + i_w * (BLOCK_K // 8) + 4 * quarter))
    for j in gl.static_range(2):
        b = xs.slice(32 * quarter + 16 * j, 16, dim=1).permute((1, 0)).load(b_l)
        acc0 = mma_v2(decode_chunk(chunks0[j], scales[0], shift, levels, w_l, a_l), b, acc0)
        acc1 = mma_v2(decode_chunk(chunks1[j], scales[1], shift, levels, w_l, a_l), b, acc1)
    return acc0, acc1


@gluon.jit
def _k_step(acc, i, steps, xs, x_next, rows, scale_ptrs, shift, levels, x_ptrs, w_l: gl.constexpr,
            a_l: gl.constexpr, b_l: gl.constexpr):  # fmt: skip
    """One K-step of 128: copy step i + 2's activations into x_next, decode and multiply step i's (as gluon_nf4)."""
    live = i < steps
    i_w = gl.minimum(i, steps - 1)
    absmax_ptr, absmax2_ptr, code2_ptr, offset2 = scale_ptrs
    s0 = step_scales(absmax_ptr, absmax2_ptr, code2_ptr, offset2, rows[1] + i_w, live)
    s1 = step_scales(absmax_ptr, absmax2_ptr, code2_ptr, offset2, rows[3] + i_w, live)
    async_copy.wait_group(1)
    cta_barrier()  # step i's slot landed for every thread, and every thread is done reading step i - 1's
    async_load(x_next, x_ptrs + gl.minimum(i + 2, steps - 1) * BLOCK_K)  # past K: a slot no step reads
    async_copy.commit_group()
    acc = _quarter_step(acc, xs, 0, rows, i_w, (s0[0], s1[0]), shift, levels, w_l, a_l, b_l)
    acc = _quarter_step(acc, xs, 1, rows, i_w, (s0[0], s1[0]), shift, levels, w_l, a_l, b_l)
    acc = _quarter_step(acc, xs, 2, rows, i_w, (s0[1], s1[1]), shift, levels, w_l, a_l, b_l)
    return _quarter_step(acc, xs, 3, rows, i_w, (s0[1], s1[1]), shift, levels, w_l, a_l, b_l)


@gluon.jit
def _nf4_swapped_kernel_sm80(
    x_ptr, gather_ptr, out_ptr, act_ptr, w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset2,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr, p_ptr, l_ptr, lora_scale,
    S, K, R, words_we, words_row, stride_xs, stride_os, stride_as, stride_pm, stride_le, stride_lr,
    stride_ln,
    LEVELS_ASM: gl.constexpr, BLOCK_T: gl.constexpr, ROW_STEP: gl.constexpr, R_PAD: gl.constexpr, GLU: gl.constexpr,
    STORE_Y: gl.constexpr, PENDING: gl.constexpr, UP_OFFSET: gl.constexpr, HAS_GATHER: gl.constexpr,
):  # fmt: skip
    """gluon_nf4._nf4_swapped_kernel's contract (PENDING is unused: mma_v2 is synchronous)."""
    e, start, end, n0, up0 = program_tile(tile_expert_ptr, tile_start_ptr, tile_end_ptr, ROW_STEP, UP_OFFSET)
    if start >= end:  # a spare tile of the upper-bound grid (ops.expert_tiles)
        return
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=acc_l, k_width=2)
    w_l: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, CHUNK_LAYOUT))  # (n, h)

    rows, shift, levels = decode_setup(w_ptr, e, n0, up0, words_we, words_row, LEVELS_ASM)
    scale_ptrs = (absmax_ptr, absmax2_ptr, code2_ptr, offset2)
    steps = gl.cdiv(K, BLOCK_K)
    x_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    slots, x_ptrs = activation_slots(x_ptr, gather_ptr, start, S, steps, stride_xs, x_sl, BLOCK_T, HAS_GATHER)
    x0, x1, x2, x3 = slots
    acc0 = gl.zeros([64, BLOCK_T], gl.float32, acc_l)
    acc1 = gl.zeros([64, BLOCK_T], gl.float32, acc_l)
    if R_PAD > 0:  # the LoRA term first (as on sm_90); P^T (R_PAD, BLOCK_T) is the B fragment, read from memory
        pr = gl.arange(0, R_PAD, layout=gl.SliceLayout(1, b_l))
        pt = gl.minimum(start + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, b_l)), S - 1)
        p_ptrs = p_ptr + pt.to(gl.int64)[None, :] * stride_pm + pr[:, None]
        p_t = gl.load(p_ptrs, mask=(pr < R)[:, None], other=0.0).to(gl.bfloat16)
        l0 = lora_factors(l_ptr, e, n0, R, stride_le, stride_lr, stride_ln, a_l, R_PAD)
        acc0 = lora_scale * mma_v2(l0, p_t, acc0)
        l1 = lora_factors(l_ptr, e, up0, R, stride_le, stride_lr, stride_ln, a_l, R_PAD)
        acc1 = lora_scale * mma_v2(l1, p_t, acc1)
    acc = (acc0, acc1)
    for i in range(0, steps, 4):
        acc = _k_step(acc, i, steps, x0, x2, rows, scale_ptrs, shift, levels, x_ptrs, w_l, a_l, b_l)
        acc = _k_step(acc, i + 1, steps, x1, x3, rows, scale_ptrs, shift, levels, x_ptrs, w_l, a_l, b_l)
        acc = _k_step(acc, i + 2, steps, x2, x0, rows, scale_ptrs, shift, levels, x_ptrs, w_l, a_l, b_l)
        acc = _k_step(acc, i + 3, steps, x3, x1, rows, scale_ptrs, shift, levels, x_ptrs, w_l, a_l, b_l)
    async_copy.wait_group(0)

    acc0, acc1 = acc
    store_outputs(acc0, acc1, out_ptr, act_ptr, n0, up0, start, end, stride_os, stride_as, acc_l, BLOCK_T, GLU, STORE_Y)
