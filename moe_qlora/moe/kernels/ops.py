"""Launchers of the Triton kernels and, beside each, the plain-torch reference that is its oracle.

grouped_matmul:          Y[s] = X[row(s)] @ W_e(s) (+ b_e(s)) (+ c P[s] @ L_e(s))   MUL_MAT_ID, NF4 or dense
grouped_matmul_silu_mul: the same on gate_up stacks, also giving silu(gate) * up in the epilogue
grouped_outer_product:   G[e] = sum over rows s of e of a[s] (x) b[s]    OUT_PROD_ID, the LoRA gradients
Rows are sorted by expert (routing.RoutedTokens); `offsets` gives each expert's row range.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from moe_qlora.moe.nf4 import NF4_LEVELS, NF4Stack, dequantize_expert


@dataclass(frozen=True)
class GroupedWeight:
    """W_e[k, n] of every expert e, read from a dense (E, R, C) tensor or an NF4 stack (E, R, C) with
    `transpose` saying whether W_e is the stored matrix (k = row) or its transpose (k = column)."""

    data: torch.Tensor  # dense (E, R, C), or the NF4 stack's packed bytes
    shape: tuple[int, int, int]  # stored (E, R, C)
    transpose: bool
    nf4: NF4Stack | None = None

    @classmethod
    def dense(cls, w: torch.Tensor, *, transpose: bool) -> GroupedWeight:
        return cls(w, tuple(w.shape), transpose)

    @classmethod
    def quantized(cls, stack: NF4Stack, *, transpose: bool) -> GroupedWeight:
        return cls(stack.packed, tuple(stack.shape), transpose, stack)

    @property
    def k(self) -> int:
        return self.shape[2] if self.transpose else self.shape[1]

    @property
    def n(self) -> int:
        return self.shape[1] if self.transpose else self.shape[2]

    def strides(self) -> tuple[int, int, int]:
        """(per expert, per k, per n) in elements of the flat stack (NF4: elements, not bytes)."""
        if self.nf4 is None:
            se, sr, sc = self.data.stride()
        else:
            se, sr, sc = self.shape[1] * self.shape[2], self.shape[2], 1
        return (se, sc, sr) if self.transpose else (se, sr, sc)

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """W_e as a (K, N) tensor (the reference path: one expert dequantized at a time)."""
        w = dequantize_expert(self.nf4, e, dtype) if self.nf4 is not None else self.data[e].to(dtype)
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


@dataclass(frozen=True)
class MatmulConfig:
    """Tile sizes and launch shape of _grouped_matmul_kernel. BLOCK_M (rows of one expert per tile) is chosen
    on the host from the rows per expert (it shapes the tile map built before the launch): the config's own,
    64 or 128 (the tall class), or 16 in swapped tiles; the rest may be autotuned within the class."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    block_m: int = 64

    def packs(self, blocksize: int, along_n: bool) -> bool:
        """Whether a tile step stays within one quant block along the packed dim (and half a step is still a
        tensor-core dot): the condition of the packed NF4 paths."""
        step = self.block_n if along_n else self.block_k
        return blocksize % step == 0 and step >= 32

    @property
    def wide(self) -> bool:
        """A tile wider than one quant block along N (128 columns): twice the weights decoded per K-step for the
        same x tile and loop bookkeeping, so fewer instructions per decoded weight (Qwen3-30B-A3B's down
        projection on sm_90: 6.8 instead of 8.7), but it cannot take the N_PACKED path (one block scale per row
        of a step) and its accumulators fill the registers."""
        return self.block_n > 64

    @property
    def tall(self) -> bool:
        """A 128-row tile: each decoded weight feeds twice the rows, so the decode's cost per FLOP halves."""
        return self.block_m > 64

    def serves(self, k_packed: bool, glu: bool, swap: bool, tall: bool = False) -> bool:
        """Whether the autotuner times this candidate for a launch: one of the launch's class (tall tiles or
        not); a wide one only on the forward's K_PACKED path with one accumulator, or two (gate and up) in
        swapped 16-row tiles; a tall one with gate and up only in 8 warps. Elsewhere they spill
        (scripts/kernel_report.py --candidates)."""
        if self.tall != tall or (self.tall and glu and self.num_warps < 8):
            return False
        return not self.wide or (k_packed and (not glu or swap))


