"""Every Triton kernel against its torch reference, run by Triton's interpreter on the CPU
(TRITON_INTERPRET=1, set before triton is imported: see conftest), and compiled ahead of time for
sm_80 and sm_90 so nothing only the interpreter accepts slips in.

With a CUDA GPU (no TRITON_INTERPRET) the same tests run the compiled kernels on it (fixture `dev`).
Shapes are small (the interpreter runs each program in Python) but cover what breaks grouped kernels:
ragged groups, experts with no rows, one expert with every row, dims that are not multiples of the blocks.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from moe_qlora.moe.kernels import ops, tiles
from moe_qlora.moe.kernels.ops import (
    GroupedWeight,
    LowRank,
    grouped_matmul,
    grouped_matmul_reference,
    grouped_matmul_silu_mul,
    grouped_matmul_silu_mul_reference,
    grouped_outer_product,
    grouped_outer_product_reference,
)
from moe_qlora.moe.kernels.triton_kernels import _output_block
from moe_qlora.moe.nf4 import NF4Stack, dequantize_stack, quantize_stack

# (dtype, atol, rtol). fp32: products are exact (ieee dot); only the summation order differs, ~1e-6
# relative on sums of O(10) terms. bf16 with dense bf16 weights: the products of bf16 inputs are exact in
# fp32 in both paths; the outputs are rounded to bf16 (torch to nearest, the interpreter towards zero:
# up to 2 ulps apart, 2**-6 relative), hence rtol 2e-2 and atol 2e-2 for values near zero. The NF4 test
# bounds its bf16 error per element instead (the weights are rounded too).
DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2e-2)]

# counts per expert: ragged; experts 1 and 4 empty; all rows on one expert
ROUTINGS = {"ragged": [5, 0, 17, 3, 0, 9], "one_expert": [0, 0, 21, 0, 0, 0]}


@pytest.fixture(autouse=True)
def bf16_tiles_in_fp32():
    """fp32 launches here take the bf16 tile configs (swapped, tall, wide), not tiles.FP32_CONFIG: the interpreter's
    fp32 products are exact, so the code paths a GPU runs in bf16 are checked to 1e-5."""
    with tiles.kernel_settings_overridden(fp32_own_config=False):
        yield


def offsets_of(counts):
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def nf4_stack(e, rows, cols, *, double_quant=False, seed=0, device="cpu"):
    w = torch.randn(e, rows, cols, generator=torch.Generator().manual_seed(seed))
    return NF4Stack.from_param(quantize_stack(w.to(device), double_quant=double_quant))


def rounding_bound(x, stack, offsets, y_ref, *, transpose, rel, gather=None, bias=None, lora=None):
    """Per-element bound on |kernel - reference| of a grouped NF4 matmul whose operands may be rounded
    differently (bf16: torch rounds to nearest even, Triton's interpreter towards zero, measured
    1.6940 -> 1.6875 where nearest gives 1.6953; so weights, bias and LoRA factor may be a whole ulp,
    rel = 2**-7, apart): rel * (sum_k |x||w| + |b| + c |P||L|) + 2 rel |y| (the output roundings)
    + 1e-5. fp32 (rel ~1e-5): only the summation order differs, well inside the first term."""
    dense_abs = GroupedWeight.dense(dequantize_stack(stack).abs(), transpose=transpose)
    abs_lora = None
    if lora is not None:
        abs_lora = LowRank(
            lora.p.float().abs(), GroupedWeight.dense(lora.weight.data.abs(), transpose=True), lora.scale
        )
    magnitude = grouped_matmul_reference(
        x.float().abs(), dense_abs, offsets, gather=gather, bias=None if bias is None else bias.abs(), lora=abs_lora
    )
    return rel * magnitude + 2 * rel * y_ref.float().abs() + 1e-5


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("transpose", [True, False], ids=["x_WT", "x_W"])
@pytest.mark.parametrize("double_quant", [False, True], ids=["absmax", "nested"])
@pytest.mark.usefixtures("small_triton_blocks")
def test_grouped_nf4_matmul_matches_reference(dev, dtype, atol, rtol, routing, transpose, double_quant):
    # Stored (6, 40, 48): K and N of 40/48 are not multiples of the 16-wide blocks the tests use.
    offsets = offsets_of(ROUTINGS[routing])
    stack = nf4_stack(6, 40, 48, double_quant=double_quant, device=dev)
    weight = GroupedWeight.quantized(stack, transpose=transpose)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, weight.k, generator=g).to(dev, dtype)  # 11 tokens, gathered into sorted rows
    gather = torch.randint(0, 11, (offsets[-1],), generator=g).to(dev)
    bias = torch.randn(6, weight.n, generator=g).to(dev)
    expected = grouped_matmul_reference(x, weight, offsets, gather=gather, bias=bias)
    got = grouped_matmul(x, weight, offsets, gather=gather, bias=bias)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
        return
    # bf16: both paths round the decoded weight and the output to bf16, possibly in different directions.
    bound = rounding_bound(x, stack, offsets, expected, transpose=transpose, rel=2**-7, gather=gather, bias=bias)
    excess = (got.float() - expected.float()).abs() / bound
    assert excess.max() <= 1.0, f"bf16 error {excess.max():.2f}x its bound"


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.usefixtures("small_triton_blocks")
def test_grouped_dense_matmul_matches_reference(dev, dtype, atol, rtol, transpose):
    # The LoRA projections: (E, r, in) and (E, out, r) factors, rank 4 smaller than a block.
    offsets = offsets_of(ROUTINGS["ragged"])
    w = torch.randn(6, 4, 37, generator=torch.Generator().manual_seed(2)).to(dev, dtype)
    weight = GroupedWeight.dense(w, transpose=transpose)
    x = torch.randn(offsets[-1], weight.k, generator=torch.Generator().manual_seed(3)).to(dev, dtype)
    torch.testing.assert_close(
        grouped_matmul(x, weight, offsets).float(),
        grouped_matmul_reference(x, weight, offsets).float(),
        atol=atol,
        rtol=rtol,
    )


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.usefixtures("small_triton_blocks")
def test_grouped_outer_product_matches_reference(dev, dtype, atol, rtol, routing, gathered):
    offsets = offsets_of(ROUTINGS[routing])
    g = torch.Generator().manual_seed(4)
    a = torch.randn(13 if gathered else offsets[-1], 5, generator=g).to(dev, dtype)
    b = torch.randn(offsets[-1], 37, generator=g).to(dev, dtype)
    gather = torch.randint(0, 13, (offsets[-1],), generator=g).to(dev) if gathered else None
    expected = grouped_outer_product_reference(a, b, offsets, gather=gather)
    got = grouped_outer_product(a, b, offsets, gather=gather)
    # bf16 here accumulates in fp32 from bf16 inputs in both paths: only the summation order differs.
    torch.testing.assert_close(got, expected, atol=atol if dtype == torch.float32 else 1e-4, rtol=1e-4)
    empty = [e for e, c in enumerate(ROUTINGS[routing]) if c == 0]
    assert torch.equal(got[empty], torch.zeros_like(got[empty]))


def lora_term(offsets, rank, n, *, scale, dtype, seed=6, device="cpu"):
    """A LowRank term: P (S, rank) sorted rows and L (E, n, rank) stored as a B factor (read transposed)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(offsets[-1], rank, generator=g).to(device, dtype)
    b = torch.randn(len(offsets) - 1, n, rank, generator=g).to(device)
    return LowRank(p, GroupedWeight.dense(b, transpose=True), scale)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("rank", [4, 20], ids=["rank_below_block", "rank_over_block"])
