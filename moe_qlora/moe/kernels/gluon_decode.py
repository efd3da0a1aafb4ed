"""What the Gluon NF4 kernels (gluon_nf4.py for sm_90, gluon_nf4_sm80.py for sm_80-89) share: the decode of a
16-wide chunk of NF4 codes into the MMA's bf16 A fragment (mma.m16n8k16's register layout is the wgmma's), the step's
block scales, the words' layouts, the LoRA factors, the epilogue's stores, and the Triton-version shims.

The decode: the code of column k = 16 c + 8 h + 2 q + p (q = lane % 4) is nibble 8 q + 4 (1 - p) of the row's word
2 c + h, bitsandbytes' high-nibble-first order; its NF4 level comes from a `shfl` of the lane holding it (the 16 levels
sit in lanes 0-15 and again in 16-31, so only the code's low five bits matter); the level times the fp32 block scale
is rounded once to bf16, as bitsandbytes dequantizes.
"""

from __future__ import annotations

import struct

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from moe_qlora.moe.nf4 import NF4_LEVELS

BLOCK_N = gl.constexpr(128)  # weight rows a program holds: two blocks of one warpgroup's wgmma M (64)
BLOCK_K = gl.constexpr(128)  # weights a row decodes per K-step: two quant blocks of 64
# Triton 3.7 renamed these (3.6, the GPU machines' version, has the old names only).
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# fp32 x2 -> one register of two bf16, rounded to nearest even ($1 the low half). As an asm LLVM may not move, the
# rounding stays in the step that decodes: folded through the loop's phi, it was sunk to the wgmma.
PACK_BF16X2 = gl.constexpr("cvt.rn.bf16x2.f32 $0, $2, $1;")
LEVEL_OF_CODE = gl.constexpr("shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;")


def lane_levels_asm(levels=NF4_LEVELS) -> str:
    """PTX putting levels[laneid % 16] (fp32) in $0, once per thread ($1 is an unused constant input)."""
    bits = [struct.unpack("<I", struct.pack("<f", v))[0] for v in levels]
    lines = [
        "{",
        ".reg .b32 l;",
        ".reg .pred p;",
        "mov.u32 l, %laneid;",
        "and.b32 l, l, 15;",
        f"mov.b32 $0, {bits[0]:#x};",
    ]
    for i, b in enumerate(bits[1:], 1):
        lines += [f"setp.eq.u32 p, l, {i};", f"@p mov.b32 $0, {b:#x};"]
    return "\n".join(lines + ["}"])


# The A fragment of a 64 x 16 bf16 chunk over (n, h, q, p), k = 8 h + 2 q + p: the wgmma's own register order
# (k + 1, n + 8, k + 8), its lanes (k + 2, k + 4, n + 1, n + 2, n + 4) and warps (n + 16, n + 32), as
# gl.to_linear_layout gives it. The compiler checks the match (convert_layout's assert_trivial).
CHUNK_LAYOUT = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [8, 0, 0, 0], [0, 1, 0, 0]],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]],
        block_bases=[],
        shape=[64, 2, 4, 2],
    )
)
# A quarter step's 4 words of each of a thread's two rows of a block, in consecutive registers (one 16-byte load a
# row); the four threads of a quad hold the same words.
WORD_LAYOUT = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]],
        lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[64, 4],
    )
)


def word_and_shift(k: int) -> tuple[int, int]:
    """Which of a row's words (of 8 codes) holds the code of column k of a step, and at what bit: the decode's
    index math, for the CPU test against bitsandbytes' dequantization."""
    c, h, q, p = k // 16, (k // 8) % 2, (k // 2) % 4, k % 2
    return 2 * c + h, 8 * q + 4 * (1 - p)


@gluon.jit
def split_first(t):
    """The halves of t along its dim 1, a register dim: no data moves."""
    if len(t.shape) == 5:
        return gl.split(gl.permute(t, [0, 2, 3, 4, 1]))
    elif len(t.shape) == 4:
        return gl.split(gl.permute(t, [0, 2, 3, 1]))
    else:
        return gl.split(gl.permute(t, [0, 2, 1]))


@gluon.jit
def chunk_words(words):
    """(64, 4) words of a quarter step -> 2 tensors (64, 2): each 16-wide chunk's two words a row."""
    return split_first(gl.reshape(words, [64, 2, 2]))


