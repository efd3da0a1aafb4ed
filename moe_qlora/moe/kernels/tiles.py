"""Which tiles a grouped-matmul launch takes: the candidate configs per GPU architecture, the classes a launch
falls in (swapped 16-row tiles, 64-row, tall 128-row; split-K), which candidates the autotuner may time, and the
settings that turn autotuning off or pin a config (tests, the ahead-of-time capture).

The settings (KernelSettings) come from the environment once, at their first use in a process
(MOE_QLORA_TRITON_BLOCKS, MOE_QLORA_AUTOTUNE, MOE_QLORA_TARGET_ARCH, TRITON_INTERPRET), and are replaced for a block
with kernel_settings_overridden: a launch reads fields of one frozen object, never the environment.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from moe_qlora.common.settings import ReadOnce


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

    def packs(self, blocksize: int, along_n: bool, whole_blocks: bool = False) -> bool:
        """Whether a tile step stays within one quant block along the packed dim (and half a step is still a
        tensor-core dot): the condition of the packed NF4 paths. whole_blocks (MXFP4, 32-code blocks): a step
        of whole blocks also packs, each block's scale broadcast along its codes."""
        step = self.block_n if along_n else self.block_k
        fits = blocksize % step == 0 or (whole_blocks and step % blocksize == 0)
        return fits and step >= 32

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


# The order of a grouped matmul's programs (row tile, N block), and so of their start: groups of row tiles, within a
# group the tiles fastest, then the N blocks (the grid (group, N blocks, groups): triton_kernels._output_block;
# grid_block below is the same map). 1: every N block of a row tile before the next tile; 0: one group of all, every
# row tile of an N block before the next block (the order before issue 67), which re-reads all the activations once
# per N block (up to 224 times: Mixtral-8x7B's gate_up). A group's
# activation tiles stay in L2 while it sweeps the N blocks, and each expert's weight columns are read once per
# group: as many row tiles as GROUP_L2_BYTES of activations hold (group_m), measured with scripts/layer_traffic.py's
# L2 model (--grid). GROUP_M set: every launch takes it (the tests).
GROUP_M: int | None = None
GROUP_L2_BYTES = 32 * 2**20  # two thirds of the H100's L2 (50 MB): the rest holds the weight tiles streaming past
GROUP_M_MAX = 16