@pytest.mark.usefixtures("small_triton_blocks")
def test_fused_lora_term_matches_reference(dev, dtype, atol, rtol, rank):
    # y = x W^T + c P B^T, the LoRA term added in the epilogue; rank 20 loops over two 16-wide chunks.
    offsets = offsets_of(ROUTINGS["ragged"])
    w = torch.randn(6, 37, 40, generator=torch.Generator().manual_seed(7)).to(dev, dtype)
    weight = GroupedWeight.dense(w, transpose=True)  # K = 40, N = 37
    x = torch.randn(offsets[-1], weight.k, generator=torch.Generator().manual_seed(8)).to(dev, dtype)
    lora = lora_term(offsets, rank, weight.n, scale=0.75, dtype=dtype, device=dev)
    expected = grouped_matmul_reference(x, weight, offsets, lora=lora).float()
    got = grouped_matmul(x, weight, offsets, lora=lora).float()
    torch.testing.assert_close(got, expected, atol=atol * 4, rtol=rtol)
    # Control: the LoRA term matters at this scale (a kernel that drops it is caught).
    assert (grouped_matmul(x, weight, offsets).float() - expected).abs().max() > 1.0


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("double_quant", [False, True], ids=["absmax", "nested"])
@pytest.mark.usefixtures("small_triton_blocks")
def test_silu_mul_epilogue_matches_reference(dev, dtype, atol, rtol, routing, double_quant):
    # gate_up stored (6, 2*24, 40): I = 24 is not a multiple of the 16-wide blocks, so the last gate tile
    # straddles the gate/up boundary; bias and LoRA are added to both halves before the activation.
    offsets = offsets_of(ROUTINGS[routing])
    stack = nf4_stack(6, 48, 40, double_quant=double_quant, seed=9, device=dev)
    weight = GroupedWeight.quantized(stack, transpose=True)
    g = torch.Generator().manual_seed(10)
    x = (0.3 * torch.randn(11, 40, generator=g)).to(dev, dtype)
    gather = torch.randint(0, 11, (offsets[-1],), generator=g).to(dev)
    bias = torch.randn(6, 48, generator=g).to(dev)
    lora = lora_term(offsets, 4, 48, scale=0.5, dtype=dtype, device=dev)
    h_ref, act_ref = grouped_matmul_silu_mul_reference(x, weight, offsets, gather=gather, bias=bias, lora=lora)
    h, act = grouped_matmul_silu_mul(x, weight, offsets, gather=gather, bias=bias, lora=lora)
    _, act_only = grouped_matmul_silu_mul(x, weight, offsets, gather=gather, bias=bias, lora=lora, keep_h=False)
    assert _ is None and torch.equal(act_only, act)
    # h bounded as in the NF4 test (bias and LoRA factor rounded too); act = silu(g) u then errs by
    # |silu'(g)| |dg| |u| + |silu(g)| |du| <= 1.1 |u| |dg| + |g| |du|, plus its own rounding.
    rel = 1e-5 if dtype == torch.float32 else 2**-7
    dh = rounding_bound(x, stack, offsets, h_ref, transpose=True, rel=rel, gather=gather, bias=bias, lora=lora)
    assert ((h.float() - h_ref.float()).abs() <= dh).all()
    gate, up = h_ref.float().chunk(2, dim=-1)
    dgate, dup = dh.chunk(2, dim=-1)
    bound = 1.1 * up.abs() * dgate + gate.abs() * dup + 2 * rel * act_ref.float().abs() + 1e-5
    assert ((act.float() - act_ref.float()).abs() <= bound).all()
    # Control: gate and up swapped is caught (silu(u) g differs from silu(g) u).
    swapped = torch.nn.functional.silu(up) * gate
    assert ((swapped - act_ref.float()).abs() > bound).any()


def recorded_launches(monkeypatch, override_kernel_settings) -> list[dict]:
    """The constexpr flags of every _grouped_matmul_kernel launch from here on (the kernel still runs). Not
    autotuned, on a GPU too: the autotuner would wrap the recorder, which is no JITFunction (it has no
    arg_names), so each launch runs its class's first candidate."""
    from moe_qlora.moe.kernels import triton_kernels

    override_kernel_settings(autotune=False)
    launches, real = [], triton_kernels._grouped_matmul_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs | {"grid": grid})
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(triton_kernels, "_grouped_matmul_kernel", Recorder())
    return launches


def default_blocks(monkeypatch, override_kernel_settings, arch: int, *, swap: bool, split_k_max: int = 1):
    """Launches at `arch`'s default blocks (no small-block override), with the swapped 16-row tiles or without
    whatever the row count, and split-K off unless `split_k_max` (one launch: split-K has its own test). Not
    autotuned, also on a GPU: each launch runs its class's first candidate, and reaches recorded_launches."""
    override_kernel_settings(block_override=None, autotune=False, target_arch=arch)
    monkeypatch.setattr(tiles, "SWAP_AB_MAX_ROWS", 10**6 if swap else 0)
    monkeypatch.setattr(tiles, "SPLIT_K_MAX", split_k_max)


def nibbles_swapped(stack: NF4Stack) -> NF4Stack:
    """Broken control: the high and low nibble of every byte exchanged (codes k and k + 1 along `in`)."""
    packed = ((stack.packed >> 4) | (stack.packed << 4)).to(torch.uint8)
    return NF4Stack(packed, stack.absmax, stack.nested, stack.shape, stack.blocksize)


def codes_of_experts_rolled(stack: NF4Stack) -> NF4Stack:
    """Broken control: expert e gets expert e - 1's codes (its own block scales kept)."""
    packed = stack.packed.view(stack.shape[0], -1).roll(1, 0).reshape(-1)
    return NF4Stack(packed, stack.absmax, stack.nested, stack.shape, stack.blocksize)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("double_quant", [False, True], ids=["absmax", "nested"])
