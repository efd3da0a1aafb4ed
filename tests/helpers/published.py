"""Checkpoints written as their publishers write them, from a tiny bf16 checkpoint: DeepSeek-V3's block-scaled FP8,
gpt-oss's MXFP4 experts, and DeepSeek-V4-Flash's FP8 with FP4 experts."""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0  # e4m3's largest finite value
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def quantized_names(state: dict) -> list[str]:
    """The weights DeepSeek-V3 publishes in FP8: every projection (attention, experts, shared experts), and every
    expert's weight under other names (MiniMax-M2's w1, w2, w3)."""
    projection = ("_proj", ".experts.")
    return [k for k, v in state.items() if any(p in k for p in projection) and k.endswith(".weight") and v.dim() == 2]


def to_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale grid) with each (b0, b1) block's absmax at FP8_MAX; the last blocks may be partial."""
    rows, cols = w.shape
    grid = torch.zeros((-(-rows // block[0]), -(-cols // block[1])))
    q = torch.empty_like(w)
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            cells = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            grid[i, j] = w[cells].abs().max().clamp(min=1e-12) / FP8_MAX
            q[cells] = w[cells] / grid[i, j]
    return q.to(torch.float8_e4m3fn), grid


def publish_fp8(source: Path, out: Path, block: tuple[int, int], *, shift: int = 0) -> Path:
    """The tiny checkpoint `source` as DeepSeek-V3 is published: every projection in FP8 e4m3 with its
    `weight_scale_inv` grid, the rest in bf16, quantization_config fp8 with `block` (shift: each weight given the
    scales of the block `shift` rows of blocks below its own, the broken control)."""
    (weights,) = source.glob("*.safetensors")
    state = {k: v.to(torch.bfloat16) for k, v in load_file(str(weights)).items()}
    for key in quantized_names(state):
        q, grid = to_fp8_blocks(state[key].float(), block)
        state[key], state[key + "_scale_inv"] = q, grid.roll(shift, 0)
    (folder,) = write_variants(out.parent, source, {out.name: state})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def to_e2m1_pairs(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., cols) -> uint8 (..., cols / 2) of two e2m1 codes a byte, low nibble first, and e8m0 exponent bytes
    (..., cols / 32): each group of 32 scaled by a power of two so its largest value is at most 6, each value
    rounded to the nearest e2m1."""
    groups = w.float().reshape(*w.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - torch.tensor(E2M1)).abs().argmin(-1).to(torch.uint8).reshape(w.shape)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def to_mxfp4(stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A (E, in, out) stack as the hub stores it: blocks (E, out, in / 32, 16) and e8m0 scales (E, out, in / 32)."""
    pairs, exponents = to_e2m1_pairs(stack.transpose(1, 2))
    return pairs.reshape(*exponents.shape, 16), exponents


def transformers_dequantized(folder: Path, out: Path) -> Path:
    """The FP8 checkpoint `folder` as transformers' own loader dequantizes it (FineGrainedFP8Config(dequantize=True):
    its scale renames, FP4 unpacking and block grids), saved in bf16 to `out` without a quantization_config."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    theirs = AutoModelForCausalLM.from_pretrained(
        str(folder), quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.bfloat16
    )
    theirs.save_pretrained(str(out))
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))
    return out


def write_variants(root, source, variants: dict[str, dict]) -> list:
    """A copy of the checkpoint folder `source` per variant, its weights replaced by the variant's tensors."""
    (weights,) = source.glob("*.safetensors")
    folders = []
    for name, tensors in variants.items():
        folder = shutil.copytree(source, root / name)
        (folder / weights.name).unlink()
        save_file(tensors, str(folder / "model.safetensors"))
        folders.append(folder)
    return folders


def publish_gpt_oss_mxfp4(source: Path, out: Path) -> tuple[Path, dict]:
    """The tiny gpt-oss checkpoint `source` as openai/gpt-oss-20b is published: every expert stack as MXFP4 blocks
    and scales, the rest in bf16, quantization_config mxfp4. Returns (folder, {stack key: (blocks, scales)})."""
    (weights,) = source.glob("*.safetensors")
    state = {k: v.to(torch.bfloat16) for k, v in load_file(str(weights)).items()}
    stacks = {}
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stacks[key] = to_mxfp4(state.pop(key))
        state[key + "_blocks"], state[key + "_scales"] = stacks[key]
    (folder,) = write_variants(out.parent, source, {out.name: state})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, stacks


V4_FLASH_QUANTIZATION = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}


def published_in_fp8_by_v4_flash(name: str, tensor: torch.Tensor) -> bool:
    """The weights V4-Flash ships quantized: 2D projections outside the compressor, the router and the embeddings
    (FP4 for the routed experts, FP8 for the rest)."""
    skipped = ("compressor", "embed", ".gate.", "hc_")
    projection = name.endswith(".weight") and tensor.dim() == 2 and not name.startswith("head")
    return projection and not any(s in name for s in skipped)


def is_routed_expert(name: str) -> bool:
    return ".experts." in name and ".shared_experts." not in name


def to_fp4_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) -> int8 (rows, cols / 2) e2m1 pairs and uint8 e8m0 (rows, cols / 32), as V4-Flash stores them."""
    pairs, exponents = to_e2m1_pairs(w)
    return pairs.view(torch.int8), exponents


def to_fp8_e8m0_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, F8_E8M0 grid): each block's scale the power of two that puts its absmax at most FP8_MAX."""
    q, grid = to_fp8_blocks(w, block)
    grid = torch.exp2(torch.ceil(torch.log2(grid)))
    cells = grid.repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(block[1], 1)[:, : w.shape[1]]
    return (w / cells).to(torch.float8_e4m3fn), grid.to(torch.float8_e8m0fnu)


def publish_v4_flash(source: Path, out: Path) -> tuple[Path, dict]:
    """The tiny DeepSeek-V4 checkpoint `source` as DeepSeek-V4-Flash is published: routed experts' w1/w2/w3 in FP4
    (int8 pairs, e8m0 `.scale` bytes per 32), the other projections FP8 with F8_E8M0 `.scale` grids of 128 x 128,
    the rest bf16. Returns (folder, {model stack key: (MXFP4 blocks, scales)} of the experts' bytes, gate before up)."""
    (weights,) = source.glob("*.safetensors")
    config = json.loads((source / "config.json").read_text())
    experts = config["n_routed_experts"]
    state = {k: v if k.endswith("tid2eid") else v.to(torch.bfloat16) for k, v in load_file(str(weights)).items()}
    for k in [k for k in state if k.endswith("tid2eid")]:  # built zeros: every token to expert 0, the gate idle
        picks = [torch.randperm(experts, generator=torch.Generator().manual_seed(t)) for t in range(len(state[k]))]
        state[k] = torch.stack(picks)[:, : state[k].shape[1]].contiguous()
    for k in [k for k, v in state.items() if published_in_fp8_by_v4_flash(k, v)]:
        quantized = to_fp4_rows(state[k]) if is_routed_expert(k) else to_fp8_e8m0_blocks(state[k].float(), (128, 128))
        state[k], state[k.removesuffix(".weight") + ".scale"] = quantized
    (folder,) = write_variants(out.parent, source, {out.name: state})
    config["quantization_config"] = V4_FLASH_QUANTIZATION
    (folder / "config.json").write_text(json.dumps(config))
    return folder, v4_flash_stacks(state, config["num_hidden_layers"], experts)


def v4_flash_stacks(state: dict, layers: int, experts: int) -> dict:
    """{model stack key: (blocks (E, out, G, 16), scales (E, out, G))}: each expert's FP4 rows (w1 then w3 for
    gate_up, w2 for down) as the MXFP4 stack they are."""
    stacks = {}
    for i in range(layers):
        for stack, sources in (("gate_up_proj", ("w1", "w3")), ("down_proj", ("w2",))):
            keys = [[f"model.layers.{i}.ffn.experts.{e}.{w}" for w in sources] for e in range(experts)]
            blocks = torch.stack([torch.cat([state[k + ".weight"].view(torch.uint8) for k in e]) for e in keys])
            scales = torch.stack([torch.cat([state[k + ".scale"] for k in e]) for e in keys])
            stacks[f"model.layers.{i}.mlp.experts.{stack}"] = (blocks.view(*scales.shape, 16), scales)
    return stacks