# Rows per expert (on average: known on the host without a sync) at or below which the packed NF4 paths compute
# their tiles transposed, the rows on the MMA's narrow side in tiles of SWAP_AB_BLOCK_M: decode, GRPO sampling
# and small batches, where 64-row tiles would be mostly padding. A first guess from the tile shapes alone (a
# 16-row tile wastes at most 15 rows, a 64-row one 63); to be re-measured on a GPU with bench_moe.py.
SWAP_AB_MAX_ROWS = 16
SWAP_AB_BLOCK_M = 16
# Rows per expert (on average) at or above which launches take the tall class's 128-row tiles: Mixtral-8x7B at
# 2048 tokens (512), Qwen3-30B-A3B from 4096 (256). The issue-bound ceiling of sm_90's down projection goes from
# 45% to 83% of tensor peak (kernel_report.py) while the padding of each expert's last tile grows by 64 rows on
# average, a quarter of 256. A first guess from the tile shapes; to be re-measured on a GPU with bench_moe.py.
TALL_MIN_ROWS = 256
# Split-K: when a launch has at most half as many programs (tiles x N blocks, the tiles' upper bound) as
# SPLIT_K_SMS, K is split over floor(SPLIT_K_SMS / programs) programs per tile (at most SPLIT_K_MAX, each with two
# or more K-steps), and a second launch adds the partial sums in split order: deterministic, no atomics. The count
# is a constant, not the device's SM count (132 on an H100 SXM, 114 on a PCIe one, 108 on an A100): the split
# changes the order of the fp32 sums, so a device-dependent split would make a resume on another GPU model
# differ in the last bits.
SPLIT_K_MAX = 4
SPLIT_K_SMS = 132
# Candidates per GPU architecture (compute capability x 10). A launch is timed over the candidates that serve
# it (MatmulConfig.serves), and with autotuning off (MOE_QLORA_AUTOTUNE=0), in the interpreter and in the
# ahead-of-time report it takes the first of them: the first entry for 64-row tiles, the first tall one that
# fits for 128-row ones. Every narrow candidate packs NF4 at bitsandbytes' blocksize 64 along K and N, so the
# packed paths do not depend on the choice. The defaults were picked from scripts/kernel_report.py (fewest
# issued instructions per FLOP without spills, at Qwen3-30B-A3B and Mixtral-8x7B shapes, for every launch);
# the rest are for the autotuner to time on the GPU.
MATMUL_CONFIGS = {
    90: [MatmulConfig(64, 64, 4, 3), MatmulConfig(64, 64, 4, 4), MatmulConfig(64, 32, 4, 4),
         MatmulConfig(32, 64, 4, 3), MatmulConfig(128, 64, 4, 3),
         MatmulConfig(64, 64, 4, 3, 128), MatmulConfig(64, 64, 8, 3, 128), MatmulConfig(128, 64, 8, 3, 128)],
    80: [MatmulConfig(64, 32, 4, 3), MatmulConfig(64, 64, 8, 3), MatmulConfig(32, 32, 4, 3),
         MatmulConfig(64, 32, 4, 4), MatmulConfig(128, 32, 4, 3),
         MatmulConfig(64, 32, 4, 3, 128), MatmulConfig(64, 64, 8, 3, 128), MatmulConfig(128, 32, 8, 3, 128)],
}  # fmt: skip
# fp32 activations: exact IEEE products run on the FMA units, whose dot keeps each thread's operand slices in
# registers; every candidate above spills there (sm_90: 255 registers and 300-11,552 bytes per thread). fp32
# launches take this one config instead, 32 x 32 tiles in 8 warps: at most 180 registers and no spill on sm_80 and
# sm_90 (scripts/kernel_report.py --dtype fp32), never swapped, tall or autotuned.
FP32_CONFIG = MatmulConfig(32, 32, num_warps=8, num_stages=2, block_m=32)
# False: fp32 launches take the bf16 tile configs (swapped, tall, wide) as bf16 ones do. The kernel tests set it:
# in the interpreter fp32 products are exact, so the code paths a GPU runs in bf16 are checked there to 1e-5.
FP32_OWN_CONFIG = True
# The arch defaults as shipped: what a launch no pinned candidate serves falls back to (ops.pinned_config).
DEFAULT_CONFIGS = {arch: configs[0] for arch, configs in MATMUL_CONFIGS.items()}
OUTER_BLOCKS = (64, 64, 32)  # OUT_PROD_ID: BLOCK_M, BLOCK_N, BLOCK_S, not autotuned
OUTER_BLOCKS_FP32 = (32, 32, 32)  # fp32 (FMA): (64, 64, 32) spills 176 bytes per thread on sm_80; this 0 on both
TARGET_ARCH_ENV = "MOE_QLORA_TARGET_ARCH"  # the architecture whose config list launches use (AOT capture, tests)


