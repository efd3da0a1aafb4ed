"""Per llama.cpp architecture (FamilyNames.gguf_arch), read from llama.cpp 0c1e57098's converters and graphs: the
blk.N.<kind> tensor a non-expert module's LoRA lands on (gguf's TensorNameMap, or GGUF_HAND_NAMES), whether the
graph applies a LoRA to that tensor (build_lora_mm) or multiplies it without one, and which tensors the
converter can fuse. A LoRA llama.cpp would ignore is refused by name rather than written to be ignored.
"""

from __future__ import annotations

from moe_qlora.export.family_tables import DSV4_MODULES, PEFT_KEEPS, ExportError

# llama.cpp tensors (blk.N.<kind>) whose product goes through build_lora_mm, so that a LoRA on them is applied:
# attention, the router, dense MLPs (build_ffn), shared experts and Qwen2-MoE's shared-expert gate.
GGUF_LORA_KINDS = {
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate_inp",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "ffn_gate_shexp",
    "ffn_up_shexp",
    "ffn_down_shexp",
    "ffn_gate_inp_shexp",
}
_GATED_DELTANET_KINDS = {"attn_qkv", "attn_gate", "ssm_out"}  # linear attention, through build_lora_mm
GGUF_EXTRA_LORA_KINDS = {
    "laguna": {"attn_gate"},  # its g_proj through build_lora_mm (src/models/laguna.cpp)
    # src/models/qwen3next.cpp, qwen35moe.cpp, qwen4exp.cpp (and the indexer's q and k), minimax-m3.cpp
    "qwen3next": _GATED_DELTANET_KINDS | {"ssm_ba"},
    "qwen35moe": _GATED_DELTANET_KINDS | {"ssm_alpha", "ssm_beta"},
    "qwen4exp": _GATED_DELTANET_KINDS | {"ssm_alpha", "ssm_beta", "indexer.q_proj", "indexer.k_proj"},
    "minimax-m3": {"indexer.q_proj", "indexer.k_proj"},
    # src/models/deepseek4.cpp: every projection but the grouped attn_output_a (a plain ggml_mul_mat)
    "deepseek4": {
        "attn_q_a",
        "attn_q_b",
        "attn_kv",
        "attn_output_b",
        "attn_compressor_kv",
        "attn_compressor_gate",
        "indexer_compressor_kv",
        "indexer_compressor_gate",
        "indexer.attn_q_b",
        "indexer.proj",
    },
}
# Architectures whose converter names tensors no TensorNameMap knows (DeepSeek-V4's, from the original
# checkpoint's keys), or modules their donor map lacks: {transformers' module path under layers.N: blk.N.<kind>}.
GGUF_HAND_NAMES = {
    # (the indexer's q and k: gguf_pieces splits Qwen4-Exp's index_qk_proj into these, as its converter does)
    "qwen4exp": {"self_attn.indexer.q_proj": "indexer.q_proj", "self_attn.indexer.k_proj": "indexer.k_proj"},
    # MiniMax-M3's shared experts and dense MLPs, which MiniMax-M2 (whose names it takes) does not have
    # (gguf-py/gguf/tensor_mapping.py at 0c1e57098; gguf_pieces splits their fused gate_up)
    "minimax-m3": {
        "self_attn.indexer.q_proj": "indexer.q_proj",
        "self_attn.indexer.k_proj": "indexer.k_proj",
        "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
        "mlp.shared_experts.up_proj": "ffn_up_shexp",
        "mlp.shared_experts.down_proj": "ffn_down_shexp",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    },
    # Granite's shared MLP: input_linear's gate and up halves (gguf_pieces) as GraniteMoeModel's converter splits
    # them, fused as they are by Granite-MoE-SWA's (conversion/granite.py)
    **dict.fromkeys(
        ("granitemoe", "granitehybrid"),
        {"shared_mlp.gate_proj": "ffn_gate_shexp", "shared_mlp.up_proj": "ffn_up_shexp"},
    ),
    "granite_swa": {"shared_mlp.input_linear": "ffn_up_shexp"},
    "deepseek4": {module: kind for module, (_, kind) in DSV4_MODULES.items()},
}
# Architectures newer than the gguf package's (0.19.0 on PyPI lacks them): the one whose TensorNameMap gives
# the same blk.N names for the family's modules as llama.cpp's own gguf-py at 0c1e57098 (checked name by name,
# and against the converter's output by tests/export/test_llamacpp.py); general.architecture is still the real one,
# which libllama requires of an adapter.
GGUF_NAMES_FROM = {
    "cohere2moe": "glm4moe",
    "deepseek32": "glm-dsa",
    "dots3note": "glm-dsa",
    "glm5-next": "kimi-linear",
    "granite_swa": "granitemoe",
    "hy_v3": "glm4moe",
    "hy_v4": "glm-dsa",
    "laguna": "afmoe",
    "mellum": "qwen3moe",
    "qwen4exp": "qwen35moe",
    "minimax-m3": "minimax-m2",
    # gguf's bailingmoe2 names Ling's checkpoint keys (attention.query_key_value); Sarvam, the one
    # family exported as it, has GLM-4-MoE's module names in transformers
    "bailingmoe2": "glm4moe",
}
# ...except where an architecture's graph multiplies them with a plain ggml_mul_mat: DeepSeek-V2/V3's query
# (wq, and wq_a / wq_b, like the rest of MLA but the output projection).
GGUF_NO_LORA = {
    # (the MLA families of DeepSeek-V2's graph alike: a query without a low-rank projection is wq, unhooked)
    **dict.fromkeys(("deepseek2", "mistral4", "deepseek32", "dots3note", "hy_v4"), {"attn_q"}),
    "deepseek4": {"attn_output_a"},  # grouped, multiplied with ggml_mul_mat
    "glm5-next": {"attn_q", "attn_k", "attn_v", "attn_output"},
    # Kimi-Linear: its delta-attention layers' q/k/v/o and the MLA query (the MLA output is hooked, but shares
    # attn_output with the delta-attention layers, so both are refused)
    "kimi-linear": {"attn_q", "attn_k", "attn_v", "attn_output"},
}
# The architectures whose graphs were read whole (llama.cpp's MLA projections have no LoRA hook): there, a kind
# outside GGUF_LORA_KINDS is known to be multiplied without one.
LEGACY_LORA_ARCHS = {"deepseek2", "glm-dsa", "mistral4", "deepseek32", "dots3note", "hy_v4", "glm5-next", "deepseek4"}
# (Tensors whose rows llama.cpp's converter regroups or splits: gguf_pieces lays their LoRA out the same way.)
# Architectures whose ffn_gate_up_exps llama.cpp's --fuse-gate-up-exps writes (MODEL_TENSORS lists it; for
# every other one its converter raises): gguf-py/gguf/constants.py at 0c1e57098. Gemma-4's is always fused.
GGUF_FUSABLE_GATE_UP = {"qwen3next", "qwen35moe", "qwen4exp", "mistral4", "cohere2moe", "granite_swa"}
# Architectures whose converter always writes one attn_qkv (the export then fuses the q, k and v LoRA itself)
GGUF_ALWAYS_FUSED_QKV = {"bailingmoe2"}
# ...and whose attn_qkv --fuse-qkv writes (the converter fuses the layers where q, k and v all exist; Jamba's and
# Granite-Hybrid's list attn_qkv too, but their converters write q, k and v apart even so:
# tests/export/test_llamacpp.py)
GGUF_FUSABLE_QKV = {
    "afmoe",
    "dots1",
    "ernie4_5-moe",
    "exaone-moe",
    "gemma4",
    "glm4moe",
    "gpt-oss",
    "granitemoe",
    "hunyuan-moe",
    "kimi-linear",
    "lfm2moe",
    "llama",
    "llama4",
    "mimo2",
    "minimax-m2",
    "nemotron_h_moe",
    "olmoe",
    "phimoe",
    "qwen2moe",
    "qwen35moe",
    "qwen3moe",
    "qwen3next",
    "qwen3vlmoe",
    "qwen4exp",
}


