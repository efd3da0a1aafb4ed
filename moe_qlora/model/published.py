"""Checkpoints as they are published in a quantized form. FP8 with block scales (DeepSeek-V3/R1, Kimi-K2,
Qwen3's and GLM-4.5's FP8 releases: `quant_method: fp8` with `weight_block_size`; DeepSeek-V4-Flash's, whose
experts are FP4 with `expert_dtype: fp4`) and gpt-oss's MXFP4 experts (`quant_method: mxfp4`) are dequantized
tensor by tensor as they are read, then quantized to NF4 like any bf16 checkpoint; every other quantized format is
refused by name, never silently read as something else.

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

import re
from pathlib import Path

import torch

from moe_qlora.moe.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX, decode_values

SCALE_SUFFIX = "_scale_inv"  # weight -> weight_scale_inv
SCALE_NAMES = ("weight_scale_inv", "scale", "qscale_weight")  # <m>.weight's scales, under any of these
FP8_STORED = ("F8_E4M3", "F8_E5M2")
FP4_STORED = ("I8",)  # expert_dtype fp4: two e2m1 codes a byte
FP4_GROUP = 32  # FP4 values that share a scale, along a row
INSTEAD = {  # a format moe-qlora does not read, and what to load instead
    "gptq": "a GPTQ checkpoint holds int4 weights of its own scheme: load the unquantized release",
    "awq": "an AWQ checkpoint holds int4 weights of its own scheme: load the unquantized release",
    "compressed-tensors": "compressed-tensors (llm-compressor) weights are not read: load the unquantized release",
    "bitsandbytes": "a checkpoint saved in bitsandbytes 4/8-bit: load the unquantized release (moe-qlora quantizes "
    "it to NF4 itself)",
}


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


def quantization_configs(config) -> list:
    """The configs that carry a quantization_config: the top level, or the text model's (where transformers also
    looks for it)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    both = [config] if text is config else [config, text]
    return [c for c in both if getattr(c, "quantization_config", None) is not None]


def quant_setting(config, key: str):
    qc = quantization_configs(config)[0].quantization_config
    return qc.get(key) if isinstance(qc, dict) else getattr(qc, key, None)


def quant_method(config) -> str | None:
    return quant_setting(config, "quant_method") if quantization_configs(config) else None


def experts_published_in_mxfp4(config) -> bool:
    """Whether the checkpoint's experts are MXFP4 values: gpt-oss's (quant_method mxfp4), or FP4 experts with e8m0
    scales in an FP8 release (expert_dtype fp4 with scale_fmt ue8m0: DeepSeek-V4-Flash)."""
    method = quant_method(config)
    fp4_experts = method == "fp8" and quant_setting(config, "expert_dtype") == "fp4"
    return method == "mxfp4" or (fp4_experts and quant_setting(config, "scale_fmt") == "ue8m0")


def chosen_expert_format(config, asked: str, folder: Path) -> str:
    """model.expert_format resolved for a checkpoint: auto keeps experts published in MXFP4 as MXFP4 and quantizes
    every other checkpoint to NF4; mxfp4 asked of a checkpoint not published in MXFP4 is refused."""
    if asked == "auto":
        return "mxfp4" if experts_published_in_mxfp4(config) else "nf4"
    if asked == "mxfp4" and not experts_published_in_mxfp4(config):
        published = quant_method(config)
        stored = f"published with quant_method {published!r}" if published else "not quantized"
        if published == "fp8" and quant_setting(config, "expert_dtype") == "fp4":
            stored += f" and FP4 experts whose scales are not e8m0 (scale_fmt {quant_setting(config, 'scale_fmt')!r})"
        raise ModelLoadError(
            f"{folder}: model.expert_format mxfp4 keeps experts as published in MXFP4 (gpt-oss's, or FP4 experts "
            f"with e8m0 scales: DeepSeek-V4-Flash's); this checkpoint is {stored}: use expert_format nf4 (or auto)"
        )
    return asked


def forget_quantization(config) -> None:
    """Once the state dict decodes the checkpoint, transformers must not apply its own quantizer to it."""
    for c in quantization_configs(config):
        del c.quantization_config


