"""NF4 storage of expert stacks in bitsandbytes' format, and per-expert dequantization.

A stack of E matrices (E, out, in) is quantized as one flat tensor with blocksize 64, exactly as bitsandbytes
would quantize it; expert e then owns a contiguous slice of the packed codes and of the block scales, so it
can be dequantized alone (the MoE layer never holds more than one expert) and quantized alone (a rank's shard).

Shape letters: E experts, O rows (out features), I columns (in features), N = O * I, B = blocksize.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import bitsandbytes as bnb
import bitsandbytes.functional as bnbF
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from moe_qlora.common.memory import unwritten, written_only

BLOCKSIZE = 64
# bitsandbytes' nested (double) quantization groups 256 block scales under one fp32 scale.
NESTED_BLOCKSIZE = 256

# The 16 NF4 levels (QLoRA, Dettmers et al. 2023, appendix E): quantiles of N(0, 1) scaled to [-1, 1].
# Written out here rather than read from bitsandbytes so the torch decoder is an independent oracle.
NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


class QuantizationLayoutError(ValueError):
    """An expert stack whose shape cannot be split per expert in NF4 blocks."""


@dataclass(frozen=True)
class NF4Stack:
    """A read-only view of one quantized expert stack (E, O, I).

    packed:  (E*N/2,) uint8, two codes a byte, the first in the high nibble.
    absmax:  (E*N/B,) float32 block scales, or uint8 codes of them when `nested` is set.
    nested:  (absmax2 (ceil(E*N/B/256),) float32, code2 (256,) float32, offset float) or None.
    """

    packed: torch.Tensor
    absmax: torch.Tensor
    nested: tuple[torch.Tensor, torch.Tensor, float] | None
    shape: tuple[int, int, int]
    blocksize: int = BLOCKSIZE

    @classmethod
    def from_param(cls, param: bnb.nn.Params4bit) -> NF4Stack:
        qs = param.quant_state
        nested = (qs.state2.absmax, qs.state2.code, nested_offset(qs)) if qs.nested else None
        return cls(param.data.view(-1), qs.absmax, nested, tuple(qs.shape), qs.blocksize)

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def expert_numel(self) -> int:
        return self.shape[1] * self.shape[2]

    def expert_absmax(self, e: int) -> torch.Tensor:
        """Block scales of expert e as float32: (N/B,). Undoes the nested quantization if any."""
        return self.experts_absmax(e, e + 1)

    def experts_absmax(self, first: int, end: int) -> torch.Tensor:
        """Block scales of experts first..end-1 as float32: ((end - first) N/B,), nested quantization undone."""
        per_expert = self.expert_numel // self.blocksize
        lo, hi = first * per_expert, end * per_expert
        if self.nested is None:
            return self.absmax[lo:hi].float()
        absmax2, code2, offset = self.nested
        if lo % NESTED_BLOCKSIZE == 0:
            # A range starting on a group of 256 blocks (the whole stack, a window's): bitsandbytes' blockwise decode,
            # one kernel reading a byte a block, the same fp32 code2[q] * absmax2[i // 256] as below.
            groups = absmax2[lo // NESTED_BLOCKSIZE : -(-hi // NESTED_BLOCKSIZE)]
            state2 = bnbF.QuantState(absmax=groups, code=code2, blocksize=NESTED_BLOCKSIZE, dtype=torch.float32)
            return bnbF.dequantize_blockwise(self.absmax[lo:hi], state2) + offset
        # Block i of the flat stack is scaled by absmax2[i // 256]; slices need not align with 256.
        nested_idx = torch.arange(lo, hi, device=self.absmax.device) // NESTED_BLOCKSIZE
        return code2[self.absmax[lo:hi].long()] * absmax2[nested_idx] + offset

    def expert_codes(self, e: int) -> torch.Tensor:
        """Packed codes of expert e: (N/2,) uint8."""
        return self.experts_codes(e, e + 1)

    def experts_codes(self, first: int, end: int) -> torch.Tensor:
        """Packed codes of experts first..end-1: ((end - first) N/2,) uint8."""
        half = self.expert_numel // 2
        return self.packed[first * half : end * half]

    def decode(self, first: int, end: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Experts first..end-1 as (end - first, O, I) in `dtype` (bitsandbytes' decode: dequantize_experts)."""
        return dequantize_experts(self, first, end, dtype)

    def decode_rows(self, first: int, end: int, dtype: torch.dtype, scales: torch.Tensor | None = None):
        """Stored rows first..end-1 of every expert: (E, end - first, I) in `dtype`. Their codes must fill whole
        quant blocks (first * I and end * I multiples of the blocksize: window_granule). scales: the stack's
        fp32 block scales (experts_absmax(0, E)) when already decoded, so that windows share one decode."""
        experts, rows, cols = self.shape
        lo, hi = first * cols, end * cols
        if lo % self.blocksize or hi % self.blocksize:
            raise ValueError(f"rows {first}..{end} of {cols} codes do not start and end on quant blocks")
        codes = self.packed.view(experts, rows * cols // 2)[:, lo // 2 : hi // 2]
        blocks = self._scales(scales).view(experts, -1)[:, lo // self.blocksize : hi // self.blocksize]
        return _decode_blocks(codes, blocks, self.blocksize, dtype).view(experts, end - first, cols)

    def decode_columns(self, first: int, end: int, dtype: torch.dtype, scales: torch.Tensor | None = None):
        """Stored columns first..end-1 of every expert: (E, O, end - first) in `dtype`; each row's run of them is
        whole quant blocks (the row length, first and end multiples of the blocksize). scales as decode_rows'."""
        experts, rows, cols = self.shape
        b = self.blocksize
        if cols % b or first % b or end % b:
            raise ValueError(f"columns {first}..{end} of rows of {cols} codes are not whole quant blocks of {b}")
        codes = self.packed.view(experts, rows, cols // 2)[:, :, first // 2 : end // 2]
        blocks = self._scales(scales).view(experts, rows, cols // b)[:, :, first // b : end // b]
        return _decode_blocks(codes, blocks, b, dtype).view(experts, rows, end - first)

    def _scales(self, scales: torch.Tensor | None) -> torch.Tensor:
        return scales if scales is not None else self.experts_absmax(0, self.num_experts)


def _decode_blocks(codes: torch.Tensor, scales: torch.Tensor, blocksize: int, dtype: torch.dtype) -> torch.Tensor:
    """bitsandbytes' decode of whole blocks gathered from a stack (a window of it): codes (..., n/2) uint8 and
    their block scales (..., n/blocksize) fp32 in the same order, flat in `dtype`. The gathered codes are a
    quarter of the decoded window's bytes in bf16."""
    codes, scales = codes.contiguous().view(-1), scales.contiguous().view(-1)
    state = bnbF.QuantState(
        absmax=scales,
        shape=decode_shape(codes.numel() * 2, blocksize),
        code=_nf4_code(str(codes.device)),
        blocksize=blocksize,
        quant_type="nf4",
        dtype=dtype,
    )
    return bnbF.dequantize_4bit(codes, state).view(-1)


def check_quantizable(shape: tuple[int, ...]) -> None:
    """Raise unless every expert of a (E, O, I) stack fills whole NF4 blocks."""
    if len(shape) != 3:
        raise QuantizationLayoutError(f"expected a 3D expert stack (experts, out, in), got shape {tuple(shape)}")
    if (shape[1] * shape[2]) % BLOCKSIZE:
        raise QuantizationLayoutError(
            f"expert matrices of shape {tuple(shape[1:])} have {shape[1] * shape[2]} elements, not a multiple of "
            f"the NF4 blocksize {BLOCKSIZE}; experts could not be dequantized one at a time"
        )


def quantize_stack(weight, *, double_quant: bool = False, device=None, held: range | None = None) -> bnb.nn.Params4bit:
    """Quantize a (E, O, I) expert stack to a frozen bitsandbytes Params4bit (NF4, blocksize 64), on `device`
    (default: the stack's). `weight` is a tensor, or anything with a `shape` whose `[e]` gives expert e (O, I):
    a checkpoint's experts read one at a time (published_experts.ExpertReader), never whole.

    Experts are quantized one at a time, each upcast to fp32 alone, so a bf16 stack is never copied whole;
    blocks never straddle experts, so the result equals bitsandbytes quantizing the fp32 stack at once.

    `held` (a rank's FSDP shard of experts, recorded on the param): only their codes are written, so the others'
    pages never become resident; other experts are read only for double_quant's scales (its offset spans the stack).
    """
    check_quantizable(tuple(weight.shape))
    experts, numel = weight.shape[0], weight.shape[1] * weight.shape[2]
    device = device if device is not None else weight.device
    # Outputs allocated once, one fp32 staging buffer reused (+250 MiB of RSS to quantize a 288 MiB stack else, +95)
    packed = unwritten(experts * numel // 2, torch.uint8, device)
    absmax = unwritten(experts * numel // BLOCKSIZE, torch.float32, device)
    staging = torch.empty(tuple(weight.shape[1:]), dtype=torch.float32, device=device)
    for e in range(experts):
        if held is not None and e not in held and not double_quant:
            continue
        codes, scales = torch.ops.bitsandbytes.quantize_4bit.default(
            staging.copy_(weight[e]), BLOCKSIZE, "nf4", torch.uint8
        )
        if held is None or e in held:
            packed[e * numel // 2 : (e + 1) * numel // 2] = codes.view(-1)
        absmax[e * numel // BLOCKSIZE : (e + 1) * numel // BLOCKSIZE] = scales.view(-1)
        del codes, scales
    del staging
    state = _stack_state(absmax, tuple(weight.shape), double_quant)
    if held is not None and double_quant:  # the others' nested scale codes served the offset only: not kept
        state.absmax = written_only(state.absmax, held.start * numel // BLOCKSIZE, held.stop * numel // BLOCKSIZE)
    param = bnb.nn.Params4bit(
        packed.view(-1, 1),
        requires_grad=False,
        quant_state=state,
        blocksize=BLOCKSIZE,
        compress_statistics=double_quant,
        quant_type="nf4",
        quant_storage=torch.uint8,
        bnb_quantized=True,
    )
    param.held_experts = held
    return param


def _stack_state(absmax: torch.Tensor, shape: tuple[int, ...], double_quant: bool) -> bnbF.QuantState:
    """bitsandbytes' QuantState for fp32 block scales, nesting them as quantize_4bit does when asked."""
    common = dict(
        shape=torch.Size(shape),
        dtype=torch.float32,
        blocksize=BLOCKSIZE,
        quant_type="nf4",
        code=bnbF.get_4bit_type("nf4", device=absmax.device),
    )
    if not double_quant:
        return bnbF.QuantState(absmax=absmax, **common)
    offset = absmax.mean()
    nested_codes, nested_state = bnbF.quantize_blockwise(absmax - offset, blocksize=NESTED_BLOCKSIZE)
    state = bnbF.QuantState(absmax=nested_codes, offset=offset, state2=nested_state, **common)
    state.offset_float = float(offset)  # read once here, so the layer never syncs for it
    return state


def nested_offset(state: bnbF.QuantState) -> float:
    """The nested-scales offset as a Python float: the copy made at quantization, else read (one sync)."""
    cached = getattr(state, "offset_float", None)
    return cached if cached is not None else float(state.offset)


def dequantize_expert_reference(stack: NF4Stack, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pure-torch NF4 decode of expert e: (O, I). The oracle for bitsandbytes' and our kernels."""
    codes = stack.expert_codes(e)
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=codes.device)
    nibbles = torch.stack([codes >> 4, codes & 0x0F], dim=-1).reshape(-1).long()  # high nibble first
    values = levels[nibbles].view(-1, stack.blocksize) * stack.expert_absmax(e)[:, None]
    return values.view(stack.shape[1], stack.shape[2]).to(dtype)


@functools.cache
def _nf4_code(device: str) -> torch.Tensor:
    """bitsandbytes' NF4 code table, built once per device (a third of a small expert's decode time otherwise);
    a real tensor even when first asked under a fake mode (tracing), which would otherwise cache a fake one."""
    with unset_fake_temporarily():
        return bnbF.get_4bit_type("nf4", device=device)


def dequantize_expert(stack: NF4Stack, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize expert e with bitsandbytes' native kernel (CPU or CUDA): (O, I) in `dtype`."""
    return dequantize_experts(stack, e, e + 1, dtype)[0]


# bitsandbytes hands its 4-bit kernels the element count as a C int: a larger decode (DeepSeek-V3's gate_up
# stack is 7.5e9 elements) is split into calls of whole experts below it.
MAX_DECODE_ELEMENTS = 2**31 - 1


def decode_shape(numel: int, blocksize: int) -> torch.Size:
    """The shape bitsandbytes decodes `numel` values in: one row per block, (numel / blocksize, blocksize).

    bitsandbytes 0.50's CPU kernel parallelizes over rows: a flat (1, numel) decode runs on one thread and took
    4.5x longer for a 1M-value bf16 expert (1.68 ms against 0.37 ms, 2 threads). It mis-decodes 2D shapes whose
    last dimension is not a multiple of the blocksize (e.g. (64, 32)), so a row is exactly one block; a count
    that is not whole blocks is decoded flat. The CUDA kernel reads only the element count."""
    if numel % blocksize:
        return torch.Size([numel])
    return torch.Size([numel // blocksize, blocksize])


def dequantize_experts(stack: NF4Stack, first: int, end: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Experts first..end-1 decoded by bitsandbytes: (end - first, O, I) in `dtype`, in one call unless that
    passes MAX_DECODE_ELEMENTS. No host sync: the nested offset is a float read when the stack was built."""
    per_call = max(1, MAX_DECODE_ELEMENTS // stack.expert_numel)
    if end - first > per_call:
        out = torch.empty(end - first, *stack.shape[1:], dtype=dtype, device=stack.packed.device)
        for lo in range(first, end, per_call):
            hi = min(lo + per_call, end)
            out[lo - first : hi - first] = dequantize_experts(stack, lo, hi, dtype)
        return out
    state = bnbF.QuantState(
        absmax=stack.experts_absmax(first, end),
        shape=decode_shape((end - first) * stack.expert_numel, stack.blocksize),
        code=_nf4_code(str(stack.packed.device)),
        blocksize=stack.blocksize,
        quant_type="nf4",
        dtype=dtype,
    )
    return bnbF.dequantize_4bit(stack.experts_codes(first, end), state).view(end - first, *stack.shape[1:])


def dequantize_stack(stack: NF4Stack, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """All experts at once, (E, O, I): for tests and for building a dequantized reference model."""
    return dequantize_experts(stack, 0, stack.num_experts, dtype)


def stack_nbytes(param: bnb.nn.Params4bit) -> int:
    """Bytes held by a quantized stack: codes plus block scales (and nested scales)."""
    qs = param.quant_state
    total = param.data.numel() * param.data.element_size() + qs.absmax.numel() * qs.absmax.element_size()
    if qs.nested:
        total += qs.state2.absmax.numel() * qs.state2.absmax.element_size()
    return total


def dequantize_param(param: bnb.nn.Params4bit, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Any bitsandbytes 4-bit parameter back to its full shape (decoded a block per row: see decode_shape)."""
    data, state = standard_layout(param)  # bitsandbytes may have repacked it for its bf16 CPU inference kernel
    state = copy.copy(state)
    shape = state.shape
    state.shape = decode_shape(shape.numel(), state.blocksize)
    state.dtype = dtype
    return bnbF.dequantize_4bit(data, state).view(shape)


class _NF4LinearFunction(torch.autograd.Function):
    """y = x W^T (+ b) with W decoded from NF4 codes for the forward and again for the backward, never saved
    (as bitsandbytes' own 4-bit matmul does): W is frozen, so only x gets a gradient."""

    @staticmethod
    def forward(ctx, x, codes, absmax, bias, shape):
        ctx.save_for_backward(codes, absmax)
        ctx.shape = shape
        return F.linear(x, _decoded_rows(codes, absmax, shape, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out):
        codes, absmax = ctx.saved_tensors
        return grad_out @ _decoded_rows(codes, absmax, ctx.shape, grad_out.dtype), None, None, None, None


def _decoded_rows(codes: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int], dtype) -> torch.Tensor:
    """W (O, I) in `dtype` from row-major NF4 codes (O, I/2) and fp32 block scales (O, I/64)."""
    return dequantize_experts(NF4Stack(codes.view(-1), absmax.view(-1), None, (1, *shape)), 0, 1, dtype)[0]


class ShardableLinear4bit(nn.Module):
    """A bitsandbytes 4-bit linear whose codes and block scales are plain frozen parameters laid out by output
    row, `weight_nf4` (O, I/2) uint8 and `weight_absmax` (O, I/64) fp32 (nested scales decoded: the same values),
    so that FSDP2 shards it by rows like any weight. Computes what the Linear4bit computed: x W^T + b."""

    def __init__(self, linear: bnb.nn.Linear4bit):
        super().__init__()
        data, state = standard_layout(linear.weight)
        out_features, in_features = state.shape
        nested = (state.state2.absmax, state.state2.code, nested_offset(state)) if state.nested else None
        stack = NF4Stack(data.reshape(-1), state.absmax, nested, (1, out_features, in_features), state.blocksize)
        self.in_features, self.out_features = in_features, out_features
        self.weight_nf4 = nn.Parameter(data.reshape(out_features, in_features // 2).clone(), requires_grad=False)
        self.weight_absmax = nn.Parameter(
            stack.experts_absmax(0, 1).view(out_features, -1).clone(), requires_grad=False
        )
        self.bias = linear.bias
        self.compute_dtype = linear.compute_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.compute_dtype or x.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        out = _NF4LinearFunction.apply(
            x.to(dtype), self.weight_nf4, self.weight_absmax, bias, (self.out_features, self.in_features)
        )
        return out.to(x.dtype)


def shardable_by_rows(linear: nn.Module) -> bool:
    """A 4-bit linear whose rows hold whole NF4 blocks (in_features a multiple of 64): its codes and scales can
    be split by output row."""
    return isinstance(linear, bnb.nn.Linear4bit) and linear.in_features % BLOCKSIZE == 0


def make_linears_shardable(model: nn.Module) -> int:
    """Replace every bitsandbytes 4-bit linear that shardable_by_rows by a ShardableLinear4bit (FSDP2 cannot
    shard a Params4bit: its scales live in a quant_state beside it). Returns how many."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if shardable_by_rows(child)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, ShardableLinear4bit(child))
    return len(swaps)


def standard_layout(param: bnb.nn.Params4bit):
    """(codes, quant_state) of a 4-bit parameter in bitsandbytes' standard packing (undoing its CPU repacking)."""
    data, state = param.data, param.quant_state
    if getattr(state, "packing_format_for_cpu", False):
        data, state = bnbF._convert_weight_packed_for_cpu_inverse(data.clone(), copy.deepcopy(state))
    return data, state
