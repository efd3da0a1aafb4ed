"""NF4 storage: our torch decoder against bitsandbytes' kernel, per-expert slicing, refusal of bad shapes."""

import copy

import bitsandbytes.functional as bnbF
import pytest
import torch
from torch import nn

from moe_qlora.moe.nf4 import (
    NF4Stack,
    QuantizationLayoutError,
    dequantize_expert,
    dequantize_expert_reference,
    dequantize_stack,
    quantize_stack,
)


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize(
    "shape",
    [
        (3, 64, 32),  # one expert = 32 blocks
        (5, 48, 40),  # 30 blocks per expert: expert slices straddle the 256-block nested groups
        (1, 8, 8),  # a single block
    ],
)
def test_per_expert_decode_equals_bitsandbytes_whole_stack(shape, double_quant):
    torch.manual_seed(0)
    w = torch.randn(shape) * 0.05
    param = quantize_stack(w, double_quant=double_quant)
    stack = NF4Stack.from_param(param)
    # bitsandbytes decodes the full stack, flat (its CPU kernel mis-decodes last dims not a multiple of 64).
    flat_state = copy.copy(param.quant_state)
    flat_state.shape = torch.Size([w.numel()])
    whole = bnbF.dequantize_4bit(param.data, flat_state).view(shape)
    ours_ref = torch.stack([dequantize_expert_reference(stack, e) for e in range(shape[0])])
    # Exact: both multiply the same fp32 level by the same fp32 scale.
    torch.testing.assert_close(ours_ref, whole, rtol=0, atol=0)
    torch.testing.assert_close(dequantize_stack(stack), whole, rtol=0, atol=0)
    # NF4 is lossy: the error is bounded by half the widest gap between levels (0.304/2) times the block scale.
    blocks = w.reshape(-1, 64)
    err = (whole.reshape(-1, 64) - blocks).abs()
    assert torch.all(err <= 0.1521 * blocks.abs().amax(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize(
    ("shape", "rows", "columns"),
    [
        ((3, 64, 32), [(0, 2), (10, 64)], []),  # 32 codes a row: row windows of even rows; no column window
        ((5, 48, 128), [(7, 8), (0, 48)], [(64, 128), (0, 64)]),  # 2 blocks a row
        ((4, 96, 192), [(1, 95)], [(0, 192), (64, 128)]),  # 3 blocks a row; 288 blocks an expert straddle 256
    ],
)
def test_a_window_of_rows_or_columns_decodes_to_the_same_bits_as_the_whole_stack(shape, rows, columns, double_quant):
    """grouped_mm's windows (every expert's stored rows first..end, or columns): bitsandbytes' decode of the gathered
    blocks with the scales decoded once, bit for bit the whole stack's decode sliced. Controls: a window whose edge
    cuts a block is refused, and scales taken one block off give other values."""
    torch.manual_seed(0)
    stack = NF4Stack.from_param(quantize_stack(torch.randn(shape) * 0.05, double_quant=double_quant))
    whole = dequantize_stack(stack, torch.bfloat16)
    scales = stack.experts_absmax(0, shape[0])
    for first, end in rows:
        assert torch.equal(stack.decode_rows(first, end, torch.bfloat16, scales), whole[:, first:end])
    for first, end in columns:
        assert torch.equal(stack.decode_columns(first, end, torch.bfloat16), whole[:, :, first:end])
    with pytest.raises(ValueError, match="quant blocks"):
        stack.decode_columns(32, 64, torch.bfloat16) if shape[2] % 64 == 0 else stack.decode_rows(0, 1, torch.bfloat16)
    first, end = rows[0]
    shifted = torch.roll(scales, 1)
    assert not torch.equal(stack.decode_rows(first, end, torch.bfloat16, shifted), whole[:, first:end])


def test_nested_block_scales_of_any_range_are_their_definition():
    """Block i's scale is code2[q_i] * absmax2[i // 256] + offset (bitsandbytes' double quantization), whether the
    range starts on a group of 256 blocks (bitsandbytes' blockwise kernel decodes it) or not (gathered in torch).
    7 experts of 288 blocks: expert ranges straddle groups. Control: the groups read one off."""
    torch.manual_seed(0)
    stack = NF4Stack.from_param(quantize_stack(torch.randn(7, 96, 192) * 0.05, double_quant=True))
    absmax2, code2, offset = stack.nested
    i = torch.arange(stack.absmax.numel())
    defined = code2[stack.absmax.long()] * absmax2[i // 256] + offset
    per_expert = 96 * 192 // 64
    for first, end in [(0, 7), (0, 1), (1, 3), (6, 7)]:  # (0, *): aligned; the others start mid-group
        got = stack.experts_absmax(first, end)
        assert torch.equal(got, defined[first * per_expert : end * per_expert])
    shifted = code2[stack.absmax.long()] * absmax2[(i // 256 + 1).clamp(max=absmax2.numel() - 1)] + offset
    assert not torch.equal(stack.experts_absmax(0, 7), shifted)


@pytest.mark.parametrize("double_quant", [False, True])
def test_a_decode_past_bitsandbytes_int_limit_is_split_into_calls_of_whole_experts(double_quant, monkeypatch):
    """bitsandbytes counts elements in a C int: a larger decode runs as several calls (here the limit is cut to
    2.5 experts, so 7 experts take 4 calls of 2, 2, 2, 1) and gives the same bits as one call."""
    import moe_qlora.moe.nf4 as nf4

    stack = NF4Stack.from_param(quantize_stack(torch.randn(7, 64, 32) * 0.05, double_quant=double_quant))
    whole = dequantize_stack(stack)
    calls = []
    real = bnbF.dequantize_4bit
    monkeypatch.setattr(
        nf4.bnbF, "dequantize_4bit", lambda codes, state: calls.append(state.shape) or real(codes, state)
    )
    monkeypatch.setattr(nf4, "MAX_DECODE_ELEMENTS", int(2.5 * 64 * 32))
    split = dequantize_stack(stack)
    assert [s.numel() for s in calls] == [2 * 64 * 32] * 3 + [64 * 32]
    assert torch.equal(split, whole)


def test_decoder_detects_swapped_nibbles():
    """Broken control: decoding the low nibble first must not match bitsandbytes."""
    torch.manual_seed(0)
    param = quantize_stack(torch.randn(2, 16, 64))
    stack = NF4Stack.from_param(param)
    swapped = NF4Stack(((stack.packed & 0x0F) << 4) | (stack.packed >> 4), stack.absmax, None, stack.shape)
    assert not torch.equal(dequantize_expert_reference(swapped, 0), dequantize_expert(stack, 0))


@pytest.mark.parametrize("shape", [(2, 3, 5), (4, 10)])
def test_refuses_stacks_that_do_not_fill_blocks(shape):
    with pytest.raises(QuantizationLayoutError, match="expert|3D"):
        quantize_stack(torch.randn(shape))


@pytest.mark.parametrize("double_quant", [False, True])
def test_per_expert_quantization_equals_bitsandbytes_on_the_whole_stack(double_quant):
    """We quantize expert by expert (memory); the codes and scales must be bitsandbytes' own, bit for bit."""
    torch.manual_seed(1)
    w = (torch.randn(6, 32, 96) * 0.02).to(torch.bfloat16)
    ours = quantize_stack(w, double_quant=double_quant)
    codes, state = bnbF.quantize_4bit(w.float(), blocksize=64, quant_type="nf4", compress_statistics=double_quant)
    assert torch.equal(ours.data, codes)
    assert torch.equal(ours.quant_state.absmax, state.absmax)
    if double_quant:
        assert torch.equal(ours.quant_state.state2.absmax, state.state2.absmax)
        assert float(ours.quant_state.offset) == float(state.offset)


@pytest.mark.parametrize("nested", [False, True])
def test_a_shardable_linear4bit_computes_what_the_bitsandbytes_linear_did(nested):
    """FSDP shards 4-bit linears by output row as plain codes (O, I/2) and fp32 scales (O, I/64); the oracle is
    bitsandbytes' own Linear4bit on the same weights, forward and input gradient. Tolerance 1e-6 relative: the
    same decoded weights, fp32 sums in another order. Control: the codes' rows rolled by one are far off."""
    import bitsandbytes as bnb

    from moe_qlora.moe.nf4 import ShardableLinear4bit, make_linears_shardable

    torch.manual_seed(0)
    linear = bnb.nn.Linear4bit(
        128, 48, bias=True, compute_dtype=torch.float32, compress_statistics=nested, quant_type="nf4"
    )
    linear.load_state_dict(nn.Linear(128, 48).state_dict())
    linear = linear.to("cpu")  # quantizes
    linear.weight.requires_grad_(False)
    holder = nn.Sequential(linear)
    x = torch.randn(5, 128, requires_grad=True)
    expected = linear(x)
    (gx_expected,) = torch.autograd.grad(expected.square().sum(), x)
    assert make_linears_shardable(holder) == 1 and isinstance(holder[0], ShardableLinear4bit)
    shardable = holder[0]
    assert shardable.weight_nf4.shape == (48, 64) and shardable.weight_absmax.shape == (48, 2)
    got = shardable(x)
    (gx,) = torch.autograd.grad(got.square().sum(), x)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx, gx_expected, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        shardable.weight_nf4.copy_(shardable.weight_nf4.roll(1, dims=0))
    assert float((shardable(x) - expected).detach().abs().max()) > 1e-2


class _CountingReader:
    """A stack read an expert at a time, as published_experts.ExpertReader reads a checkpoint: which it read."""

    def __init__(self, w: torch.Tensor):
        self.w, self.shape, self.read = w, tuple(w.shape), []

    def __getitem__(self, e: int) -> torch.Tensor:
        self.read.append(e)
        return self.w[e]


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_rank_quantizes_exactly_the_experts_fully_shard_keeps_on_it_and_reads_no_other(double_quant, world):
    """Loading for FSDP (issue 70, item 1): each rank quantizes the experts its shard keeps, bit for bit what the
    whole stack's quantization holds there (the nested scales too: their offset spans the stack), and fully_shard's
    own chunking of the (E, ...) rows gives that rank exactly those experts. Without double quantization the
    other experts are never read; with it they are (every block's scale is needed), and never stored."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from moe_qlora.model.distributed import Ranks, shard_rows
    from moe_qlora.moe.stack_surgery import expert_rows

    torch.manual_seed(2)
    w = (torch.randn(7, 32, 96) * 0.02).to(torch.bfloat16)
    whole_codes, whole_absmax = expert_rows(NF4Stack.from_param(quantize_stack(w, double_quant=double_quant)), None)
    for rank in range(world):
        held = shard_rows(7, Ranks(rank=rank, world=world))
        reader = _CountingReader(w)
        param = quantize_stack(reader, double_quant=double_quant, held=held, device="cpu")
        codes, absmax = expert_rows(NF4Stack.from_param(param), param.held_experts)
        assert reader.read == (list(range(7)) if double_quant else list(held))
        per = 32 * 96 // 64
        stored = param.quant_state.absmax  # nested: only the held experts' scale codes kept
        assert not stored[: held.start * per].any() and not stored[held.stop * per :].any()
        fsdp_codes = _chunk_with_empty(codes, world, dim=0)[rank]
        fsdp_absmax = _chunk_with_empty(absmax, world, dim=0)[rank]
        assert torch.equal(fsdp_codes, whole_codes[held.start : held.stop])
        assert torch.equal(fsdp_absmax, whole_absmax[held.start : held.stop])
        others = [e for e in range(7) if e not in held]
        assert not codes[others].any() and not absmax[others].any()  # never written


def test_the_shard_check_fails_for_a_rank_given_its_neighbours_experts():
    """Control: a rank that quantized the wrong experts (its neighbour's range) does not hold what fully_shard
    keeps on it."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from moe_qlora.model.distributed import Ranks, shard_rows
    from moe_qlora.moe.stack_surgery import expert_rows

    torch.manual_seed(2)
    w = (torch.randn(6, 32, 96) * 0.02).to(torch.bfloat16)
    whole_codes, _ = expert_rows(NF4Stack.from_param(quantize_stack(w)), None)
    wrong = shard_rows(6, Ranks(rank=1, world=2))
    codes, _ = expert_rows(NF4Stack.from_param(quantize_stack(w, held=wrong)), wrong)
    assert not torch.equal(_chunk_with_empty(codes, 2, dim=0)[0], whole_codes[0:3])
