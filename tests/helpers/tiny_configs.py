"""Tiny configs of any model type the installed transformers knows, for the tests: the hand-made one of a
family in moe_qlora.model.tiny, else the type's defaults shrunk to a few layers of width 64 (the family sweep).
"""

from __future__ import annotations

from moe_qlora.model.tiny import TINY_COMMON, TINY_FAMILIES, tiny_config


def tiny_mixtral_config(vocab_size: int, **overrides):
    """The demo model's config."""
    return tiny_config("mixtral", vocab_size, **overrides)


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
