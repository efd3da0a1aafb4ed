"""gpt-oss and DeepSeek-V4-Flash trained on their own MXFP4 experts (model.expert_format): a tiny checkpoint
written in the hub's quantized layout (gpt-oss: `*_blocks`, `*_scales`, quantization_config mxfp4; V4-Flash:
per-expert int8 FP4 weights with e8m0 `.scale` bytes in an FP8 release, expert_dtype fp4) loads with its expert
bytes kept as stored, and the whole model's LoRA gradients (experts, attention, router) match PEFT's on the base as
transformers dequantizes that checkpoint (Mxfp4Config / FineGrainedFP8Config(dequantize=True)), its 4-bit linears
replaced by ours decoded.

Tolerance: helpers.oracle.REL_TOL (4e-6) of each gradient's largest element, fp32 reordering only: the MXFP4
experts are decoded exactly on both sides (tested bit for bit here too), so nothing else differs. Broken control:
the nibbles of every byte of our stacks swapped, which moves every expert gradient by more than 1%.
"""

import json

import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

from moe_qlora.config.sections import LoraSection
from moe_qlora.export.adapter import dequantized_base_state_dict, save_adapter
from moe_qlora.model.adapters import attach_adapters
from moe_qlora.model.loaded_model import parameter_bytes_by_kind
from moe_qlora.model.loading import LoadOptions, ModelLoadError, load_model
from moe_qlora.model.peft_adapter import adapter_state_dict
from moe_qlora.model.peft_roundtrip import PEFT_PREFIX
from moe_qlora.model.tiny import build_byte_tokenizer, save_tiny_model, tiny_config
from moe_qlora.moe.expert_stacks import experts_modules
from moe_qlora.moe.experts import kernel_self_check, set_moe_kernels

from helpers.oracle import assert_close_scaled, next_token_gradients, randomize_lora_b
from helpers.published import publish_gpt_oss_mxfp4, publish_v4_flash
from helpers.tiny_configs import tiny_config_any

LORA = LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"], router=True)
FAMILIES = {  # model type: (publisher, transformers' dequantizing config, LoRA)
    "gpt_oss": (publish_gpt_oss_mxfp4, Mxfp4Config, LORA),
    "deepseek_v4": (
        publish_v4_flash,
        FineGrainedFP8Config,
        LoraSection(rank=4, alpha=8.0, target_modules=["q_a_proj", "o_b_proj"], router=True),
    ),
}


def published(root, family: str):
    """(the checkpoint as published, the bf16 one it was made from, {stack key: (blocks, scales)})."""
    tok = build_byte_tokenizer()
    config = tiny_config(family, len(tok)) if family == "gpt_oss" else tiny_config_any(family, len(tok))
    source = save_tiny_model(root / "source", config, seed=0, tokenizer=tok)
    folder, stacks = FAMILIES[family][0](source, root / "mxfp4")
    return folder, source, stacks


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    return published(tmp_path_factory.mktemp("gpt-oss-mxfp4"), "gpt_oss")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_mxfp4(request, tmp_path_factory):
    """(family, the checkpoint as published, {stack key: (blocks, scales)})."""
    folder, _, stacks = published(tmp_path_factory.mktemp(f"{request.param}-mxfp4"), request.param)
    return request.param, folder, stacks


def test_the_experts_keep_the_published_bytes(family_mxfp4):
    """auto keeps MXFP4 as MXFP4: each stack's blocks and scales are the file's bytes, 4.25 bits a weight."""
    _, folder, stacks = family_mxfp4
    model = load_model(LoadOptions(str(folder)))
    assert model.expert_format == "mxfp4"
    params = dict(model.named_parameters())
    for key, (blocks, scales) in stacks.items():
        assert torch.equal(params[key + "_blocks"], blocks) and torch.equal(params[key + "_scales"], scales)
    weights = sum(blocks.numel() * 2 for blocks, _ in stacks.values())
    assert parameter_bytes_by_kind(model)["experts_mxfp4"] * 8 == weights * 4.25


def test_nf4_is_still_there_when_asked_and_mxfp4_is_refused_for_a_checkpoint_not_published_so(gpt_oss_mxfp4):
    folder, source, _ = gpt_oss_mxfp4
    nf4 = load_model(LoadOptions(str(folder), expert_format="nf4"))
    assert nf4.expert_format == "nf4" and "experts_mxfp4" not in parameter_bytes_by_kind(nf4)
    with pytest.raises(ModelLoadError, match=r"expert_format mxfp4 .* this checkpoint is not quantized"):
        load_model(LoadOptions(str(source), expert_format="mxfp4"))


def tokens() -> torch.Tensor:
    return torch.randint(3, 263, (2, 24), generator=torch.Generator().manual_seed(0))


def our_gradients(model) -> dict[str, torch.Tensor]:
    """Every LoRA gradient of one next-token loss, under its adapter-file key."""
    return next_token_gradients(model, adapter_state_dict, tokens())


