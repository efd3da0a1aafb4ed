"""lora.init_from: continue from an exported adapter; one made for another base model or layout is refused."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from moe_qlora.cli.app import app
from moe_qlora.config.sections import LoraSection
from moe_qlora.export.adapter import save_adapter
from moe_qlora.model.adapters import attach_adapters
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.peft_adapter import AdapterMismatchError, adapter_state_dict, load_adapter
from moe_qlora.model.tiny import build_byte_tokenizer, save_tiny_model, tiny_config

ROOT = Path(__file__).resolve().parents[2]
LORA = LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])


def adapted(path, lora=LORA):
    return attach_adapters(load_model(LoadOptions(str(path))), lora, seed=0)


@pytest.fixture(scope="module")
def trained_adapter(tiny_mixtral_dir, tmp_path_factory):
    model = adapted(tiny_mixtral_dir)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    out = tmp_path_factory.mktemp("adapter") / "adapter"
    return save_adapter(model, out, cfg=LORA, base_model_name_or_path=str(tiny_mixtral_dir))


def test_an_adapter_loads_back_exactly(tiny_mixtral_dir, trained_adapter):
    model = adapted(tiny_mixtral_dir)
    assert load_adapter(model, trained_adapter, LORA) == 16  # 2 layers x (experts: 4, q_proj: 2, v_proj: 2)
    saved = load_file(str(trained_adapter / "adapter_model.safetensors"))
    now = adapter_state_dict(model)
    assert now.keys() == saved.keys() and all(torch.equal(now[k], saved[k]) for k in now)


def test_an_adapter_for_another_base_model_is_refused(trained_adapter, tmp_path):
    tok = build_byte_tokenizer()
    other = save_tiny_model(tmp_path / "wider", tiny_config("mixtral", len(tok), hidden_size=128), tokenizer=tok)
    with pytest.raises(
        AdapterMismatchError, match=r"q_proj.lora_A.weight has shape \(4, 64\), this model needs \(4, 128\)"
    ):
        load_adapter(adapted(other), trained_adapter, LORA)
    qwen = save_tiny_model(tmp_path / "qwen", tiny_config("qwen3_moe", len(tok)), tokenizer=tok)
    with pytest.raises(AdapterMismatchError, match="has no base_model.model.model.layers"):
        load_adapter(adapted(qwen), trained_adapter, LORA)


def test_another_rank_or_scale_is_refused_from_the_cli(tiny_mixtral_dir, trained_adapter, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        f"model: {{name_or_path: {tiny_mixtral_dir}}}\n"
        f"lora: {{rank: 8, alpha: 8, target_modules: [q_proj, v_proj], init_from: {trained_adapter}}}\n"
        f"data: {{train_files: [{ROOT / 'data' / 'demo_sft.jsonl'}]}}\n"
        f"output: {{dir: {tmp_path / 'run'}}}\n"
    )
    result = CliRunner().invoke(app, ["train", "--config", str(cfg)])
    assert result.exit_code == 2
    assert "trained with r=4, lora_alpha=8.0; this run has lora.rank=8" in result.output


@pytest.mark.parametrize("setting", [{"use_rslora": True}, {"alpha_pattern": {"q_proj": 64}}])
def test_an_adapter_scaled_otherwise_is_refused(tiny_mixtral_dir, trained_adapter, tmp_path, setting):
    """An adapter from elsewhere with rsLoRA (alpha/sqrt(r)) or per-module alphas: loaded as alpha/r its LoRA
    would be silently mis-scaled in generate, merge and init_from."""
    import json
    import shutil

    other = shutil.copytree(trained_adapter, tmp_path / "other")
    config = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config, **setting}))
    with pytest.raises(AdapterMismatchError, match=f"sets {{'{next(iter(setting))}'"):
        load_adapter(adapted(tiny_mixtral_dir), other, LORA)
