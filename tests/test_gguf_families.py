"""GGUF export for every family it writes (export.formats.FAMILIES), against PEFT.

Per family: a tiny model from its transformers config, LoRA on the experts, the router and the linears llama.cpp
applies a LoRA to, every factor random (non-zero). The oracle is PEFT's own merge of the adapter into the fp32
base (merged - base, per parameter). The GGUF is read back with gguf.GGUFReader; every expert's dense delta
scale * B_e A_e is recomputed from the file and compared with PEFT's, and every other tensor's under the name
gguf's TensorNameMap (llama.cpp's own mapping) gives the base module. Tolerance 1e-5: fp32 products of
O(0.1) factors, summed over rank 4, against PEFT's fp32 merge.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_formats import field_value, merged_minus_base, read_gguf, reference_permute

from moe_qlora.config.sections import LoraSection
from moe_qlora.export import formats
from moe_qlora.export.adapter import save_adapter
from moe_qlora.model.adapters import attach_adapters
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.tiny import build_byte_tokenizer, save_tiny_model, tiny_config_any

TOL = 1e-5
# Targets per family: the attention projections llama.cpp applies a LoRA to (DeepSeek's MLA query and latent
# projections it multiplies without one, and the export refuses them: test_formats).
TARGETS = {"deepseek_v2": ["o_proj"], "deepseek_v3": ["o_proj"]}
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def family_adapter(workdir: Path, model_type: str) -> Path:
    tok = build_byte_tokenizer()
    path = save_tiny_model(workdir / model_type, tiny_config_any(model_type, len(tok)), tokenizer=tok)
    lora = LoraSection(rank=4, alpha=8.0, target_modules=TARGETS.get(model_type, DEFAULT_TARGETS), router=True)
    model = attach_adapters(load_model(LoadOptions(str(path))), lora, seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (p for p in model.parameters() if p.requires_grad):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return save_adapter(model, workdir / f"{model_type}-adapter", cfg=lora, base_model_name_or_path=str(path))


@pytest.fixture(scope="module", params=sorted(formats.FAMILIES))
def exported(request, tmp_path_factory):
    """(model_type, PEFT's deltas, the base config, the GGUF's tensors, its fields)."""
    workdir = tmp_path_factory.mktemp(request.param)
    adapter = family_adapter(workdir, request.param)
    deltas, config = merged_minus_base(adapter)
    _, fields, tensors = read_gguf(formats.write_gguf(adapter, workdir / "adapter.gguf"))
    return request.param, deltas, config.get_text_config(), tensors, fields


def gguf_delta(tensors: dict, name: str, scale: float) -> np.ndarray:
    return scale * (tensors[f"{name}.lora_b"] @ tensors[f"{name}.lora_a"])


def expert_deltas(tensors: dict, layer: int, scale: float) -> dict[str, np.ndarray]:
    return {kind: gguf_delta(tensors, f"blk.{layer}.ffn_{kind}_exps.weight", scale) for kind in ("gate", "up", "down")}


def check_experts(deltas: dict, tensors: dict, config, scale: float) -> list[str]:
    """Layers whose GGUF expert deltas differ from PEFT's (every expert at once); [] when all match."""
    wrong, checked = [], 0
    for key, gate_up in deltas.items():
        if not key.endswith("experts.gate_up_proj"):
            continue
        layer = int(key.split(".layers.")[1].split(".")[0])
        down = deltas[key.replace("gate_up_proj", "down_proj")].numpy()
        inter = gate_up.shape[1] // 2
        got = expert_deltas(tensors, layer, scale)
        want = {"gate": gate_up[:, :inter].numpy(), "up": gate_up[:, inter:].numpy(), "down": down}
        checked += 1
        wrong += [f"{key} {kind}" for kind in want if np.abs(got[kind] - want[kind]).max() > TOL]
    assert checked, "no expert LoRA in PEFT's merge: the oracle saw nothing to compare"
    return wrong


def test_every_experts_delta_matches_peft(exported):
    model_type, deltas, config, tensors, fields = exported
    assert field_value(fields["general.architecture"]) == formats.FAMILIES[model_type].gguf_arch
    assert field_value(fields["general.type"]) == "adapter"
    assert check_experts(deltas, tensors, config, scale=8.0 / 4) == []


def test_rolled_experts_are_caught(exported):
    """Broken control: expert e's factors under expert e + 1 (np.roll over the expert axis)."""
    _, deltas, config, tensors, _ = exported
    rolled = {k: np.roll(v, 1, axis=0) if "_exps." in k else v for k, v in tensors.items()}
    assert check_experts(deltas, rolled, config, scale=8.0 / 4) != []


def test_every_other_tensor_lands_under_llama_cpp_name_with_peft_delta(exported):
    model_type, deltas, config, tensors, _ = exported
    names = formats.FAMILIES[model_type]
    tensor_names = formats.gguf_name_map(names.gguf_arch, config.num_hidden_layers)
    heads = {"attn_q": config.num_attention_heads,
             "attn_k": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}  # fmt: skip
    compared = 0
    for key, delta in deltas.items():
        if ".experts." in key:
            continue
        name = tensor_names.get_name(key.removesuffix(".weight"))
        assert name is not None, f"{key}: gguf has no tensor name for it"
        want = delta.numpy()
        kind = name.split(".")[2]
        if names.permute_qk and kind in heads:  # llama.cpp's converter permutes the base's q/k rows
            want = reference_permute(want, heads[kind])
        assert np.abs(gguf_delta(tensors, f"{name}.weight", 8.0 / 4) - want).max() <= TOL, key
        compared += 1
    assert compared >= config.num_hidden_layers  # the router at least, in every layer