@pytest.fixture(scope="module")
def peft_oracle(family_mxfp4, tmp_path_factory):
    """(our model with random LoRA, PEFT's gradients of the same loss on transformers' dequantized checkpoint)."""
    family, folder, _ = family_mxfp4
    _, dequantizing, lora = FAMILIES[family]
    model = attach_adapters(load_model(LoadOptions(str(folder))), lora, seed=0)
    assert model.expert_format == "mxfp4"
    model.eval()  # no dropout: both sides compute the same function
    randomize_lora_b(model, seed=1)
    adapter = save_adapter(model, tmp_path_factory.mktemp("adapter"), cfg=lora, base_model_name_or_path=str(folder))
    base = AutoModelForCausalLM.from_pretrained(
        str(folder), quantization_config=dequantizing(dequantize=True), dtype=torch.float32
    )
    ours = dequantized_base_state_dict(model)
    theirs = base.state_dict()
    for name, _ in experts_modules(model):  # the experts as transformers decodes them, bit for bit ours
        for stack in ("gate_up_proj", "down_proj"):
            key = f"{name.removeprefix(PEFT_PREFIX)}.{stack}"
            assert torch.equal(theirs[key], ours.pop(key)), key
    missing, unexpected = base.load_state_dict(ours, strict=False)  # our 4-bit linears, decoded
    buffers = {n for n, _ in base.named_buffers()}  # DeepSeek-V4's hash routing table
    stacks_or_buffers = all(("experts." in k and k.endswith("_proj")) or k in buffers for k in missing)
    assert not unexpected and stacks_or_buffers, (missing, unexpected)
    peft_model = PeftModel.from_pretrained(base, str(adapter), is_trainable=True).eval()
    return model, next_token_gradients(peft_model, get_peft_model_state_dict, tokens())


@pytest.mark.parametrize("kernels", ["torch", "grouped_mm", "triton"])
def test_every_lora_gradient_matches_peft_on_transformers_dequantization(peft_oracle, kernels):
    model, expected = peft_oracle
    set_moe_kernels(model, kernels)
    got = our_gradients(model)
    assert sorted(got) == sorted(expected) and any("experts" in k for k in got)
    for key in expected:
        assert_close_scaled(key, got[key], expected[key])


def test_the_control_nibbles_swapped_fails(peft_oracle):
    model, expected = peft_oracle
    set_moe_kernels(model, "torch")
    blocks = [p for n, p in model.named_parameters() if n.endswith("_blocks")]
    saved = [b.data.clone() for b in blocks]
    try:
        for b in blocks:
            b.data = ((b.data >> 4) | (b.data << 4)).to(torch.uint8)
        got = our_gradients(model)
    finally:
        for b, data in zip(blocks, saved, strict=True):
            b.data = data
    experts = [k for k in expected if "experts" in k]
    worst = max(float((got[k] - expected[k]).abs().max() / expected[k].abs().max()) for k in experts)
    assert worst > 1e-2


def test_the_gguf_adapter_is_the_one_nf4_experts_give(gpt_oss_mxfp4, tmp_path):
    """Exporting reads the LoRA factors, never the base: the llama.cpp adapter of a run on the MXFP4 experts (which
    llama.cpp's converter keeps as MXFP4 in gpt-oss's GGUF) is byte for byte the one of the same factors on NF4
    experts, every expert's gate, up and down LoRA in it."""
    import gguf

    from moe_qlora.export.gguf_lora import write_gguf

    folder, _, _ = gpt_oss_mxfp4
    files = {}
    for expert_format in ("mxfp4", "nf4"):
        model = attach_adapters(load_model(LoadOptions(str(folder), expert_format=expert_format)), LORA, seed=0)
        randomize_lora_b(model, seed=1)
        adapter = save_adapter(model, tmp_path / expert_format, cfg=LORA, base_model_name_or_path=str(folder))
        files[expert_format] = write_gguf(adapter, tmp_path / f"{expert_format}.gguf").read_bytes()
    assert files["mxfp4"] == files["nf4"]
    names = {t.name for t in gguf.GGUFReader(str(tmp_path / "mxfp4.gguf")).tensors}
    for proj in ("gate", "up", "down"):
        assert {f"blk.{i}.ffn_{proj}_exps.weight.lora_{ab}" for i in (0, 1) for ab in "ab"} <= names, sorted(names)


def test_the_self_check_keeps_the_mxfp4_kernel_and_drops_a_wrong_one(peft_oracle, inject_faults):
    """model.kernel_self_check on MXFP4 experts: the Triton path passes its check against the torch reference on
    every layer; the same path made wrong (its output x 1.5) fails it and falls back, checked in turn."""
    model, expected = peft_oracle
    set_moe_kernels(model, "triton", self_check=True)
    got = our_gradients(model)
    checker = kernel_self_check(model)
    assert checker.verdicts and not checker.failed
    for key in expected:
        assert_close_scaled(key, got[key], expected[key])
    inject_faults(kernel_fault="triton:wrong")
    set_moe_kernels(model, "triton", self_check=True)
    got = our_gradients(model)
    failed = kernel_self_check(model).failed
    assert failed and all(key[0] == "triton" for key in failed), failed
    for key in expected:  # the fallback's numbers: the run goes on right
        assert_close_scaled(key, got[key], expected[key])


def test_an_adapter_records_the_expert_format_it_was_trained_on(gpt_oss_mxfp4, tmp_path):
    """moe_qlora.json says which experts the adapter learned against, so generate and merge rebuild that base: an
    MXFP4 run's record says mxfp4, an NF4 run's nf4, and a record written before the setting existed (its experts
    were NF4 then) reads as nf4, not as auto (which now keeps this checkpoint in MXFP4)."""
    from moe_qlora.inference.generate import trained_quantization
    from moe_qlora.model.peft_roundtrip import TRAINED_ON

    folder, _, _ = gpt_oss_mxfp4
    for expert_format in ("mxfp4", "nf4"):
        model = attach_adapters(load_model(LoadOptions(str(folder), expert_format=expert_format)), LORA, seed=0)
        adapter = save_adapter(model, tmp_path / expert_format, cfg=LORA, base_model_name_or_path=str(folder))
        assert trained_quantization(adapter)["expert_format"] == expert_format
    record = json.loads((adapter / TRAINED_ON).read_text())
    del record["base_quantization"]["expert_format"]
    (adapter / TRAINED_ON).write_text(json.dumps(record))
    assert trained_quantization(adapter)["expert_format"] == "nf4"
