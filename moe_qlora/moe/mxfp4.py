"""MXFP4 storage of expert stacks, kept as published (gpt-oss), beside NF4 (nf4.py).

OCP microscaling FP4: every 32 consecutive values along a stored row share one e8m0 exponent, and each value is
an e2m1 code (sign, two exponent bits, one mantissa bit) packed two to a byte, the low nibble first:

    W[e, o, i] = E2M1[nibble i of row (e, o)] * 2^(scales[e, o, i // 32] - 127)

gpt-oss stores `<stack>_blocks` (E, out, in/32, 16) uint8 and `<stack>_scales` (E, out, in/32) uint8 in the
(E, out, in) orientation, though transformers' modules hold the decoded stacks transposed, (E, in, out). The
stack is kept in the published orientation; the MoE layer reads it as a stack stored (E, out, in).

Every decoded value is exact in bf16 (two significant bits, an exponent in fp32's range), so each path computes
on the published model itself: 4.25 bits per weight (4 for the code, 8 per 32 for the exponent).

Shape letters: E experts, O rows (out), I columns (in), N = O * I.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

BLOCKSIZE = 32
SCALE_BIAS = 127
BITS_PER_WEIGHT = 4 + 8 / BLOCKSIZE
# The 16 e2m1 values by code: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0 (OCP MX v1.0, table 5).
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


class MXFP4LayoutError(ValueError):
    """Blocks and scales that do not form an MXFP4 stack."""


@dataclass(frozen=True)
class MXFP4Stack:
    """A read-only view of one MXFP4 expert stack, stored (E, O, I) with blocks along I.

    packed: (E*N/2,) uint8 codes, two a byte, the first in the low nibble.
    scales: (E*N/32,) uint8 e8m0 exponents, scale 2^(s - 127) for values 32b .. 32b + 31 of the flat stack.
    The field names match NF4Stack's where the kernels read them the same way (packed codes, blocksize).
    """

    packed: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int, int]
    blocksize: int = BLOCKSIZE
    nested = None  # no nested scales: an NF4Stack field the grouped layer reads

    @classmethod
    def from_published(cls, blocks: torch.Tensor, scales: torch.Tensor) -> MXFP4Stack:
        """A stack from gpt-oss's tensors: blocks (E, O, I/32, 16) and scales (E, O, I/32), both uint8."""
        if blocks.dim() != 4 or blocks.shape[-1] != BLOCKSIZE // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
            raise MXFP4LayoutError(
                f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: expected (E, out, G, 16) "
                "and (E, out, G)"
            )
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise MXFP4LayoutError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
        experts, out, groups, _ = blocks.shape
        return cls(blocks.reshape(-1), scales.reshape(-1), (experts, out, groups * BLOCKSIZE))

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def expert_numel(self) -> int:
        return self.shape[1] * self.shape[2]

    def experts_codes(self, first: int, end: int) -> torch.Tensor:
        """Packed codes of experts first..end-1: ((end - first) N/2,) uint8."""
        half = self.expert_numel // 2
        return self.packed[first * half : end * half]

    def experts_scales(self, first: int, end: int) -> torch.Tensor:
        """e8m0 exponents of experts first..end-1: ((end - first) N/32,) uint8."""
        per_expert = self.expert_numel // self.blocksize
        return self.scales[first * per_expert : end * per_expert]

    def decode(self, first: int, end: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Experts first..end-1 as (end - first, O, I) in `dtype` (exact in bf16, fp16 aside), an expert at a time
        into the output: the fp32 temporaries (8 bytes a weight) are one expert's, never the stack's."""
        out = torch.empty(end - first, *self.shape[1:], dtype=dtype, device=self.packed.device)
        for e in range(first, end):
            values = decode_values(self.experts_codes(e, e + 1), self.experts_scales(e, e + 1))
            out[e - first] = values.view(self.shape[1:])
        return out

    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel()


@functools.cache
def _byte_values(device: str) -> torch.Tensor:
    """(256, 2) fp32: the two e2m1 values of each byte, the low nibble's first (real under a fake mode too)."""
    with unset_fake_temporarily():
        table = torch.tensor(E2M1, dtype=torch.float32)
        byte = torch.arange(256)
        return torch.stack((table[byte & 0x0F], table[byte >> 4]), dim=-1).to(device)


def e8m0_scales(exponents: torch.Tensor) -> torch.Tensor:
    """2^(e - 127) in fp32 from e8m0 bytes, built as the float's bits (exact, and the same on every device, as
    a pow or exp2 need not be): the byte is the biased exponent field; byte 0 stands for 2^-127, below fp32's
    normal range, the subnormal 0x00400000 (the Triton kernels build it the same way)."""
    biased = exponents.to(torch.int32)
    return torch.where(biased > 0, biased << 23, 0x400000).view(torch.float32)


def decode_values(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(n/2,) packed bytes and (n/32,) e8m0 exponents -> (n,) fp32: the low nibble first, each value times its
    group's scale (both factors exact, so is the product, subnormals included)."""
    pairs = _byte_values(str(packed.device))[packed.long()]  # (n/2, 2)
    return (pairs.view(-1, BLOCKSIZE) * e8m0_scales(scales)[:, None]).view(-1)


def stack_shape_of(stored_shape: tuple[int, ...], transposed: bool) -> tuple[int, int, int]:
    """The (E, out, in) shape an MXFP4 stack takes for a module stack stored (E, out, in), or (E, in, out) when
    transposed (gpt-oss)."""
    experts, d1, d2 = stored_shape
    return (experts, d2, d1) if transposed else (experts, d1, d2)


def check_encodable(shape: tuple[int, int, int], name: str) -> None:
    """Raise unless rows of `in` values split into whole 32-value MXFP4 groups."""
    if shape[2] % BLOCKSIZE:
        raise MXFP4LayoutError(f"{name}: rows of {shape[2]} values are not whole MXFP4 groups of {BLOCKSIZE}")


def published_shapes(shape: tuple[int, int, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(blocks, scales) shapes of an (E, O, I) stack as gpt-oss publishes it."""
    experts, out, inp = shape
    return (experts, out, inp // BLOCKSIZE, BLOCKSIZE // 2), (experts, out, inp // BLOCKSIZE)
