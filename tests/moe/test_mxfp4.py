"""MXFP4 expert stacks kept as published (gpt-oss): the torch decode against transformers' own and the format's
definition, and the Triton grouped matmul reading MXFP4 codes (the generic byte path and both packed word paths,
with 32-code blocks inside a 64-wide tile step) against the torch reference, in Triton's interpreter on the CPU.

Random bytes cover all 16 codes in both nibbles; scales span 2^-10 .. 2^9 and include the byte 0 (2^-127, below
fp32's normal range) and 250 (6 x 2^123; from 253 up, codes of 2 and more pass fp32's and bf16's largest value).
Broken controls: the nibbles of each byte in bitsandbytes' order (high first), and each group's scale taken from
its neighbour, both off by O(1).
"""

import pytest
import torch
from test_kernels import (  # noqa: F401 (bf16_tiles_in_fp32: an autouse fixture, as in test_kernels)
    DTYPES,
    ROUTINGS,
    bf16_tiles_in_fp32,
    default_blocks,
    offsets_of,
    recorded_launches,
)

from moe_qlora.moe.kernels.ops import (
    GroupedWeight,
    LowRank,
    grouped_matmul,
    grouped_matmul_reference,
    grouped_matmul_silu_mul,
    grouped_matmul_silu_mul_reference,
)
from moe_qlora.moe.mxfp4 import E2M1, MXFP4LayoutError, MXFP4Stack

E2M1_VALUES = torch.tensor(E2M1)


def random_published(experts: int, out: int, inp: int, *, seed: int, extremes: bool = False):
    """gpt-oss's (blocks (E, out, in/32, 16), scales (E, out, in/32)) uint8 tensors, random."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, out, inp // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(117, 137, (experts, out, inp // 32), generator=g).to(torch.uint8)
    if extremes:
        scales[0, 0, 0], scales[-1, -1, -1] = 0, 250
    return blocks, scales


def random_stack(experts: int, out: int, inp: int, *, seed: int, device="cpu", extremes=False) -> MXFP4Stack:
    blocks, scales = random_published(experts, out, inp, seed=seed, extremes=extremes)
    return MXFP4Stack.from_published(blocks.to(device), scales.to(device))


def by_definition(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(E, out, in) fp64 from the format's definition: the low nibble is element 2k, the high one 2k + 1, each
    e2m1 value times 2^(its group's byte - 127), computed in float64 (no fp32 subnormal on the way)."""
    low, high = E2M1_VALUES[(blocks & 15).long()], E2M1_VALUES[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).reshape(*scales.shape, 32).double()
    factor = torch.pow(torch.tensor(2.0, dtype=torch.float64), scales.double() - 127)
    return (values * factor[..., None]).reshape(*scales.shape[:2], -1)


def test_decode_is_the_definition_and_transformers_own():
    """Exact in fp32 and bf16 (every MXFP4 value is), the groups of byte 0 and of 250 included; transformers'
    gpt-oss dequantization (convert_moe_packed_tensors, which returns (E, in, out)) agrees bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_published(3, 8, 96, seed=0, extremes=True)
    stack = MXFP4Stack.from_published(blocks, scales)
    expected = by_definition(blocks, scales)
    assert torch.equal(stack.decode(0, 3).double(), expected)
    assert torch.equal(stack.decode(0, 3, torch.bfloat16).double(), expected)
    assert torch.equal(stack.decode(1, 3), expected[1:].float())
    theirs = convert_moe_packed_tensors(blocks, scales)
    assert torch.equal(stack.decode(0, 3, torch.bfloat16).transpose(1, 2), theirs)


def test_a_layout_that_is_not_mxfp4_is_named():
    blocks, scales = random_published(2, 4, 64, seed=1)
    with pytest.raises(MXFP4LayoutError, match=r"expected \(E, out, G, 16\)"):
        MXFP4Stack.from_published(blocks[..., :8], scales)
    with pytest.raises(MXFP4LayoutError, match="uint8"):
        MXFP4Stack.from_published(blocks, scales.float())


def nibbles_high_first(stack: MXFP4Stack) -> MXFP4Stack:
    """Broken control: each byte read in NF4's order (codes k and k + 1 exchanged)."""
    packed = ((stack.packed >> 4) | (stack.packed << 4)).to(torch.uint8)
    return MXFP4Stack(packed, stack.scales, stack.shape)


def scales_of_the_next_group(stack: MXFP4Stack) -> MXFP4Stack:
    """Broken control: each 32-code group scaled by its neighbour's exponent."""
    return MXFP4Stack(stack.packed, stack.scales.roll(1), stack.shape)


