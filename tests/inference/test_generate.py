"""`moe-qlora generate`: the 4-bit model with the run's adapter generates what PEFT generates on the
dequantized base with the same adapter (greedy, so the same argmax at every step; the two differ only by
fp32 summation order, far below any logit gap of a trained model), and `--no-adapter` what the base does."""

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from rich.console import Console
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from moe_qlora.cli.app import app
from moe_qlora.config.load import validate_config
from moe_qlora.export.adapter import dequantized_base_state_dict
from moe_qlora.inference.generate import Sampling, generate, load_for_generation
from moe_qlora.train import sft as trainer

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Add: 3+5\n"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = validate_config(
        {
            "model": {"name_or_path": "builtin:tiny-mixtral"},
            "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
            "data": {"train_files": [str(ROOT / "data" / "demo_sft.jsonl")], "max_seq_len": 48},
            "train": {"max_steps": 20, "lr": 1e-2, "warmup_steps": 0},
            "output": {"dir": str(out)},
        }
    )
    trainer.train(cfg, Console(quiet=True))
    return out / "adapter"


def peft_greedy(model, adapter: Path, tokenizer, *, with_adapter: bool) -> str:
    """Greedy text from transformers' own model on our dequantized base, with PEFT loading the adapter."""
    base = AutoModelForCausalLM.from_pretrained(
        model.peft_config["default"].base_model_name_or_path, dtype=torch.float32
    )
    base.load_state_dict(dequantized_base_state_dict(model), strict=True)
    reference = PeftModel.from_pretrained(base, str(adapter)) if with_adapter else base
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    out = reference.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=12,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_generate_matches_peft_on_the_dequantized_base_with_and_without_the_adapter(adapter):
    model, tokenizer = load_for_generation(adapter, Console(quiet=True), device="cpu")
    greedy = Sampling(max_new_tokens=12)
    ours = generate(model, tokenizer, PROMPT, greedy, stream=False)
    ours_base = generate(model, tokenizer, PROMPT, greedy, adapter=False, stream=False)
    assert ours == peft_greedy(model, adapter, tokenizer, with_adapter=True)
    assert ours_base == peft_greedy(model, adapter, tokenizer, with_adapter=False)
    assert ours != ours_base  # the adapter changes what is generated (else the first check proves little)


def test_generate_from_the_cli_streams_the_completion(adapter):
    result = CliRunner().invoke(app, ["generate", "--adapter", str(adapter), "--max-new-tokens", "6", PROMPT])
    assert result.exit_code == 0, result.output
    model, tokenizer = load_for_generation(adapter, Console(quiet=True), device="cpu")
    assert generate(model, tokenizer, PROMPT, Sampling(max_new_tokens=6), stream=False) in result.output
    result = CliRunner().invoke(app, ["generate", "--adapter", str(adapter.parent / "nope"), "x"])
    assert result.exit_code == 2 and "adapter_config.json" in result.output
