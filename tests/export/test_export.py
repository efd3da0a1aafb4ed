"""Export parity: PEFT's own loader on the dequantized base reproduces the training-time model."""

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from moe_qlora.config.sections import LoraSection
from moe_qlora.export.adapter import dequantized_base_state_dict, save_adapter
from moe_qlora.model.adapters import attach_adapters
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.peft_adapter import expert_lora_to_peft, peft_to_expert_lora
from moe_qlora.moe.expert_lora import ExpertLoRA

LORA = LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj"])


@pytest.fixture(scope="module")
def exported(tiny_mixtral_dir, tmp_path_factory):
    """A 4-bit model with every LoRA factor random (B too), its logits, and its exported adapter."""
    model = attach_adapters(load_model(LoadOptions(str(tiny_mixtral_dir))), LORA, seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.eval()
    ids = torch.randint(0, 263, (2, 24), generator=g)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    out = save_adapter(
        model, tmp_path_factory.mktemp("export") / "adapter", cfg=LORA, base_model_name_or_path=str(tiny_mixtral_dir)
    )
    return model, ids, logits, out


def peft_logits(tiny_mixtral_dir, training_model, adapter_dir, ids):
    base = AutoModelForCausalLM.from_pretrained(str(tiny_mixtral_dir), dtype=torch.float32)
    missing, unexpected = base.load_state_dict(dequantized_base_state_dict(training_model), strict=True)
    assert not unexpected and not missing
    peft_model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        return peft_model(input_ids=ids).logits


def test_peft_reproduces_training_logits(tiny_mixtral_dir, exported):
    model, ids, logits, adapter = exported
    ref = peft_logits(tiny_mixtral_dir, model, adapter, ids)
    # fp32 on both sides; PEFT merges B A into the expert weight, we keep it apart: reordering only.
    assert (ref - logits).abs().max() <= 1e-4
    assert logits.abs().max() > 0.5  # the comparison is not between near-zero tensors
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]


def test_wrong_expert_layout_breaks_parity(tiny_mixtral_dir, exported, tmp_path):
    """Broken control: lora_B columns written expert-major instead of PEFT's rank-major must not match."""
    model, ids, logits, adapter = exported
    broken = tmp_path / "broken"
    broken.mkdir()
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    for key, t in tensors.items():
        if "experts" in key and "lora_B" in key:
            e = 8
            tensors[key] = t.view(t.shape[0], e, -1).permute(0, 2, 1).reshape(t.shape).contiguous()
    save_file(tensors, str(broken / "adapter_model.safetensors"))
    (broken / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    ref = peft_logits(tiny_mixtral_dir, model, broken, ids)
    assert (ref - logits).abs().max() > 1e-3


def test_expert_layout_round_trips():
    lora = ExpertLoRA(num_experts=3, hidden=8, intermediate=4, rank=2, alpha=4.0)
    with torch.no_grad():
        for p in lora.parameters():
            p.copy_(torch.randn(p.shape))
    copy = ExpertLoRA(num_experts=3, hidden=8, intermediate=4, rank=2, alpha=4.0)
    peft_to_expert_lora(expert_lora_to_peft(lora), copy)
    for a, b in zip(lora.parameters(), copy.parameters(), strict=True):
        assert torch.equal(a, b)
    flat = expert_lora_to_peft(lora)["base_layer.lora_B.weight"]  # (2I, r*E), column j*E + e is B_e[:, j]
    assert torch.equal(flat[:, 1 * 3 + 2], lora.gate_up_b[2, :, 1])


def test_router_lora_trains_and_exports(tiny_mixtral_dir, tmp_path):
    """lora.router: the router weight gets PEFT LoRA (gradients flow to it through the routing weights)."""
    lora = LoraSection(rank=4, alpha=8.0, target_modules=["q_proj"], router=True)
    model = attach_adapters(load_model(LoadOptions(str(tiny_mixtral_dir))), lora, seed=0)
    router_params = {n: p for n, p in model.named_parameters() if "mlp.gate" in n and "lora_" in n}
    assert len(router_params) == 4 and all(p.requires_grad for p in router_params.values())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ids = torch.randint(0, 263, (2, 12), generator=g)
    model(input_ids=ids).logits.square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in router_params.values())
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    adapter = save_adapter(model, tmp_path / "adapter", cfg=lora, base_model_name_or_path=str(tiny_mixtral_dir))
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert "mlp.gate.weight" in config["target_parameters"]
    ref = peft_logits(tiny_mixtral_dir, model, adapter, ids)
    assert (ref - logits).abs().max() <= 1e-4
