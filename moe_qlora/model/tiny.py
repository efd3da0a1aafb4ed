"""Tiny MoE models and a byte-level tokenizer, generated with a fixed seed and saved in HF format.

The demo and the tests load these through the same `from_pretrained` path a hub checkpoint takes;
nothing is downloaded. A generated model is cached by a hash of its recipe.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from moe_qlora.config.sections import ConfigError
from moe_qlora.model.classes import text_model_from_config

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Shared by every tiny model. The init is wide enough that a frozen random lm_head can express confident
# predictions (std 0.02 caps logits near +-1.3 after the final RMSNorm, so a loss could not fall far below
# ln(vocab)). Expert matrices (64 x 64 or 64 x 128) fill whole NF4 blocks.
TINY_COMMON = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.15,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# One entry per MoE family: its transformers config class and what makes it small but complete
# (shared experts, dense layers first, grouped routing... as the family has them).
TINY_FAMILIES = {
    "mixtral": (
        "MixtralConfig",
        {
            "num_hidden_layers": 2,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 128,
            "rope_theta": 10000.0,
        },
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_hidden_layers": 2,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 128,
            "intermediate_size": 128,
            "norm_topk_prob": False,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "num_hidden_layers": 3,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "intermediate_size": 128,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
            "head_dim": 16,
        },
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        {
            "num_hidden_layers": 3,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "intermediate_size": 128,
            "kv_lora_rank": 32,
            "q_lora_rank": None,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "n_group": 4,
            "topk_group": 2,
            "topk_method": "group_limited_greedy",
            "routed_scaling_factor": 2.0,
            "num_key_value_heads": 4,  # MLA: one latent KV per attention head
        },
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            "num_hidden_layers": 3,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "intermediate_size": 128,
            "kv_lora_rank": 32,
            "q_lora_rank": 48,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "num_key_value_heads": 4,
        },
    ),
    "olmoe": (
        "OlmoeConfig",
        {
            "num_hidden_layers": 2,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,
        },
    ),
    "gpt_oss": (
        "GptOssConfig",
        {
            "num_hidden_layers": 2,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,
            "head_dim": 16,
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"],
            "max_position_embeddings": 131072,  # YaRN's factor 32 over 4096 original positions
        },
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        {
            "num_hidden_layers": 3,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "intermediate_size": 128,
            "n_group": 2,
            "topk_group": 1,
            "head_dim": 16,
            "routed_scaling_factor": 1.5,
            "norm_topk_prob": True,
        },
    ),
    "laguna": (
        "LagunaConfig",
        {  # shared experts (PEFT renames their adapter keys on load), a dense first layer
            "num_hidden_layers": 2,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "intermediate_size": 128,
            "head_dim": 16,
        },
    ),
    # Hybrids: linear attention (gated DeltaNet, its 3D short-convolution weight) beside full attention.
    "qwen3_next": (
        "Qwen3NextConfig",
        {
            "num_hidden_layers": 4,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "intermediate_size": 128,
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            "mlp_only_layers": [0],
        },
    ),
    "qwen3_5_moe_text": (
        "Qwen3_5MoeTextConfig",
        {
            "num_hidden_layers": 2,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "layer_types": ["linear_attention", "full_attention"],
        },
    ),
    # Experts off the interface, stored (E, in, out), fed every token scaled by its sigmoid score; top-1 routing
    # and a shared expert; MoE on every layer, chunked attention and no-RoPE layers as in Llama-4.
    "llama4_text": (
        "Llama4TextConfig",
        {
            "num_hidden_layers": 2,
            "num_local_experts": 8,
            "num_experts_per_tok": 1,
            "intermediate_size": 64,
            "intermediate_size_mlp": 128,
            "head_dim": 16,
            "interleave_moe_layer_step": 1,
            "attention_chunk_size": 32,
        },
    ),
    # Shared experts as fused 3D stacks (separate gate / up / down), every token through each, weighted by
    # router gammas; hybrid sliding-window layers.
    "inkling_text": (
        "InklingTextConfig",
        {
            "num_hidden_layers": 2,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 2,
            "moe_intermediate_size": 64,
            "intermediate_size": 128,
            "head_dim": 16,
            "sliding_window_size": 32,
            "mlp_layer_types": ["sparse", "sparse"],
            "logits_mup_width_multiplier": 1.0,  # muP's 1/24 at full width leaves a tiny model's logits near 0
        },
    ),
    # Gemma-4's MoE layers (gemma-4-26B-A4B): a dense MLP and routed experts side by side in every layer, their
    # outputs summed; GELU-tanh gating, per-layer input embeddings, sliding-window and full attention layers.
    "gemma4_text": (
        "Gemma4TextConfig",
        {
            "num_hidden_layers": 2,
            "enable_moe_block": True,
            "num_experts": 8,
            "top_k_experts": 2,
            "moe_intermediate_size": 64,
            "intermediate_size": 128,
            "head_dim": 16,
            "sliding_window": 32,
            "vocab_size_per_layer_input": 260,
            "hidden_size_per_layer_input": 16,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    # dots.llm1: DeepSeek-V3-style routing (sigmoid scores with a correction bias, normalized top-k) and a
    # shared expert, a dense first layer.
    "dots1": (
        "Dots1Config",
        {
            "num_hidden_layers": 3,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "intermediate_size": 128,
            "n_group": 1,
            "topk_group": 1,
            "head_dim": 16,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
        },
    ),
    # Mamba-2 mixers, attention and non-gated experts (up -> squared ReLU -> down) with a shared expert.
    "nemotron_h": (
        "NemotronHConfig",
        {
            "layers_block_type": ["mamba", "moe", "attention", "moe"],
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "moe_shared_expert_intermediate_size": 64,
            "intermediate_size": 128,
            "head_dim": 16,
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "ssm_state_size": 16,
            "n_groups": 2,
            "chunk_size": 16,
            "use_mamba_kernels": False,
        },
    ),
}


def tiny_config(family: str, vocab_size: int, **overrides):
    """The tiny config of a family; `overrides` change any field (tests use more experts or layers)."""
    class_name, fields = TINY_FAMILIES[family]
    return getattr(transformers, class_name)(vocab_size=vocab_size, **{**TINY_COMMON, **fields, **overrides})


def tiny_mixtral_config(vocab_size: int, **overrides):
    """The demo model's config."""
    return tiny_config("mixtral", vocab_size, **overrides)


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


