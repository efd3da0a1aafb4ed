"""Triton kernels of the MoE layer: the expert-dispatched matmul (MUL_MAT_ID) over NF4 or dense expert
weights, and the per-expert scattered outer product (OUT_PROD_ID) that gives the LoRA weight gradients.

Shape letters: S routed rows sorted by expert, K reduction dim, N output dim, E experts, R LoRA rank.
A "tile" is (expert, first row, end row) of at most BLOCK_M rows of one expert, listed on the device over an
upper-bound grid: spare tiles are empty and return at once, so an expert with no rows costs nothing and the
launch needs no host sync. Launchers: ops.py.
"""

import triton
import triton.language as tl


@triton.jit
def _load_weight_tile(
    w_ptr,
    code_ptr,
    absmax_ptr,
    absmax2_ptr,
    code2_ptr,
    offset2,
    e,
    offs_k,
    offs_n,
    K,
    N,
    stride_we,
    stride_wk,
    stride_wn,
    W_NF4: tl.constexpr,
    NESTED: tl.constexpr,
    MXFP4: tl.constexpr,
    BLOCKSIZE: tl.constexpr,
):
    """(BLOCK_K, BLOCK_N) tile of expert e's weight as fp32: read dense, or decoded in registers.

    NF4 (bitsandbytes): element f of the flat stack is nibble f % 2 (high first) of byte f // 2, scaled by
    absmax[f // BLOCKSIZE] (itself code2[absmax_u8] * absmax2[block // 256] + offset2 when nested).
    MXFP4 (W_NF4 and MXFP4 set, code the e2m1 table): the low nibble first, scaled by 2^(absmax_u8[f // 32] - 127).
    """
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    # int64: e * stride_we reaches E * out * in, past 2**31 for the largest stacks (DeepSeek-V3: 3.7e9).
    flat = e.to(tl.int64) * stride_we + offs_k[:, None].to(tl.int64) * stride_wk + offs_n[None, :] * stride_wn
    if W_NF4:
        byte = tl.load(w_ptr + (flat >> 1), mask=mask, other=0).to(tl.int32)
        if MXFP4:
            nibble = (byte >> ((flat & 1) * 4).to(tl.int32)) & 0xF
        else:
            nibble = (byte >> ((1 - (flat & 1)) * 4).to(tl.int32)) & 0xF
        level = tl.load(code_ptr + nibble, mask=mask, other=0.0)
        block = flat // BLOCKSIZE
        if MXFP4:
            scale = _e8m0(tl.load(absmax_ptr + block, mask=mask, other=0))
        elif NESTED:
            q = tl.load(absmax_ptr + block, mask=mask, other=0).to(tl.int32)
            scale = (
                tl.load(code2_ptr + q, mask=mask, other=0.0) * tl.load(absmax2_ptr + block // 256, mask=mask, other=0.0)
                + offset2
            )
        else:
            scale = tl.load(absmax_ptr + block, mask=mask, other=0.0)
        return level * scale
    return tl.load(w_ptr + flat, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _e8m0(exponent):
    """2^(exponent - 127) in fp32 from e8m0 bytes, built as the float's bits (exact, no exp2): the byte is the
    biased exponent field; byte 0 stands for 2^-127, below fp32's normal range, the subnormal 0x00400000."""
    biased = exponent.to(tl.int32)
    return tl.where(biased > 0, biased << 23, 0x400000).to(tl.float32, bitcast=True)


@triton.jit
def _block_scale(absmax_ptr, absmax2_ptr, code2_ptr, offset2, block, ok, NESTED: tl.constexpr, MXFP4: tl.constexpr):
    """fp32 scales of quant blocks `block` (a row or column of them): absmax[block], or when nested
    code2[absmax_u8[block]] * absmax2[block // 256] + offset2, or MXFP4's 2^(absmax_u8[block] - 127)."""
    if MXFP4:
        scale = _e8m0(tl.load(absmax_ptr + block, mask=ok, other=0))
    elif NESTED:
        q = tl.load(absmax_ptr + block, mask=ok, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + q) * tl.load(absmax2_ptr + block // 256, mask=ok, other=0.0) + offset2
    else:
        scale = tl.load(absmax_ptr + block, mask=ok, other=0.0)
    return scale


@triton.jit
def _nibble(word, shift: tl.constexpr):
    """The 4-bit code at bit `shift` of each int32 word (the mask also drops the sign's copies of >>)."""
    return (word >> shift) & 0xF


@triton.jit
def _decode_nf4_rows(w_ptr, first, ok, scale, code, dtype, WORDS: tl.constexpr, LOW_FIRST: tl.constexpr):
    """(R, 8 * WORDS) weights in `dtype` of R rows each stored as 8 * WORDS consecutive NF4 codes: row r's
    codes are the WORDS 4-byte words from w_ptr + first[r] (w_ptr an int32 view of the packed bytes), all in
    one quant block of scale scale[r]. first, ok, scale: (R, 1). code: (16,) fp32 NF4 levels.
    LOW_FIRST (MXFP4): element 2b of a byte is its low nibble, code the e2m1 values, and scale (R, 8 * WORDS)
    may differ along a row (one per 32 codes, _load_nf4_runs).

    A thread holds a run of whole words of one row, loaded as one 16-byte vector. Byte b of a word
    (little-endian) holds elements 2b (high nibble, bitsandbytes' order) and 2b + 1, so element j of the word
    is its nibble at bit 8 (j // 2) + 4 (1 - j % 2): one shift and mask each, straight from the word. The
    level is read from the 16-entry table (the compiler keeps it in shared memory: one conflict-free 4-byte
    read per element, the 16 levels sitting in 16 banks) and scaled in fp32, then rounded once to `dtype`, as
    dequantizing to `dtype` rounds it. Per element that is about 4.6 instructions on sm_90 (shift, mask, read,
    multiply, half a convert, a share of the 16-byte store of the MMA operand): scripts/kernel_report.py."""
    word = tl.load(w_ptr + first + tl.arange(0, WORDS)[None, :], mask=ok, other=0)  # (R, WORDS) int32
    # Element j of each word, j = 4a + 2b + c, placed by three interleaves, the last one choosing c.
    high = tl.interleave(
        tl.interleave(_nibble(word, 4), _nibble(word, 20)), tl.interleave(_nibble(word, 12), _nibble(word, 28))
    )
    low = tl.interleave(
        tl.interleave(_nibble(word, 0), _nibble(word, 16)), tl.interleave(_nibble(word, 8), _nibble(word, 24))
    )
    if LOW_FIRST:
        index = tl.interleave(low, high)
    else:
        index = tl.interleave(high, low)
    level = tl.reshape(tl.gather(code, tl.reshape(index, (index.shape[0] * index.shape[1],)), 0), index.shape)
    return (level * scale).to(dtype)


@triton.jit
def _load_nf4_runs(
    w_ptr,
    code,
    absmax_ptr,
    absmax2_ptr,
    code2_ptr,
    offset2,
    e,
    offs_run,
    start,
    run_ok,
    stride_we,
    stride_run,
    words_we,
    words_run,
    dtype,
    NESTED: tl.constexpr,
    MXFP4: tl.constexpr,
    BLOCKSIZE: tl.constexpr,
    LENGTH: tl.constexpr,
):
    """(R, LENGTH) weights in `dtype`: codes start .. start + LENGTH of expert e's stored rows offs_run (R,),
    the rows the codes run along (the forward's columns n of W_e = stored^T; the input gradient's rows k).

    A run starts on a quant block (stride_run % BLOCKSIZE == 0) and BLOCKSIZE % LENGTH == 0, so it has one block
    scale (MXFP4 also takes LENGTH a multiple of its 32-code blocks: one scale each, broadcast along the run),
    and it is LENGTH / 8 consecutive words. Word offsets come from the word strides (an eighth of the
    element strides, passed as such): the JIT's 16-divisibility of those arguments, which dividing in the kernel
    would hide, lets the compiler prove each run aligned for a vector load. Only runs are masked (run_ok, (R, 1)):
    the packed dim is a multiple of LENGTH on these paths (ops.py)."""
    run = e.to(tl.int64) * stride_we + offs_run[:, None].to(tl.int64) * stride_run  # (R, 1) flat index of code 0
    first = e.to(tl.int64) * words_we + offs_run[:, None].to(tl.int64) * words_run + start // 8
    if LENGTH > BLOCKSIZE:  # several blocks along the run: (R, LENGTH / BLOCKSIZE) scales, each on its block's codes
        GROUPS: tl.constexpr = LENGTH // BLOCKSIZE
        blocks = (run + start) // BLOCKSIZE + tl.arange(0, GROUPS)[None, :]
        scales = _block_scale(absmax_ptr, absmax2_ptr, code2_ptr, offset2, blocks, run_ok, NESTED, MXFP4)
        scale = tl.reshape(
            tl.broadcast_to(scales[:, :, None], (scales.shape[0], GROUPS, BLOCKSIZE)), (scales.shape[0], LENGTH)
        )
    else:
        scale = _block_scale(
            absmax_ptr, absmax2_ptr, code2_ptr, offset2, (run + start) // BLOCKSIZE, run_ok, NESTED, MXFP4
        )
    return _decode_nf4_rows(w_ptr, first, run_ok, scale, code, dtype, LENGTH // 8, MXFP4)


@triton.jit
def _dot(x, w, acc, IEEE: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + x (M, K) in the input dtype times w (K, N) fp32, accumulated in fp32 (by the MMA itself: no
    separate add per accumulator element)."""
    if IEEE:  # fp32 inputs: exact fp32 products (tf32 would cost ~1e-3 relative error)
        return tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
    elif DOT_FP32:  # the interpreter's bf16 dot is wrong; bf16 x bf16 products are exact in fp32 anyway
        return tl.dot(x.to(tl.float32), w.to(x.dtype).to(tl.float32), acc, input_precision="ieee")
    else:  # bf16/fp16 inputs: tensor-core products of the weight rounded to the input dtype
        return tl.dot(x, w.to(x.dtype), acc)


@triton.jit
def _weight_dot(x, w, acc, SWAP_AB: tl.constexpr, IEEE: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + x (M, K) @ w (K, N); with SWAP_AB the accumulator is the transposed (N, M) one and the product is
    taken as w^T x^T, so the weight's N fills the MMA's wide side (64) and the rows, few, its narrow side
    (down to 16): the weight is not padded to 64 rows of tokens that do not exist."""
    if SWAP_AB:  # the weight rounded to the input dtype first, as _dot rounds its second operand
        acc = _dot(tl.trans(w).to(x.dtype), tl.trans(x), acc, IEEE, DOT_FP32)
    else:
        acc = _dot(x, w, acc, IEEE, DOT_FP32)
    return acc


@triton.jit
def _output_block(SPLIT_K: tl.constexpr, PHASE: tl.constexpr):
    """(row tile, N block, N blocks, split) of this program on the grid (GROUP, N blocks [x SPLIT_K in PHASE 1],
    row tiles / GROUP): the grid's x runs fastest, so a group of GROUP row tiles takes each N block in turn and its
    programs resident at once share both its activation rows and each expert's weight columns through L2
    (tiles.group_m; tiles.grid_block is the same map on the host). Read off the program ids alone, which the
    compiler re-reads where it needs them rather than keeping them in registers through the K loop."""
    tile = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
    if PHASE == 1:
        return tile, tl.program_id(1) // SPLIT_K, tl.num_programs(1) // SPLIT_K, tl.program_id(1) % SPLIT_K
    return tile, tl.program_id(1), tl.num_programs(1), 0


@triton.jit
def _partial_sums_slot(
    ws_ptr, block, split, SPLIT_K: tl.constexpr, GLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Pointers (BLOCK_M, BLOCK_N) to split `split`'s gate (or only) partial sums of output block `block` (tile *
    N blocks + N block) in the split-K workspace; the up tile follows at + BLOCK_M * BLOCK_N when GLU."""
    slot = block.to(tl.int64) * SPLIT_K + split
    size: tl.constexpr = BLOCK_M * BLOCK_N * (2 if GLU else 1)
    return ws_ptr + slot * size + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]


@triton.jit
def _store_partial_sums(
    ws_ptr,
    block,
    split,
    acc,
    acc_up,
    SPLIT_K: tl.constexpr,
    GLU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    slot = _partial_sums_slot(ws_ptr, block, split, SPLIT_K, GLU, BLOCK_M, BLOCK_N)
    tl.store(slot, acc)
    if GLU:
        tl.store(slot + BLOCK_M * BLOCK_N, acc_up)


@triton.jit
def _sum_partial_sums(
    ws_ptr, block, SPLIT_K: tl.constexpr, GLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """The (gate, up) accumulators of a tile as the sum of its splits' partial sums, always in split order (so
    two runs give the same bits, whatever order the splits ran in)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        slot = _partial_sums_slot(ws_ptr, block, split, SPLIT_K, GLU, BLOCK_M, BLOCK_N)
        acc += tl.load(slot)
        if GLU:
            acc_up += tl.load(slot + BLOCK_M * BLOCK_N)
    return acc, acc_up


@triton.jit
def _low_rank_term(
    p_ptr,
    l_ptr,
    rows,
    row_ok,
    e,
    offs_n,
    R,
    N_W,
    stride_pm,
    stride_pr,
    stride_le,
    stride_lr,
    stride_ln,
    IEEE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """(BLOCK_M, BLOCK_N) fp32 tile of P[rows] @ L_e[:, offs_n]: the LoRA term of a projection, P (S, R)
    the rows' rank-R factor (x A^T, or c g B in the backward) and L_e (R, N_W) the expert's other factor."""
    acc = tl.zeros((rows.shape[0], offs_n.shape[0]), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        p = tl.load(
            p_ptr + rows[:, None].to(tl.int64) * stride_pm + offs_r[None, :] * stride_pr,
            mask=row_ok[:, None] & (offs_r[None, :] < R),
            other=0.0,
        )
        lw = tl.load(
            l_ptr + e.to(tl.int64) * stride_le + offs_r[:, None] * stride_lr + offs_n[None, :] * stride_ln,
            mask=(offs_r[:, None] < R) & (offs_n[None, :] < N_W),
            other=0.0,
        ).to(tl.float32)
        acc = _dot(p, lw, acc, IEEE, DOT_FP32)
    return acc


@triton.jit
def _grouped_matmul_kernel(
    x_ptr,  # (T, K) rows, read through gather_ptr when GATHER, else (S, K) already sorted
    gather_ptr,  # (S,) int64: the x row of each sorted row (its token)
    tiles_ptr,  # (num_tiles, 3) int32: expert, first sorted row, end row (exclusive)
    w_ptr,  # expert weights: (E, ...) dense, the packed NF4 bytes of the stack, or (K_/N_PACKED) their int32 view
    code_ptr,  # (16,) fp32 NF4 levels (MXFP4: the e2m1 values)
    absmax_ptr,  # block scales: fp32, or uint8 codes when NESTED, or uint8 e8m0 exponents when MXFP4
    absmax2_ptr,  # nested: fp32 scale per 256 blocks
    code2_ptr,  # nested: (256,) fp32 code of the block scales
    offset2,  # nested: fp32 offset added to decoded block scales
    bias_ptr,  # (E, N_W) bias, when HAS_BIAS
    p_ptr,  # (S, R) sorted rows: the LoRA factor P of the fused term c * P L_e, when HAS_LORA
    l_ptr,  # (E, ...) dense L_e[r, n] (R, N_W), when HAS_LORA
    lora_scale,  # fp32 c
    y_ptr,  # (S, N_W) output, one row per sorted row (the pre-activation when GLU; written if STORE_Y)
    act_ptr,  # (S, N) silu(gate) * up when GLU
    ws_ptr,  # split-K: fp32 partial sums, one (GLU: two) BLOCK_M x BLOCK_N slot per (tile, N block, split)
    K,
    N,
    R,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wk,
    stride_wn,
    words_we,
    words_wk,
    words_wn,  # packed NF4: the weight strides in 4-byte words, so their 16-divisibility is seen
    stride_be,
    stride_pm,
    stride_pr,
    stride_le,
    stride_lr,
    stride_ln,
    stride_ym,
    stride_yn,
    stride_am,
    stride_an,
    rows_class,  # unused here: the autotuner's key for rows per expert (tiles.rows_class)
    W_NF4: tl.constexpr,
    NESTED: tl.constexpr,
    MXFP4: tl.constexpr,
    GATHER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    GLU: tl.constexpr,
    STORE_Y: tl.constexpr,
    K_PACKED: tl.constexpr,
    N_PACKED: tl.constexpr,
    SWAP_AB: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PHASE: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCKSIZE: tl.constexpr,
    IEEE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Y[s, n] = sum_k X[row(s), k] W_e(s)[k, n] + bias[e(s), n] + c sum_r P[s, r] L_e(s)[r, n]: MUL_MAT_ID
    with the LoRA term fused (HAS_LORA).

    W_e[k, n] lives at w + e*stride_we + k*stride_wk + n*stride_wn, so the same kernel computes x W^T on
    stored (E, out, in) weights (forward) and g W through the transposed experts (input gradient) by
    swapping the two strides, and reads LoRA factors (E, r, in) / (E, out, r) the same way.

    GLU: W has N_W = 2N columns, gate in [0, N) and up in [N, 2N) (transformers' gate_up_proj). Each program
    accumulates a gate tile and the matching up tile, and its epilogue writes act = silu(gate) * up (S, N),
    plus the (S, 2N) pre-activation the backward needs when STORE_Y. Gate and up are rounded to Y's dtype
    before the activation, so act equals the unfused silu(h[:, :N]) * h[:, N:] on the stored h.

    SWAP_AB (packed NF4 paths, few rows per expert): the tile is computed transposed, tokens on the MMA's
    narrow side (_weight_dot).

    Split-K (few tiles for the GPU's SMs), deterministic and without atomics: PHASE 1 runs SPLIT_K programs
    per tile, each over its share of K, and writes its partial sums to ws; PHASE 2 (a second launch, one
    program per tile) adds them in split order and runs the epilogue. PHASE 0 is the whole K in one program.
    """
    if GLU:
        N_W = 2 * N
    else:
        N_W = N
    tile, n_block, n_blocks, split = _output_block(SPLIT_K, PHASE)
    e = tl.load(tiles_ptr + tile * 3)
    start = tl.load(tiles_ptr + tile * 3 + 1)
    end = tl.load(tiles_ptr + tile * 3 + 2)
    if start >= end:  # a spare tile of the upper-bound grid (ops.expert_tiles)
        return
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    if GATHER:
        src = tl.load(gather_ptr + rows, mask=row_ok, other=0)
    else:
        src = rows.to(tl.int64)
    if SWAP_AB:  # transposed accumulators (see _weight_dot), turned back after the K loop
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if K_PACKED or N_PACKED:  # loop-invariant: the NF4 levels, once per program
        code = tl.load(code_ptr + tl.arange(0, 16))
    if IEEE or DOT_FP32:  # the weights the dot multiplies: fp32, or the input dtype for the tensor cores
        W_DTYPE: tl.constexpr = tl.float32
    else:
        W_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    if PHASE == 0:
        k_lo = 0
        k_hi = K
    elif PHASE == 1:  # this split's whole K-steps
        k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_lo = split * k_per_split
        k_hi = tl.minimum(K, k_lo + k_per_split)
    else:  # the partial sums are in ws already
        k_lo = 0
        k_hi = 0
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if K_PACKED or EVEN_K:  # K a multiple of BLOCK_K: only rows masked, so a row's K-run loads as one vector
            x_ok = row_ok[:, None]
        else:
            x_ok = row_ok[:, None] & (offs_k[None, :] < K)
        x = tl.load(x_ptr + src[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=x_ok, other=0.0)
        if K_PACKED:  # NF4 read along its contiguous dim K: each column's codes as words, one scale per column
            # Columns n of the tile are runs along K, decoded as rows and transposed (by layout, not a copy).
            w = _load_nf4_runs(
                w_ptr,
                code,
                absmax_ptr,
                absmax2_ptr,
                code2_ptr,
                offset2,
                e,
                offs_n,
                k0,
                offs_n[:, None] < N_W,
                stride_we,
                stride_wn,
                words_we,
                words_wn,
                W_DTYPE,
                NESTED,
                MXFP4,
                BLOCKSIZE,
                BLOCK_K,
            )
            acc = _weight_dot(x, tl.trans(w), acc, SWAP_AB, IEEE, DOT_FP32)
            if GLU:
                w = _load_nf4_runs(
                    w_ptr,
                    code,
                    absmax_ptr,
                    absmax2_ptr,
                    code2_ptr,
                    offset2,
                    e,
                    offs_n + N,
                    k0,
                    offs_n[:, None] < N,
                    stride_we,
                    stride_wn,
                    words_we,
                    words_wn,
                    W_DTYPE,
                    NESTED,
                    MXFP4,
                    BLOCKSIZE,
                    BLOCK_K,
                )
                acc_up = _weight_dot(x, tl.trans(w), acc_up, SWAP_AB, IEEE, DOT_FP32)
        elif N_PACKED:  # NF4 read along its contiguous dim N: each row's codes as words, one scale per row
            if EVEN_K:  # every row of the step exists: no mask, no predicate per load
                k_ok = tl.full((BLOCK_K, 1), 1, tl.int1)
            else:
                k_ok = offs_k[:, None] < K
            w = _load_nf4_runs(
                w_ptr,
                code,
                absmax_ptr,
                absmax2_ptr,
                code2_ptr,
                offset2,
                e,
                offs_k,
                n_block * BLOCK_N,
                k_ok,
                stride_we,
                stride_wk,
                words_we,
                words_wk,
                W_DTYPE,
                NESTED,
                MXFP4,
                BLOCKSIZE,
                BLOCK_N,
            )
            acc = _weight_dot(x, w, acc, SWAP_AB, IEEE, DOT_FP32)
        else:
            w = _load_weight_tile(
                w_ptr,
                code_ptr,
                absmax_ptr,
                absmax2_ptr,
                code2_ptr,
                offset2,
                e,
                offs_k,
                offs_n,
                K,
                N_W,
                stride_we,
                stride_wk,
                stride_wn,
                W_NF4,
                NESTED,
                MXFP4,
                BLOCKSIZE,
            )
            acc = _dot(x, w, acc, IEEE, DOT_FP32)
            if GLU:
                w = _load_weight_tile(
                    w_ptr,
                    code_ptr,
                    absmax_ptr,
                    absmax2_ptr,
                    code2_ptr,
                    offset2,
                    e,
                    offs_k,
                    offs_n + N,
                    K,
                    N_W,
                    stride_we,
                    stride_wk,
                    stride_wn,
                    W_NF4,
                    NESTED,
                    MXFP4,
                    BLOCKSIZE,
                )
                acc_up = _dot(x, w, acc_up, IEEE, DOT_FP32)
    if SWAP_AB:
        acc = tl.trans(acc)
        acc_up = tl.trans(acc_up)
    if PHASE == 1:
        _store_partial_sums(ws_ptr, tile * n_blocks + n_block, split, acc, acc_up, SPLIT_K, GLU, BLOCK_M, BLOCK_N)
    else:
        if PHASE == 2:
            acc, acc_up = _sum_partial_sums(ws_ptr, tile * n_blocks + n_block, SPLIT_K, GLU, BLOCK_M, BLOCK_N)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + e * stride_be + offs_n, mask=offs_n < N_W, other=0.0).to(tl.float32)[None, :]
            if GLU:
                acc_up += tl.load(bias_ptr + e * stride_be + N + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[
                    None, :
                ]
        if HAS_LORA:
            acc += lora_scale * _low_rank_term(
                p_ptr,
                l_ptr,
                rows,
                row_ok,
                e,
                offs_n,
                R,
                N_W,
                stride_pm,
                stride_pr,
                stride_le,
                stride_lr,
                stride_ln,
                IEEE,
                DOT_FP32,
                BLOCK_K,
            )
            if GLU:
                acc_up += lora_scale * _low_rank_term(
                    p_ptr,
                    l_ptr,
                    rows,
                    row_ok,
                    e,
                    offs_n + N,
                    R,
                    N_W,
                    stride_pm,
                    stride_pr,
                    stride_le,
                    stride_lr,
                    stride_ln,
                    IEEE,
                    DOT_FP32,
                    BLOCK_K,
                )
        mask = row_ok[:, None] & (offs_n[None, :] < N)
        y_rows = y_ptr + rows[:, None].to(tl.int64) * stride_ym
        if STORE_Y:
            tl.store(y_rows + offs_n[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=mask)
            if GLU:
                tl.store(y_rows + (offs_n[None, :] + N) * stride_yn, acc_up.to(y_ptr.dtype.element_ty), mask=mask)
        if GLU:
            gate = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
            up = acc_up.to(y_ptr.dtype.element_ty).to(tl.float32)
            act = gate * tl.sigmoid(gate) * up
            tl.store(
                act_ptr + rows[:, None].to(tl.int64) * stride_am + offs_n[None, :] * stride_an,
                act.to(act_ptr.dtype.element_ty),
                mask=mask,
            )


@triton.jit
def _grouped_outer_product_kernel(
    a_ptr,  # (T, M) rows, read through gather_ptr when GATHER, else (S, M) sorted
    gather_ptr,  # (S,) int64: the a row of each sorted row
    b_ptr,  # (S, N) sorted rows
    offsets_ptr,  # (E + 1,) int64: rows of expert e are offsets[e]:offsets[e + 1]
    out_ptr,  # (E, M, N) fp32: out[e] = sum over rows s of e of a[s] (x) b[s]
    M,
    N,
    stride_am,
    stride_ak,
    stride_bm,
    stride_bn,
    stride_oe,
    stride_om,
    stride_on,
    GATHER: tl.constexpr,
    IEEE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """OUT_PROD_ID: out[e] = A_e^T B_e with A_e, B_e the rows routed to e; one program per (expert, tile
    of out[e]), reducing over the expert's rows BLOCK_S at a time. An expert with no rows writes zeros."""
    e = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    offs_m = (tl.program_id(1) // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tl.program_id(1) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s0 in range(start, end, BLOCK_S):
        rows = s0 + tl.arange(0, BLOCK_S)
        row_ok = rows < end
        if GATHER:
            src = tl.load(gather_ptr + rows, mask=row_ok, other=0)
        else:
            src = rows.to(tl.int64)
        a = tl.load(
            a_ptr + src[:, None] * stride_am + offs_m[None, :] * stride_ak,
            mask=row_ok[:, None] & (offs_m[None, :] < M),
            other=0.0,
        )
        b = tl.load(
            b_ptr + rows[:, None].to(tl.int64) * stride_bm + offs_n[None, :] * stride_bn,
            mask=row_ok[:, None] & (offs_n[None, :] < N),
            other=0.0,
        )
        acc = _dot(tl.trans(a), b.to(tl.float32), acc, IEEE, DOT_FP32)
    tl.store(
        out_ptr + e.to(tl.int64) * stride_oe + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        acc,
        mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
    )
