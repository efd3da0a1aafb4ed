"""`--format per-expert`: the PEFT adapter a run writes, with its expert LoRA as PEFT keys under the family's hub
checkpoint names, one LoRA per expert and projection (Mixtral `block_sparse_moe.experts.M.w1/w3/w2`; Qwen-MoE,
OLMoE, DeepSeek, GLM-4-MoE `mlp.experts.M.gate_proj/up_proj/down_proj`), as vLLM and SGLang read for those
families. The fused gate_up LoRA becomes gate and up LoRAs sharing A: rows [:I] of B are gate's, rows [I:] up's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from moe_qlora.common.fileio import atomic_dir, save_safetensors
from moe_qlora.export.family_tables import DSV4_MODULES, PER_EXPERT_UNREAD, ExportError, FamilyNames
from moe_qlora.export.peft_factors import EXPERT_KEY, LINEAR_KEY, check_one_decoder, expert_layers, read_run_adapter

# Families whose hub checkpoints name every module otherwise than transformers (which renames them on load), and
# have no model. root: {transformers' module path: the hub's}. vLLM 0.33.0 reads DeepSeek-V4's so (its
# DeepseekV4ForCausalLM's hf_to_vllm_mapper adds the model. root, models/deepseek_v4/nvidia/model.py)
HUB_MODULE_NAMES = {"deepseek_v4": {module: hub for module, (hub, _) in DSV4_MODULES.items()}}


def hub_module_key(key: str, modules: dict[str, str]) -> str:
    """A non-expert LoRA key under the hub checkpoint's module names and root (HUB_MODULE_NAMES)."""
    m = LINEAR_KEY.fullmatch(key)
    module = f"{m['path']}.{m['proj']}"
    if module not in modules:
        raise ExportError(f"{key}: no hub checkpoint name known for {module} (known: {', '.join(sorted(modules))})")
    return f"{m['prefix'].removesuffix('.model')}.layers.{m['layer']}.{modules[module]}.lora_{m['ab']}.weight"