def cache_dir() -> Path:
    return Path(os.environ.get("MOE_QLORA_CACHE", Path.home() / ".cache" / "moe-qlora"))


def ensure_tiny(family: str = "mixtral", *, seed: int = 0, **overrides) -> Path:
    """Path of the generated tiny model of a family for this recipe, building it on first use (atomically)."""
    tokenizer = build_byte_tokenizer()
    config = tiny_config(family, len(tokenizer), **overrides)
    recipe = json.dumps({"config": config.to_dict(), "seed": seed, "v": 1}, sort_keys=True, default=str)
    target = cache_dir() / f"tiny-{family}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
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


# builtin:tiny-mixtral is the demo's model; builtin:tiny-<family> for every family in TINY_FAMILIES.
BUILTIN_MODELS = {f"builtin:tiny-{f.replace('_', '-')}": functools.partial(ensure_tiny, f) for f in TINY_FAMILIES}


def resolve_model_path(name_or_path: str) -> str:
    """Turn `builtin:<name>` into the path of the generated model; pass anything else through."""
    if name_or_path.startswith("builtin:"):
        if name_or_path not in BUILTIN_MODELS:
            near = difflib.get_close_matches(name_or_path, list(BUILTIN_MODELS), n=1)
            hint = f"did you mean {near[0]!r}?" if near else f"known: {', '.join(BUILTIN_MODELS)}"
            raise ConfigError(f"model.name_or_path: unknown builtin model {name_or_path!r}; {hint}")
        return str(BUILTIN_MODELS[name_or_path]())
    return name_or_path


