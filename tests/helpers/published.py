"""Checkpoints written as their publishers write them, from a tiny bf16 checkpoint: gpt-oss's MXFP4 experts."""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def to_mxfp4(stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A (E, in, out) stack as the hub stores it: blocks (E, out, in / 32, 16) and e8m0 scales (E, out, in / 32),
    each group of 32 inputs scaled so its largest value is at most 6, every value rounded to the nearest e2m1."""
    w = stack.transpose(1, 2).float()
    groups = w.reshape(*w.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - torch.tensor(E2M1)).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


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
