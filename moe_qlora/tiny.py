"""Tiny MoE models and a byte-level tokenizer, generated with a fixed seed and saved in HF format.

The demo and the tests load these through the same `from_pretrained` path a hub checkpoint takes;
nothing is downloaded. A generated model is cached by a hash of its recipe.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, MixtralConfig, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# The embedded default: Mixtral architecture, small enough to train for a few hundred steps on 2 CPU cores.
TINY_MIXTRAL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    # Wide enough init that a frozen random lm_head can express confident predictions (std 0.02 caps
    # logits near +-1.3 after the final RMSNorm, so the loss could not fall far below ln(vocab)).
    "initializer_range": 0.15,
}


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: one token per UTF-8 byte, plus chat special tokens. Needs no training."""
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(byte_chars)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_mixtral_config(vocab_size: int, **overrides) -> MixtralConfig:
    """The demo model's config; `overrides` change any field (tests use more experts or layers)."""
    fields = {**TINY_MIXTRAL, **overrides}
    return MixtralConfig(vocab_size=vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2, **fields)


def save_tiny_model(path: str | Path, config, *, seed: int = 0, tokenizer=None) -> Path:
    """Build a model from `config` with random weights (seeded) and save it with a tokenizer."""
    path = Path(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    (tokenizer or build_byte_tokenizer()).save_pretrained(path)
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("MOE_QLORA_CACHE", Path.home() / ".cache" / "moe-qlora"))


def ensure_tiny_mixtral(*, seed: int = 0, **overrides) -> Path:
    """Path of the generated tiny Mixtral for this recipe, building it on first use (atomically)."""
    tokenizer = build_byte_tokenizer()
    config = tiny_mixtral_config(len(tokenizer), **overrides)
    recipe = json.dumps({"config": config.to_dict(), "seed": seed, "v": 1}, sort_keys=True, default=str)
    target = cache_dir() / f"tiny-mixtral-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".building-") as tmp:
        save_tiny_model(tmp, config, seed=seed, tokenizer=tokenizer)
        try:
            os.rename(tmp, target)
        except OSError:  # another process built it first
            if not (target / "config.json").exists():
                raise
        os.makedirs(tmp, exist_ok=True)  # TemporaryDirectory cleans up the (now moved) path
    return target


BUILTIN_MODELS = {"builtin:tiny-mixtral": ensure_tiny_mixtral}


def resolve_model_path(name_or_path: str) -> str:
    """Turn `builtin:<name>` into the path of the generated model; pass anything else through."""
    if name_or_path.startswith("builtin:"):
        if name_or_path not in BUILTIN_MODELS:
            raise KeyError(f"unknown builtin model {name_or_path!r}; known: {', '.join(BUILTIN_MODELS)}")
        return str(BUILTIN_MODELS[name_or_path]())
    return name_or_path