def block_override() -> tuple[int, int, int] | None:
    """MOE_QLORA_TRITON_BLOCKS=M,N,K: fixed blocks for every kernel (the tests' small shapes), no autotuning."""
    override = os.environ.get("MOE_QLORA_TRITON_BLOCKS")
    return tuple(int(v) for v in override.split(",")) if override else None


def autotune_requested() -> bool:
    """MOE_QLORA_AUTOTUNE=0 turns the autotuner off: every launch takes the first candidate that serves it."""
    return os.environ.get("MOE_QLORA_AUTOTUNE", "1") != "0"


def autotuning() -> bool:
    """Whether launches here are autotuned: requested, compiled (not interpreted), and no block override."""
    return autotune_requested() and not _interpreted() and block_override() is None


def target_arch(device) -> int:
    """Whose config list `device` uses: 90 for Hopper and datacenter Blackwell (sm_90, sm_100), 80 for the GPUs
    whose tensor cores Triton drives with mma.sync, Ampere, Ada and consumer Blackwell (sm_80/86/89/120: the
    24 GB cards). MOE_QLORA_TARGET_ARCH, when set, wins on any device: the AOT capture records either list from
    CPU tensors (90 when unset), and the kernel tests run either list on whatever GPU they find (both lists
    compile for every arch from sm_80 on and fit its shared memory)."""
    if override := os.environ.get(TARGET_ARCH_ENV):
        return int(override)
    if torch.device(device).type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return 90 if major in (9, 10) else 80
    return 90


