"""Checkpoints as they are published in a quantized form. FP8 with block scales (DeepSeek-V3/R1, Kimi-K2,
Qwen3's and GLM-4.5's FP8 releases: `quant_method: fp8` with `weight_block_size`; DeepSeek-V4-Flash's, whose
experts are FP4 with `expert_dtype: fp4`) and gpt-oss's MXFP4 experts (`quant_method: mxfp4`) are dequantized
tensor by tensor as they are read, then quantized to NF4 like any bf16 checkpoint; every other quantized format is
refused by name, never silently read as something else.
The formats' tensors, decoded as read, are in published_tensors; per-expert weights read as the model's fused
stacks in published_experts.
"""

from __future__ import annotations

from pathlib import Path

from moe_qlora.model.published_experts import (
    fp4_stacks_kept,
    fused_expert_stacks,
)
from moe_qlora.model.published_tensors import (
    FP4_GROUP,
    Fp4RowTensor,
    Fp8BlockTensor,
    ModelLoadError,
    Mxfp4Tensor,
)
from moe_qlora.moe.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX

SCALE_SUFFIX = "_scale_inv"  # weight -> weight_scale_inv
SCALE_NAMES = ("weight_scale_inv", "scale", "qscale_weight")  # <m>.weight's scales, under any of these
FP8_STORED = ("F8_E4M3", "F8_E5M2")
FP4_STORED = ("I8",)  # expert_dtype fp4: two e2m1 codes a byte
INSTEAD = {  # a format moe-qlora does not read, and what to load instead
    "gptq": "a GPTQ checkpoint holds int4 weights of its own scheme: load the unquantized release",
    "awq": "an AWQ checkpoint holds int4 weights of its own scheme: load the unquantized release",
    "compressed-tensors": "compressed-tensors (llm-compressor) weights are not read: load the unquantized release",
    "bitsandbytes": "a checkpoint saved in bitsandbytes 4/8-bit: load the unquantized release (moe-qlora quantizes "
    "it to NF4 itself)",
}


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