def assert_matches(got, expected, x, stack, offsets, *, transpose, dtype, gather=None, lora=None):
    """Bounded per element by the magnitude M = sum_k |x||w| (+ c |P||L|). fp32: the products are exact (ieee
    dot) and only the summation order differs, at most K 2^-24 M for K <= 192 terms: 2^-16 M. bf16: the decoded
    weights are exact in bf16, so the roundings of the sum and of the output (torch to nearest, the interpreter
    towards zero: up to one ulp each) differ: 2^-7 M + 2^-6 |y|. MXFP4 values span 2^-127 .. 2^126, so no fixed
    tolerance fits every element (a cancelling sum of large products is off by 1e-5 in fp32)."""
    dense_abs = GroupedWeight.dense(stack.decode(0, stack.num_experts).abs(), transpose=transpose)
    abs_lora = None
    if lora is not None:
        abs_lora = LowRank(
            lora.p.float().abs(), GroupedWeight.dense(lora.weight.data.abs(), transpose=True), lora.scale
        )
    magnitude = grouped_matmul_reference(x.float().abs(), dense_abs, offsets, gather=gather, lora=abs_lora)
    if dtype == torch.float32:
        bound = 2**-16 * magnitude + 1e-6
    else:
        bound = 2**-7 * magnitude + 2**-6 * expected.float().abs() + 1e-5
    assert ((got.float() - expected.float()).abs() <= bound).all()


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("transpose", [True, False], ids=["x_WT", "x_W"])
@pytest.mark.usefixtures("small_triton_blocks")
def test_byte_path_matches_reference(dev, dtype, atol, rtol, routing, transpose):
    """16-wide blocks (each tile step half a group), stored (6, 40, 96): the generic path, one byte per code."""
    offsets = offsets_of(ROUTINGS[routing])
    stack = random_stack(6, 40, 96, seed=2, device=dev)
    weight = GroupedWeight.quantized(stack, transpose=transpose)
    g = torch.Generator().manual_seed(3)
    x = (0.05 * torch.randn(11, weight.k, generator=g)).to(dev, dtype)
    gather = torch.randint(0, 11, (offsets[-1],), generator=g).to(dev)
    expected = grouped_matmul_reference(x, weight, offsets, gather=gather)
    got = grouped_matmul(x, weight, offsets, gather=gather)
    assert_matches(got, expected, x, stack, offsets, transpose=transpose, dtype=dtype, gather=gather)
    broken = grouped_matmul(
        x, GroupedWeight.quantized(nibbles_high_first(stack), transpose=transpose), offsets, gather=gather
    )
    assert (broken.float() - expected.float()).abs().max() > 0.1


@pytest.mark.parametrize("transpose", [True, False], ids=["x_WT", "x_W"])
def test_each_decoded_weight_is_exact_in_the_kernel_extreme_scales_included(dev, transpose):
    """x = identity rows picks each weight out of the fp32 kernel exactly (1 * w, plus exact zeros): the kernel's
    decode equals the torch one value by value, the groups of scale byte 0 (2^-127: the subnormal _e8m0 builds from
    bits; a GPU may flush it to zero) and 250 included. Control: the nibbles in NF4's order."""
    stack = random_stack(2, 64, 64, seed=9, device=dev, extremes=True)
    weight = GroupedWeight.quantized(stack, transpose=transpose)
    x = torch.eye(weight.k, device=dev).repeat(2, 1)  # expert 0's rows, then expert 1's
    offsets = [0, weight.k, 2 * weight.k]
    expected = torch.cat([weight.expert(e, torch.float32) for e in range(2)])
    got = grouped_matmul(x, weight, offsets)
    flushed = (expected.abs() < 2**-120) & (got == 0)
    assert ((got == expected) | flushed).all() and (expected.abs() < 2**-120).any()
    broken = grouped_matmul(x, GroupedWeight.quantized(nibbles_high_first(stack), transpose=transpose), offsets)
    assert not torch.equal(broken, expected)


@pytest.mark.parametrize("arch", [80, 90], ids=["sm_80_blocks", "sm_90_blocks"])
@pytest.mark.parametrize("transpose", [True, False], ids=["forward", "input_gradient"])
def test_a_packed_dim_of_an_odd_number_of_groups_is_not_read_past(
    dev, arch, transpose, monkeypatch, override_kernel_settings
):
    """in = 96 (three 32-code groups): each architecture's candidates include a 64-wide step, which would run past
    each row, so the launches take the byte path, and the result is the reference's (packed, the last step read
    the next row's codes and, on the forward, the next token's x)."""
    default_blocks(monkeypatch, override_kernel_settings, arch, swap=False)
    offsets = offsets_of(ROUTINGS["ragged"])
    stack = random_stack(6, 80, 96, seed=31, device=dev)
    weight = GroupedWeight.quantized(stack, transpose=transpose)
    g = torch.Generator().manual_seed(32)
    x = (0.05 * torch.randn(offsets[-1], weight.k, generator=g)).to(dev)
    launches = recorded_launches(monkeypatch, override_kernel_settings)
    expected = grouped_matmul_reference(x, weight, offsets)
    got = grouped_matmul(x, weight, offsets)
    packed = "K_PACKED" if transpose else "N_PACKED"
    assert [f[packed] for f in launches] == [False]
    assert_matches(got, expected, x, stack, offsets, transpose=transpose, dtype=torch.float32)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("glu", [False, True], ids=["down", "gate_up"])