def split_k(programs: int, k_steps: int) -> int:
    """How many programs share each tile's K (1: no split), from the launch's upper-bound program count; the
    same on every device (SPLIT_K_SMS)."""
    if block_override() is not None:
        return 1
    return max(1, min(SPLIT_K_MAX, SPLIT_K_SMS // max(programs, 1), k_steps // 2))


def matmul_plan(device, dtype: torch.dtype = torch.bfloat16) -> list[MatmulConfig]:
    """Candidate configs of a grouped matmul on `device` with `dtype` activations: the override as one config,
    FP32_CONFIG in fp32, else the architecture's list (each launch then keeps those that serve it:
    launch_candidates)."""
    override = block_override()
    if override is not None:
        return [MatmulConfig(override[1], override[2], block_m=override[0])]
    if dtype == torch.float32 and FP32_OWN_CONFIG:
        return [FP32_CONFIG]
    return MATMUL_CONFIGS[target_arch(device)]


@contextmanager
def pinned_config(arch: int, config: MatmulConfig | None = None):
    """Launches inside are not autotuned (each takes its first serving candidate, as with
    MOE_QLORA_AUTOTUNE=0), `arch`'s list is cut to `config` if given, and a launch on a CPU tensor records
    `arch`: the AOT capture, the report's candidates, the GPU check that every candidate gives the same bits."""
    saved = MATMUL_CONFIGS[arch], os.environ.get(TARGET_ARCH_ENV), os.environ.get("MOE_QLORA_AUTOTUNE")
    if config is not None:
        MATMUL_CONFIGS[arch] = [config]
    os.environ[TARGET_ARCH_ENV] = str(arch)
    os.environ["MOE_QLORA_AUTOTUNE"] = "0"
    try:
        yield
    finally:
        MATMUL_CONFIGS[arch] = saved[0]
        for name, value in ((TARGET_ARCH_ENV, saved[1]), ("MOE_QLORA_AUTOTUNE", saved[2])):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def tile_bound(num_rows: int, num_experts: int, block_m: int) -> int:
    """The most BLOCK_M-row tiles S rows sorted over E experts can fill: the grid of a grouped launch."""
    return -(-num_rows // block_m) + min(num_experts, num_rows)


def expert_tiles(offsets: torch.Tensor, num_rows: int, block_m: int) -> torch.Tensor:
    """(num_tiles, 3) int32 (expert, first row, end row) of each BLOCK_M-row tile, built on the device.

    The grid size must not depend on the data (no host sync), so it is the upper bound
    ceil(S / BLOCK_M) + min(E, S) (each expert with rows, at most S of them, wastes at most one partial
    tile): tile_bound(S, E, BLOCK_M). Tile i belongs to the expert whose
    cumulative tile count first exceeds i, and tiles past the last one are (0, 0, 0), which the kernel
    skips at once. offsets: (E+1,) int64 device tensor."""
    counts = offsets[1:] - offsets[:-1]
    tiles_per_expert = (counts + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles_per_expert, 0)
    num_experts = counts.shape[0]
    tile = torch.arange(tile_bound(num_rows, num_experts, block_m), device=offsets.device)
    expert = torch.searchsorted(tile_ends, tile, right=True)
    valid = expert < num_experts
    expert = expert.clamp(max=num_experts - 1)
    first = offsets[expert] + (tile - (tile_ends[expert] - tiles_per_expert[expert])) * block_m
    end = offsets[expert + 1]
    zero = torch.zeros_like(first)
    return torch.stack([torch.where(valid, expert, zero), torch.where(valid, first, zero),
                        torch.where(valid, end, zero)], dim=1).to(torch.int32)  # fmt: skip


def device_offsets(offsets, device) -> torch.Tensor:
    """(E+1,) int64 offsets on `device`: a device tensor as is, a host list (the tests' form) copied once."""
    if isinstance(offsets, torch.Tensor):
        return offsets
    return _offsets_tensor(tuple(offsets), str(device))


def _num_rows(offsets, x, gather) -> int:
    if not isinstance(offsets, torch.Tensor):
        return offsets[-1]
    return gather.shape[0] if gather is not None else x.shape[0]


def _interpreted() -> bool:
    """Running in Triton's interpreter (CPU tests), whose bf16 tl.dot gives wrong results."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _levels(device: str) -> torch.Tensor:
    return torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)


_MATMUL_TUNE_KEYS = ["K", "N", "R", "rows_class", "BLOCK_M", "W_NF4", "NESTED", "GATHER", "GLU", "HAS_LORA",
                     "K_PACKED", "N_PACKED", "SWAP_AB", "PHASE"]  # fmt: skip
ROWS_CLASS_MAX = 2048


def rows_class(num_rows: int, num_experts: int) -> int:
    """Average rows per expert, rounded up to a power of two in [16, ROWS_CLASS_MAX]: part of the autotuner's
    key, so that the config timed at one token count is not reused at another 8x larger or smaller (within a
    tile class, the best BLOCK_N and stage count move with the rows). Always a multiple of 16, so the JIT
    specializes the argument one way whatever its value: a new class costs a timing run, not a compile."""
    average = max(1, -(-num_rows // num_experts))
    return min(ROWS_CLASS_MAX, max(16, 1 << (average - 1).bit_length()))


@functools.cache
def _autotuned_matmul(arch: int, candidates: tuple[MatmulConfig, ...]):
    """_grouped_matmul_kernel under Triton's autotuner over `candidates` (those of `arch`'s list that serve the
    launch), timed once per key (shapes and variant) on first use; the kernel only writes its outputs, so
    repeated timing runs are harmless."""
    import triton

    from moe_qlora.moe.kernels.triton_kernels import _grouped_matmul_kernel

    configs = [triton.Config({"BLOCK_N": c.block_n, "BLOCK_K": c.block_k}, num_warps=c.num_warps,
                             num_stages=c.num_stages) for c in candidates]  # fmt: skip
    return triton.autotune(configs=configs, key=_MATMUL_TUNE_KEYS)(_grouped_matmul_kernel)


def _candidates_where(keep, configs: list[MatmulConfig], device) -> list[MatmulConfig]:
    """The configs `keep` accepts, in list order; the architecture's shipped default if it accepts none (a
    config pinned by pinned_config); the block override as given."""
    if block_override() is not None:
        return configs
    return [c for c in configs if keep(c)] or [DEFAULT_CONFIGS[target_arch(device)]]


def path_candidates(configs: list[MatmulConfig], device) -> list[MatmulConfig]:
    """The candidates a launch's path (packed along K, along N, or bytes) is chosen over: the narrow ones (a
    wide one is then timed only where it serves the path)."""
    return _candidates_where(lambda c: not c.wide, configs, device)


def mma_kind(config: MatmulConfig, arch: int, swap: bool) -> str:
    """The tensor-core instruction a bf16/fp16 launch at `config` compiles to on `arch`'s list: "wgmma" on sm_90
    when the MMA's M side (the tile's rows, or its weight columns in swapped tiles) is at least 64, the size of
    one warpgroup's instruction, else "mma.sync" (read from the PTX of every candidate: tests/test_kernels.py)."""
    m_side = config.block_n if swap else config.block_m
    return "wgmma" if arch == 90 and m_side >= 64 and config.num_warps % 4 == 0 else "mma.sync"


