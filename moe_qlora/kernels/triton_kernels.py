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
def _load_weight_tile(w_ptr, code_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset2, e, offs_k, offs_n, K, N,
                      stride_we, stride_wk, stride_wn, W_NF4: tl.constexpr, NESTED: tl.constexpr,
                      BLOCKSIZE: tl.constexpr):  # fmt: skip
    """(BLOCK_K, BLOCK_N) tile of expert e's weight as fp32: read dense, or decoded from NF4 in registers.

    NF4 (bitsandbytes): element f of the flat stack is nibble f % 2 (high first) of byte f // 2, scaled by
    absmax[f // BLOCKSIZE] (itself code2[absmax_u8] * absmax2[block // 256] + offset2 when nested).
    """
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    # int64: e * stride_we reaches E * out * in, past 2**31 for the largest stacks (DeepSeek-V3: 3.7e9).
    flat = e.to(tl.int64) * stride_we + offs_k[:, None].to(tl.int64) * stride_wk + offs_n[None, :] * stride_wn
    if W_NF4:
        byte = tl.load(w_ptr + (flat >> 1), mask=mask, other=0).to(tl.int32)
        nibble = (byte >> ((1 - (flat & 1)) * 4).to(tl.int32)) & 0xF
        level = tl.load(code_ptr + nibble, mask=mask, other=0.0)
        block = flat // BLOCKSIZE
        if NESTED:
            q = tl.load(absmax_ptr + block, mask=mask, other=0).to(tl.int32)
            scale = tl.load(code2_ptr + q, mask=mask, other=0.0) * tl.load(absmax2_ptr + block // 256, mask=mask,
                                                                            other=0.0) + offset2  # fmt: skip
        else:
            scale = tl.load(absmax_ptr + block, mask=mask, other=0.0)
        return level * scale
    return tl.load(w_ptr + flat, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _block_scale(absmax_ptr, absmax2_ptr, code2_ptr, offset2, block, ok, NESTED: tl.constexpr):
    """fp32 scales of quant blocks `block` (a row or column of them): absmax[block], or when nested
    code2[absmax_u8[block]] * absmax2[block // 256] + offset2."""
    if NESTED:
        q = tl.load(absmax_ptr + block, mask=ok, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + q) * tl.load(absmax2_ptr + block // 256, mask=ok, other=0.0) + offset2
    else:
        scale = tl.load(absmax_ptr + block, mask=ok, other=0.0)
    return scale


@triton.jit
def _load_nf4_pairs(w_ptr, code, absmax_ptr, absmax2_ptr, code2_ptr, offset2, e, k0, offs_n, K, N, stride_we,
                    stride_wn, bytes_we, bytes_wn, NESTED: tl.constexpr, BLOCKSIZE: tl.constexpr,
                    BLOCK_K: tl.constexpr):  # fmt: skip
    """The K-contiguous NF4 tile as two (BLOCK_K / 2, BLOCK_N) fp32 halves: rows j are k = k0 + 2j (high
    nibbles) and k0 + 2j + 1 (low nibbles) of the same bytes.

    Stored (E, out, in) weights read along `in` (the forward) have their BLOCK_K codes of a column in
    BLOCK_K / 2 consecutive bytes, loaded as such (not one byte per element); and since a column starts on a
    quant block (stride_wn % BLOCKSIZE == 0) and BLOCKSIZE % BLOCK_K == 0, the whole K-step of a column shares
    one block scale, loaded once per column instead of once per element. `code` (16, BLOCK_N): the 16 NF4
    levels per column, loaded once per program and held in registers, looked up with tl.gather rather than
    gathered from global memory per element.
    """
    offs_j = tl.arange(0, BLOCK_K // 2)
    col = e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn  # (1, BN) flat index of k = 0
    # Columns only: K is a multiple of BLOCK_K on this path (ops.py), and a mask varying along the bytes of a
    # column would keep them from being loaded as one vector. Offsets from the byte strides (see
    # _load_nf4_column_pairs).
    first = e.to(tl.int64) * bytes_we + offs_n[None, :].to(tl.int64) * bytes_wn + k0 // 2  # (1, BN)
    byte = tl.load(w_ptr + first + offs_j[:, None], mask=offs_n[None, :] < N, other=0).to(tl.int32)
    hi = tl.gather(code, byte >> 4, axis=0)
    lo = tl.gather(code, byte & 0xF, axis=0)
    scale = _block_scale(absmax_ptr, absmax2_ptr, code2_ptr, offset2, (col + k0) // BLOCKSIZE, offs_n[None, :] < N,
                         NESTED)  # fmt: skip
    return hi * scale, lo * scale


@triton.jit
def _load_nf4_column_pairs(w_ptr, code, absmax_ptr, absmax2_ptr, code2_ptr, offset2, e, offs_k, n0, K, N,
                           stride_we, stride_wk, bytes_we, bytes_wk, NESTED: tl.constexpr, BLOCKSIZE: tl.constexpr,
                           BLOCK_N: tl.constexpr):  # fmt: skip
    """The N-contiguous NF4 tile as two (BLOCK_K, BLOCK_N / 2) fp32 halves: columns j are n = n0 + 2j (high
    nibbles) and n0 + 2j + 1 (low nibbles) of the same bytes.

    Stored (E, out, in) weights read through the transposed experts (the input gradient: k runs over `out`,
    n over `in`) hold a row's BLOCK_N codes in BLOCK_N / 2 consecutive bytes, loaded as such; since a row
    starts on a quant block (stride_wk % BLOCKSIZE == 0) and BLOCKSIZE % BLOCK_N == 0, the tile's row shares
    one block scale, loaded once per row. `code` (16, BLOCK_N / 2): the NF4 levels, held in registers.
    """
    offs_j = tl.arange(0, BLOCK_N // 2)
    row = e.to(tl.int64) * stride_we + offs_k[:, None].to(tl.int64) * stride_wk + n0  # (BK, 1) flat index, even
    # Rows only: N is a multiple of BLOCK_N on this path (ops.py), so a column mask, which would also keep the
    # compiler from loading a row's bytes as one vector, is not needed.
    mask = offs_k[:, None] < K  # (BK, 1), broadcast over the row
    # Byte offsets from the byte strides (half the element strides, passed as such): the JIT's 16-divisibility
    # of those arguments, which `row >> 1` would hide, lets the compiler prove the rows' alignment.
    first = e.to(tl.int64) * bytes_we + offs_k[:, None].to(tl.int64) * bytes_wk + n0 // 2
    byte = tl.load(w_ptr + first + offs_j[None, :], mask=mask, other=0).to(tl.int32)
    hi = tl.gather(code, byte >> 4, axis=0)
    lo = tl.gather(code, byte & 0xF, axis=0)
    scale = _block_scale(absmax_ptr, absmax2_ptr, code2_ptr, offset2, row // BLOCKSIZE, offs_k[:, None] < K, NESTED)
    return hi * scale, lo * scale


@triton.jit
def _dot(x, w, IEEE: tl.constexpr, DOT_FP32: tl.constexpr):
    """x (M, K) in the input dtype times w (K, N) fp32, accumulated in fp32."""
    if IEEE:  # fp32 inputs: exact fp32 products (tf32 would cost ~1e-3 relative error)
        return tl.dot(x.to(tl.float32), w, input_precision="ieee")
    elif DOT_FP32:  # the interpreter's bf16 dot is wrong; bf16 x bf16 products are exact in fp32 anyway
        return tl.dot(x.to(tl.float32), w.to(x.dtype).to(tl.float32), input_precision="ieee")
    else:  # bf16/fp16 inputs: tensor-core products of the weight rounded to the input dtype
        return tl.dot(x, w.to(x.dtype))


@triton.jit
def _low_rank_term(p_ptr, l_ptr, rows, row_ok, e, offs_n, R, N_W, stride_pm, stride_pr, stride_le, stride_lr,
                   stride_ln, IEEE: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    """(BLOCK_M, BLOCK_N) fp32 tile of P[rows] @ L_e[:, offs_n]: the LoRA term of a projection, P (S, R)
    the rows' rank-R factor (x A^T, or c g B in the backward) and L_e (R, N_W) the expert's other factor."""
    acc = tl.zeros((rows.shape[0], offs_n.shape[0]), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        p = tl.load(p_ptr + rows[:, None].to(tl.int64) * stride_pm + offs_r[None, :] * stride_pr,
                    mask=row_ok[:, None] & (offs_r[None, :] < R), other=0.0)  # fmt: skip
        lw = tl.load(l_ptr + e.to(tl.int64) * stride_le + offs_r[:, None] * stride_lr + offs_n[None, :] * stride_ln,
                     mask=(offs_r[:, None] < R) & (offs_n[None, :] < N_W), other=0.0).to(tl.float32)  # fmt: skip
        acc += _dot(p, lw, IEEE, DOT_FP32)
    return acc


@triton.jit
def _grouped_matmul_kernel(
    x_ptr,  # (T, K) rows, read through gather_ptr when GATHER, else (S, K) already sorted
    gather_ptr,  # (S,) int64: the x row of each sorted row (its token)
    tiles_ptr,  # (num_tiles, 3) int32: expert, first sorted row, end row (exclusive)
    w_ptr,  # expert weights: (E, ...) dense, or the packed NF4 bytes of the stack
    code_ptr,  # (16,) fp32 NF4 levels
    absmax_ptr,  # block scales: fp32, or uint8 codes when NESTED
    absmax2_ptr,  # nested: fp32 scale per 256 blocks
    code2_ptr,  # nested: (256,) fp32 code of the block scales
    offset2,  # nested: fp32 offset added to decoded block scales
    bias_ptr,  # (E, N_W) bias, when HAS_BIAS
    p_ptr,  # (S, R) sorted rows: the LoRA factor P of the fused term c * P L_e, when HAS_LORA
    l_ptr,  # (E, ...) dense L_e[r, n] (R, N_W), when HAS_LORA
    lora_scale,  # fp32 c
    y_ptr,  # (S, N_W) output, one row per sorted row (the pre-activation when GLU; written if STORE_Y)
    act_ptr,  # (S, N) silu(gate) * up when GLU
    K, N, R,
    stride_xm, stride_xk, stride_we, stride_wk, stride_wn,
    bytes_we, bytes_wk, bytes_wn,  # NF4: the weight strides in bytes (halves), so their 16-divisibility is seen
    stride_be, stride_pm, stride_pr, stride_le, stride_lr,
    stride_ln, stride_ym, stride_yn, stride_am, stride_an,
    W_NF4: tl.constexpr, NESTED: tl.constexpr, GATHER: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr, GLU: tl.constexpr, STORE_Y: tl.constexpr, K_PACKED: tl.constexpr, N_PACKED: tl.constexpr,
    BLOCKSIZE: tl.constexpr, IEEE: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Y[s, n] = sum_k X[row(s), k] W_e(s)[k, n] + bias[e(s), n] + c sum_r P[s, r] L_e(s)[r, n]: MUL_MAT_ID
    with the LoRA term fused (HAS_LORA).

    W_e[k, n] lives at w + e*stride_we + k*stride_wk + n*stride_wn, so the same kernel computes x W^T on
    stored (E, out, in) weights (forward) and g W through the transposed experts (input gradient) by
    swapping the two strides, and reads LoRA factors (E, r, in) / (E, out, r) the same way.

    GLU: W has N_W = 2N columns, gate in [0, N) and up in [N, 2N) (transformers' gate_up_proj). Each program
    accumulates a gate tile and the matching up tile, and its epilogue writes act = silu(gate) * up (S, N),
    plus the (S, 2N) pre-activation the backward needs when STORE_Y. Gate and up are rounded to Y's dtype
    before the activation, so act equals the unfused silu(h[:, :N]) * h[:, N:] on the stored h.
    """
    if GLU:
        N_W = 2 * N
    else:
        N_W = N
    tile = tl.program_id(0)
    e = tl.load(tiles_ptr + tile * 3)
    start = tl.load(tiles_ptr + tile * 3 + 1)
    end = tl.load(tiles_ptr + tile * 3 + 2)
    if start >= end:  # a spare tile of the upper-bound grid (ops.expert_tiles)
        return
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if GATHER:
        src = tl.load(gather_ptr + rows, mask=row_ok, other=0)
    else:
        src = rows.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if K_PACKED:  # loop-invariant: the NF4 table, once per program
        code = tl.load(code_ptr + tl.arange(0, 16)[:, None] + 0 * offs_n[None, :])
    if N_PACKED:  # even and odd output columns accumulate apart, interleaved after the K loop
        code = tl.load(code_ptr + tl.arange(0, 16)[:, None] + 0 * tl.arange(0, BLOCK_N // 2)[None, :])
        acc_even = tl.zeros((BLOCK_M, BLOCK_N // 2), dtype=tl.float32)
        acc_odd = tl.zeros((BLOCK_M, BLOCK_N // 2), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if N_PACKED:  # NF4 read along its contiguous dim N: byte pairs, one scale per row (_load_nf4_column_pairs)
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + src[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=row_ok[:, None] & (offs_k[None, :] < K), other=0.0)  # fmt: skip
            w_even, w_odd = _load_nf4_column_pairs(w_ptr, code, absmax_ptr, absmax2_ptr, code2_ptr, offset2, e,
                                                   offs_k, tl.program_id(1) * BLOCK_N, K, N_W, stride_we,
                                                   stride_wk, bytes_we, bytes_wk, NESTED, BLOCKSIZE,
                                                   BLOCK_N)  # fmt: skip
            acc_even += _dot(x, w_even, IEEE, DOT_FP32)
            acc_odd += _dot(x, w_odd, IEEE, DOT_FP32)
        elif K_PACKED:  # NF4 read along its contiguous dim: byte pairs, one scale per column (see _load_nf4_pairs)
            offs_even = k0 + 2 * tl.arange(0, BLOCK_K // 2)
            x_rows = x_ptr + src[:, None] * stride_xm
            x_even = tl.load(x_rows + offs_even[None, :] * stride_xk, mask=row_ok[:, None] & (offs_even[None, :] < K),
                             other=0.0)  # fmt: skip
            x_odd = tl.load(x_rows + (offs_even[None, :] + 1) * stride_xk,
                            mask=row_ok[:, None] & (offs_even[None, :] + 1 < K), other=0.0)  # fmt: skip
            w_hi, w_lo = _load_nf4_pairs(w_ptr, code, absmax_ptr, absmax2_ptr, code2_ptr, offset2, e, k0, offs_n,
                                         K, N_W, stride_we, stride_wn, bytes_we, bytes_wn, NESTED, BLOCKSIZE,
                                         BLOCK_K)  # fmt: skip
            acc += _dot(x_even, w_hi, IEEE, DOT_FP32) + _dot(x_odd, w_lo, IEEE, DOT_FP32)
            if GLU:
                w_hi, w_lo = _load_nf4_pairs(w_ptr, code, absmax_ptr, absmax2_ptr, code2_ptr, offset2, e, k0,
                                             offs_n + N, K, N_W, stride_we, stride_wn, bytes_we, bytes_wn,
                                             NESTED, BLOCKSIZE, BLOCK_K)  # fmt: skip
                acc_up += _dot(x_even, w_hi, IEEE, DOT_FP32) + _dot(x_odd, w_lo, IEEE, DOT_FP32)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + src[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=row_ok[:, None] & (offs_k[None, :] < K), other=0.0)  # fmt: skip
            w = _load_weight_tile(w_ptr, code_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset2, e, offs_k, offs_n,
                                  K, N_W, stride_we, stride_wk, stride_wn, W_NF4, NESTED, BLOCKSIZE)  # fmt: skip
            acc += _dot(x, w, IEEE, DOT_FP32)
            if GLU:
                w = _load_weight_tile(w_ptr, code_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset2, e, offs_k,
                                      offs_n + N, K, N_W, stride_we, stride_wk, stride_wn, W_NF4, NESTED,
                                      BLOCKSIZE)  # fmt: skip
                acc_up += _dot(x, w, IEEE, DOT_FP32)
    if N_PACKED:  # columns n0 + 2j and n0 + 2j + 1 side by side again
        acc = tl.reshape(tl.join(acc_even, acc_odd), (BLOCK_M, BLOCK_N))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * stride_be + offs_n, mask=offs_n < N_W, other=0.0).to(tl.float32)[None, :]
        if GLU:
            acc_up += tl.load(bias_ptr + e * stride_be + N + offs_n, mask=offs_n < N,
                              other=0.0).to(tl.float32)[None, :]  # fmt: skip
    if HAS_LORA:
        acc += lora_scale * _low_rank_term(p_ptr, l_ptr, rows, row_ok, e, offs_n, R, N_W, stride_pm, stride_pr,
                                           stride_le, stride_lr, stride_ln, IEEE, DOT_FP32, BLOCK_K)  # fmt: skip
        if GLU:
            acc_up += lora_scale * _low_rank_term(p_ptr, l_ptr, rows, row_ok, e, offs_n + N, R, N_W, stride_pm,
                                                  stride_pr, stride_le, stride_lr, stride_ln, IEEE, DOT_FP32,
                                                  BLOCK_K)  # fmt: skip
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
        tl.store(act_ptr + rows[:, None].to(tl.int64) * stride_am + offs_n[None, :] * stride_an,
                 act.to(act_ptr.dtype.element_ty), mask=mask)  # fmt: skip


@triton.jit
def _grouped_outer_product_kernel(
    a_ptr,  # (T, M) rows, read through gather_ptr when GATHER, else (S, M) sorted
    gather_ptr,  # (S,) int64: the a row of each sorted row
    b_ptr,  # (S, N) sorted rows
    offsets_ptr,  # (E + 1,) int64: rows of expert e are offsets[e]:offsets[e + 1]
    out_ptr,  # (E, M, N) fp32: out[e] = sum over rows s of e of a[s] (x) b[s]
    M, N,
    stride_am, stride_ak, stride_bm, stride_bn, stride_oe, stride_om, stride_on,
    GATHER: tl.constexpr, IEEE: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
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
        a = tl.load(a_ptr + src[:, None] * stride_am + offs_m[None, :] * stride_ak,
                    mask=row_ok[:, None] & (offs_m[None, :] < M), other=0.0)  # fmt: skip
        b = tl.load(b_ptr + rows[:, None].to(tl.int64) * stride_bm + offs_n[None, :] * stride_bn,
                    mask=row_ok[:, None] & (offs_n[None, :] < N), other=0.0)  # fmt: skip
        acc += _dot(tl.trans(a), b.to(tl.float32), IEEE, DOT_FP32)
    tl.store(out_ptr + e.to(tl.int64) * stride_oe + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, acc,
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))  # fmt: skip