def dequantized_as_read(state: dict, config, folder: Path, *, keep_mxfp4: bool = False) -> dict:
    """The checkpoint's state dict as moe-qlora quantizes it: unchanged for an unquantized checkpoint, FP8 and
    MXFP4 tensors wrapped to be decoded as they are read (every pairing checked from the headers first, so a bad
    one stops the load at once; `config` is then stripped of its quantization_config, so transformers does not
    apply its own); ModelLoadError for any other quantized format, naming it. keep_mxfp4: MXFP4 blocks and
    scales (gpt-oss's, or FP4 experts' bytes gathered into stacks) stay as stored (checked), for experts kept in
    MXFP4 (model.expert_format)."""
    method = quant_method(config)
    if method is None:
        return state
    if method == "mxfp4":
        paired = mxfp4_state(state, folder)
        state = state if keep_mxfp4 else paired
    elif method == "fp8":
        block = quant_setting(config, "weight_block_size")
        if not block or len(block) != 2:
            raise ModelLoadError(
                f"{folder}: FP8 without quantization_config.weight_block_size (one scale per tensor or per channel) "
                "is not read yet; block-scaled FP8 (DeepSeek-V3's, 128 x 128) is"
            )
        fp4 = quant_setting(config, "expert_dtype") == "fp4"
        state = fp8_state(state, (int(block[0]), int(block[1])), folder, fp4=fp4)
        state = fused_expert_stacks(state, getattr(config, "model_type", None))
        if keep_mxfp4:
            state = fp4_stacks_kept(state, folder)
    else:
        why = INSTEAD.get(method, "moe-qlora reads unquantized checkpoints, FP8 with block scales and MXFP4")
        raise ModelLoadError(f"{folder}: quantization_config.quant_method is {method!r}: {why}")
    forget_quantization(config)
    return state


ACTIVATION_SCALES = ("input_scale", "activation_scale")  # FP8 inference's; the decoded weights compute in bf16
SCALE_DTYPES = ("F32", "BF16", "F16", "U8", "F8_E8M0")


def fp8_state(state: dict, block: tuple[int, int], folder: Path, *, fp4: bool = False) -> dict:
    """Every FP8 weight with its scales as one Fp8BlockTensor, and with fp4 (`expert_dtype: fp4`) every int8 weight
    with its scales as one Fp4RowTensor; the scales (and FP8 activation scales) out. A weight without its scale, a
    `weight_scale_inv` without an FP8 weight, a weight that is not 2D or a grid that does not match: ModelLoadError
    naming the key. A `<m>.scale` beside a weight that is not quantized is a parameter of its own, kept."""
    scale_of = {  # quantized weight -> the key of its scales
        name: scale_key_of(name, state, folder)
        for name, tensor in state.items()
        if tensor.get_dtype() in FP8_STORED or is_fp4_weight(name, state, fp4)
    }
    scales = set(scale_of.values())
    out = {}
    for name, tensor in state.items():
        if name.endswith(ACTIVATION_SCALES) or name in scales:
            continue
        if name in scale_of and tensor.get_dtype() in FP8_STORED:
            scale = checked_scale(name, scale_of[name], state, block, folder)
            out[name] = Fp8BlockTensor(name, tensor, scale, block)
        elif name in scale_of:
            out[name] = Fp4RowTensor(name, tensor, checked_fp4_scale(name, scale_of[name], state, fp4, folder))
        elif name.endswith(SCALE_SUFFIX):
            weight = state.get(name.removesuffix(SCALE_SUFFIX))
            stored = "no weight" if weight is None else f"a {weight.get_dtype()} weight"
            raise ModelLoadError(f"{folder}: {name} scales {stored}, not an FP8 one: a layout not read")
        else:
            out[name] = tensor
    return out


def is_fp4_weight(name: str, state: dict, fp4: bool) -> bool:
    """An int8 weight with scales beside it; with fp4 (`expert_dtype: fp4`) every int8 `.weight`, so one whose
    scales are missing is named, never read as raw codes."""
    if state[name].get_dtype() not in FP4_STORED:
        return False
    return (fp4 and name.endswith(".weight")) or any(key in state for key in scale_names(name))


