"""Per family (transformers' model_type), what the export formats know of it: the hub checkpoints' expert module
names and llama.cpp's architecture (FAMILIES), the families no format writes or the per-expert layout does not
(NOT_EXPORTED, PER_EXPERT_UNREAD), the layout vLLM reads (vllm_layout), and the base's model_type, read from its
config.json (no model is loaded). One set of tables, apart from the writers, so that every format and the docs'
tables (tests/export/test_export_families.py renders docs/export.md's) follow the same decisions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moe_qlora.config.sections import ConfigError


@dataclass(frozen=True)
class FamilyNames:
    gguf_arch: str  # llama.cpp's general.architecture for the base
    experts: str  # the per-expert module list under a decoder layer, in the hub checkpoints
    gate: str
    up: str
    down: str
    permute_qk: bool = False  # llama.cpp permutes q/k rows of this architecture
    # experts stored (E, in, out) and adopted by moe-qlora (Llama-4): PEFT, which does not know, reads them
    # (E, out, in), so the PEFT file holds each expert's factors with their roles swapped (export/adapter.py)
    peft_swapped: bool = False
    interleaved_gate_up: bool = False  # gate and up alternate along the fused projection's outputs (GPT-OSS)
    gated: bool = True  # False: the experts have up and down projections only (Nemotron-H, relu^2)
    fused_gate_up: bool = False  # llama.cpp's tensor is one ffn_gate_up_exps, gate's rows first (Gemma-4)


_QWEN_STYLE = {"experts": "mlp.experts", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
FAMILIES = {
    "mixtral": FamilyNames("llama", "block_sparse_moe.experts", "w1", "w3", "w2", permute_qk=True),
    "qwen2_moe": FamilyNames("qwen2moe", **_QWEN_STYLE),
    "qwen3_moe": FamilyNames("qwen3moe", **_QWEN_STYLE),
    "olmoe": FamilyNames("olmoe", **_QWEN_STYLE),
    "deepseek_v2": FamilyNames("deepseek2", **_QWEN_STYLE),
    "deepseek_v3": FamilyNames("deepseek2", **_QWEN_STYLE),
    "glm4_moe": FamilyNames("glm4moe", **_QWEN_STYLE),
    # read from llama.cpp 0c1e57098 (conversion/*.py, src/models/*.cpp): each arch's graph runs its experts
    # through build_moe_ffn (LoRA applied) from gate/up halves of the fused stack, with no q/k permutation
    "qwen3_next": FamilyNames("qwen3next", **_QWEN_STYLE),
    "qwen3_5_moe": FamilyNames("qwen35moe", **_QWEN_STYLE),
    "qwen3_5_moe_text": FamilyNames("qwen35moe", **_QWEN_STYLE),
    "ernie4_5_moe": FamilyNames("ernie4_5-moe", **_QWEN_STYLE),
    "hunyuan_v1_moe": FamilyNames("hunyuan-moe", **_QWEN_STYLE),
    "minimax_m2": FamilyNames("minimax-m2", "block_sparse_moe.experts", "w1", "w3", "w2"),
    "dots1": FamilyNames("dots1", **_QWEN_STYLE),
    "afmoe": FamilyNames("afmoe", **_QWEN_STYLE),
    "lfm2_moe": FamilyNames("lfm2moe", "feed_forward.experts", "w1", "w3", "w2"),
    "glm_moe_dsa": FamilyNames("glm-dsa", **_QWEN_STYLE),
    "kimi_linear": FamilyNames("kimi-linear", "block_sparse_moe.experts", "w1", "w3", "w2"),
    "mimo_v2_flash": FamilyNames("mimo2", **_QWEN_STYLE),
    "exaone_moe": FamilyNames("exaone-moe", **_QWEN_STYLE),
    "phimoe": FamilyNames("phimoe", "block_sparse_moe.experts", "w1", "w3", "w2"),
    "jamba": FamilyNames("jamba", "feed_forward.experts", "gate_proj", "up_proj", "down_proj"),
    # stored (E, in, out): llama.cpp's converter transposes them back; Llama-4's gate and up are halves, GPT-OSS's
    # alternate (and it has expert biases, which a LoRA leaves alone)
    "llama4": FamilyNames("llama4", "feed_forward.experts", "gate_proj", "up_proj", "down_proj", peft_swapped=True),
    "llama4_text": FamilyNames(
        "llama4", "feed_forward.experts", "gate_proj", "up_proj", "down_proj", peft_swapped=True
    ),
    "gpt_oss": FamilyNames("gpt-oss", "mlp.experts", "gate_proj", "up_proj", "down_proj", interleaved_gate_up=True),
    "qwen3_vl_moe": FamilyNames("qwen3vlmoe", **_QWEN_STYLE),
    # Granite: llama.cpp's converter splits input_linear into gate and up halves and permutes q/k (LlamaModel)
    **dict.fromkeys(
        ("granitemoe", "granitemoeshared"),
        FamilyNames("granitemoe", "block_sparse_moe.experts", "gate_proj", "up_proj", "down_proj", permute_qk=True),
    ),
    "granitemoehybrid": FamilyNames(
        "granitehybrid", "block_sparse_moe.experts", "gate_proj", "up_proj", "down_proj", permute_qk=True
    ),
    # Gemma-4: experts beside the dense MLP in the decoder layer; llama.cpp keeps gate_up fused
    **dict.fromkeys(
        ("gemma4", "gemma4_text"),
        FamilyNames("gemma4", "experts", "gate_proj", "up_proj", "down_proj", fused_gate_up=True),
    ),
    # no gate; llama.cpp's converter permutes its q/k rows like Llama's (it inherits the Granite converter)
    "nemotron_h": FamilyNames(
        "nemotron_h_moe", "mixer.experts", "", "up_proj", "down_proj", permute_qk=True, gated=False
    ),
    # MLA (DeepSeek-V2's graph and its LoRA hooks): GLM-4.7-Flash, Mistral-Small-4 (whose checkpoints hold the
    # experts fused, which its converter keeps), DeepSeek-V3.2, dots3-note, Hunyuan-V4
    "glm4_moe_lite": FamilyNames("deepseek2", **_QWEN_STYLE),
    "mistral4": FamilyNames("mistral4", **_QWEN_STYLE, fused_gate_up=True),
    "deepseek_v32": FamilyNames("deepseek32", **_QWEN_STYLE),
    **dict.fromkeys(("dots3_note", "dots3_note_text"), FamilyNames("dots3note", **_QWEN_STYLE)),
    "hy_v4": FamilyNames("hy_v4", **_QWEN_STYLE),
    # GLM-4-MoE's converter and graph: Solar-Open, GLM-4.5V's text model
    **dict.fromkeys(("solar_open", "glm4v_moe"), FamilyNames("glm4moe", **_QWEN_STYLE)),
    "cohere2_moe": FamilyNames("cohere2moe", **_QWEN_STYLE),
    "hy_v3": FamilyNames("hy_v3", **_QWEN_STYLE),
    "laguna": FamilyNames("laguna", **_QWEN_STYLE),
    "mellum": FamilyNames("mellum", **_QWEN_STYLE),
    **dict.fromkeys(("qwen4_exp", "qwen4_exp_text"), FamilyNames("qwen4exp", **_QWEN_STYLE)),
    # every attention projection of its graph (delta attention and MLA) is multiplied without a LoRA hook
    "glm5_next": FamilyNames("glm5-next", **_QWEN_STYLE),
    # Granite-MoE-SWA: its converter keeps input_linear fused (gate's rows first) and permutes q/k (LlamaModel)
    "granitemoe_swa": FamilyNames(
        "granite_swa",
        "block_sparse_moe.experts",
        "gate_proj",
        "up_proj",
        "down_proj",
        permute_qk=True,
        fused_gate_up=True,
    ),
    # DeepSeek-V4: compressed and sparse attention; tensor names from gguf_archs.GGUF_HAND_NAMES
    "deepseek_v4": FamilyNames(
        "deepseek4", "ffn.experts", "w1", "w3", "w2"
    ),  # (hub names: per_expert_lora.HUB_MODULE_NAMES)
    # Sarvam-MoE: GLM-4-MoE's modules in transformers, converted by llama.cpp as Ling's bailingmoe2 with q, k and v
    # always one attn_qkv (conversion/bailingmoe.py); no q/k permutation
    "sarvam_moe": FamilyNames("bailingmoe2", **_QWEN_STYLE),
    # MiniMax-M3: q, k, v apart, experts split; the fused gate_up Linears of its dense and shared MLPs are
    # llama.cpp's ffn_gate and ffn_up (gguf_pieces)
    "minimax_m3_vl": FamilyNames("minimax-m3", "block_sparse_moe.experts", "w1", "w3", "w2"),
}
# No per-expert export for these: vLLM reads GPT-OSS's expert LoRA only in PEFT's fused layout (VLLM_FUSED_3D);
# the others' hub checkpoints name their modules otherwise than transformers, and this layout does not rename them
PER_EXPERT_UNREAD = {
    "gpt_oss": "vLLM reads GPT-OSS's expert LoRA in PEFT's fused layout only (use --format vllm)",
    "minimax_m3_vl": "its hub checkpoints hold the dense and shared MLPs' gate and up apart, which this layout "
    "does not write",
}
# DeepSeek-V4's modules: {transformers' module path: (the hub checkpoint's name, llama.cpp's blk.N.<kind>)}.
# transformers renames the checkpoints' keys on load (conversion_mapping.py: attn -> self_attn, ffn -> mlp,
# wq_a -> q_a_proj, wkv -> kv_proj, wgate -> gate_proj, wo_a/wo_b -> o_a_proj/o_b_proj, indexer.compressor ->
# compressor.indexer, w1/w2/w3 -> gate/down/up_proj); llama.cpp's converter names its tensors from those keys
# (conversion/deepseek.py, _map_dsv4_tensor_name), and vLLM 0.33.0 reads them (per_expert_lora.HUB_MODULE_NAMES).
DSV4_MODULES = {
    "self_attn.q_a_proj": ("attn.wq_a", "attn_q_a"),
    "self_attn.q_b_proj": ("attn.wq_b", "attn_q_b"),
    "self_attn.kv_proj": ("attn.wkv", "attn_kv"),
    "self_attn.o_a_proj": ("attn.wo_a", "attn_output_a"),
    "self_attn.o_b_proj": ("attn.wo_b", "attn_output_b"),
    "self_attn.compressor.kv_proj": ("attn.compressor.wkv", "attn_compressor_kv"),
    "self_attn.compressor.gate_proj": ("attn.compressor.wgate", "attn_compressor_gate"),
    "self_attn.compressor.indexer.kv_proj": ("attn.indexer.compressor.wkv", "indexer_compressor_kv"),
    "self_attn.compressor.indexer.gate_proj": ("attn.indexer.compressor.wgate", "indexer_compressor_gate"),
    "self_attn.compressor.indexer.q_b_proj": ("attn.indexer.wq_b", "indexer.attn_q_b"),
    "self_attn.compressor.indexer.scorer.weights_proj": ("attn.indexer.weights_proj", "indexer.proj"),
    "mlp.gate": ("ffn.gate", "ffn_gate_inp"),
    "mlp.shared_experts.gate_proj": ("ffn.shared_experts.w1", "ffn_gate_shexp"),
    "mlp.shared_experts.up_proj": ("ffn.shared_experts.w3", "ffn_up_shexp"),
    "mlp.shared_experts.down_proj": ("ffn.shared_experts.w2", "ffn_down_shexp"),
}
# Families moe-qlora trains that these formats do not write, with the reason (read from llama.cpp 0c1e57098's
# converters and graphs); the run's own adapter folder (PEFT's format) serves them all
_NO_CONVERTER = "llama.cpp 0c1e57098 has no converter for its checkpoints, so no base GGUF exists to apply a LoRA to"
NOT_EXPORTED = {
    **dict.fromkeys(
        (
            "aria",
            "aria_text",
            "axk1",
            "axk2",
            "bailing_hybrid",
            "beam",
            "ernie4_5_vl_moe",
            "flex_olmo",
            "flint",
            "inkling2",
            "inkling2_loop",
            "inkling2_loop_text",
            "inkling2_text",
            "inkling_mm_model",
            "inkling_text",
            "kolibri1",
            "lara_mini",
            "minimax",
            "zaya",
            "sarvam_mla",
            "hy_v4_vl",
            "qwen3_omni_moe_thinker",
            "minimax_m3_vl_text",
        ),
        _NO_CONVERTER,
    ),
}

# vLLM 0.33.0 (vllm/lora/model_manager.py, vllm/model_executor/models): the model classes that set
# is_3d_moe_weight read PEFT's fused 3D expert LoRA (experts.base_layer = gate_up, experts = down) as written;
# every other class with MoE LoRA reads per-expert 2D keys under its checkpoint names (write_per_expert).
# Qwen3.5-MoE: the multimodal class (qwen3_5_moe) reads 3D, the text-only one (qwen3_5_moe_text) 2D.
VLLM_VERSION = "0.33.0"
VLLM_FUSED_3D = {"gpt_oss", "qwen3_5_moe", "qwen3_vl_moe", "qwen3_omni_moe"}
_TRANSFORMERS_BACKEND = (
    "served by vLLM's Transformers backend, whose expert mapping lists both the gate_proj "
    "and the w1 names, so a per-expert adapter fails its packing assertion (lora_weights.py)"
)
VLLM_NO_MOE_LORA = {
    "kimi_linear": "KimiLinearForCausalLM implements no LoRA",
    "mimo_v2_flash": "MiMoV2FlashForCausalLM implements no LoRA",
    "dots1": "Dots1ForCausalLM was removed in vLLM 0.23.0",
    "cohere2_moe": "Cohere2MoeForCausalLM implements no LoRA",
    **dict.fromkeys(("dots3_note", "dots3_note_text"), "Dots3NoteForCausalLM implements no LoRA"),
    **dict.fromkeys(("hunyuan_v1_moe", "solar_open", "mellum"), _TRANSFORMERS_BACKEND),
    "mistral4": "no vLLM class of its own: its HF checkpoints fall back to the Transformers backend",
    "minimax_m3_vl": "MiniMaxM3SparseForConditionalGeneration implements no LoRA (models/minimax_m3)",
    # its model-level expert mapping prefixes the per-expert names with block_sparse_moe., so that vLLM's adapter
    # check (lora/lora_model.py), which keeps a key's part from `.experts` on, rejects every one
    "granitemoehybrid": "GraniteMoeHybridForCausalLM's expert mapping (granitemoehybrid.py, get_expert_mapping) "
    "names no per-expert key its LoRA check accepts",
}

PEFT_AS_IS = "the run's adapter folder is in PEFT's format, which loads as it is"
PEFT_KEEPS = "the run's PEFT adapter keeps it"


class ExportError(ConfigError):
    """An adapter this format cannot express (a family or a module it does not know), said by name."""


class UnexportableModules(ExportError):
    """LoRA on modules a format cannot carry: {module path in its layer ('self_attn.kv_b_proj'): why}, the first
    reason said in full and every module named, so that one retraining fixes them all."""

    def __init__(self, modules: dict[str, str], advice: str = ""):
        self.modules = modules = dict(sorted(modules.items()))  # the same sentence whatever order they came in
        first = next(iter(modules.values()))
        others = sorted(set(modules) - {next(iter(modules))})
        more = f"; the same for {', '.join(others)}" if others else ""
        super().__init__(first + more + (f"; {advice}" if advice else ""))

    def with_advice(self, advice: str) -> UnexportableModules:
        return UnexportableModules(self.modules, advice)


def targets_without(targets: list[str], modules: set[str]) -> list[str]:
    """lora.target_modules with every name that reaches one of `modules` (module paths inside a layer) left out."""
    return [t for t in targets if not any(m == t or m.endswith(f".{t}") for m in modules)]


def retrain_advice(config: dict, modules: set[str], fmt: str) -> str:
    """The --set that trains what `fmt` carries: the adapter's targets without those reaching `modules`."""
    kept = targets_without(sorted(config.get("target_modules") or []), modules)
    return f"to export --format {fmt}, train with --set lora.target_modules=[{','.join(kept)}]"


