"""Training on a base published in FP8 with block scales (DeepSeek-V3, Qwen3-30B-A3B-FP8): the whole model's LoRA
gradients (experts, attention, router) on a tiny checkpoint written in the hub's quantized key layout match PEFT's
on the base as transformers dequantizes that checkpoint (FineGrainedFP8Config(dequantize=True), saved in bf16 and
quantized to NF4 by moe-qlora like any bf16 checkpoint).

So the chain is checked end to end: our FP8 decode gives the NF4 base transformers' decode gives, byte for byte
(asserted on the dequantized state), and training on it is the NF4 oracle test's (helpers.oracle.REL_TOL, 4e-6 of
each gradient's largest element: fp32 reordering only). The blocks divide every projection here: transformers' CPU
path infers the block from the scale grid and misreads partial blocks, which test_published checks against the
format's definition instead. Broken control: every weight given the scales of the next row of blocks, off by more
than 1% in every family. gpt-oss's MXFP4 experts: test_mxfp4_experts.py.
"""

import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from moe_qlora.config.sections import LoraSection
from moe_qlora.export.adapter import dequantized_base_state_dict, save_adapter
from moe_qlora.model.adapters import attach_adapters
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.peft_adapter import adapter_state_dict
from moe_qlora.model.tiny import build_byte_tokenizer, save_tiny_model, tiny_config

from helpers.oracle import assert_close_scaled, next_token_gradients, randomize_lora_b
from helpers.published import publish_fp8, transformers_dequantized

FAMILIES = {  # model type: (weight_block_size dividing every projection, attention targets)
    "deepseek_v3": ((8, 16), ["q_b_proj", "o_proj"]),
    "qwen3_moe": ((16, 16), ["q_proj", "v_proj"]),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def published(request, tmp_path_factory):
    """(family, FP8 checkpoint, the same with shifted scales, transformers' dequantization saved in bf16)."""
    family = request.param
    block, _ = FAMILIES[family]
    root = tmp_path_factory.mktemp(f"fp8-{family}")
    tok = build_byte_tokenizer()
    source = save_tiny_model(root / "source", tiny_config(family, len(tok)), seed=0, tokenizer=tok)
    fp8 = publish_fp8(source, root / "fp8", block)
    shifted = publish_fp8(source, root / "shifted", block, shift=1)
    return family, fp8, shifted, transformers_dequantized(fp8, root / "dequantized")


def lora_model(folder, family):
    lora = LoraSection(rank=4, alpha=8.0, target_modules=FAMILIES[family][1], router=True)
    model = attach_adapters(load_model(LoadOptions(str(folder))), lora, seed=0)
    model.eval()  # no dropout: both sides compute the same function
    randomize_lora_b(model, seed=1)
    return model, lora


def tokens() -> torch.Tensor:
    return torch.randint(3, 263, (2, 24), generator=torch.Generator().manual_seed(0))


def peft_gradients(dequantized, model, lora, tmp_path) -> dict[str, torch.Tensor]:
    """PEFT with our adapter on transformers' dequantization, quantized to NF4 and decoded again (fp32)."""
    nf4_base = dequantized_base_state_dict(load_model(LoadOptions(str(dequantized))))
    ours = dequantized_base_state_dict(model)
    assert nf4_base.keys() == ours.keys()
    assert [k for k in ours if not torch.equal(ours[k], nf4_base[k])] == []  # the same base, byte for byte
    adapter = save_adapter(model, tmp_path / "adapter", cfg=lora, base_model_name_or_path=str(dequantized))
    base = AutoModelForCausalLM.from_pretrained(str(dequantized), dtype=torch.float32)
    missing, unexpected = base.load_state_dict(nf4_base, strict=False)
    assert not unexpected and set(missing) <= {n for n, _ in base.named_buffers()}, (missing, unexpected)
    peft_model = PeftModel.from_pretrained(base, str(adapter), is_trainable=True).eval()
    return next_token_gradients(peft_model, get_peft_model_state_dict, tokens())


def test_every_lora_gradient_matches_peft_on_transformers_dequantization(published, tmp_path):
    family, fp8, _, dequantized = published
    model, lora = lora_model(fp8, family)
    got = next_token_gradients(model, adapter_state_dict, tokens())
    expected = peft_gradients(dequantized, model, lora, tmp_path)
    assert sorted(got) == sorted(expected) and any("experts" in k for k in got)
    for key in expected:
        assert_close_scaled(key, got[key], expected[key])


def test_the_control_scales_off_by_one_block_fails(published, tmp_path):
    family, fp8, shifted, dequantized = published
    model, lora = lora_model(shifted, family)
    got = next_token_gradients(model, adapter_state_dict, tokens())
    reference, _ = lora_model(fp8, family)
    expected = next_token_gradients(reference, adapter_state_dict, tokens())
    worst = max(float((got[k] - expected[k]).abs().max() / expected[k].abs().max()) for k in expected)
    assert worst > 1e-2