# The sizes every MoE family's config is shrunk to for the family sweep (tests/model/test_family_sweep.py): set where
# the config has the field. Hybrid features stay on: layer-type lists are rebuilt for the smaller depth.
SWEEP_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_local_experts": 8,
    "n_routed_experts": 8,
    "moe_num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.15,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "qk_head_dim": 24,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "n_groups": 2,
    "chunk_size": 16,
    "use_mamba_kernels": False,
    "mamba_d_state": 16,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "sliding_window": 32,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 8,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    "top_k_experts": 2,
}
# Per-family fields the generic shrink cannot derive (layer patterns given by period, nested sub-configs).
SWEEP_EXTRA = {
    "jamba": {
        "num_hidden_layers": 4,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 0},
    "granitemoehybrid": {
        "layer_types": ["mamba", "attention"],
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_n_groups": 2,
        "mamba_chunk_size": 16,
    },
    "zaya": {"num_experts_per_tok": 1},
    # hybrids whose full-attention layer comes every 4th, and families with dense first layers
    "beam": {"num_hidden_layers": 4},
    # Qwen4-Exp's sparse-attention indexer has no default sizes (the checkpoint's config gives them)
    "qwen4_exp_text": {
        "num_hidden_layers": 4,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 16,
        "indexer_compress_ratio": 4,
    },
    "bailing_hybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "kimi_linear": {"layer_types": ["linear_attention", "full_attention"]},
    "flint": {"mlp_only_layers": [0]},
    "step3p5": {"mlp_layer_types": ["dense", "sparse"]},
    "glm4v_moe_text": {"head_dim": 128},  # its M-RoPE sections (8, 12, 12) need a rotary dimension of 64
    # GLM-5-Next: linear attention beside DSA (indexed, NoPE) attention; the indexer's top-k a multiple of its pool
    "glm5_next_text": {
        "index_kpool": 8,
        "qk_rope_head_dim": 0,
        "mlp_layer_types": ["dense", "sparse"],
        "layer_types": ["linear_attention", "indexed_attention"],
    },
    "hy_v4_vl_text": {
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "mrope_section": [2, 1, 1]}
    },  # sums to qk_rope_head_dim / 2
    # DeepSeek-OCR-2's text config leaves its dense/sparse layer list unset (None), which its decoder indexes
    "deepseek_ocr2_text": {"mlp_layer_types": ["dense", "sparse"]},
    "ernie4_5_vl_moe_text": {
        "moe_intermediate_size": [64, 64],  # text and vision experts' widths
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "mrope_section": [3, 3, 2]},
    },  # sums to head_dim / 2
    # dots3-note: a vision tower with its own experts (layer pattern given by expert count per layer) and adapters
    # whose widths must equal the tower's and the text model's hidden size
    "dots3_note_vision_encoder": {"pyramid_num_routed": [-1, 8], "adapter_in_dim": 64, "adapter_out_dim": 64},
    "dots3_note_audio_encoder": {"adapter_input_size": 64, "adapter_out_dim": 64, "downsample_hidden_size": 16},
    "nemotron_h_omni": {"vision_config": {"video_temporal_patch_size": 2}, "projector_hidden_size": 64},
    # Muse Spark: the audio tower's widths, one per stage; the vision adapter's widths on the wrapper
    "muse_spark": {
        "audio_config": {"num_hidden_layers": 4, "hidden_sizes": [16, 32, 32, 64]},
        "out_hidden_size": 64,
        "projector_hidden_size": 64,
    },
    "muse_spark_text": {"moe_hidden_size": 32},  # experts in a latent width, projected from and to hidden_size
    "dbrx": {
        "d_model": 64,
        "n_heads": 4,
        "n_layers": 2,
        "max_seq_len": 512,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0},
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 8, "moe_top_k": 2},
    },
}
LAYER_LISTS = ("layer_types", "mlp_layer_types")
SWEEP_VISION = {
    "depth": 2,
    "num_heads": 4,
    "out_hidden_size": 64,
    "num_hidden_layers": 2,
    "vision_output_dim": 64,
    "projector_input_dim": 64,
    "projector_output_dim": 64,
    "text_hidden_size": 64,
}