@pytest.mark.parametrize("glu", [False, True], ids=["down", "gate_up"])
@pytest.mark.parametrize("arch", [80, 90], ids=["sm_80_blocks", "sm_90_blocks"])
@pytest.mark.parametrize("swap", [False, True], ids=["rows_x_weight", "swapped"])
def test_packed_nf4_path_matches_reference(
    dev, dtype, atol, rtol, double_quant, glu, arch, swap, monkeypatch, override_kernel_settings
):
    """The forward's NF4 path at each architecture's default blocks (sm_90: 64 x 64 x 64, sm_80: 64 x 64 x 32):
    codes read as 4-byte words along the stored `in` dim, one block scale per column and K-step (K_PACKED).
    K = 192 spans three quant blocks; N = 80 (gate_up: 2 x 40) is not a multiple of 64. Checked to be the path
    taken, against the reference; the broken control (the two nibbles of a byte swapped) is off by O(1)."""

    default_blocks(monkeypatch, override_kernel_settings, arch, swap=swap)
    offsets = offsets_of(ROUTINGS["ragged"])
    stack = nf4_stack(6, 80, 192, double_quant=double_quant, seed=11, device=dev)
    weight = GroupedWeight.quantized(stack, transpose=True)
    g = torch.Generator().manual_seed(12)
    x = (0.3 * torch.randn(11, 192, generator=g)).to(dev, dtype)
    gather = torch.randint(0, 11, (offsets[-1],), generator=g).to(dev)
    launches = recorded_launches(monkeypatch, override_kernel_settings)
    if glu:
        expected, _ = grouped_matmul_silu_mul_reference(x, weight, offsets, gather=gather)
        got, _ = grouped_matmul_silu_mul(x, weight, offsets, gather=gather)
    else:
        expected = grouped_matmul_reference(x, weight, offsets, gather=gather)
        got = grouped_matmul(x, weight, offsets, gather=gather)
    assert [(flags["K_PACKED"], flags["SWAP_AB"], flags["BLOCK_M"]) for flags in launches] == [
        (True, swap, 16 if swap else 64)
    ]
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
    else:
        bound = rounding_bound(x, stack, offsets, expected, transpose=True, rel=2**-7, gather=gather)
        assert ((got.float() - expected.float()).abs() <= bound).all()
    broken_weight = GroupedWeight.quantized(nibbles_swapped(stack), transpose=True)
    broken = (
        grouped_matmul_silu_mul(x, broken_weight, offsets, gather=gather)[0]
        if glu
        else grouped_matmul(x, broken_weight, offsets, gather=gather)
    )
    assert (broken.float() - expected.float()).abs().max() > 0.1


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("double_quant", [False, True], ids=["absmax", "nested"])
@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("arch", [80, 90], ids=["sm_80_blocks", "sm_90_blocks"])
@pytest.mark.parametrize("swap", [False, True], ids=["rows_x_weight", "swapped"])
def test_column_pair_nf4_path_of_the_input_gradient_matches_reference(
    dev, dtype, atol, rtol, double_quant, lora, arch, swap, monkeypatch, override_kernel_settings
):
    """The input gradient's NF4 path (g W through the transposed experts) at each architecture's default
    blocks: codes read as 4-byte words along the stored `in` dim, which is N here, their nibbles interleaved
    back into column order in registers, one block scale per row (N_PACKED). K = 80 is not a multiple of
    BLOCK_K, so the rows stay masked (EVEN_K off); N = 128 is two N tiles. Checked to be the path taken,
    against the reference, with the fused LoRA term too; the broken control (the two nibbles of a byte
    swapped: columns n and n + 1 exchanged) is off by O(1)."""

    default_blocks(monkeypatch, override_kernel_settings, arch, swap=swap)
    offsets = offsets_of(ROUTINGS["ragged"])
    stack = nf4_stack(6, 80, 128, double_quant=double_quant, seed=21, device=dev)
    weight = GroupedWeight.quantized(stack, transpose=False)
    g = torch.Generator().manual_seed(22)
    x = (0.3 * torch.randn(offsets[-1], 80, generator=g)).to(dev, dtype)
    low_rank = lora_term(offsets, 4, 128, scale=0.5, dtype=dtype, device=dev) if lora else None
    launches = recorded_launches(monkeypatch, override_kernel_settings)
    expected = grouped_matmul_reference(x, weight, offsets, lora=low_rank)
    got = grouped_matmul(x, weight, offsets, lora=low_rank)
    assert [(flags["N_PACKED"], flags["SWAP_AB"], flags["EVEN_K"]) for flags in launches] == [(True, swap, False)]
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
    else:
        bound = rounding_bound(x, stack, offsets, expected, transpose=False, rel=2**-7, lora=low_rank)
        assert ((got.float() - expected.float()).abs() <= bound).all()
    swapped = nibbles_swapped(stack)
    broken = grouped_matmul(x, GroupedWeight.quantized(swapped, transpose=False), offsets, lora=low_rank)
    assert (broken.float() - expected.float()).abs().max() > 0.1


def test_codes_not_on_a_4_byte_boundary_take_the_byte_path(dev, monkeypatch, override_kernel_settings):
    """The packed paths read the codes through an int32 view, which needs them 4-byte aligned; a stack whose
    bytes start one past a boundary (a view into a larger buffer) is read a byte per element instead, and
    still matches the reference."""
    override_kernel_settings(block_override=None)
    offsets = offsets_of(ROUTINGS["ragged"])
    stack = nf4_stack(6, 64, 128, seed=41, device=dev)
    shifted = torch.cat([stack.packed.new_zeros(1), stack.packed])[1:]
    assert shifted.storage_offset() == 1 and torch.equal(shifted, stack.packed)
    moved = NF4Stack(shifted, stack.absmax, stack.nested, stack.shape, stack.blocksize)
    x = torch.randn(offsets[-1], 128, generator=torch.Generator().manual_seed(42)).to(dev)
    launches = recorded_launches(monkeypatch, override_kernel_settings)
    got = grouped_matmul(x, GroupedWeight.quantized(moved, transpose=True), offsets)
    assert [f["K_PACKED"] for f in launches] == [False]
    expected = grouped_matmul_reference(x, GroupedWeight.quantized(stack, transpose=True), offsets)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_every_autotune_candidate_takes_the_packed_paths():
    """The packed paths are chosen on the host before the autotuner picks a config, so every narrow candidate
    must keep a tile step within one of bitsandbytes' 64-code quant blocks along K and N (and a half step >= 16),
    and every wide one (128 columns, timed only on the K_PACKED path it serves) along K. The default is narrow.
    The control: a 128-wide step does not pack along N, a 16-deep one not along K."""
    from moe_qlora.moe.kernels.tiles import MATMUL_CONFIGS, MatmulConfig

    assert all(not cs[0].wide for cs in MATMUL_CONFIGS.values())
    assert all(
        c.packs(64, along_n=False) and (c.wide or c.packs(64, along_n=True))
        for cs in MATMUL_CONFIGS.values()
        for c in cs
    )
    assert not MatmulConfig(128, 64).packs(64, along_n=True) and not MatmulConfig(64, 16).packs(64, along_n=False)


