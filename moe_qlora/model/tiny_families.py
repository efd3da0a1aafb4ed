"""The tiny models' configs, one per MoE family (`builtin:tiny-<family>`), as plain data: the CLI checks a builtin
name against them before importing torch; tiny.py builds and saves the models.
"""

from __future__ import annotations

import difflib

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


BUILTIN_FAMILIES = {f"builtin:tiny-{family.replace('_', '-')}": family for family in TINY_FAMILIES}


def unknown_builtin_model(name_or_path: str) -> str | None:
    """What is wrong with a `builtin:` name that names no tiny model (the nearest known one, or all of them);
    None for a known one or a name that is not builtin."""
    if not name_or_path.startswith("builtin:") or name_or_path in BUILTIN_FAMILIES:
        return None
    near = difflib.get_close_matches(name_or_path, list(BUILTIN_FAMILIES), n=1)
    hint = f"did you mean {near[0]!r}?" if near else f"known: {', '.join(BUILTIN_FAMILIES)}"
    return f"model.name_or_path: unknown builtin model {name_or_path!r}; {hint}"