@gluon.jit
def decode_chunk(words, scale, shift, levels, w_l: gl.constexpr, a_l: gl.constexpr):
    """(64, 16) bf16 A fragment of one chunk: words (64, 2) int32, scale (64,) fp32, shift (1, 1, 4, 2)."""
    codes = gl.convert_layout(words, w_l)[:, :, None, None] >> shift
    level = gl.inline_asm_elementwise(LEVEL_OF_CODE, "=r,r,r", [levels, codes], dtype=gl.float32, is_pure=True, pack=1)
    w = level * scale[:, None, None, None]
    w = gl.inline_asm_elementwise(PACK_BF16X2, "=r,r,r", [w], dtype=gl.bfloat16, is_pure=False, pack=2)
    return gl.convert_layout(gl.reshape(w, [64, 16]), a_l, assert_trivial=True)


@gluon.jit
def step_scales(absmax_pairs_ptr, absmax2_ptr, code2_ptr, offset2, pair, live):
    """fp32 scales of a step's two quant blocks 2 pair and 2 pair + 1 of each row, 0 past K (nested:
    code2[absmax_u8] * absmax2[block // 256] + offset2; both blocks share their absmax2, 256 being even)."""
    codes = gl.load(absmax_pairs_ptr + pair).to(gl.int32)  # the two u8 codes, the first block's low
    scale2 = gl.where(live, gl.load(absmax2_ptr + pair // 128), 0.0)
    scale0 = gl.load(code2_ptr + (codes & 0xFF)) * scale2 + offset2
    scale1 = gl.load(code2_ptr + ((codes >> 8) & 0xFF)) * scale2 + offset2
    return gl.where(live, scale0, 0.0), gl.where(live, scale1, 0.0)


@gluon.jit
def row_block(w_ptr, e, n0, words_we, words_row, w_l: gl.constexpr):
    """(word pointers (64, 4): a quarter step's, first quant-block pairs (64,)) of rows n0 .. n0 + 63 of expert e.
    The pairs are counted in int32 from words: the launchers take stacks of fewer than 2^31 words (1.7e10 codes;
    DeepSeek-V3's gate_up is 7.5e9)."""
    rows_w = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, WORD_LAYOUT))
    row_words = e.to(gl.int64) * words_we + rows_w.to(gl.int64) * words_row
    w_ptrs = w_ptr + (row_words[:, None] + gl.arange(0, 4, layout=gl.SliceLayout(0, WORD_LAYOUT))[None, :])
    rows = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, w_l))
    return w_ptrs, (e * words_we + rows * words_row) // 16


@gluon.jit
def lora_factors(l_ptr, e, first_row, R, stride_le, stride_lr, stride_ln, a_l: gl.constexpr, R_PAD: gl.constexpr):
    """(64, R_PAD) bf16 A fragment of L_e^T for weight rows first_row.. (L (E, R, N), the expert's other LoRA
    factor), columns past R zero: rank 8 is padded to 16, the MMA's K, not to a K-step."""
    rn = first_row + gl.arange(0, 64, layout=gl.SliceLayout(1, a_l))
    rr = gl.arange(0, R_PAD, layout=gl.SliceLayout(0, a_l))
    ptrs = l_ptr + e.to(gl.int64) * stride_le + rr[None, :] * stride_lr + rn[:, None] * stride_ln
    return gl.load(ptrs, mask=(rr < R)[None, :], other=0.0).to(gl.bfloat16)


@gluon.jit
def store_outputs(acc0, acc1, out_ptr, act_ptr, n0, up0, start, end, stride_os, stride_as, acc_l: gl.constexpr,
                  BLOCK_T: gl.constexpr, GLU: gl.constexpr, STORE_Y: gl.constexpr):  # fmt: skip
    """Block 0's rows n0.. and block 1's rows up0.. of out (S, N) (transposed back) for the tile's rows start..end.
    With GLU block 0 holds gate rows and block 1 the up rows of the same columns, and act (S, I) = silu(gate) * up
    is stored too, from the pre-activations rounded to bf16 (the Triton kernel's epilogue, tl.sigmoid's formula)."""
    on = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
    ot = start + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, acc_l))
    t_ok = (ot < end)[None, :]
    out = out_ptr + ot.to(gl.int64)[None, :] * stride_os + on[:, None]
    y0 = acc0.to(gl.bfloat16)
    y1 = acc1.to(gl.bfloat16)
    if STORE_Y:
        gl.store(out + n0, y0, mask=t_ok)
        gl.store(out + up0, y1, mask=t_ok)
    if GLU:
        gate = y0.to(gl.float32)
        act = gate * (1 / (1 + gl.exp(-gate))) * y1.to(gl.float32)
        act_out = act_ptr + ot.to(gl.int64)[None, :] * stride_as + (n0 + on[:, None])
        gl.store(act_out, act.to(gl.bfloat16), mask=t_ok)