def _has_field(config, name: str) -> bool:
    """hasattr that also counts a field a heterogeneous (per-layer) config refuses to read globally: transformers
    raises AmbiguousGlobalPerLayerAttributeError for it (Gemma-4, dots3), but the constructor takes it."""
    try:
        return hasattr(config, name)
    except Exception as exc:
        if type(exc).__name__ == "AmbiguousGlobalPerLayerAttributeError":
            return True
        raise


def _shrunk_sub_configs(cls, defaults, vocab_size: int) -> dict:
    """The sub-configs of a multimodal wrapper, shrunk: the text config as a whole tiny config of its type, the
    others (vision, audio, and their own parts, such as DeepSeek-OCR-2's SAM encoder) to the sweep's sizes."""
    from transformers import CONFIG_MAPPING

    fields = {}
    for key, sub in (getattr(cls, "sub_configs", None) or {}).items():
        if not getattr(sub, "model_type", None):  # declared as AutoConfig: the class its default holds
            sub = type(getattr(defaults, key, None))
        sub_type = getattr(sub, "model_type", None)
        if key == "text_config" and sub_type in CONFIG_MAPPING:
            fields[key] = tiny_config_any(sub_type, vocab_size).to_dict()
        elif sub_type:
            sub_defaults = sub()
            sizes = {k: v for k, v in {**SWEEP_SIZES, **SWEEP_VISION}.items() if _has_field(sub_defaults, k)}
            nested = _shrunk_sub_configs(sub, sub_defaults, vocab_size)
            fields[key] = {"model_type": sub_type, **sizes, **nested, **SWEEP_EXTRA.get(sub_type, {})}
    return fields


def tiny_config_any(model_type: str, vocab_size: int):
    """A tiny config of any model type: the hand-made one of TINY_FAMILIES, else the defaults shrunk to
    SWEEP_SIZES (plus SWEEP_EXTRA). Raises what the config class raises when it cannot be shrunk."""
    if model_type in TINY_FAMILIES:
        return tiny_config(model_type, vocab_size)
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    defaults = cls()
    fields = {k: v for k, v in SWEEP_SIZES.items() if _has_field(defaults, k)}
    fields.update(_shrunk_sub_configs(cls, defaults, vocab_size))
    settable = [k for k in LAYER_LISTS if not isinstance(getattr(cls, k, None), property)]
    fields.update({k: None for k in settable if isinstance(getattr(defaults, k, None), list)})
    specials = {k: TINY_COMMON[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
    # other vocabulary sizes (Inkling-2's unpadded_vocab_size) must not exceed the tiny one
    other_vocabularies = [
        k
        for k, v in vars(defaults).items()
        if k.endswith("vocab_size") and k != "vocab_size" and isinstance(v, int) and v > vocab_size
    ]
    fields.update(dict.fromkeys(other_vocabularies, vocab_size))
    if "kv_lora_rank" in fields:  # multi-head latent attention: one latent KV per head
        fields["num_key_value_heads"] = fields["num_attention_heads"]
        if "head_dim" in fields:  # MLA configs use head_dim for the rotary part
            fields["head_dim"] = fields["qk_rope_head_dim"]
    extra = {
        k: {**fields[k], **v} if isinstance(v, dict) and isinstance(fields.get(k), dict) else v
        for k, v in SWEEP_EXTRA.get(model_type, {}).items()
    }  # a shrunk sub-config keeps its sizes
    return cls(vocab_size=vocab_size, **{**fields, **specials, **extra})