def test_wide_candidates_serve_only_the_launches_they_fit(override_kernel_settings):
    """A 128-column candidate is timed for the forward's K_PACKED launches with one accumulator, or with two in
    swapped 16-row tiles, and never for the N_PACKED input gradient (whose row steps it would split between
    quant blocks) nor the byte path; a launch with only a wide candidate pinned runs the shipped default."""
    wide, narrow = tiles.MatmulConfig(128, 64), tiles.MatmulConfig(64, 64)
    assert wide.serves(True, False, False) and wide.serves(True, True, True)
    assert not wide.serves(True, True, False) and not wide.serves(False, False, False)
    assert all(narrow.serves(*flags) for flags in [(True, True, False), (False, False, False), (False, True, True)])
    override_kernel_settings(block_override=None, interpreted=False)  # autotuning on: every serving candidate
    configs, short = tiles.MATMUL_CONFIGS[90], [c for c in tiles.MATMUL_CONFIGS[90] if not c.tall]
    assert tiles.launch_candidates(configs, "cpu", k_packed=True, glu=False, swap=False, tall=False) == short
    assert tiles.launch_candidates(configs, "cpu", k_packed=False, glu=False, swap=False, tall=False) == short[:-1]
    assert tiles.launch_candidates([wide], "cpu", k_packed=False, glu=False, swap=True, tall=False) == [
        tiles.DEFAULT_CONFIGS[90]
    ]
    assert tiles.path_candidates(configs, "cpu") == [c for c in configs if not c.wide]


def test_a_served_candidate_that_would_split_a_quant_block_is_refused(monkeypatch, override_kernel_settings):
    """The packed path is chosen over the narrow candidates, but the autotuner also times the wide ones it
    serves: one of 128 codes along K (two quant blocks) would decode a step with one block's scale, so the
    launch refuses it rather than compute wrong weights."""
    # autotuning on: the wide candidate is served
    override_kernel_settings(block_override=None, interpreted=False, target_arch=90)
    monkeypatch.setitem(tiles.MATMUL_CONFIGS, 90, [tiles.MatmulConfig(64, 64), tiles.MatmulConfig(128, 128)])
    offsets = offsets_of(ROUTINGS["ragged"])
    weight = GroupedWeight.quantized(nf4_stack(6, 200, 128), transpose=True)
    with pytest.raises(RuntimeError, match="spans quant blocks"):
        grouped_matmul(torch.randn(offsets[-1], 128), weight, offsets)


@pytest.mark.parametrize("glu", [False, True], ids=["down", "gate_up"])
def test_wide_tiles_match_reference(dev, glu, monkeypatch, override_kernel_settings):
    """The wide candidate pinned (sm_90's 128 x 64, 4 warps): the down projection in 64-row tiles and gate_up in
    swapped 16-row ones run with BLOCK_N 128 on the K_PACKED path and match the reference (fp32: 1e-5, as the
    other NF4 paths; N = 200 is two 128-column blocks, the second partial); the input gradient (N_PACKED),
    which the wide tile does not serve, runs at the default's 64 columns on its packed path. Control: one
    expert's codes rolled to the next expert is off by O(1)."""
    default_blocks(monkeypatch, override_kernel_settings, 90, swap=glu)
    offsets = offsets_of(ROUTINGS["ragged"])
    stack = nf4_stack(6, 200 * (2 if glu else 1), 128, double_quant=True, seed=51, device=dev)
    weight = GroupedWeight.quantized(stack, transpose=True)
    x = (0.3 * torch.randn(offsets[-1], 128, generator=torch.Generator().manual_seed(52))).to(dev)
    launches = recorded_launches(monkeypatch, override_kernel_settings)

    def run(w):
        return grouped_matmul_silu_mul(x, w, offsets)[0] if glu else grouped_matmul(x, w, offsets)

    expected = (
        grouped_matmul_silu_mul_reference(x, weight, offsets)[0]
        if glu
        else grouped_matmul_reference(x, weight, offsets)
    )
    with tiles.pinned_config(90, tiles.MatmulConfig(128, 64, 4, 3)):
        got = run(weight)
        broken = run(GroupedWeight.quantized(codes_of_experts_rolled(stack), transpose=True))
        g = torch.randn(offsets[-1], 128, generator=torch.Generator().manual_seed(53)).to(dev)
        input_grad = grouped_matmul(
            g, GroupedWeight.quantized(nf4_stack(6, 128, 64, seed=54, device=dev), transpose=False), offsets
        )
    assert [(f["K_PACKED"], f["BLOCK_N"], f["SWAP_AB"]) for f in launches[:2]] == [(True, 128, glu)] * 2
    assert (launches[2]["N_PACKED"], launches[2]["BLOCK_N"]) == (True, tiles.DEFAULT_CONFIGS[90].block_n)
    assert input_grad.shape == (offsets[-1], 64)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (broken - expected).abs().max() > 0.1


# path: (glu, stored transposed as x W^T, K, N)
TALL_CASES = {"gate_up": (True, True, 192, 40), "down": (False, True, 192, 80), "input_grad": (False, False, 128, 128)}


@pytest.mark.parametrize("arch", [80, 90], ids=["sm_80_blocks", "sm_90_blocks"])
@pytest.mark.parametrize("path", list(TALL_CASES))
def test_tall_tiles_match_reference(dev, arch, path, monkeypatch, override_kernel_settings):
    """Many rows per expert take the tall class's 128-row tiles at its default config (the first tall one that
    serves: gate_up in 8 warps). TALL_MIN_ROWS is lowered to 1 for the tests' small routings; experts of 150
    and 129 rows span two tiles each, the second nearly empty, and one expert has none. Checked to be the path
    and tile height taken, against the reference in fp32 (1e-5, as the other NF4 paths); control: the experts'
    codes rolled to the next expert is off by O(1)."""
    default_blocks(monkeypatch, override_kernel_settings, arch, swap=False)
    monkeypatch.setattr(tiles, "TALL_MIN_ROWS", 1)
    glu, transpose, k, n = TALL_CASES[path]
    offsets = offsets_of([0, 150, 3, 129, 0, 40])
    rows_out, cols_in = ((2 * n if glu else n), k) if transpose else (k, n)
    stack = nf4_stack(6, rows_out, cols_in, double_quant=True, seed=61, device=dev)
    x = (0.3 * torch.randn(offsets[-1], k, generator=torch.Generator().manual_seed(62))).to(dev)
    launches = recorded_launches(monkeypatch, override_kernel_settings)

    def run(s):
        w = GroupedWeight.quantized(s, transpose=transpose)
        return grouped_matmul_silu_mul(x, w, offsets)[0] if glu else grouped_matmul(x, w, offsets)

    weight = GroupedWeight.quantized(stack, transpose=transpose)
    expected = (
        grouped_matmul_silu_mul_reference(x, weight, offsets)[0]
        if glu
        else grouped_matmul_reference(x, weight, offsets)
    )
    got = run(stack)
    default = next(c for c in tiles.MATMUL_CONFIGS[arch] if c.serves(transpose, glu, False, tall=True))
    flags = launches[0]
    assert (flags["BLOCK_M"], flags["BLOCK_N"], flags["BLOCK_K"], flags["num_warps"]) == (
        128,
        default.block_n,
        default.block_k,
        8 if glu else 4,
    )
    assert (flags["K_PACKED"], flags["N_PACKED"]) == (transpose, not transpose)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (run(codes_of_experts_rolled(stack)) - expected).abs().max() > 0.1


