"""`moe-qlora merge` against PEFT: the merged checkpoint, loaded by transformers alone, gives PEFT's logits on the
dequantized base with the adapter, and a dropped expert delta is caught before anything is written."""

import json

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from moe_qlora.cli.app import app
from moe_qlora.config.sections import LoraSection
from moe_qlora.export.adapter import dequantized_base_state_dict, save_adapter
from moe_qlora.inference import merge as merge_module
from moe_qlora.inference.merge import MergeError, merge_adapter
from moe_qlora.model.adapters import attach_adapters
from moe_qlora.model.checkpoint_files import checkpoint_files
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.tiny import build_byte_tokenizer, save_tiny_model, tiny_config
from moe_qlora.moe.layouts import consumer_stack_names

from helpers.published import publish_gpt_oss_mxfp4

# fp32 on both sides; PEFT and the merge both fold B A into the same dequantized weight, in a different order.
LOGIT_TOL = 1e-4
FAMILIES = {
    # per-expert checkpoint names (block_sparse_moe.experts.M.w1/w3/w2) rebuilt from the fused stacks; router LoRA
    "mixtral": LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj"], router=True),
    # experts stored transposed (E, in, out), interleaved gate/up columns, expert biases
    "gpt_oss": LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "o_proj"]),
    # shared experts as split gate / up stacks that moe-qlora fuses at load: merged back into the two
    "inkling_text": LoraSection(rank=4, alpha=8.0, target_modules=["q_proj"]),
    # gpt-oss as published, its experts kept in MXFP4 (model.expert_format auto): the merge adds each delta to the
    # published base decoded exactly, written in the merged dtype
    "gpt_oss-mxfp4": LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "o_proj"]),
}


def randomize_trainables(model, seed=0, std=0.1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * std)


@pytest.fixture(scope="module", params=list(FAMILIES))
def adapted(request, tmp_path_factory):
    """(base dir, 4-bit model with every LoRA factor random, its adapter dir, token ids)."""
    family, lora = request.param, FAMILIES[request.param]
    model_type, _, published = family.partition("-")
    tok = build_byte_tokenizer()
    root = tmp_path_factory.mktemp(f"base-{family}")
    base = save_tiny_model(root / "bf16", tiny_config(model_type, len(tok)), seed=0, tokenizer=tok)
    if published == "mxfp4":
        base, _ = publish_gpt_oss_mxfp4(base, root / "mxfp4")
    model = attach_adapters(load_model(LoadOptions(str(base))), lora, seed=0)
    assert model.expert_format == (published or "nf4")
    randomize_trainables(model)
    model.eval()
    adapter = save_adapter(
        model, tmp_path_factory.mktemp("adapter") / "adapter", cfg=lora, base_model_name_or_path=str(base)
    )
    ids = torch.randint(0, len(tok), (2, 20), generator=torch.Generator().manual_seed(1))
    return base, model, adapter, ids


@pytest.fixture(scope="module")
def merged(adapted, tmp_path_factory):
    base, _, adapter, _ = adapted
    out = tmp_path_factory.mktemp("merged") / "merged"
    # 64 KiB shards: several of them even for the tiny model, so the index and the per-shard renaming are used.
    report = merge_adapter(adapter, out, dtype="float32", max_shard_bytes=64 * 2**10)
    return out, report


def peft_reference_logits(base, model, adapter, ids):
    """The independent oracle: transformers' model on the dequantized base weights + PEFT loading the adapter."""
    ref = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    missing, unexpected = ref.load_state_dict(dequantized_base_state_dict(model), strict=False)
    buffers = {name for name, _ in ref.named_buffers()}  # as from_pretrained loaded them (DeepSeek-style biases)
    assert not unexpected and set(missing) <= buffers
    with torch.no_grad():
        base_logits = ref(input_ids=ids).logits
        peft_model = PeftModel.from_pretrained(ref, str(adapter)).eval()
        return base_logits, peft_model(input_ids=ids).logits


def merged_logits(out, ids):
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_merged_checkpoint_gives_peft_logits(adapted, merged):
    base, model, adapter, ids = adapted
    out, _ = merged
    base_logits, ref = peft_reference_logits(base, model, adapter, ids)
    got = merged_logits(out, ids)
    assert (got - ref).abs().max() <= LOGIT_TOL * max(1.0, float(ref.abs().max()))
    assert (ref - base_logits).abs().max() > 1e-2  # the adapter changes the logits: the comparison can fail


def test_merged_checkpoint_keeps_the_base_layout(adapted, merged):
    base, _, _, _ = adapted
    out, report = merged

    def keys_and_shapes(folder):
        found = {}
        for f in checkpoint_files(folder):
            with safe_open(str(f), "pt") as st:
                found.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
        return found

    expected = keys_and_shapes(base)
    for key in [k for k in expected if k.endswith("_blocks")]:  # published MXFP4: merged into gpt-oss's (E, in, out)
        experts, rows, groups, _ = expected.pop(key)
        del expected[key.removesuffix("_blocks") + "_scales"]
        expected[key.removesuffix("_blocks")] = (experts, groups * 32, rows)
    assert keys_and_shapes(out) == expected
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert report.shards > 1 and len(set(index["weight_map"].values())) == report.shards
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert len(AutoTokenizer.from_pretrained(str(out))) == len(build_byte_tokenizer())