def gguf_name_map(arch: str, layers: int):
    """gguf's TensorNameMap of llama.cpp architecture `arch`: transformers module names -> blk.N.<kind>
    (None where only GGUF_HAND_NAMES names the architecture's tensors: DeepSeek-V4)."""
    import gguf

    if not has_name_map(arch):
        return None
    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    return gguf.get_tensor_name_map(by_name[GGUF_NAMES_FROM.get(arch, arch)], layers)


def has_name_map(arch: str) -> bool:
    """Whether the gguf package has a TensorNameMap for `arch` (or the architecture it takes names from)."""
    import gguf

    return GGUF_NAMES_FROM.get(arch, arch) in gguf.MODEL_ARCH_NAMES.values()


def gguf_lora_kinds(arch: str) -> set[str]:
    """The blk.N.<kind>s whose LoRA llama.cpp's `arch` graph applies (the experts aside)."""
    kinds = (GGUF_LORA_KINDS | GGUF_EXTRA_LORA_KINDS.get(arch, set())) - GGUF_NO_LORA.get(arch, set())
    if not has_name_map(arch):  # only the hand-named tensors exist
        kinds &= set(GGUF_HAND_NAMES[arch].values())
    return kinds


def gguf_linear_name(tensor_names, arch: str, layer: int, path: str, proj: str) -> str:
    """blk.N.<kind> of the non-expert module layers.N.path.proj; an ExportError for a module llama.cpp has no
    tensor for, or one it multiplies without its LoRA (which would then be silently dropped)."""
    module = f"layers.{layer}.{path}.{proj}"
    hand = GGUF_HAND_NAMES.get(arch, {})
    if f"{path}.{proj}" in hand:
        return check_lora_applied(arch, module, f"blk.{layer}.{hand[f'{path}.{proj}']}")
    if tensor_names is None:
        raise ExportError(
            f"{module}: llama.cpp has no tensor for this LoRA target in {arch} (it has one for "
            f"{', '.join(sorted(hand))})"
        )
    # the hub checkpoint's root (gguf maps those names): model, or backbone (Nemotron-H, which transformers v5
    # loads as model)
    # (Granite's router, a module of its own in transformers v5, is router.layer in its checkpoints)
    candidates = [f"{root}.{m}" for root in ("model", "backbone") for m in (module, f"{module}.layer")]
    name = next((n for c in candidates if (n := tensor_names.get_name(c))), None)
    if name is None:
        if arch in GGUF_NAMES_FROM:
            raise ExportError(
                f"{module}: no llama.cpp name known for this LoRA target in {arch} (named as gguf's "
                f"{GGUF_NAMES_FROM[arch]}): not written by this export yet ({PEFT_KEEPS})"
            )
        raise ExportError(f"{module}: llama.cpp has no tensor for this LoRA target in this architecture")
    return check_lora_applied(arch, module, name)


def check_lora_applied(arch: str, module: str, name: str) -> str:
    """`name` (blk.N.<kind>), or an ExportError where llama.cpp would ignore or misplace a LoRA on it."""
    kind, kinds = name.split(".", 2)[2], gguf_lora_kinds(arch)
    if kind in GGUF_NO_LORA.get(arch, ()) or (kind not in kinds and arch in LEGACY_LORA_ARCHS):
        raise ExportError(
            f"{module}: llama.cpp's {arch} graph multiplies {name} without applying LoRA to it, so "
            f"its LoRA would be ignored (it applies LoRA to the experts and "
            f"{', '.join(sorted(kinds))})"
        )
    if kind not in kinds:
        raise ExportError(
            f"{module}: a LoRA on llama.cpp's {name} ({arch}) is not written by this export yet: only "
            f"{', '.join(sorted(kinds))} and the experts are ({PEFT_KEEPS})"
        )
    return name
