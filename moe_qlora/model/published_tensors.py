"""The tensors of a checkpoint published quantized, each decoded as it is read (the LazyTensor interface that
transformers' loader reads state-dict entries through), and the formats' math.

MXFP4 (OCP microscaling): `<stack>_blocks` (E, out, G, 16) bytes hold two e2m1 values each, the low nibble first,
and `<stack>_scales` (E, out, G) one e8m0 exponent (bias 127) per 32 values along the input: W[e, i, o] =
e2m1[nibble] * 2^(scale - 127), stored transposed to the model's (E, in, out) stacks. Every such value is exact
in bf16 (two mantissa bits and an fp32-range exponent), so the decoded stack is the published model itself.

FP8 block scaling: W[i, j] = q[i, j] * s[i // b0, j // b1], q in float8 e4m3, s the `weight_scale_inv` grid of
ceil(rows / b0) x ceil(cols / b1) fp32 scales, (b0, b1) = weight_block_size. A dimension that is not a multiple
of its block ends in a partial block (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows, 4.5 blocks of 128), which is
why the block size is read from the config and never inferred from the grid's shape. A weight's scales are stored
as `<m>.weight_scale_inv`, or `<m>.scale` (DeepSeek-V4-Flash) or `<m>.qscale_weight` (Mistral Large 4), the names
transformers' FP8 quantizer renames.

FP4 experts (`expert_dtype: fp4`, DeepSeek-V4-Flash): an int8 weight (rows, cols / 2) of two e2m1 values a byte,
the low nibble first, and a scale per 32 values along each row (rows, cols / 32): MXFP4's values, one expert at a
time. With e8m0 scales (`scale_fmt: ue8m0`) the bytes are kept as MXFP4 stacks like gpt-oss's (model.expert_format
auto or mxfp4), gathered per layer; otherwise, or with expert_format nf4, decoded exactly (with e8m0 scales every
value is exact in bf16) and quantized to NF4.
"""

from __future__ import annotations

import torch

from moe_qlora.moe.mxfp4 import decode_values

FP4_GROUP = 32  # FP4 values that share a scale, along a row


class ModelLoadError(ValueError):
    """A model path or checkpoint that cannot be loaded as asked."""


class Fp8BlockTensor:
    """An FP8 weight and its block scales, read as one bf16 tensor on `[...]` (the LazyTensor interface that
    transformers' loader reads state-dict entries through); the scales then go."""

    def __init__(self, name: str, weight, scale, block: tuple[int, int]):
        self.name, self.weight, self.scale, self.block = name, weight, scale, block  # checked by fp8_state

    def get_dtype(self) -> str:
        return "BF16"

    def get_shape(self) -> list[int]:
        return self.weight.get_shape()

    def __getitem__(self, index):
        return dequantize_blocks(self.weight[index], scale_values(self.scale[index]), self.block)


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """The scales as fp32 multipliers: fp32 / bf16 / fp16 / float8_e8m0fnu as stored; uint8 as e8m0 exponents,
    2^(b - 127) (checkpoints with `scale_fmt: ue8m0` that store the exponents as bytes)."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127)
    return scale.float()


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """q (rows, cols) fp8 times each element's block scale (scale: (ceil(rows/b0), ceil(cols/b1)) fp32), rounded
    once to bf16; one row of blocks at a time in fp32 (a whole DeepSeek-V3 dense weight would be 0.5 GiB)."""
    rows, cols = q.shape
    b0, b1 = block
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    for i in range(scale.shape[0]):
        band = slice(i * b0, (i + 1) * b0)
        out[band] = (q[band].float() * scale[i].repeat_interleave(b1)[:cols]).to(torch.bfloat16)
    return out


class Fp4RowTensor:
    """An FP4 weight (rows, cols / 2) and its scales (rows, cols / 32), read whole as one bf16 (rows, cols) tensor
    on `[...]`."""

    def __init__(self, name: str, weight, scale):
        self.name, self.weight, self.scale = name, weight, scale  # checked by fp8_state

    def get_dtype(self) -> str:
        return "BF16"

    def get_shape(self) -> list[int]:
        rows, half = self.weight.get_shape()
        return [rows, 2 * half]

    def __getitem__(self, index):
        if index is not Ellipsis:
            raise ValueError(f"{self.name}: read whole ([...]), not [{index!r}]")
        return decode_fp4_rows(self.weight[...], self.scale[...])


def decode_fp4_rows(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(rows, cols / 2) int8 of e2m1 pairs, low nibble first, and (rows, cols / 32) scales -> (rows, cols) bf16:
    each value times its group's scale, rounded once (exact for e8m0 scales)."""
    rows = packed.shape[0]
    codes = packed.contiguous().view(torch.uint8).reshape(-1)
    if scale.dtype == torch.uint8:
        return decode_values(codes, scale.reshape(-1)).view(rows, -1).to(torch.bfloat16)
    unit = torch.full((scale.numel(),), 127, dtype=torch.uint8)  # 2^0: the values alone, then the float scales
    values = decode_values(codes, unit).view(rows, -1, FP4_GROUP)
    return (values * scale_values(scale)[..., None]).view(rows, -1).to(torch.bfloat16)


class Mxfp4Tensor:
    """An MXFP4 expert stack (its blocks and scales) read as one bf16 (E, in, out) tensor on `[...]`, decoded one
    expert at a time (a gpt-oss-120b stack decoded whole in fp32 would be 4 GiB)."""

    def __init__(self, name: str, blocks, scales):
        self.name, self.blocks, self.scales = name, blocks, scales

    def get_dtype(self) -> str:
        return "BF16"

    def get_shape(self) -> list[int]:
        experts, out, groups, half = self.blocks.get_shape()
        return [experts, groups * half * 2, out]

    def __getitem__(self, index):
        blocks, scales = self.blocks[index], self.scales[index]
        stack = torch.empty(self.get_shape(), dtype=torch.bfloat16)
        for e in range(stack.shape[0]):
            stack[e] = decode_mxfp4(blocks[e], scales[e]).T
        return stack


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(out, G, 16) bytes and (out, G) e8m0 exponents -> (out, G * 32) fp32 values."""
    return decode_values(blocks.reshape(-1), scales.reshape(-1)).view(scales.shape[0], -1)