def test_autotuning_is_on_by_default_and_switched_off_by_the_environment(monkeypatch, override_kernel_settings):
    """On a GPU (not the interpreter) a launch times its architecture's candidates; MOE_QLORA_AUTOTUNE=0 keeps
    the default (first) config, and MOE_QLORA_TRITON_BLOCKS fixes the blocks outright."""
    from moe_qlora.moe.kernels import tiles

    override_kernel_settings(interpreted=False, block_override=None, autotune=True, target_arch=80)
    assert tiles.matmul_plan("cpu") == tiles.MATMUL_CONFIGS[80] and len(tiles.MATMUL_CONFIGS[80]) > 1
    override_kernel_settings(target_arch=90)
    flags = dict(k_packed=True, glu=False, swap=False, tall=False)
    assert tiles.launch_candidates(tiles.matmul_plan("cpu"), "cpu", **flags) == [
        c for c in tiles.MATMUL_CONFIGS[90] if not c.tall
    ]
    override_kernel_settings(autotune=False)
    assert tiles.launch_candidates(tiles.matmul_plan("cpu"), "cpu", **flags) == tiles.MATMUL_CONFIGS[90][:1]
    override_kernel_settings(block_override=(16, 32, 16))
    assert tiles.matmul_plan("cpu") == [tiles.MatmulConfig(32, 16, block_m=16)]
    # A GPU's list by its compute capability: mma.sync GPUs (the 24 GB cards among them) take sm_80's, unless
    # MOE_QLORA_TARGET_ARCH names one (the kernel tests run both lists on whatever GPU they find).
    capability = {"major": 8}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (capability["major"], 0))
    assert tiles.target_arch("cuda") == 90  # MOE_QLORA_TARGET_ARCH=90 on an sm_80 GPU
    override_kernel_settings(target_arch=None)
    arches = {}
    for major in (8, 9, 10, 12):
        capability["major"] = major
        arches[major] = tiles.target_arch("cuda")
    assert arches == {8: 80, 9: 90, 10: 90, 12: 80}


def test_launch_goes_through_the_autotuner_unless_switched_off(monkeypatch, override_kernel_settings):
    """With autotuning on, the launch hands the autotuner the kernel's arguments without BLOCK_N / BLOCK_K
    (it supplies each candidate's) and a grid that follows the candidate's BLOCK_N; switched off, the plain
    kernel gets the default config's blocks, warps and stages."""
    from moe_qlora.moe.kernels import ops, tiles, triton_kernels

    calls = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((self.name, grid, kwargs))

    override_kernel_settings(interpreted=False)
    monkeypatch.setattr(ops, "_autotuned_matmul", lambda arch, configs: Recorder(f"autotuned_{arch}_{len(configs)}"))
    monkeypatch.setattr(triton_kernels, "_grouped_matmul_kernel", Recorder("plain"))
    override_kernel_settings(block_override=None, target_arch=90)
    offsets = offsets_of(ROUTINGS["ragged"])
    weight = GroupedWeight.quantized(nf4_stack(6, 200, 128), transpose=True)
    x = torch.randn(offsets[-1], 128)
    override_kernel_settings(autotune=True)
    grouped_matmul(x, weight, offsets)
    override_kernel_settings(autotune=False)
    grouped_matmul(x, weight, offsets)
    (tuned, tuned_grid, tuned_kw), (plain, plain_grid, plain_kw) = calls
    # The forward's K_PACKED launch (one accumulator, few rows: swapped 16-row tiles) times every 64-row-class
    # candidate, the wide one too, but the one whose 32 columns would run mma.sync where the default runs wgmma.
    short = sum(not c.tall and tiles.mma_kind(c, 90, swap=True) == "wgmma" for c in tiles.MATMUL_CONFIGS[90])
    assert short == sum(not c.tall for c in tiles.MATMUL_CONFIGS[90]) - 1
    assert tuned == f"autotuned_90_{short}" and "BLOCK_N" not in tuned_kw and tuned_kw["K_PACKED"]
    # one program per (row tile, N block): (row tiles a group, N blocks, groups), N = 200
    (group, n_32, groups), (_, n_64, _) = tuned_grid({"BLOCK_N": 32}), tuned_grid({"BLOCK_N": 64})
    assert (n_32, n_64) == (7, 4) and group * groups >= ops.tile_bound(offsets[-1], 6, tiles.SWAP_AB_BLOCK_M)
    default = tiles.MATMUL_CONFIGS[90][0]
    assert plain == "plain" and plain_kw["BLOCK_N"] == default.block_n and plain_kw["BLOCK_K"] == default.block_k
    assert (plain_kw["num_warps"], plain_kw["num_stages"]) == (default.num_warps, default.num_stages)