@gluon.jit
def activation_rows(x_ptr, gather_ptr, start, S, stride_xs, x_l: gl.constexpr, BLOCK_T: gl.constexpr,
                    HAS_GATHER: gl.constexpr):  # fmt: skip
    """(BLOCK_T, BLOCK_K) pointers to the first K-step of the activations of the tile's sorted rows start..: x's
    rows themselves, or (HAS_GATHER) x[gather[row]] (the gate_up launch reads each token once per expert it was
    routed to). Rows past S read row S - 1 again (their outputs are never stored)."""
    rows = gl.minimum(start + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, x_l)), S - 1)
    if HAS_GATHER:
        rows = gl.load(gather_ptr + rows)
    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_l))
    return x_ptr + rows.to(gl.int64)[:, None] * stride_xs + offs_k[None, :]


@gluon.jit
def decode_setup(w_ptr, e, n0, up0, words_we, words_row, LEVELS_ASM: gl.constexpr):
    """The decode's loop invariants for weight rows n0.. and up0.. of expert e: each block's (word pointers, first
    quant-block pairs), the nibble shift of each (q, p) (1, 1, 4, 2), and the NF4 level each lane holds."""
    w_l: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, CHUNK_LAYOUT))  # (n, h)
    qp_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, CHUNK_LAYOUT))  # (q, p)
    w_ptrs0, pair0_0 = row_block(w_ptr, e, n0, words_we, words_row, w_l)
    w_ptrs1, pair0_1 = row_block(w_ptr, e, up0, words_we, words_row, w_l)
    q = gl.arange(0, 4, layout=gl.SliceLayout(1, qp_l))
    p = gl.arange(0, 2, layout=gl.SliceLayout(0, qp_l))
    shift = (8 * q[:, None] + 4 * (1 - p[None, :]))[None, None, :, :]
    splat = gl.full([64, 2, 4, 2], 0, gl.int32, CHUNK_LAYOUT)
    levels = gl.inline_asm_elementwise(LEVELS_ASM, "=r,r", [splat], dtype=gl.float32, is_pure=True, pack=1)
    return (w_ptrs0, pair0_0, w_ptrs1, pair0_1), shift, levels


@gluon.jit
def activation_slots(x_ptr, gather_ptr, start, S, steps, stride_xs, x_sl: gl.constexpr, BLOCK_T: gl.constexpr,
                     HAS_GATHER: gl.constexpr):  # fmt: skip
    """Four (BLOCK_T, BLOCK_K) activation slots, one allocation each (with the K loop unrolled by four every slot is
    named at compile time, and a step's one barrier orders both hazards: step i's copy fills the slot step i - 2
    read), the first two steps' copies issued, and the copies' pointers: half a row's step a thread, one address and
    eight 16-byte copies at fixed offsets."""
    x0 = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_T, BLOCK_K], x_sl)
    x1 = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_T, BLOCK_K], x_sl)
    x2 = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_T, BLOCK_K], x_sl)
    x3 = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_T, BLOCK_K], x_sl)
    x_l: gl.constexpr = gl.BlockedLayout([1, 64], [16, 2], [4, 1], [1, 0])
    x_ptrs = activation_rows(x_ptr, gather_ptr, start, S, stride_xs, x_l, BLOCK_T, HAS_GATHER)
    async_load(x0, x_ptrs)
    async_copy.commit_group()
    async_load(x1, x_ptrs + gl.minimum(1, steps - 1) * BLOCK_K)
    async_copy.commit_group()
    return (x0, x1, x2, x3), x_ptrs


@gluon.jit
def program_tile(tile_expert_ptr, tile_start_ptr, tile_end_ptr, ROW_STEP: gl.constexpr, UP_OFFSET: gl.constexpr):
    """(expert, first row, end row) of this program's tile of routed rows, and its two blocks' first weight rows:
    n0 = program * ROW_STEP and n0 + UP_OFFSET (the next 64 rows, or with the GLU the up rows of block 0's gates)."""
    tile = gl.program_id(0)
    n0 = gl.program_id(1) * ROW_STEP
    e = gl.load(tile_expert_ptr + tile)
    return e, gl.load(tile_start_ptr + tile), gl.load(tile_end_ptr + tile), n0, n0 + UP_OFFSET
