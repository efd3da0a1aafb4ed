"""Checkpoints as they are on the hub: legacy per-expert layouts and sharded safetensors with an index load
into the same NF4 experts as the fused layout, through transformers' own conversion."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.tiny import build_byte_tokenizer, save_tiny_model, tiny_config
from moe_qlora.moe.nf4 import dequantize_param


def legacy_state(fused: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """Split fused expert stacks back into the per-expert tensors of the original hub checkpoints."""
    out = {}
    for key, t in fused.items():
        if key.endswith("experts.gate_up_proj") or key.endswith("experts.down_proj"):
            prefix, name = key.rsplit(".", 1)
            if family == "mixtral":
                prefix = prefix.replace(".mlp.experts", ".block_sparse_moe.experts")
            for e in range(t.shape[0]):
                if name == "down_proj":
                    out[f"{prefix}.{e}.{'w2' if family == 'mixtral' else 'down_proj'}.weight"] = t[e].clone()
                else:
                    gate, up = t[e].chunk(2, dim=0)
                    names = ("w1", "w3") if family == "mixtral" else ("gate_proj", "up_proj")
                    out[f"{prefix}.{e}.{names[0]}.weight"] = gate.clone()
                    out[f"{prefix}.{e}.{names[1]}.weight"] = up.clone()
        elif family == "mixtral" and ".mlp.gate." in key:
            out[key.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = t
        else:
            out[key] = t
    return out


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def fused_and_legacy(request, tmp_path_factory):
    family = request.param
    tok = build_byte_tokenizer()
    fused = save_tiny_model(tmp_path_factory.mktemp(f"{family}-fused"), tiny_config(family, len(tok)), tokenizer=tok)
    legacy = tmp_path_factory.mktemp(f"{family}-legacy")
    for f in fused.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, legacy / f.name)
    state = legacy_state(load_file(str(fused / "model.safetensors")), family)
    save_file(state, str(legacy / "model.safetensors"), metadata={"format": "pt"})
    return family, fused, legacy, state


def expert_weights(model):
    return {n: dequantize_param(p) for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))}


def test_legacy_per_expert_checkpoint_loads_into_the_same_nf4_experts(fused_and_legacy):
    family, fused, legacy, state = fused_and_legacy
    per_expert = "w1" if family == "mixtral" else "experts.0.gate_proj"
    assert any(per_expert in k for k in state), "the legacy checkpoint has per-expert tensors"
    a, b = expert_weights(load_model(LoadOptions(str(fused)))), expert_weights(load_model(LoadOptions(str(legacy))))
    assert a.keys() == b.keys() and len(a) == 4  # two MoE layers (Qwen3's dense layer 0 has none) x two stacks
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_sharded_checkpoint_with_index_loads_the_same(fused_and_legacy, tmp_path):
    family, fused, _, _ = fused_and_legacy
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(str(fused), dtype=torch.float32)
    dense.save_pretrained(tmp_path, max_shard_size="100KB")
    for f in fused.iterdir():
        if f.suffix != ".safetensors" and not (tmp_path / f.name).exists():
            shutil.copy(f, tmp_path / f.name)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    a, b = expert_weights(load_model(LoadOptions(str(fused)))), expert_weights(load_model(LoadOptions(str(tmp_path))))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_truncated_or_garbage_safetensors_is_refused_by_name(fused_and_legacy, tmp_path):
    from moe_qlora.model.loading import ModelLoadError

    _, fused, _, _ = fused_and_legacy
    for f in fused.iterdir():
        shutil.copy(f, tmp_path / f.name)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors: truncated safetensors file"):
        load_model(LoadOptions(str(tmp_path)))
    weights.write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors: not a readable safetensors file"):
        load_model(LoadOptions(str(tmp_path)))
