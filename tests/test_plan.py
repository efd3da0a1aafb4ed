"""`plan` counts from config.json alone exactly the bytes a loaded model holds; it runs on the shipped configs."""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moe_qlora.adapters import attach_adapters
from moe_qlora.cli import app
from moe_qlora.config import validate_config
from moe_qlora.loading import LoadOptions, load_model, parameter_bytes_by_kind
from moe_qlora.plan import plan_run
from moe_qlora.tiny import build_byte_tokenizer, save_tiny_model, tiny_config

ROOT = Path(__file__).resolve().parent.parent


def run_config(path, **model):
    return validate_config({
        "model": {"name_or_path": str(path), **model},
        "lora": {"rank": 4, "router": True},
        "data": {"train_files": ["unused.jsonl"], "max_seq_len": 32},
    })  # fmt: skip


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v2", "gpt_oss"])
@pytest.mark.parametrize("double_quant", [False, True])
def test_plan_equals_the_bytes_of_the_loaded_model(tmp_path, family, double_quant):
    tok = build_byte_tokenizer()
    path = save_tiny_model(tmp_path / family, tiny_config(family, len(tok)), tokenizer=tok)
    cfg = run_config(path, expert_double_quant=double_quant, linear_double_quant=double_quant)
    opts = LoadOptions(str(path), expert_double_quant=double_quant, linear_double_quant=double_quant)
    model = attach_adapters(load_model(opts), cfg.lora, seed=0)
    measured = parameter_bytes_by_kind(model)
    planned = plan_run(cfg, name_or_path=str(path), device="cpu").bytes
    assert {k: planned[k] for k in measured} == measured
    assert planned["optimizer"] == 2 * planned["lora"] and planned["activations_estimate"] > 0  # fp32 AdamW


@pytest.mark.parametrize(
    "name,params_b",
    [("mixtral-8x7b", 46.70), ("qwen3-30b-a3b", 30.53), ("deepseek-v2-lite", 15.71)],  # published sizes
)
def test_plan_on_shipped_configs_from_the_cli(name, params_b):
    result = CliRunner().invoke(app, ["plan", "--model", str(ROOT / "configs/models" / name), "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert round(plan["params"] / 1e9, 2) == params_b
    b = plan["bytes"]
    # The experts are most of the weights (DeepSeek-V2-Lite: 78%, its vocabulary is large); NF4 with double
    # quantization (the default) stores them in 0.5 + 1/64 + 4/(64*256) = 0.516 bytes per weight.
    assert b["experts_nf4"] > 0.7 * (b["experts_nf4"] + b["linear_4bit"] + b["other"])
    assert 0.5 * plan["params"] < b["experts_nf4"] + b["linear_4bit"] + b["other"] < 0.75 * plan["params"]


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit"])
def test_planned_optimizer_state_equals_the_state_after_a_step(tmp_path, optimizer):
    """The optimizer row is exact: bitsandbytes' uint8 codes and per-256 scales for tensors of 4,096
    elements or more, fp32 moments below (the tiny Mixtral has both), torch's fp32 moments for adamw. Step
    counters and bitsandbytes' two shared code maps are left out of both sides."""
    from moe_qlora.optim import build_optimizer

    tok = build_byte_tokenizer()
    path = save_tiny_model(tmp_path / "mixtral", tiny_config("mixtral", len(tok)), tokenizer=tok)
    cfg = validate_config({"model": {"name_or_path": str(path)}, "lora": {"rank": 4, "target_modules": ["q_proj"]},
                           "data": {"train_files": ["unused.jsonl"]}, "train": {"optimizer": optimizer}})  # fmt: skip
    model = attach_adapters(load_model(LoadOptions(str(path))), cfg.lora, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, cfg.train)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    held = sum(v.nbytes for s in opt.state.values() for k, v in s.items()
               if torch.is_tensor(v) and k not in ("step", "qmap1", "qmap2"))  # fmt: skip
    sizes = [p.numel() for p in params]
    assert min(sizes) < 4096 <= max(sizes)
    assert plan_run(cfg, name_or_path=str(path), device="cpu").bytes["optimizer"] == held


def test_optimizer_in_backward_plans_one_layers_gradients():
    common = ["plan", "--model", str(ROOT / "configs/models/qwen3-30b-a3b"), "--json", "--set", "lora.rank=16"]
    ordinary = json.loads(CliRunner().invoke(app, common).stdout)["bytes"]
    inside = json.loads(CliRunner().invoke(app, [*common, "--set", "train.optimizer_in_backward=true"]).stdout)["bytes"]
    assert ordinary["gradients"] == ordinary["lora"]
    assert inside["gradients"] == -(-ordinary["lora"] // 48)  # 48 layers: one layer's LoRA gradients at a time


@pytest.mark.parametrize(
    "settings,expected_mib",
    [
        # Qwen3-30B-A3B gate_up: 128 experts x 1536 x 2048 bf16 = 768 MiB; 256 MiB budget -> 42 experts (252 MiB)
        ([], 128 * 1536 * 2048 * 2 * 42 // 128 / 2**20),
        (["model.dequant_buffer_mb=null"], 768.0),  # no budget: the whole largest stack
        (["model.kernels=triton"], None),  # the fused kernel decodes in registers: no buffer
        (["data.max_seq_len=512"], None),  # auto: 512 x 8 / 128 = 32 rows per expert < 64 -> triton
    ],
)
def test_grouped_mm_decode_buffer_is_planned(settings, expected_mib):
    args = [
        "plan",
        "--model",
        str(ROOT / "configs/models/qwen3-30b-a3b"),
        "--json",
        "--set",
        "data.max_seq_len=2048",
        "--set",
        "train.micro_batch_size=1",
    ]
    for s in settings:
        args += ["--set", s]
    planned = json.loads(CliRunner().invoke(app, args).stdout)["bytes"]
    assert planned.get("dequant_buffer", 0) / 2**20 == (expected_mib or 0)