def base_model_type(config: dict, where: Path) -> str:
    """model_type of the adapter's base, from its config.json (a local folder, builtin:, or the hub cache)."""
    from transformers import AutoConfig

    from moe_qlora.model.model_path import resolve_model_path

    base = config.get("base_model_name_or_path")
    if not base:
        raise ExportError(f"{where}/adapter_config.json: no base_model_name_or_path")
    try:
        base_config = AutoConfig.from_pretrained(resolve_model_path(base))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{where}: cannot read the base model's config.json ({base}): {exc}") from None
    return tables_model_type(base_config)


def tables_model_type(config, also: tuple[str, ...] = ()) -> str:
    """model_type as these tables (and `also`) name the family: a multimodal model's text model where they do
    not name the model itself."""
    if config.model_type in (*FAMILIES, *NOT_EXPORTED, *VLLM_FUSED_3D, *VLLM_NO_MOE_LORA, *also):
        return config.model_type
    return config.get_text_config().model_type


def vllm_layout(model_type: str) -> str:
    """What --format vllm writes for a family: "refused", "fused-3d" (PEFT's layout as written) or "per-expert".
    The one decision write_vllm and the docs' tables follow (router LoRA aside: vllm_lora.VLLM_IGNORED_ROUTER)."""
    if model_type in VLLM_NO_MOE_LORA:
        return "refused"
    if model_type in VLLM_FUSED_3D:
        return "fused-3d"
    return "per-expert" if model_type in FAMILIES and model_type not in PER_EXPERT_UNREAD else "refused"