def test_every_expert_delta_is_reported(adapted, merged):
    _, model, _, _ = adapted
    _, report = merged
    stacks = [k for k, v in report.delta_norms.items() if len(v) > 1]
    expected = [
        n for _, m in model.named_modules() if getattr(m, "moe_lora", None) is not None for n in consumer_stack_names(m)
    ]
    assert len(stacks) == len(expected) > 0
    assert all(min(report.delta_norms[k]) > 0 for k in stacks)


def drop_one_expert(monkeypatch):
    """Broken control: the down_proj delta of the last expert of the second experts module is left out."""
    real, modules = merge_module.expert_delta, []

    def dropping(module, stack, e):
        delta = real(module, stack, e)
        if stack == "down_proj" and module not in modules:
            modules.append(module)
        last = e == module.moe_lora.down_a.shape[0] - 1
        return torch.zeros_like(delta) if stack == "down_proj" and modules.index(module) == 1 and last else delta

    monkeypatch.setattr(merge_module, "expert_delta", dropping)


def test_a_dropped_expert_delta_fails_the_merge(adapted, tmp_path, monkeypatch):
    _, _, adapter, _ = adapted
    drop_one_expert(monkeypatch)
    with pytest.raises(MergeError, match=r"experts\.down_proj expert \d+: merged \|\|delta\|\| 0 but"):
        merge_adapter(adapter, tmp_path / "merged", dtype="float32")
    assert not (tmp_path / "merged").exists()  # nothing written


def test_a_dropped_expert_delta_changes_the_logits(adapted, tmp_path, monkeypatch):
    """Without the norm check, the logit oracle alone also catches the dropped delta."""
    base, model, adapter, ids = adapted
    drop_one_expert(monkeypatch)
    monkeypatch.setattr(merge_module, "verify_against_adapter", lambda *a: 0)
    merge_adapter(adapter, tmp_path / "merged", dtype="float32")
    _, ref = peft_reference_logits(base, model, adapter, ids)
    assert (merged_logits(tmp_path / "merged", ids) - ref).abs().max() > 1e-3


def test_merge_from_the_cli_in_bfloat16(tiny_mixtral_dir, tmp_path):
    from typer.testing import CliRunner

    lora = FAMILIES["mixtral"]
    model = attach_adapters(load_model(LoadOptions(str(tiny_mixtral_dir))), lora, seed=0)
    randomize_trainables(model)
    adapter = save_adapter(model, tmp_path / "adapter", cfg=lora, base_model_name_or_path=str(tiny_mixtral_dir))
    runner = CliRunner()
    result = runner.invoke(app, ["merge", str(adapter), "--out", str(tmp_path / "merged")])
    assert result.exit_code == 0, result.output
    assert "merged 12 adapted weights (32 expert deltas)" in result.output
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), "pt") as st:
        assert {st.get_slice(k).get_dtype() for k in st.keys()} == {"BF16"}
    bad = runner.invoke(app, ["merge", str(adapter), "--out", str(tmp_path / "m2"), "--dtype", "int8"])
    assert bad.exit_code == 2 and "--dtype 'int8': expected one of float32, bfloat16, float16" in bad.output
    bad = runner.invoke(app, ["merge", str(adapter), "--out", str(tmp_path / "m2"), "--max-shard-size", "lots"])
    assert bad.exit_code == 2 and "--max-shard-size 'lots'" in bad.output


def test_an_mxfp4_base_merged_without_expert_lora_keeps_its_experts(tmp_path):
    """lora.experts false on gpt-oss as published: the merged checkpoint holds the experts decoded exactly (not
    their packed bytes as floats) and gives PEFT's logits."""
    tok = build_byte_tokenizer()
    source = save_tiny_model(tmp_path / "bf16", tiny_config("gpt_oss", len(tok)), seed=0, tokenizer=tok)
    base, _ = publish_gpt_oss_mxfp4(source, tmp_path / "mxfp4")
    lora = LoraSection(rank=4, alpha=8.0, experts=False, target_modules=["q_proj", "o_proj"])
    model = attach_adapters(load_model(LoadOptions(str(base))), lora, seed=0)
    randomize_trainables(model)
    model.eval()
    adapter = save_adapter(model, tmp_path / "adapter", cfg=lora, base_model_name_or_path=str(base))
    merge_adapter(adapter, tmp_path / "merged", dtype="float32")
    ids = torch.randint(0, len(tok), (2, 20), generator=torch.Generator().manual_seed(1))
    _, ref = peft_reference_logits(base, model, adapter, ids)
    got = merged_logits(tmp_path / "merged", ids)
    assert (got - ref).abs().max() <= LOGIT_TOL * max(1.0, float(ref.abs().max()))