def scale_names(name: str) -> list[str]:
    """Where the scales of weight `name` may be stored: SCALE_NAMES beside a `.weight`, `<name>_scale_inv` beside
    any other tensor (an FP8 stack saved by transformers: `experts.gate_up_proj_scale_inv`)."""
    if not name.endswith(".weight"):
        return [name + SCALE_SUFFIX]
    return [f"{name.removesuffix('.weight')}.{suffix}" for suffix in SCALE_NAMES]


def scale_key_of(name: str, state: dict, folder: Path) -> str:
    """The one key that holds the scales of quantized weight `name`."""
    found = [key for key in scale_names(name) if key in state]
    if not found:
        raise ModelLoadError(
            f"{folder}: {name} is stored in {state[name].get_dtype()} without its scales (looked for "
            f"{', '.join(scale_names(name))})"
        )
    if len(found) > 1:
        raise ModelLoadError(f"{folder}: {name} has scales under {found}: one is expected")
    return found[0]


def checked_scale(name: str, scale_key: str, state: dict, block: tuple[int, int], folder: Path):
    """The scale grid of FP8 `name`, its shape and dtype checked against the weight's from the headers."""
    weight, scale = state[name], state[scale_key]
    shape = weight.get_shape()
    if len(shape) != 2:
        raise ModelLoadError(f"{folder}: {name}: an FP8 tensor of shape {shape}; only 2D weights are read")
    grid = [-(-shape[0] // block[0]), -(-shape[1] // block[1])]
    if scale.get_shape() != grid or scale.get_dtype() not in SCALE_DTYPES:
        raise ModelLoadError(
            f"{folder}: {scale_key}: a {scale.get_dtype()} grid of {scale.get_shape()}, expected {grid} "
            f"({', '.join(SCALE_DTYPES)}) for a {shape} weight in blocks of {block[0]} x {block[1]} "
            "(quantization_config.weight_block_size)"
        )
    return scale


def checked_fp4_scale(name: str, scale_key: str, state: dict, fp4: bool, folder: Path):
    """The scales of FP4 weight `name`: one per FP4_GROUP values of a row, checked from the headers; an int8
    weight with scales is FP4 only where the config says so."""
    if not fp4:
        raise ModelLoadError(
            f"{folder}: {name} is int8 with scales {scale_key}, but quantization_config.expert_dtype is not "
            "'fp4': a layout not read"
        )
    weight, scale = state[name], state[scale_key]
    shape = weight.get_shape()
    grid = [shape[0], 2 * shape[1] // FP4_GROUP] if len(shape) == 2 else None
    if grid is None or (2 * shape[1]) % FP4_GROUP or scale.get_shape() != grid or scale.get_dtype() not in SCALE_DTYPES:
        raise ModelLoadError(
            f"{folder}: {name}: FP4 weight {shape} with scales {scale.get_dtype()} {scale.get_shape()}; expected an "
            f"int8 (rows, cols / 2) weight and ({', '.join(SCALE_DTYPES)}) scales (rows, cols / {FP4_GROUP})"
        )
    return scale


class FusedExpertsTensor:
    """Per-expert FP8 weights read as the fused (E, sum of rows, cols) bf16 stack the model holds, one expert at a
    time into one buffer: transformers' own merge (MergeModulelist, then Concatenate for gate and up) keeps each
    expert's decoded tensor, their stack and the concatenation alive together, about twice a layer's experts in
    bf16 (measured: 523 MiB over the load's bound with bench_load.py --format fp8)."""

    def __init__(self, name: str, parts: list[list]):
        self.name, self.parts = name, parts  # parts[source][expert]: the tensors concatenated along rows

    def get_dtype(self) -> str:
        return "BF16"

    def get_shape(self) -> list[int]:
        rows = sum(part[0].get_shape()[0] for part in self.parts)
        return [len(self.parts[0]), rows, self.parts[0][0].get_shape()[1]]

    def __getitem__(self, index):
        if index is not Ellipsis:
            raise ValueError(f"{self.name}: read whole ([...]), not [{index!r}]")
        out = torch.empty(self.get_shape(), dtype=torch.bfloat16)
        for e in range(out.shape[0]):
            out[e] = self.expert(e)
        return out

    def expert(self, e: int) -> torch.Tensor:
        """Expert e alone: (sum of rows, cols) bf16."""
        return torch.cat([part[e][...] for part in self.parts])


class Fp4StackBytes:
    """The stored bytes of a fused FP4 stack as MXFP4's `<stack>_blocks` (E, out, G, 16) or `<stack>_scales`
    (E, out, G): each expert's sources' rows concatenated (gate before up), nothing decoded. An FP4 row of
    (cols / 2) bytes is its G groups of 16 bytes, low nibble first as in MXFP4, so the bytes are already MXFP4's."""

    def __init__(self, fused: FusedExpertsTensor, part: str):
        self.fused, self.part = fused, part  # part: "weight" (the codes) or "scale" (the e8m0 exponents)

    def get_dtype(self) -> str:
        return "U8"

    def get_shape(self) -> list[int]:
        experts, rows, cols = self.fused.get_shape()
        groups = cols // FP4_GROUP
        return [experts, rows, groups, FP4_GROUP // 2] if self.part == "weight" else [experts, rows, groups]

    def __getitem__(self, index):
        if index is not Ellipsis:
            suffix = BLOCKS_SUFFIX if self.part == "weight" else SCALES_SUFFIX
            raise ValueError(f"{self.fused.name}{suffix}: read whole ([...]), not [{index!r}]")
        out = torch.empty(self.get_shape(), dtype=torch.uint8)
        for e in range(out.shape[0]):
            rows = [getattr(part[e], self.part)[...].contiguous().view(torch.uint8) for part in self.fused.parts]
            out[e] = torch.cat(rows).view(out.shape[1:])
        return out


def fp4_stacks_kept(state: dict, folder: Path) -> dict:
    """`state` with every fused stack of FP4 experts as MXFP4 `<stack>_blocks` and `<stack>_scales` of the stored
    bytes (model.expert_format mxfp4); an FP4 weight left out of a stack, or scales that are not e8m0 bytes,
    cannot be kept so: ModelLoadError."""
    out = {}
    for name, tensor in state.items():
        parts = tensor.parts if isinstance(tensor, FusedExpertsTensor) else [[tensor]]
        if not any(isinstance(p, Fp4RowTensor) for part in parts for p in part):
            out[name] = tensor
            continue
        if not isinstance(tensor, FusedExpertsTensor) or any(type(p) is not Fp4RowTensor for q in parts for p in q):
            raise ModelLoadError(
                f"{folder}: {name}: an FP4 weight outside a stack of FP4 experts cannot be kept as MXFP4: use "
                "model.expert_format nf4"
            )
        scales = {p.scale.get_dtype() for part in parts for p in part}
        if not scales <= {"U8", "F8_E8M0"}:
            raise ModelLoadError(
                f"{folder}: {name}: FP4 scales stored as {sorted(scales)}, not e8m0: kept as MXFP4 only with e8m0 "
                "scales; use model.expert_format nf4"
            )
        out[name + BLOCKS_SUFFIX] = Fp4StackBytes(tensor, "weight")
        out[name + SCALES_SUFFIX] = Fp4StackBytes(tensor, "scale")
    return out


class ExpertReader:
    """A FusedExpertsTensor as nf4.quantize_stack reads a stack: `shape`, and `[e]` expert e decoded alone."""

    def __init__(self, fused: FusedExpertsTensor):
        self.fused, self.shape = fused, tuple(fused.get_shape())

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.fused.expert(e)


def stacks_read_by_expert(state: dict, model_type: str | None) -> dict[str, FusedExpertsTensor]:
    """The fused FP8/FP4 stacks moe-qlora quantizes itself, an expert at a time as each is decoded, instead of
    handing transformers the stack, under the name transformers' renames give them (DeepSeek-V4's ffn -> mlp,
    MiniMax-M2's block_sparse_moe -> mlp; the base model's prefix, where the checkpoint has none, is added where
    the model is at hand: loading.stack_of). Each tensor's own `name` is its key in `state`."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, apply_renamings

    renamings = [r for r in get_checkpoint_conversion_mapping(model_type) or [] if isinstance(r, WeightRenaming)]
    fused = {apply_renamings(k, renamings): v for k, v in state.items() if isinstance(v, FusedExpertsTensor)}
    # a module's stacks all or none: one left to transformers would be the module's only stack while it loads,
    # and a module without its stacks is no experts module to the quantizer (its other stack left in bf16)
    stacks = {k.rsplit(".", 1)[1] for k in fused}
    modules = {k.rsplit(".", 1)[0] for k in fused}
    whole = {m for m in modules if all(f"{m}.{stack}" in fused for stack in stacks)}
    return {k: v for k, v in fused.items() if k.rsplit(".", 1)[0] in whole}


def fused_expert_stacks(state: dict, model_type: str | None) -> dict:
    """Per-expert FP8 (or FP4) weights grouped into FusedExpertsTensor stacks under the names transformers'
    checkpoint conversion for `model_type` gives them (a converter that stacks experts, MergeModulelist(0), and
    concatenates its sources along rows, Concatenate(1): gate and up into gate_up_proj); transformers' renames
    (DeepSeek-V4's ffn -> mlp) then apply to the stack's name. Only complete groups (every source for experts
    0..E-1, all quantized) are fused; anything else is left to transformers."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    for converter in get_checkpoint_conversion_mapping(model_type) or []:
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(converter, "operations", [])]
        stacks = ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])
        if isinstance(converter, WeightConverter) and stacks and len(converter.target_patterns) == 1:
            state = fuse_converter_sources(state, list(converter.source_patterns), converter.target_patterns[0])
    return state


def literal_pattern(pattern: str, wildcards: int) -> str | None:
    """A converter's pattern as the literal key text it stands for (transformers writes a dot either way, `.` or
    `\\.`), or None when it uses more of regex than that or has not `wildcards` `*`s: left to transformers."""
    text = pattern.replace(r"\.", ".")
    return text if re.fullmatch(r"[\w.*]+", text) and text.count("*") == wildcards else None


def fuse_converter_sources(state: dict, sources: list[str], target: str) -> dict:
    """`state` with each complete group of per-expert quantized keys matching `sources` (one `*` for the expert
    index) replaced by one FusedExpertsTensor named prefix + `target`."""
    literal = [literal_pattern(s, 1) for s in sources]
    target = literal_pattern(target, 0)
    if None in literal or target is None:
        return state
    matchers = [re.compile(r"^(.*?)" + r"(\d+)".join(map(re.escape, s.split("*"))) + "$") for s in literal]
    groups: dict[str, list[dict[int, str]]] = {}
    for key in state:
        for i, matcher in enumerate(matchers):
            if m := matcher.match(key):
                groups.setdefault(m.group(1), [{} for _ in sources])[i][int(m.group(2))] = key
    out = dict(state)
    for prefix, per_source in groups.items():
        experts = len(per_source[0])
        complete = all(sorted(keys) == list(range(experts)) for keys in per_source)
        decoded = (Fp8BlockTensor, Fp4RowTensor)
        if not complete or not all(isinstance(state[k], decoded) for keys in per_source for k in keys.values()):
            continue
        parts = [[state[keys[e]] for e in range(experts)] for keys in per_source]
        for keys in per_source:
            for k in keys.values():
                del out[k]
        out[prefix + target] = FusedExpertsTensor(prefix + target, parts)
    return out


def mxfp4_state(state: dict, folder: Path) -> dict:
    """Every `<stack>_blocks` with its `<stack>_scales` as one Mxfp4Tensor named `<stack>` (bytes, paired shapes
    checked from the headers); the rest as stored."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(SCALES_SUFFIX) and name.removesuffix(SCALES_SUFFIX) + BLOCKS_SUFFIX in state:
            continue
        if name.endswith(BLOCKS_SUFFIX):
            stack = name.removesuffix(BLOCKS_SUFFIX)
            scales = state.get(stack + SCALES_SUFFIX)
            if scales is None:
                raise ModelLoadError(f"{folder}: {name} has no {stack}{SCALES_SUFFIX} beside it")
            shape, grid = tensor.get_shape(), scales.get_shape()
            if len(shape) != 4 or shape[:-1] != grid or tensor.get_dtype() != "U8" or scales.get_dtype() != "U8":
                raise ModelLoadError(
                    f"{folder}: {stack}: MXFP4 blocks {tensor.get_dtype()} {shape} and scales {scales.get_dtype()} "
                    f"{grid}; expected U8 (E, out, G, 16) and U8 (E, out, G)"
                )
            out[stack] = Mxfp4Tensor(stack, tensor, scales)
        else:
            out[name] = tensor
    return out