def group_m(block_m: int, k: int, itemsize: int) -> int:
    """Row tiles per group for a launch whose activation tile is block_m x k of `itemsize` bytes: the largest
    power of two up to GROUP_M_MAX whose tiles fit GROUP_L2_BYTES, at least 1 (GROUP_M when set; 0: one group of
    all the tiles)."""
    if GROUP_M is not None:
        return GROUP_M
    fit = max(1, min(GROUP_M_MAX, GROUP_L2_BYTES // (block_m * k * itemsize)))
    return 1 << (fit.bit_length() - 1)


def grid_block(pid: int, num_tiles: int, n_blocks: int, group_m: int) -> tuple[int, int]:
    """(row tile, N block) of the pid-th program to start: triton_kernels._output_block on the host (num_tiles a
    multiple of group_m; 0: one group of all)."""
    if group_m == 0:
        return pid % num_tiles, pid // num_tiles
    in_group = group_m * n_blocks
    r = pid % in_group
    return (pid // in_group) * group_m + r % group_m, r // group_m


# Candidates per GPU architecture (compute capability x 10). A launch is timed over the candidates that serve
# it (MatmulConfig.serves), and with autotuning off (MOE_QLORA_AUTOTUNE=0), in the interpreter and in the
# ahead-of-time report it takes the first of them: the first entry for 64-row tiles, the first tall one that
# fits for 128-row ones. Every narrow candidate packs NF4 at bitsandbytes' blocksize 64 along K and N, so the
# packed paths do not depend on the choice. The defaults were picked from scripts/kernel_report.py (fewest
# issued instructions per FLOP without spills, at Qwen3-30B-A3B and Mixtral-8x7B shapes, for every launch);
# the rest are for the autotuner to time on the GPU.
MATMUL_CONFIGS = {
    90: [
        MatmulConfig(64, 64, 4, 3),
        MatmulConfig(64, 64, 4, 4),
        MatmulConfig(64, 32, 4, 4),
        MatmulConfig(32, 64, 4, 3),
        MatmulConfig(128, 64, 4, 3),
        MatmulConfig(64, 64, 4, 3, 128),
        MatmulConfig(64, 64, 8, 3, 128),
        MatmulConfig(128, 64, 8, 3, 128),
    ],
    80: [
        MatmulConfig(64, 32, 4, 3),
        MatmulConfig(64, 64, 8, 3),
        MatmulConfig(32, 32, 4, 3),
        MatmulConfig(64, 32, 4, 4),
        MatmulConfig(128, 32, 4, 3),
        MatmulConfig(64, 32, 4, 3, 128),
        MatmulConfig(64, 64, 8, 3, 128),
        MatmulConfig(128, 32, 8, 3, 128),
    ],
}


# fp32 activations: exact IEEE products run on the FMA units, whose dot keeps each thread's operand slices in
# registers; every candidate above spills there (sm_90: 255 registers and 300-11,552 bytes per thread). fp32
# launches take this one config instead, 32 x 32 tiles in 8 warps: at most 180 registers and no spill on sm_80 and
# sm_90 (scripts/kernel_report.py --dtype fp32), never swapped, tall or autotuned.
FP32_CONFIG = MatmulConfig(32, 32, num_warps=8, num_stages=2, block_m=32)


# The arch defaults as shipped: what a launch no pinned candidate serves falls back to (ops.pinned_config).
DEFAULT_CONFIGS = {arch: configs[0] for arch, configs in MATMUL_CONFIGS.items()}


OUTER_BLOCKS = (64, 64, 32)  # OUT_PROD_ID: BLOCK_M, BLOCK_N, BLOCK_S, not autotuned


OUTER_BLOCKS_FP32 = (32, 32, 32)  # fp32 (FMA): (64, 64, 32) spills 176 bytes per thread on sm_80; this 0 on both


BLOCKS_ENV = "MOE_QLORA_TRITON_BLOCKS"  # M,N,K: fixed blocks for every kernel (the tests' small shapes)
AUTOTUNE_ENV = "MOE_QLORA_AUTOTUNE"  # 0: no autotuning, every launch takes the first candidate that serves it
TARGET_ARCH_ENV = "MOE_QLORA_TARGET_ARCH"  # the architecture whose config list launches use (AOT capture, tests)
INTERPRET_ENV = "TRITON_INTERPRET"  # 1: Triton's interpreter runs the kernels (read by Triton when it is imported)
GLUON_ENV = "MOE_QLORA_GLUON"  # 1: the forward's NF4 launches run the experimental Gluon kernels where they serve


@dataclass(frozen=True)
class KernelSettings:
    """What configures every launch, fixed for a process: read from the environment at the first use
    (kernel_settings) so that no launch parses it, and replaced for a block by kernel_settings_overridden
    (pinned_config, the tests)."""

    block_override: tuple[int, int, int] | None = None  # BLOCK_M, N, K of every kernel: no autotuning, no split-K
    autotune: bool = True  # False: every launch takes the first candidate that serves it
    target_arch: int | None = None  # whose config list launches use on any device (None: the device's own)
    interpreted: bool = False  # Triton's interpreter runs the kernels (CPU tests), whose bf16 tl.dot is wrong
    # False: fp32 launches take the bf16 tile configs (swapped, tall, wide) as bf16 ones do. The kernel tests set
    # it: in the interpreter fp32 products are exact, so the code paths a GPU runs in bf16 are checked there to 1e-5.
    fp32_own_config: bool = True
    gluon: bool = False  # the forward's NF4 launches by kernels/gluon_nf4.py where it serves (experimental)

    @classmethod
    def from_environment(cls, environ=os.environ) -> KernelSettings:
        """The settings `environ` asks for: MOE_QLORA_TRITON_BLOCKS=M,N,K, MOE_QLORA_AUTOTUNE=0,
        MOE_QLORA_TARGET_ARCH=80|90, TRITON_INTERPRET=1 (exactly "1", as this package has always read it),
        MOE_QLORA_GLUON=1."""
        blocks, arch = environ.get(BLOCKS_ENV), environ.get(TARGET_ARCH_ENV)
        return cls(
            block_override=tuple(int(v) for v in blocks.split(",")) if blocks else None,
            autotune=environ.get(AUTOTUNE_ENV, "1") != "0",
            target_arch=int(arch) if arch else None,
            interpreted=environ.get(INTERPRET_ENV) == "1",
            gluon=environ.get(GLUON_ENV) == "1",
        )


# tests/conftest.py sets TRITON_INTERPRET before anything here runs, and a child process (the AOT capture,
# scripts/gpu_check.sh, the tests' subprocesses) reads its own environment.
_SETTINGS = ReadOnce(KernelSettings.from_environment)


def kernel_settings() -> KernelSettings:
    """The settings launches use now: the innermost override, else the environment's (read at the first call)."""
    return _SETTINGS.current()


@contextmanager
def kernel_settings_overridden(**changes) -> Iterator[KernelSettings]:
    """Inside the block, launches use the current settings with `changes` (KernelSettings fields) replaced:
    kernel_settings_overridden(autotune=False, target_arch=90). Blocks nest; the settings return on exit."""
    with _SETTINGS.overriding(dataclasses.replace(kernel_settings(), **changes)) as settings:
        yield settings


def block_override() -> tuple[int, int, int] | None:
    """Fixed blocks for every kernel (MOE_QLORA_TRITON_BLOCKS=M,N,K: the tests' small shapes), no autotuning."""
    return kernel_settings().block_override


def autotune_requested() -> bool:
    """Whether autotuning was asked for (MOE_QLORA_AUTOTUNE=0 turns it off: every launch takes the first candidate
    that serves it)."""
    return kernel_settings().autotune


def autotuning() -> bool:
    """Whether launches here are autotuned: requested, compiled (not interpreted), and no block override."""
    return autotune_requested() and not interpreted() and block_override() is None


def target_arch(device) -> int:
    """Whose config list `device` uses: 90 for Hopper and datacenter Blackwell (sm_90, sm_100), 80 for the GPUs
    whose tensor cores Triton drives with mma.sync, Ampere, Ada and consumer Blackwell (sm_80/86/89/120: the
    24 GB cards). The settings' target_arch (MOE_QLORA_TARGET_ARCH), when set, wins on any device: the AOT capture
    records either list from CPU tensors (90 when unset), and the kernel tests run either list on whatever GPU
    they find (both lists compile for every arch from sm_80 on and fit its shared memory)."""
    if (override := kernel_settings().target_arch) is not None:
        return override
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
    FP32_CONFIG in fp32 (unless the settings' fp32_own_config is off), else the architecture's list (each launch
    then keeps those that serve it: launch_candidates)."""
    override = block_override()
    if override is not None:
        return [MatmulConfig(override[1], override[2], block_m=override[0])]
    if dtype == torch.float32 and kernel_settings().fp32_own_config:
        return [FP32_CONFIG]
    return MATMUL_CONFIGS[target_arch(device)]


@contextmanager
def pinned_config(arch: int, config: MatmulConfig | None = None):
    """Launches inside are not autotuned (each takes its first serving candidate, as with
    MOE_QLORA_AUTOTUNE=0), `arch`'s list is cut to `config` if given, and a launch on a CPU tensor records
    `arch`: the AOT capture, the report's candidates, the GPU check that every candidate gives the same bits."""
    saved = MATMUL_CONFIGS[arch]
    if config is not None:
        MATMUL_CONFIGS[arch] = [config]
    try:
        with kernel_settings_overridden(target_arch=arch, autotune=False):
            yield
    finally:
        MATMUL_CONFIGS[arch] = saved


def interpreted() -> bool:
    """Running in Triton's interpreter (CPU tests, TRITON_INTERPRET=1), whose bf16 tl.dot gives wrong results."""
    return kernel_settings().interpreted


ROWS_CLASS_MAX = 2048


def rows_class(num_rows: int, num_experts: int) -> int:
    """Average rows per expert, rounded up to a power of two in [16, ROWS_CLASS_MAX]: part of the autotuner's
    key, so that the config timed at one token count is not reused at another 8x larger or smaller (within a
    tile class, the best BLOCK_N and stage count move with the rows). Always a multiple of 16, so the JIT
    specializes the argument one way whatever its value: a new class costs a timing run, not a compile."""
    average = max(1, -(-num_rows // num_experts))
    return min(ROWS_CLASS_MAX, max(16, 1 << (average - 1).bit_length()))


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
    one warpgroup's instruction, else "mma.sync" (read from the PTX of every candidate: tests/moe/test_kernels.py)."""
    m_side = config.block_n if swap else config.block_m
    return "wgmma" if arch == 90 and m_side >= 64 and config.num_warps % 4 == 0 else "mma.sync"


def launch_candidates(
    configs: list[MatmulConfig], device, *, k_packed: bool, glu: bool, swap: bool, tall: bool
) -> list[MatmulConfig]:
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
