"""The tiny models the package generates (`builtin:tiny-<family>`, see model_path.py): one small but complete
config per MoE family, a byte-level tokenizer, and random weights from a fixed seed, saved in HF format.

The demo and the tests load these through the same `from_pretrained` path a hub checkpoint takes; nothing is
downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from moe_qlora.model.classes import text_model_from_config
from moe_qlora.model.tiny_families import TINY_COMMON, TINY_FAMILIES

__all__ = ["TINY_COMMON", "TINY_FAMILIES", "build_byte_tokenizer", "save_tiny_model", "tiny_config"]

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_config(family: str, vocab_size: int, **overrides):
    """The tiny config of a family; `overrides` change any field (tests use more experts or layers)."""
    class_name, fields = TINY_FAMILIES[family]
    return getattr(transformers, class_name)(vocab_size=vocab_size, **{**TINY_COMMON, **fields, **overrides})


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


def save_tiny_model(path: str | Path, config, *, seed: int = 0, tokenizer=None) -> Path:
    """Build a model from `config` with random weights (seeded) and save it with a tokenizer."""
    path = Path(path)
    with torch.random.fork_rng():  # the caller's RNG (a training run's dropout) must not depend on the cache
        torch.manual_seed(seed)
        model = text_model_from_config(config, dtype=torch.float32)
        with torch.no_grad():  # a trained model's routing bias is not zero: make it matter in the tests too
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.copy_(torch.randn(buf.shape) * 0.5)
    model.save_pretrained(path)
    (tokenizer or build_byte_tokenizer()).save_pretrained(path)
    return path
