"""`moe-qlora generate`: the 4-bit model with a run's adapter, as trained (NF4 experts, expert LoRA, the same
MoE kernels), streaming tokens to the terminal. `--no-adapter` gives the base model to compare.

The LoRA layout comes from the adapter's adapter_config.json (rank, alpha, linear targets, expert and router
targets), so the adapter loads into exactly the modules it was trained in (export.load_adapter refuses
anything else by name).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from transformers import GenerationConfig, TextStreamer

from moe_qlora.config.load import validate_config
from moe_qlora.config.sections import RunConfig
from moe_qlora.export.norms import AdapterReadError
from moe_qlora.model.adapters import adapters_disabled


@dataclass
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


def run_config_for(adapter_dir: Path, *, device: str, kernels: str) -> RunConfig:
    """The RunConfig that rebuilds the adapter's model (base from adapter_config.json, its LoRA layout) and
    loads the adapter into it (lora.init_from)."""
    config_path = adapter_dir / "adapter_config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterReadError(f"{config_path}: not a readable adapter config ({exc})") from None
    parameters = config.get("target_parameters") or []
    targets = config.get("target_modules") or []
    return validate_config({
        "model": {"name_or_path": config["base_model_name_or_path"], "device": device, "kernels": kernels,
                  **trained_quantization(adapter_dir)},
        "lora": {"rank": config["r"], "alpha": config["lora_alpha"], "dropout": 0.0,
                 "experts": any(not p.endswith("weight") for p in parameters),
                 "router": any(p.endswith("weight") for p in parameters),
                 "target_modules": sorted(targets) if isinstance(targets, list) else [targets],
                 "init_from": str(adapter_dir)},
        "data": {"train_files": ["(not read by generate)"]},
        "train": {"gradient_checkpointing": False},
    }, source=str(config_path))  # fmt: skip


def trained_quantization(adapter_dir: Path) -> dict[str, bool]:
    """model.*_double_quant as the adapter was trained (moe_qlora.json); {} (the defaults) for adapters from
    elsewhere, which do not say."""
    from moe_qlora.export.adapter import TRAINED_ON

    path = adapter_dir / TRAINED_ON
    if not path.exists():
        return {}
    try:
        return dict(json.loads(path.read_text())["base_quantization"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AdapterReadError(f"{path}: not readable ({exc})") from None


def load_for_generation(adapter_dir: str | Path, console: Console, *, device: str = "auto", kernels: str = "auto"):
    """(model with the adapter loaded, tokenizer)."""
    from moe_qlora.train.session import load_policy, load_tokenizer

    adapter_dir = Path(adapter_dir)
    cfg = run_config_for(adapter_dir, device=device, kernels=kernels)
    model_path, tokenizer = load_tokenizer(cfg)
    model, _, _ = load_policy(cfg, model_path, console)
    model.eval()
    return model, tokenizer


def prompt_ids(tokenizer, prompt: str, *, chat: bool) -> torch.Tensor:
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)  # fmt: skip
        ids = ids["input_ids"] if isinstance(ids, dict) else ids
        return torch.tensor([ids])
    return tokenizer(prompt, return_tensors="pt").input_ids


@torch.inference_mode()
def generate(model, tokenizer, prompt: str, sampling: Sampling, *, chat: bool = False, adapter: bool = True,
             stream: bool = True) -> str:  # fmt: skip
    """The completion of `prompt` (printed as it comes when `stream`)."""
    torch.manual_seed(sampling.seed)
    ids = prompt_ids(tokenizer, prompt, chat=chat).to(next(model.parameters()).device)
    greedy = sampling.temperature == 0
    gen = GenerationConfig(
        do_sample=not greedy, temperature=None if greedy else sampling.temperature,
        top_p=None if greedy else sampling.top_p, top_k=None if greedy else sampling.top_k,
        max_new_tokens=sampling.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, use_cache=True,
    )  # fmt: skip
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    off = adapters_disabled(model) if not adapter else contextlib.nullcontext()
    with off:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen,
                             streamer=streamer)  # fmt: skip
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