@pytest.mark.parametrize("arch", [80, 90], ids=["sm_80_blocks", "sm_90_blocks"])
@pytest.mark.parametrize("swap", [False, True], ids=["rows_x_weight", "swapped"])
# silu's exp(-x) of a gate below -88 is inf in the interpreter's numpy (warned), and x / (1 + inf) = -0 the limit
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_packed_forward_matches_reference(
    dev, dtype, atol, rtol, glu, arch, swap, monkeypatch, override_kernel_settings
):
    """The forward's word path (K_PACKED) at each architecture's default blocks: sm_90's 64-wide K-step spans two
    32-code groups, each scaled by its own exponent; sm_80's 32-wide one is one group. K = 192 (six groups), N = 80
    (gate_up: 2 x 40), not a multiple of 64. Checked to be the path taken; broken controls off by O(1)."""
    default_blocks(monkeypatch, override_kernel_settings, arch, swap=swap)
    offsets = offsets_of(ROUTINGS["ragged"])
    stack = random_stack(6, 80, 192, seed=11, device=dev)
    weight = GroupedWeight.quantized(stack, transpose=True)
    g = torch.Generator().manual_seed(12)
    x = (0.05 * torch.randn(11, 192, generator=g)).to(dev, dtype)
    gather = torch.randint(0, 11, (offsets[-1],), generator=g).to(dev)
    launches = recorded_launches(monkeypatch, override_kernel_settings)

    def run(w):
        if glu:
            return grouped_matmul_silu_mul(x, w, offsets, gather=gather)[0]
        return grouped_matmul(x, w, offsets, gather=gather)

    if glu:
        expected, _ = grouped_matmul_silu_mul_reference(x, weight, offsets, gather=gather)
    else:
        expected = grouped_matmul_reference(x, weight, offsets, gather=gather)
    got = run(weight)
    assert [(f["K_PACKED"], f["MXFP4"], f["SWAP_AB"], f["BLOCK_K"]) for f in launches] == [
        (True, True, swap, 64 if arch == 90 else 32)
    ]
    assert_matches(got, expected, x, stack, offsets, transpose=True, dtype=dtype, gather=gather)
    for broken in (nibbles_high_first(stack), scales_of_the_next_group(stack)):
        wrong = run(GroupedWeight.quantized(broken, transpose=True))
        assert (wrong.float() - expected.float()).abs().max() > 0.1


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("arch", [80, 90], ids=["sm_80_blocks", "sm_90_blocks"])
@pytest.mark.parametrize("swap", [False, True], ids=["rows_x_weight", "swapped"])
def test_packed_input_gradient_matches_reference(
    dev, dtype, atol, rtol, arch, swap, monkeypatch, override_kernel_settings
):
    """The input gradient's word path (g W through the stored (E, out, in) experts, N_PACKED) with the fused LoRA
    term: each row of a 64-wide N step holds two groups. K = 80 rows stay masked; N = 128 is two N tiles."""
    from test_kernels import lora_term

    default_blocks(monkeypatch, override_kernel_settings, arch, swap=swap)
    offsets = offsets_of(ROUTINGS["ragged"])
    stack = random_stack(6, 80, 128, seed=21, device=dev)
    weight = GroupedWeight.quantized(stack, transpose=False)
    g = torch.Generator().manual_seed(22)
    x = (0.05 * torch.randn(offsets[-1], 80, generator=g)).to(dev, dtype)
    low_rank = lora_term(offsets, 4, 128, scale=0.5, dtype=dtype, device=dev)
    launches = recorded_launches(monkeypatch, override_kernel_settings)
    expected = grouped_matmul_reference(x, weight, offsets, lora=low_rank)
    got = grouped_matmul(x, weight, offsets, lora=low_rank)
    assert [(f["N_PACKED"], f["MXFP4"], f["SWAP_AB"]) for f in launches] == [(True, True, swap)]
    assert_matches(got, expected, x, stack, offsets, transpose=False, dtype=dtype, lora=low_rank)
    for broken in (nibbles_high_first(stack), scales_of_the_next_group(stack)):
        wrong = grouped_matmul(x, GroupedWeight.quantized(broken, transpose=False), offsets, lora=low_rank)
        assert (wrong.float() - expected.float()).abs().max() > 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("transpose", [True, False], ids=["forward", "input_gradient"])
def test_gpt_oss_20b_gate_up_in_bf16_on_the_gpu(transpose):
    """gpt-oss-20b's gate_up stack (32 experts of 5760 x 2880) compiled and autotuned on the GPU, 2048 routed rows
    in bf16, the forward (K_PACKED) and the input gradient through the stored experts (N_PACKED), against the
    torch reference within assert_matches' bf16 bound."""
    g = torch.Generator().manual_seed(0)
    offsets = offsets_of(torch.bincount(torch.randint(0, 32, (2048,), generator=g), minlength=32).tolist())
    stack = random_stack(32, 5760, 2880, seed=5, device="cuda")
    weight = GroupedWeight.quantized(stack, transpose=transpose)
    x = (0.05 * torch.randn(offsets[-1], weight.k, generator=g)).cuda().bfloat16()
    expected = grouped_matmul_reference(x, weight, offsets)
    got = grouped_matmul(x, weight, offsets)
    assert_matches(got, expected, x, stack, offsets, transpose=transpose, dtype=torch.bfloat16)