def launch_candidates(configs: list[MatmulConfig], device, *, k_packed: bool, glu: bool, swap: bool,
                      tall: bool) -> list[MatmulConfig]:  # fmt: skip
    """The candidates that serve a launch (MatmulConfig.serves), in list order so the class's default comes
    first; only that one when not autotuning. A candidate whose tensor-core instruction differs from the
    default's (mma_kind) is left out: wgmma and mma.sync need not accumulate a K-step's products in the same
    order, and the autotuner's pick (which may differ between a run and its resume) must not change bits."""
    served = _candidates_where(lambda c: c.serves(k_packed, glu, swap, tall), configs, device)
    arch = target_arch(device)
    kind = mma_kind(served[0], arch, swap)
    served = [c for c in served if mma_kind(c, arch, swap) == kind]
    return served if autotuning() else served[:1]


def takes_tall_tiles(num_rows: int, num_experts: int, swap: bool) -> bool:
    """Whether a launch of `num_rows` sorted rows over `num_experts` takes the tall class's 128-row tiles: at
    least TALL_MIN_ROWS rows per expert on average, not swapped, no block override."""
    return block_override() is None and not swap and num_rows >= TALL_MIN_ROWS * num_experts


def _launch_matmul(x, weight: GroupedWeight, offsets, *, gather, bias, lora, glu: bool, keep_y: bool):
    """Run _grouped_matmul_kernel; returns (Y or None, act or None)."""
    from moe_qlora.moe.kernels import triton_kernels

    configs = matmul_plan(x.device, x.dtype)
    fp32 = x.dtype == torch.float32 and FP32_OWN_CONFIG  # one config (FP32_CONFIG): not swapped, not tall
    n = weight.n // 2 if glu else weight.n
    num_rows = _num_rows(offsets, x, gather)
    y = x.new_empty(num_rows, weight.n) if keep_y else None
    act = x.new_empty(num_rows, n) if glu else None
    if num_rows == 0:
        return y, act
    q = weight.nf4
    nested = q is not None and q.nested is not None
    absmax, absmax2, code2, offset2 = (q.absmax, *q.nested) if nested else (q.absmax if q else x, x, x, 0.0)
    se, sk, sn = weight.strides()
    lp, lw, rank, lse, lsr, lsn = (lora.p, lora.weight.data, lora.weight.k, *lora.weight.strides()) if lora else (
        x, x, 0, 0, 0, 0)  # fmt: skip
    out, act_out = (y if y is not None else act), (act if act is not None else x)
    # NF4 read along its contiguous dim as whole 4-byte words: each column (K_PACKED, the forward) or row
    # (N_PACKED, through the transposed experts) of a tile starts on a quant block, and with every candidate
    # the path is chosen over a tile step stays within one.
    narrow = path_candidates(configs, x.device)
    words = q is not None and q.packed.is_contiguous() and q.packed.storage_offset() % 4 == 0 and \
        se % q.blocksize == 0  # fmt: skip
    k_packed = words and sk == 1 and sn % q.blocksize == 0 and all(c.packs(q.blocksize, False) for c in narrow)
    n_packed = words and not glu and sn == 1 and sk % q.blocksize == 0 and \
        all(c.packs(q.blocksize, True) for c in narrow)  # fmt: skip
    w = weight.data.view(torch.int32) if k_packed or n_packed else weight.data
    swap = (k_packed or n_packed) and block_override() is None and not fp32 and \
        num_rows <= SWAP_AB_MAX_ROWS * weight.shape[0]  # fmt: skip
    tall = not fp32 and takes_tall_tiles(num_rows, weight.shape[0], swap)
    configs = launch_candidates(configs, x.device, k_packed=k_packed, glu=glu, swap=swap, tall=tall)
    if (k_packed or n_packed) and not all(c.packs(q.blocksize, n_packed) for c in configs):
        # the path was chosen over the narrow candidates; a launched one whose step spans two quant blocks
        # would decode a whole step with one block's scale
        raise RuntimeError(f"packed NF4 path chosen, but a candidate's step spans quant blocks: {configs}")
    bm = SWAP_AB_BLOCK_M if swap else configs[0].block_m  # the candidates share their class's BLOCK_M
    tiles = expert_tiles(device_offsets(offsets, x.device), num_rows, bm)
    default = configs[0]
    n_blocks = -(-n // default.block_n)
    split = split_k(tiles.shape[0] * n_blocks, -(-weight.k // default.block_k))
    if split > 1:  # both launches must agree on the blocks: the default config, not autotuned
        configs = configs[:1]
    if len(configs) > 1:
        kernel, meta = _autotuned_matmul(target_arch(x.device), tuple(configs)), {}
    else:
        kernel = triton_kernels._grouped_matmul_kernel
        meta = dict(BLOCK_N=default.block_n, BLOCK_K=default.block_k, num_warps=default.num_warps,
                    num_stages=default.num_stages)  # fmt: skip
    ws = x.new_empty(tiles.shape[0] * n_blocks * split * (2 if glu else 1) * bm * default.block_n,
                     dtype=torch.float32) if split > 1 else x  # fmt: skip
    args = (
        x, gather if gather is not None else tiles, tiles, w, _levels(str(x.device)), absmax, absmax2,
        code2, float(offset2), bias if bias is not None else x, lp, lw, float(lora.scale if lora else 0.0), out,
        act_out, ws, weight.k, n, rank, x.stride(0), x.stride(1), se, sk, sn, se // 8, sk // 8, sn // 8,
        bias.stride(0) if bias is not None else 0,
        lp.stride(0), lp.stride(1), lse, lsr, lsn, out.stride(0), out.stride(1), act_out.stride(0),
        act_out.stride(1), rows_class(num_rows, weight.shape[0]),
    )  # fmt: skip
    flags = dict(
        W_NF4=q is not None, NESTED=nested, GATHER=gather is not None, HAS_BIAS=bias is not None,
        HAS_LORA=lora is not None, GLU=glu, STORE_Y=keep_y, K_PACKED=k_packed, N_PACKED=n_packed, SWAP_AB=swap,
        SPLIT_K=split, EVEN_K=all(weight.k % c.block_k == 0 for c in configs), BLOCKSIZE=q.blocksize if q else 64,
        IEEE=x.dtype == torch.float32, DOT_FP32=_interpreted(),
        BLOCK_M=bm, **meta,
    )  # fmt: skip
    if split == 1:
        kernel[lambda m: (tiles.shape[0], -(-n // m["BLOCK_N"]))](*args, PHASE=0, **flags)
    else:  # partial sums over each split's K-steps, then their sum in split order and the epilogue
        kernel[(tiles.shape[0], n_blocks, split)](*args, PHASE=1, **flags)
        kernel[(tiles.shape[0], n_blocks)](*args, PHASE=2, **flags)
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
    return torch.tensor(offsets, dtype=torch.int64, device=device)


def grouped_outer_product(a, b, offsets: list[int], *, gather=None):
    """Triton OUT_PROD_ID; same contract as grouped_outer_product_reference."""
    from moe_qlora.moe.kernels.triton_kernels import _grouped_outer_product_kernel

    bm, bn, bs = block_override() or (OUTER_BLOCKS_FP32 if a.dtype == torch.float32 else OUTER_BLOCKS)
    num_experts, m, n = len(offsets) - 1, a.shape[1], b.shape[1]
    out = torch.empty(num_experts, m, n, dtype=torch.float32, device=a.device)
    offs = device_offsets(offsets, a.device)
    grid = (num_experts, -(-m // bm) * -(-n // bn))
    _grouped_outer_product_kernel[grid](
        a, gather if gather is not None else offs, b, offs, out, m, n, a.stride(0), a.stride(1), b.stride(0),
        b.stride(1), out.stride(0), out.stride(1), out.stride(2), GATHER=gather is not None,
        IEEE=a.dtype == torch.float32, DOT_FP32=_interpreted(), BLOCK_M=bm, BLOCK_N=bn, BLOCK_S=bs,
    )  # fmt: skip
    return out