def per_expert_tensors(
    tensors: dict[str, torch.Tensor], rank: int, names: FamilyNames, hub: dict[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """Our PEFT tensors with the expert LoRA rewritten under per-expert module names (attention unchanged, or
    under `hub`'s module names without transformers' model. root: HUB_MODULE_NAMES)."""
    prefix = check_one_decoder(tensors)
    if hub is None:
        out = {hub_linear_key(k, names): v for k, v in tensors.items() if not EXPERT_KEY.fullmatch(k)}
    else:
        out = {hub_module_key(k, hub): v for k, v in tensors.items() if not EXPERT_KEY.fullmatch(k)}
        prefix = prefix.removesuffix(".model")
    for layer, x in expert_layers(tensors, rank, names).items():
        inter = x.gate_up_b.shape[1] // 2
        for e in range(x.gate_up_a.shape[0]):
            base = f"{prefix}.layers.{layer}.{names.experts}.{e}"
            pieces = (
                {
                    names.gate: (x.gate_up_a[e], x.gate_up_b[e, :inter]),
                    names.up: (x.gate_up_a[e], x.gate_up_b[e, inter:]),
                    names.down: (x.down_a[e], x.down_b[e]),
                }
                if names.gated
                else {names.up: (x.gate_up_a[e], x.gate_up_b[e]), names.down: (x.down_a[e], x.down_b[e])}
            )
            for proj, (a, b) in pieces.items():
                # gate and up share A: one copy each, contiguous (Llama-4's factors are transposed views)
                out[f"{base}.{proj}.lora_A.weight"] = a.clone(memory_format=torch.contiguous_format)
                out[f"{base}.{proj}.lora_B.weight"] = b.clone(memory_format=torch.contiguous_format)
    return out


# Families whose hub checkpoints (and vLLM's class) hold q, k and v as one Linear: (its path, the output
# projection's) under a decoder layer. Sarvam-MoE: vLLM's SarvamMoEForCausalLM (a BailingMoeForCausalLM) packs
# query_key_value as one LoRA and names no q_proj (model_executor/models/bailing_moe.py, packed_modules_mapping)
HUB_FUSED_ATTENTION = {"sarvam_moe": ("attention.query_key_value", "attention.dense")}


def hub_fused_attention(tensors: dict[str, torch.Tensor], qkv: str, out: str) -> dict[str, torch.Tensor]:
    """q, k and v LoRA as the one LoRA of a fused `qkv` Linear (A stacked along the rank (3r, in), B
    block-diagonal (q_out + k_out + v_out, 3r), so B A = [B_q A_q; B_k A_k; B_v A_v] at the adapter's alpha / r,
    which the runtime reads from adapter_config.json), and o_proj's under `out`. A runtime must allow rank 3r
    (vLLM: --max-lora-rank)."""
    layers: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    renamed = {}
    for key, t in tensors.items():
        m = LINEAR_KEY.fullmatch(key)
        if m and m["path"] == "self_attn" and m["proj"] in ("q_proj", "k_proj", "v_proj"):
            layers.setdefault((m["prefix"], m["layer"]), {})[f"{m['proj'][0]}{m['ab']}"] = t
        elif m and m["path"] == "self_attn" and m["proj"] == "o_proj":
            renamed[f"{m['prefix']}.layers.{m['layer']}.{out}.lora_{m['ab']}.weight"] = t
        else:
            renamed[key] = t
    for (prefix, layer), f in layers.items():
        if missing := [p for p in "qkv" if f"{p}A" not in f]:
            raise ExportError(
                f"layer {layer}: no LoRA on {', '.join(p + '_proj' for p in missing)}; this family's "
                f"checkpoints hold q, k and v as one {qkv}, whose LoRA needs all three trained"
            )
        base = f"{prefix}.layers.{layer}.{qkv}"
        renamed[f"{base}.lora_A.weight"] = torch.cat([f["qA"], f["kA"], f["vA"]])
        renamed[f"{base}.lora_B.weight"] = torch.block_diag(f["qB"], f["kB"], f["vB"])
    return renamed


def hub_linear_key(key: str, names: FamilyNames) -> str:
    """A non-expert LoRA key under the hub checkpoint's module names: transformers v5 calls Mixtral's MoE block
    `mlp` where the checkpoints (and vLLM) say `block_sparse_moe`, so its router `mlp.gate` is renamed back."""
    block = names.experts.rsplit(".", 1)[0]
    m = LINEAR_KEY.fullmatch(key)
    if m is None or block == "mlp" or not (m["path"] == "mlp" or m["path"].startswith("mlp.")):
        return key
    path = block + m["path"].removeprefix("mlp")
    return f"{m['prefix']}.layers.{m['layer']}.{path}.{m['proj']}.lora_{m['ab']}.weight"


def write_per_expert(
    adapter_dir: str | Path,
    out_dir: str | Path,
    *,
    rename: tuple[str, str] | None = None,
    transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> Path:
    """The per-expert PEFT adapter of `adapter_dir` in `out_dir` (atomically); `rename`: (old, new) module path
    fragment of the runtime's own names; `transform`: what the runtime does to the tensors as it loads them
    done to the LoRA too (vLLM's Llama-4 reorders q's and k's rows)."""
    tensors, config, model_type, names = read_run_adapter(adapter_dir)
    if model_type in PER_EXPERT_UNREAD:
        raise ExportError(f"{model_type}: {PER_EXPERT_UNREAD[model_type]}")
    converted = per_expert_tensors(tensors, int(config["r"]), names, HUB_MODULE_NAMES.get(model_type))
    if model_type in HUB_FUSED_ATTENTION:
        converted = hub_fused_attention(converted, *HUB_FUSED_ATTENTION[model_type])
    if rename:
        converted = {k.replace(*rename): v for k, v in converted.items()}
    if transform:
        converted = transform(converted)
    linears = sorted({m["proj"] for k in converted if (m := LINEAR_KEY.fullmatch(k))})
    new_config = {**config, "target_modules": linears, "target_parameters": None}
    with atomic_dir(out_dir) as tmp:
        save_safetensors(converted, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(new_config, indent=2, sort_keys=True))
    return Path(out_dir)