@pytest.mark.cpu_only
def test_the_autotuner_is_built_over_the_architectures_candidates():
    """Triton's autotuner wraps the real kernel (compiled, so outside the interpreter) with one Config per
    candidate and the shape and variant keys."""
    code = """
import json
from moe_qlora.moe.kernels import ops, tiles
t = ops._autotuned_matmul(80, tuple(tiles.MATMUL_CONFIGS[80]))
configs = [[c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages] for c in t.configs]
print(json.dumps({"type": type(t).__name__, "keys": t.keys, "fn": t.fn.__name__, "configs": configs}))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    from moe_qlora.moe.kernels.tiles import MATMUL_CONFIGS

    assert out["type"] == "Autotuner" and out["fn"] == "_grouped_matmul_kernel" and "K_PACKED" in out["keys"]
    assert out["configs"] == [[c.block_n, c.block_k, c.num_warps, c.num_stages] for c in MATMUL_CONFIGS[80]]


# path: (glu, stored transposed as x W^T, K, N). "bytes": `in` = 392 is not a multiple of the quant block, so
# the codes are read a byte per element.
SPLIT_K_CASES = {
    "k_packed_gate_up": (True, True, 384, 80),
    "k_packed_swapped_down": (False, True, 384, 64),
    "n_packed_input_grad": (False, False, 384, 128),
    "bytes": (False, True, 392, 72),
}


# groups of 2 (the group arithmetic, a last group padded) and one group of all (the order before issue 67); the
# groups tiles.group_m chooses run in every other kernel test
@pytest.mark.parametrize("group_m", [2, 0], ids=["groups_of_2", "tiles_fastest"])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("path", list(SPLIT_K_CASES))
def test_split_k_matches_reference_and_is_deterministic(
    dev, dtype, atol, rtol, path, group_m, monkeypatch, override_kernel_settings
):
    """Few tiles for the SMs: each tile's K is shared by SPLIT_K programs writing partial sums, and a second
    launch adds them in split order and runs the epilogue (bias, LoRA term, silu x up). K = 384 is six 64-wide
    K-steps (7 on the byte path), split three ways. Against the reference (same bounds as above), twice with
    the same bits, on each NF4 path and the byte-reading one (odd sizes), in three grid orders (which program
    takes which output block and partial-sums slot: groups of 2 and of all row tiles); the broken control (the
    reducing launch told of one split fewer: the last split's sums dropped) is caught."""
    from moe_qlora.moe.kernels import tiles, triton_kernels

    monkeypatch.setattr(tiles, "GROUP_M", group_m)
    default_blocks(monkeypatch, override_kernel_settings, 90, swap=path == "k_packed_swapped_down", split_k_max=3)
    offsets = offsets_of(ROUTINGS["ragged"])
    g = torch.Generator().manual_seed(31)
    glu, transpose, k, n = SPLIT_K_CASES[path]
    rows_out, cols_in = (n, k) if transpose else (k, n)
    stack = nf4_stack(6, rows_out, cols_in, double_quant=True, seed=32, device=dev)
    weight = GroupedWeight.quantized(stack, transpose=transpose)
    x = (0.3 * torch.randn(offsets[-1], k, generator=g)).to(dev, dtype)
    bias = (0.1 * torch.randn(6, n, generator=g)).to(dev, dtype) if transpose else None
    low_rank = lora_term(offsets, 4, n, scale=0.5, dtype=dtype, device=dev)
    kwargs = dict(bias=bias, lora=low_rank)
    launches = recorded_launches(monkeypatch, override_kernel_settings)
    if glu:
        expected = grouped_matmul_silu_mul_reference(x, weight, offsets, **kwargs)[0]
        run = lambda: grouped_matmul_silu_mul(x, weight, offsets, **kwargs)[0]  # noqa: E731
    else:
        expected = grouped_matmul_reference(x, weight, offsets, **kwargs)
        run = lambda: grouped_matmul(x, weight, offsets, **kwargs)  # noqa: E731
    got = run()
    assert [(f["PHASE"], f["SPLIT_K"]) for f in launches] == [(1, 3), (2, 3)]
    packed = {
        "k_packed_gate_up": (True, False),
        "k_packed_swapped_down": (True, False),
        "n_packed_input_grad": (False, True),
        "bytes": (False, False),
    }[path]
    assert (launches[0]["K_PACKED"], launches[0]["N_PACKED"]) == packed
    assert launches[0]["SWAP_AB"] == (path == "k_packed_swapped_down")
    # the grid (group, N blocks x splits, groups): one group of all the row tiles when group_m is 0
    group, _, groups = launches[0]["grid"]
    assert group == group_m or (group_m == 0 and groups == 1)
    assert launches[0]["EVEN_K"] == (path != "bytes")  # K = 384: whole 64-wide steps, unmasked; 392 is not
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
    else:
        bound = rounding_bound(x, stack, offsets, expected, transpose=transpose, rel=2**-7, **kwargs)
        assert ((got.float() - expected.float()).abs() <= bound).all()
    assert torch.equal(run(), got)
    real = triton_kernels._grouped_matmul_kernel

    class DropLastSplit:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                return real[grid](*args, **(kw | {"SPLIT_K": kw["SPLIT_K"] - 1} if kw["PHASE"] == 2 else kw))

            return launch

    monkeypatch.setattr(triton_kernels, "_grouped_matmul_kernel", DropLastSplit())
    assert (run().float() - expected.float()).abs().max() > 0.1


@triton.jit
def _output_block_probe(out_ptr):
    tile, n_block, _, _ = _output_block(1, 0)
    pid = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    tl.store(out_ptr + 2 * pid, tile)
    tl.store(out_ptr + 2 * pid + 1, n_block)


def test_programs_take_the_output_blocks_the_host_map_says(dev):
    """The kernel's map from the program started pid-th to (row tile, N block) (_output_block, run in a probe
    kernel on the launchers' grid (group, N blocks, groups)) is tiles.grid_block, which scripts/layer_traffic.py
    reads the order from, for groups of 1, 2 and 8 and for one group of all, at 7 row tiles (padded to whole groups,
    as ops.expert_tiles pads them) and 5 N blocks: every output block taken exactly once. Control: the map of
    another group size differs."""
    n_blocks = 5
    for group_m in (1, 2, 8, 0):
        num_tiles = -(-7 // group_m) * group_m if group_m else 7
        group = group_m or num_tiles
        out = torch.full((num_tiles * n_blocks, 2), -1, dtype=torch.int32, device=dev)
        _output_block_probe[(group, n_blocks, num_tiles // group)](out)
        host = [tiles.grid_block(pid, num_tiles, n_blocks, group_m) for pid in range(num_tiles * n_blocks)]
        assert [tuple(r) for r in out.tolist()] == host
        assert sorted(host) == [(t, n) for t in range(num_tiles) for n in range(n_blocks)]
        other_m = 1 if group_m == 2 else 2
        other = [tiles.grid_block(pid, num_tiles, n_blocks, other_m) for pid in range(num_tiles * n_blocks)]
        assert other != host


@pytest.mark.usefixtures("small_triton_blocks")
def test_grouped_matmul_fails_when_experts_are_rolled(dev):
    """Control: the reference must tell experts apart (a kernel reading expert e+1's weights is caught)."""
    offsets = offsets_of(ROUTINGS["ragged"])
    stack = nf4_stack(6, 32, 32, device=dev)
    weight = GroupedWeight.quantized(stack, transpose=True)
    x = torch.randn(offsets[-1], 32, generator=torch.Generator().manual_seed(5)).to(dev)
    expected = grouped_matmul_reference(x, weight, offsets)
    rolled = [0, *offsets[2:], offsets[-1]]  # every row attributed to the next expert's range
    got = grouped_matmul(x, weight, rolled)
    assert (got - expected).abs().max() > 0.5


# Shared memory per block: sm_90's list runs on H100 (227 KiB); sm_80's on A100 (163 KiB) but also on the 24 GB
# cards, sm_86 and sm_89, which have 99 KiB: the list is held to the smallest of the GPUs it serves.
SHARED_MEMORY_LIMIT = {80: 99 * 1024, 90: 227 * 1024}


@pytest.fixture(scope="module")
def compiled_variants():
    """Every kernel variant compiled ahead of time for sm_80 and sm_90 in a subprocess: compiling needs
    the real @triton.jit functions, which an interpreter-mode process (this one, on a CPU) does not have."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "moe_qlora.moe.kernels.aot", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["variant"]: r for r in json.loads(proc.stdout)}


@pytest.mark.parametrize("arch", [80, 90], ids=["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("weights", ["dense", "nf4", "nf4_nested", "nf4_nested_silu_mul", "mxfp4", "mxfp4_input_grad"])
def test_grouped_matmul_compiles_for_ampere_and_hopper(compiled_variants, arch, dtype, weights):
    r = compiled_variants[f"grouped_matmul/{weights}/{dtype}/sm_{arch}"]
    assert r["cubin_bytes"] > 1000
    # It must also launch: shared memory within the per-block limit (sm_86/sm_89 99 KiB, H100 227 KiB).
    assert r["shared_bytes"] <= SHARED_MEMORY_LIMIT[arch]
    # bf16 products on tensor cores (mma); fp32 asks for exact IEEE products, which tensor cores do not do.
    assert r["tensor_core_mma"] == (dtype == "bf16")


@pytest.mark.parametrize("arch", [80, 90], ids=["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_grouped_outer_product_compiles_for_ampere_and_hopper(compiled_variants, arch, dtype):
    r = compiled_variants[f"grouped_outer_product/{dtype}/sm_{arch}"]
    assert r["cubin_bytes"] > 1000 and r["tensor_core_mma"] == (dtype == "bf16")


@pytest.mark.parametrize("arch", [80, 90], ids=["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("step", ["silu_mul", "silu_mul_backward", "combine"])
def test_the_row_steps_compile_for_ampere_and_hopper(compiled_variants, arch, dtype, step):
    """The row steps (kernels/rows.py) at Qwen3-30B-A3B's shapes with their LoRA terms: element-wise and row
    reductions, no tensor cores, a few bytes of shared memory at most (the backward's row sum), no spill (cuobjdump's
    resource usage)."""
    r = compiled_variants[f"rows/{step}/{dtype}/sm_{arch}"]
    assert r["cubin_bytes"] > 1000 and not r["tensor_core_mma"] and r["shared_bytes"] <= 1024
    assert r["spilled_bytes"] == 0 and r["registers"] <= 128  # room for 4 warps x 4 blocks on an SM


def test_the_autotuner_keys_on_the_rows_per_expert_class(monkeypatch):
    """The autotuner times a config once per key; without the rows in it, the first token count of a tile class
    chose the config for every later one (a 2x-8x larger batch included). The key holds rows per expert rounded
    up to a power of two (multiples of 16: one JIT specialization for all), and a launch passes its own class.
    Control: 8 experts with 16 rows each is class 16, with 17 already class 32."""
    from moe_qlora.moe.kernels import triton_kernels

    assert "rows_class" in ops._MATMUL_TUNE_KEYS and "rows_class" in triton_kernels._grouped_matmul_kernel.arg_names
    assert [tiles.rows_class(rows, 8) for rows in (0, 8 * 16, 8 * 16 + 1, 8 * 64, 8 * 65, 10**7)] == [
        16,
        16,
        32,
        64,
        128,
        tiles.ROWS_CLASS_MAX,
    ]
    passed, names = [], triton_kernels._grouped_matmul_kernel.arg_names

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: passed.append(args[names.index("rows_class")])

    monkeypatch.setattr(triton_kernels, "_grouped_matmul_kernel", Recorder())
    monkeypatch.setattr(tiles, "autotuning", lambda: False)
    offsets = [0, 40, 40, 100]  # 100 rows over 3 experts: 34 on average -> class 64
    weight = GroupedWeight.quantized(nf4_stack(3, 64, 128), transpose=True)
    grouped_matmul(torch.randn(100, 128), weight, offsets)
    assert passed == [64]


# ------------------------------------------------------------------------- GPU readiness, checked on the CPU

GPU_LIKE_LAYER = """
import json, torch
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction
from moe_qlora.moe.kernels import ops, tiles
from moe_qlora.moe.grouped_layer import MoELoRAGroupedFunction
from moe_qlora.moe.grouped_ops import grouped_ops
from moe_qlora.moe.reference_layer import FrozenExperts, MoEPlan
from moe_qlora.moe.nf4 import NF4Stack, quantize_stack
from moe_qlora.moe.routing import route

launches, timed = [], []

def run(self, *args, grid, warmup, **kwargs):  # the JIT's launch, minus compiling: what the GPU would be given
    grid(kwargs) if callable(grid) else grid
    launches.append({k: v for k, v in kwargs.items() if k in ("W_NF4", "SWAP_AB", "BLOCK_M", "BLOCK_N", "BLOCK_K")})

def bench(kernel_call, quantiles):  # the autotuner's timing of one candidate: the call runs, a fixed time
    kernel_call()
    timed.append(launches[-1])
    return [1.0, 1.0, 1.0]

JITFunction.run = run
Autotuner.do_bench = property(lambda self: bench)
assert tiles.autotuning() and tiles.target_arch("cpu") == 90
hidden, inter, experts, rank = 128, 64, 4, 4
g = torch.Generator().manual_seed(0)
stack = lambda rows, cols: NF4Stack.from_param(quantize_stack(torch.randn(experts, rows, cols, generator=g)))
frozen = FrozenExperts(stack(2 * inter, hidden), stack(hidden, inter), ops.silu_mul, gate_is_silu_mul=True)
out = {}
for tokens in (8, 200, 1024):  # rows per expert 2: swapped 16-row tiles, 50: 64-row tiles, 256: 128-row tiles
    first = len(launches)
    idx = torch.randint(0, experts, (tokens, 1), generator=g)
    x = torch.randn(tokens, hidden, generator=g).bfloat16().requires_grad_(True)
    w = torch.rand(tokens, 1, generator=g).bfloat16().requires_grad_(True)
    lora = [torch.randn(*s, generator=g).requires_grad_(True) for s in
            ((experts, rank, hidden), (experts, 2 * inter, rank), (experts, rank, inter), (experts, hidden, rank))]
    plan = MoEPlan(frozen, route(idx, experts), 2.0)
    MoELoRAGroupedFunction.apply(x, w, *lora, plan, grouped_ops("triton")).float().sum().backward()
    out[tokens] = launches[first:]
print(json.dumps({"launches": out, "timed": len(timed)}))
"""


@pytest.mark.cpu_only
def test_launchers_run_as_on_a_gpu_through_the_autotuner():
    """A whole layer's forward and backward through the launchers as a GPU runs them: compiled kernels (no
    TRITON_INTERPRET), autotuning on, Triton's own Autotuner timing every serving candidate, with only the
    JIT's compile-and-launch and the benchmark's clock stubbed. Catches what only a GPU run met before: an object
    the autotuner cannot wrap, a meta-parameter passed twice, a key the kernel does not have, a grid lambda
    that fails for a candidate. At 8, 200 and 1024 tokens, the NF4 launches take swapped 16-row tiles, 64-row and
    128-row tiles."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRITON_INTERPRET", "MOE_QLORA_TRITON_BLOCKS", "MOE_QLORA_AUTOTUNE", "MOE_QLORA_TARGET_ARCH")
    }
    proc = subprocess.run([sys.executable, "-c", GPU_LIKE_LAYER], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    block_m = {
        tokens: {launch["BLOCK_M"] for launch in launches if launch.get("W_NF4")}
        for tokens, launches in result["launches"].items()
    }
    assert block_m == {"8": {16}, "200": {64}, "1024": {128}}
    assert all(len(launches) >= 6 for launches in result["launches"].values())
    assert result["timed"] > 0  # the autotuner timed candidates (more than one served some launch)


def test_autotune_candidates_share_the_defaults_mma_kind(override_kernel_settings):
    """The autotuner may pick a different candidate in a run and in its resume, so the candidates it times for a
    launch must give the default's bits: on sm_90 the swapped 16-row tiles' default (64 weight columns on the
    MMA's M side) runs wgmma, and the 32-column candidate would run mma.sync, so it is left out; everywhere
    else every serving candidate shares the default's instruction."""
    override_kernel_settings(interpreted=False, block_override=None, autotune=True)
    narrow = tiles.MatmulConfig(32, 64, 4, 3)
    assert tiles.mma_kind(narrow, 90, swap=True) == "mma.sync" and tiles.mma_kind(narrow, 90, swap=False) == "wgmma"
    for arch in (80, 90):
        override_kernel_settings(target_arch=arch)
        for swap in (False, True):
            for tall in (False, True) if not swap else (False,):
                for k_packed, glu in ((True, True), (True, False), (False, False)):
                    served = tiles.launch_candidates(
                        tiles.MATMUL_CONFIGS[arch], "cpu", k_packed=k_packed, glu=glu, swap=swap, tall=tall
                    )
                    kinds = {tiles.mma_kind(c, arch, swap) for c in served}
                    assert kinds == {tiles.mma_kind(served[0], arch, swap)}
                    assert (narrow in served) == (narrow in tiles.MATMUL_CONFIGS[arch] and not swap and not tall)


MMA_KIND_OF_CANDIDATES = """
import json, sys
from moe_qlora.moe.kernels import ops, tiles
from moe_qlora.moe.kernels.aot import capture_launches, compile_as_jit
rows = []
for tokens in (32, 2048):  # swapped 16-row tiles, 64-row tiles
    for config in tiles.MATMUL_CONFIGS[90]:
        with tiles.pinned_config(90, config):
            launches = capture_launches(hidden=2048, inter=768, experts=128, top_k=8, tokens=tokens, rank=16)
        down = next(launch for launch in launches if launch.name == "down_nf4_nested")
        c, kw = down.constexprs, down.kwargs
        if (c["BLOCK_N"], c["BLOCK_K"], kw["num_warps"]) != (config.block_n, config.block_k, config.num_warps):
            continue  # the candidate does not serve this launch (the default ran)
        ptx = compile_as_jit(down, 90).asm["ptx"]
        kind = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
        rows.append([tokens, [config.block_n, config.block_k, config.num_warps, config.num_stages, config.block_m],
                     c["SWAP_AB"], kind])
print(json.dumps(rows))
"""


@pytest.mark.cpu_only
def test_mma_kind_is_what_the_compiler_emits_on_sm_90():
    """tiles.mma_kind, which keeps the autotuner's candidates to the default's instruction, against the PTX of
    every sm_90 candidate that serves Qwen3-30B-A3B's down projection, compiled as the JIT specializes it, in
    swapped 16-row tiles (32 tokens) and 64-row tiles (2048 tokens). The 32-column candidate in swapped tiles is
    the one that compiles to mma.sync."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOE_QLORA_TRITON_BLOCKS")}
    proc = subprocess.run(
        [sys.executable, "-c", MMA_KIND_OF_CANDIDATES], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) >= 6 and {kind for *_, kind in rows} == {"wgmma", "mma.sync"}
    for _tokens, (bn, bk, warps, stages, bm), swap, kind in rows:
        assert kind == tiles.mma_kind(tiles.MatmulConfig(bn, bk, warps, stages, bm), 90, swap), (bn, bk, swap, kind)


@pytest.mark.parametrize("tokens", [1, 64])
def test_fp32_launches_take_the_one_config_that_does_not_spill(monkeypatch, tokens, override_kernel_settings):
    """fp32 activations multiply exactly on the FMA units, where every bf16 candidate spills; fp32 launches take
    tiles.FP32_CONFIG alone (no spill: tests/moe/test_kernel_report.py), never swapped, tall or autotuned, on either
    architecture's list, at 1 token (swapped tiles in bf16) as at 64."""
    override_kernel_settings(interpreted=False, block_override=None, autotune=True, fp32_own_config=True)  # as shipped
    from moe_qlora.moe.kernels import triton_kernels

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(triton_kernels, "_grouped_matmul_kernel", Recorder())
    monkeypatch.setattr(ops, "_autotuned_matmul", lambda arch, configs: Recorder())
    monkeypatch.setattr(tiles, "SPLIT_K_MAX", 1)  # one launch per call
    weight = GroupedWeight.quantized(nf4_stack(2, 64, 128), transpose=True)
    offsets = [0, tokens, tokens]
    for arch in (80, 90):
        override_kernel_settings(target_arch=arch)
        grouped_matmul(torch.randn(tokens, 128), weight, offsets)
        grouped_matmul(torch.randn(tokens, 128).bfloat16(), weight, offsets)
    fp32, bf16 = launches[0::2], launches[1::2]
    c = tiles.FP32_CONFIG
    assert all(
        (f["BLOCK_M"], f["BLOCK_N"], f["BLOCK_K"], f["num_warps"], f["num_stages"], f["SWAP_AB"])
        == (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, False)
        for f in fp32
    )
    assert all(f["SWAP_AB"] == (tokens == 1) for f in bf16)  # control: bf16 swaps its few rows


def test_split_k_is_the_same_on_every_gpu():
    """The split count changes the order of the fp32 sums, so it must not follow the device (H100 SXM 132 SMs,
    PCIe 114, A100 108): a resume on another GPU model would differ in the last bits. It depends on the launch
    alone; Mixtral-8x7B's LoRA-A launch at 2048 tokens splits 3 ways and Qwen3-30B-A3B's at 1 token 4 ways."""
    import inspect

    from moe_qlora.moe.kernels.aot import capture_launches

    assert list(inspect.signature(tiles.split_k).parameters) == ["programs", "k_steps"]
    splits = {}
    for name, (hidden, inter, experts, top_k), tokens in (
        ("mixtral", (4096, 14336, 8, 2), 2048),
        ("qwen3", (2048, 768, 128, 8), 1),
    ):
        launches = capture_launches(
            hidden=hidden, inter=inter, experts=experts, top_k=top_k, tokens=tokens, rank=16, dtype=torch.bfloat16
        )
        splits[name] = max(launch.kwargs.get("SPLIT_K", 1) for launch in launches if "lora_a" in launch.name)
    assert splits == {"mixtral": 3, "qwen3": 4}
