"""The adapter in the layouts other runtimes read, converted from the PEFT adapter a run writes (no model is
loaded; the base's config.json names the family).

- `per-expert`: PEFT keys under the family's hub checkpoint names, one LoRA per expert and projection
  (Mixtral `block_sparse_moe.experts.M.w1/w3/w2`; Qwen-MoE, OLMoE, DeepSeek, GLM-4-MoE
  `mlp.experts.M.gate_proj/up_proj/down_proj`), as vLLM and SGLang read for those families. The fused
  gate_up LoRA becomes gate and up LoRAs sharing A: rows [:I] of B are gate's, rows [I:] up's.
- `gguf`: a llama.cpp LoRA adapter: `blk.N.ffn_{gate,up,down}_exps.weight.lora_{a,b}` as 3D tensors (E, r, in)
  and (E, out, r) (ggml reverses the order), `adapter.lora.alpha`, and the other LoRA (attention, router,
  shared experts and their gate, dense MLPs) under the names gguf's own TensorNameMap gives the base's
  tensors, where llama.cpp applies a LoRA to them (build_lora_mm); DeepSeek's MLA projections are multiplied
  without it, so their LoRA is refused rather than written to be ignored. llama.cpp permutes the q/k rows of
  llama-architecture models (Mixtral) for its RoPE; the q/k lora_B rows are permuted the same way, as its own
  converter does.

Expert factors in our PEFT file (export/adapter.py): lora_A (r*E, in) rows expert-major (row e*r + j is A_e[j]);
lora_B (out, r*E) columns rank-major (column j*E + e is B_e[:, j]); expert e's delta is scale * B_e A_e.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from moe_qlora.common.fileio import atomic_dir, disk_full_named, unwritable_named
from moe_qlora.config.sections import ConfigError
from moe_qlora.export.norms import read_adapter


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
    # DeepSeek-V4: compressed and sparse attention; tensor names from GGUF_HAND_NAMES
    "deepseek_v4": FamilyNames("deepseek4", "ffn.experts", "w1", "w3", "w2"),  # (hub names: HUB_MODULE_NAMES)
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
# DeepSeek-V4's modules: {transformers' module path: (the hub checkpoint's name, llama.cpp's blk.N.<kind>)}.
# transformers renames the checkpoints' keys on load (conversion_mapping.py: attn -> self_attn, ffn -> mlp,
# wq_a -> q_a_proj, wkv -> kv_proj, wgate -> gate_proj, wo_a/wo_b -> o_a_proj/o_b_proj, indexer.compressor ->
# compressor.indexer, w1/w2/w3 -> gate/down/up_proj); llama.cpp's converter names its tensors from those keys
# (conversion/deepseek.py, _map_dsv4_tensor_name), and vLLM 0.33.0 reads them (HUB_MODULE_NAMES).
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
# and against the converter's output by tests/test_llamacpp.py); general.architecture is still the real one,
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
# Granite-Hybrid's list attn_qkv too, but their converters write q, k and v apart even so: tests/test_llamacpp.py)
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
WHY_NOT: dict[str, str] = {}  # families refused by every layout, with the reason a user needs
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

EXPERT_KEY = re.compile(
    r"(?P<prefix>.*?)\.layers\.(?P<layer>\d+)\.(?:(?P<path>.+)\.)?experts\.(?P<inner>base_layer\.)?"
    r"lora_(?P<ab>[AB])\.weight"
)  # path: none for Gemma-4 (layers.N.experts)
LINEAR_KEY = re.compile(
    r"(?P<prefix>.*?)\.layers\.(?P<layer>\d+)\.(?P<path>.+)\.(?P<proj>[a-z_0-9]+)\.lora_"
    r"(?P<ab>[AB])\.weight"
)


PEFT_AS_IS = "the run's adapter folder is in PEFT's format, which loads as it is"
PEFT_KEEPS = "the run's PEFT adapter keeps it"


class ExportError(ConfigError):
    """An adapter this format cannot express (a family or a module it does not know), said by name."""


@dataclass
class ExpertLayer:
    """One layer's expert LoRA: gate_up A (E, r, H), B (E, 2I, r); down A (E, r, I), B (E, H, r)."""

    gate_up_a: torch.Tensor
    gate_up_b: torch.Tensor
    down_a: torch.Tensor
    down_b: torch.Tensor


def unflatten_a(flat: torch.Tensor, experts: int) -> torch.Tensor:
    return flat.reshape(experts, -1, flat.shape[1])


def unflatten_b(flat: torch.Tensor, experts: int) -> torch.Tensor:
    return flat.reshape(flat.shape[0], -1, experts).permute(2, 0, 1)


def read_run_adapter(adapter_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict, str, FamilyNames]:
    """(tensors, adapter_config, model_type, the family's names) of a PEFT adapter folder."""
    tensors, config, source = read_adapter(adapter_dir)
    if config is None:
        raise ExportError(f"{adapter_dir}: no adapter_config.json beside {source.name}")
    model_type = base_model_type(config, Path(adapter_dir))
    if model_type in WHY_NOT:
        raise ExportError(f"{model_type}: {WHY_NOT[model_type]}")
    if model_type in NOT_EXPORTED:
        raise ExportError(
            f"{model_type}: not written as GGUF ({NOT_EXPORTED[model_type]}), nor per-expert or for "
            f"vLLM (names unchecked); {PEFT_AS_IS}"
        )
    if model_type not in FAMILIES:
        raise ExportError(
            f"{model_type}: no per-expert / GGUF names known for this family (known: "
            f"{', '.join(sorted(FAMILIES))}); {PEFT_AS_IS}"
        )
    if config.get("use_rslora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ExportError(f"{adapter_dir}: rsLoRA or per-module ranks/alphas are not written by these formats")
    return tensors, config, model_type, FAMILIES[model_type]


def base_model_type(config: dict, where: Path) -> str:
    """model_type of the adapter's base, from its config.json (a local folder, builtin:, or the hub cache)."""
    from transformers import AutoConfig

    from moe_qlora.model.tiny import resolve_model_path

    base = config.get("base_model_name_or_path")
    if not base:
        raise ExportError(f"{where}/adapter_config.json: no base_model_name_or_path")
    try:
        base_config = AutoConfig.from_pretrained(resolve_model_path(base))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{where}: cannot read the base model's config.json ({base}): {exc}") from None
    if base_config.model_type in (*FAMILIES, *WHY_NOT, *NOT_EXPORTED, *VLLM_FUSED_3D, *VLLM_NO_MOE_LORA):
        return base_config.model_type
    return base_config.get_text_config().model_type  # a multimodal model's text model


def expert_layers(
    tensors: dict[str, torch.Tensor], rank: int, names: FamilyNames | None = None
) -> dict[int, ExpertLayer]:
    """Expert LoRA per layer, (E, ...) factors, from our PEFT keys, as the math sees them: B's outputs are the
    projection's rows, gate's first and then up's (Llama-4's swapped roles and GPT-OSS's interleaving undone)."""
    layers = peft_expert_layers(tensors, rank)
    if names is not None:
        layers = {n: canonical(x, names) for n, x in layers.items()}
    return layers


def canonical(x: ExpertLayer, names: FamilyNames) -> ExpertLayer:
    if names.peft_swapped:  # PEFT's delta is ours transposed: (B A)^T = A^T B^T, its A our B^T, its B our A^T
        x = ExpertLayer(
            x.gate_up_b.transpose(1, 2), x.gate_up_a.transpose(1, 2), x.down_b.transpose(1, 2), x.down_a.transpose(1, 2)
        )
    if names.interleaved_gate_up:  # output 2j is gate j, 2j + 1 is up j
        x = ExpertLayer(x.gate_up_a, torch.cat([x.gate_up_b[:, 0::2], x.gate_up_b[:, 1::2]], dim=1), x.down_a, x.down_b)
    return x


def peft_expert_layers(tensors: dict[str, torch.Tensor], rank: int) -> dict[int, ExpertLayer]:
    """Expert LoRA per layer, (E, ...) factors, as our PEFT keys hold them."""
    parts: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = EXPERT_KEY.fullmatch(key)
        if m:
            which = ("gate_up_" if m["inner"] else "down_") + m["ab"].lower()
            parts.setdefault(int(m["layer"]), {})[which] = t.float()
    layers = {}
    for layer, p in sorted(parts.items()):
        if set(p) != {"gate_up_a", "gate_up_b", "down_a", "down_b"}:
            raise ExportError(f"layer {layer}: expert LoRA has {sorted(p)}, expected gate_up and down A and B")
        e = p["gate_up_a"].shape[0] // rank
        layers[layer] = ExpertLayer(
            unflatten_a(p["gate_up_a"], e),
            unflatten_b(p["gate_up_b"], e),
            unflatten_a(p["down_a"], e),
            unflatten_b(p["down_b"], e),
        )
    return layers


def linear_factors(tensors: dict[str, torch.Tensor]) -> dict[tuple[int, str, str], dict[str, torch.Tensor]]:
    """{(layer, module path, projection): {"A": (r, in), "B": (out, r)}} of the non-expert LoRA."""
    check_one_decoder(tensors)
    out: dict = {}
    for key, t in tensors.items():
        if EXPERT_KEY.fullmatch(key):
            continue
        m = LINEAR_KEY.fullmatch(key)
        if m is None:
            raise ExportError(f"{key}: a LoRA tensor outside the decoder layers; these formats cannot place it")
        out.setdefault((int(m["layer"]), m["path"], m["proj"]), {})[m["ab"]] = t.float()
    return out


def check_one_decoder(tensors: dict[str, torch.Tensor]) -> str:
    """The module path of the decoder layers the adapter's LoRA is in (where the experts are), or an
    ExportError for LoRA in another stack of layers: a vision tower's (MiniMax-M3-VL's has q_proj too) would
    land on the text layer of the same index, and no format here can hold it (llama.cpp keeps encoders in a
    separate mmproj file)."""
    experts = {m["prefix"] for k in tensors if (m := EXPERT_KEY.fullmatch(k))}
    linears: dict[str, str] = {}  # prefix: its first key
    for k in sorted(tensors):
        if (m := LINEAR_KEY.fullmatch(k)) and not EXPERT_KEY.fullmatch(k):
            linears.setdefault(m["prefix"], k)
    decoder = experts or set(linears)
    if len(decoder) == 1 and set(linears) <= decoder:
        return next(iter(decoder))
    if not decoder:
        raise ExportError(f"no LoRA tensor under the decoder layers (keys such as {next(iter(tensors), None)!r})")
    if experts:
        found = f"outside the experts' decoder layers ({', '.join(sorted(experts))}): " + ", ".join(
            sorted(k for p, k in linears.items() if p not in experts)
        )
    else:
        found = "in several stacks of layers: " + ", ".join(sorted(linears.values()))
    raise ExportError(
        f"LoRA {found}; a vision or audio encoder's LoRA has no place in these formats (llama.cpp "
        "keeps encoders in a separate mmproj file). Train with lora.target_modules: auto, which keeps "
        "to the language model, or name its modules by a longer suffix (language_model.layers...)"
    )


# ------------------------------------------------------------------------------------------ per-expert


# Families whose hub checkpoints name every module otherwise than transformers (which renames them on load), and
# have no model. root: {transformers' module path: the hub's}. vLLM 0.33.0 reads DeepSeek-V4's so (its
# DeepseekV4ForCausalLM's hf_to_vllm_mapper adds the model. root, models/deepseek_v4/nvidia/model.py)
HUB_MODULE_NAMES = {"deepseek_v4": {module: hub for module, (hub, _) in DSV4_MODULES.items()}}


def hub_module_key(key: str, modules: dict[str, str]) -> str:
    """A non-expert LoRA key under the hub checkpoint's module names and root (HUB_MODULE_NAMES)."""
    m = LINEAR_KEY.fullmatch(key)
    module = f"{m['path']}.{m['proj']}"
    if module not in modules:
        raise ExportError(f"{key}: no hub checkpoint name known for {module} (known: {', '.join(sorted(modules))})")
    return f"{m['prefix'].removesuffix('.model')}.layers.{m['layer']}.{modules[module]}.lora_{m['ab']}.weight"


def per_expert_tensors(
    tensors: dict[str, torch.Tensor], rank: int, names: FamilyNames, hub: dict[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """Our PEFT tensors with the expert LoRA rewritten under per-expert module names (attention unchanged, or
    under `hub`'s module names without transformers' model. root: HUB_MODULE_NAMES)."""
    prefix = check_one_decoder(tensors)
    if hub is None:
        out = {hub_linear_key(k, names): v for k, v in tensors.items() if not EXPERT_KEY.fullmatch(k)}
    else:
        out = {hub_module_key(k, hub): v for k, v in tensors.items() if not EXPERT_KEY.fullmatch(k)}
        prefix = prefix.removesuffix(".model")
    for layer, x in expert_layers(tensors, rank, names).items():
        inter = x.gate_up_b.shape[1] // 2
        for e in range(x.gate_up_a.shape[0]):
            base = f"{prefix}.layers.{layer}.{names.experts}.{e}"
            pieces = (
                {
                    names.gate: (x.gate_up_a[e], x.gate_up_b[e, :inter]),
                    names.up: (x.gate_up_a[e], x.gate_up_b[e, inter:]),
                    names.down: (x.down_a[e], x.down_b[e]),
                }
                if names.gated
                else {names.up: (x.gate_up_a[e], x.gate_up_b[e]), names.down: (x.down_a[e], x.down_b[e])}
            )
            for proj, (a, b) in pieces.items():
                # gate and up share A: one copy each, contiguous (Llama-4's factors are transposed views)
                out[f"{base}.{proj}.lora_A.weight"] = a.clone(memory_format=torch.contiguous_format)
                out[f"{base}.{proj}.lora_B.weight"] = b.clone(memory_format=torch.contiguous_format)
    return out


# Families whose hub checkpoints (and vLLM's class) hold q, k and v as one Linear: (its path, the output
# projection's) under a decoder layer. Sarvam-MoE: vLLM's SarvamMoEForCausalLM (a BailingMoeForCausalLM) packs
# query_key_value as one LoRA and names no q_proj (model_executor/models/bailing_moe.py, packed_modules_mapping)
HUB_FUSED_ATTENTION = {"sarvam_moe": ("attention.query_key_value", "attention.dense")}


def hub_fused_attention(tensors: dict[str, torch.Tensor], qkv: str, out: str) -> dict[str, torch.Tensor]:
    """q, k and v LoRA as the one LoRA of a fused `qkv` Linear (A stacked along the rank (3r, in), B
    block-diagonal (q_out + k_out + v_out, 3r), so B A = [B_q A_q; B_k A_k; B_v A_v] at the adapter's alpha / r,
    which the runtime reads from adapter_config.json), and o_proj's under `out`. A runtime must allow rank 3r
    (vLLM: --max-lora-rank)."""
    layers: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    renamed = {}
    for key, t in tensors.items():
        m = LINEAR_KEY.fullmatch(key)
        if m and m["path"] == "self_attn" and m["proj"] in ("q_proj", "k_proj", "v_proj"):
            layers.setdefault((m["prefix"], m["layer"]), {})[f"{m['proj'][0]}{m['ab']}"] = t
        elif m and m["path"] == "self_attn" and m["proj"] == "o_proj":
            renamed[f"{m['prefix']}.layers.{m['layer']}.{out}.lora_{m['ab']}.weight"] = t
        else:
            renamed[key] = t
    for (prefix, layer), f in layers.items():
        if missing := [p for p in "qkv" if f"{p}A" not in f]:
            raise ExportError(
                f"layer {layer}: no LoRA on {', '.join(p + '_proj' for p in missing)}; this family's "
                f"checkpoints hold q, k and v as one {qkv}, whose LoRA needs all three trained"
            )
        base = f"{prefix}.layers.{layer}.{qkv}"
        renamed[f"{base}.lora_A.weight"] = torch.cat([f["qA"], f["kA"], f["vA"]])
        renamed[f"{base}.lora_B.weight"] = torch.block_diag(f["qB"], f["kB"], f["vB"])
    return renamed


def hub_linear_key(key: str, names: FamilyNames) -> str:
    """A non-expert LoRA key under the hub checkpoint's module names: transformers v5 calls Mixtral's MoE block
    `mlp` where the checkpoints (and vLLM) say `block_sparse_moe`, so its router `mlp.gate` is renamed back."""
    block = names.experts.rsplit(".", 1)[0]
    m = LINEAR_KEY.fullmatch(key)
    if m is None or block == "mlp" or not (m["path"] == "mlp" or m["path"].startswith("mlp.")):
        return key
    path = block + m["path"].removeprefix("mlp")
    return f"{m['prefix']}.layers.{m['layer']}.{path}.{m['proj']}.lora_{m['ab']}.weight"


def write_per_expert(adapter_dir: str | Path, out_dir: str | Path, *, rename: tuple[str, str] | None = None) -> Path:
    """The per-expert PEFT adapter of `adapter_dir` in `out_dir` (atomically); `rename`: (old, new) module path
    fragment of the runtime's own names."""
    tensors, config, model_type, names = read_run_adapter(adapter_dir)
    if model_type in PER_EXPERT_UNREAD:
        raise ExportError(f"{model_type}: {PER_EXPERT_UNREAD[model_type]}")
    converted = per_expert_tensors(tensors, int(config["r"]), names, HUB_MODULE_NAMES.get(model_type))
    if model_type in HUB_FUSED_ATTENTION:
        converted = hub_fused_attention(converted, *HUB_FUSED_ATTENTION[model_type])
    if rename:
        converted = {k.replace(*rename): v for k, v in converted.items()}
    linears = sorted({m["proj"] for k in converted if (m := LINEAR_KEY.fullmatch(k))})
    new_config = {**config, "target_modules": linears, "target_parameters": None}
    with atomic_dir(out_dir) as tmp:
        save_file(converted, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(new_config, indent=2, sort_keys=True))
    return Path(out_dir)


# ------------------------------------------------------------------------------------------ vllm

# vLLM 0.33.0 (vllm/lora/model_manager.py, vllm/model_executor/models): the model classes that set
# is_3d_moe_weight read PEFT's fused 3D expert LoRA (experts.base_layer = gate_up, experts = down) as written;
# every other class with MoE LoRA reads per-expert 2D keys under its checkpoint names (write_per_expert).
# Qwen3.5-MoE: the multimodal class (qwen3_5_moe) reads 3D, the text-only one (qwen3_5_moe_text) 2D.
VLLM_VERSION = "0.33.0"
VLLM_FUSED_3D = {"gpt_oss", "qwen3_5_moe", "qwen3_vl_moe", "qwen3_omni_moe"}
# Routers vLLM loads a LoRA for but never applies, so that it would be silently ignored: Nemotron-H's is skipped
# with a log line (lora/model_manager.py); the blocks that hand their gate to the fused-MoE runner get it back
# unwrapped, since the LoRA wrapper is set on the experts module, which is wrapped itself by then
# (layers/fused_moe/runner/moe_runner.py computes the logits; lora/model_manager.py sets the attribute).
_RUNNER_GATE = "its fused-MoE runner computes the router logits with the gate it holds, not the LoRA-wrapped one"
VLLM_IGNORED_ROUTER = {
    "nemotron_h": ("mixer.gate", "lora/model_manager.py skips it, with only a log line"),
    **dict.fromkeys(
        (
            "qwen3_moe",
            "exaone_moe",
            "deepseek_v2",
            "deepseek_v3",
            "glm_moe_dsa",
            "qwen3_next",
            "qwen3_5_moe",
            "qwen3_5_moe_text",
            "deepseek_v32",
            "qwen4_exp",
            "qwen4_exp_text",
            "glm5_next",
            "deepseek_v4",
        ),
        ("mlp.gate", _RUNNER_GATE),
    ),
}
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
# Non-expert modules vLLM loads a LoRA for but never applies: Granite-MoE-Shared's packed_modules_mapping lacks
# the shared MLP's input_linear, so no LoRA layer wraps it and model_manager.py logs that it is ignored
# (GraniteMoeSWAForCausalLM is served by the same class)
_DSV4_FROM_WEIGHT = "multiplied from its weight, not through the LoRA-wrapped module (models/deepseek_v4)"
VLLM_IGNORED_MODULE = {
    **dict.fromkeys(
        ("granitemoeshared", "granitemoe_swa"),
        {"shared_mlp.input_linear": "its packed_modules_mapping lacks input_linear, so no LoRA layer wraps it"},
    ),
    # DeepSeek-V4: wo_a through a grouped einsum/bmm of wo_a.weight (nvidia/ops/o_proj.py), both compressors'
    # fused wkv/wgate through torch.mm of the fused weight (attention.py)
    "deepseek_v4": {
        m: _DSV4_FROM_WEIGHT
        for m in (
            "self_attn.o_a_proj",
            "self_attn.compressor.kv_proj",
            "self_attn.compressor.gate_proj",
            "self_attn.compressor.indexer.kv_proj",
            "self_attn.compressor.indexer.gate_proj",
        )
    },
}
# Modules vLLM's class names otherwise than transformers (a LoRA under transformers' name would load unused)
# (Laguna's is mlp.shared_expert there, but a LoRA on its shared expert does not load in PEFT: refused in training)
VLLM_RENAMED = {
    "hy_v3": ("mlp.shared_experts.", "mlp.shared_mlp."),
    # Granite's router: block_sparse_moe.router in transformers v5, a GateLinear named gate in vLLM
    **dict.fromkeys(
        ("granitemoe", "granitemoeshared", "granitemoe_swa"), ("block_sparse_moe.router.", "block_sparse_moe.gate.")
    ),
}


def vllm_layout(model_type: str) -> str:
    """What --format vllm writes for a family: "refused", "fused-3d" (PEFT's layout as written) or "per-expert".
    The one decision write_vllm and the docs' tables follow (router LoRA aside: VLLM_IGNORED_ROUTER)."""
    if model_type in VLLM_NO_MOE_LORA:
        return "refused"
    if model_type in VLLM_FUSED_3D:
        return "fused-3d"
    return "per-expert" if model_type in FAMILIES and model_type not in PER_EXPERT_UNREAD else "refused"


def write_vllm(adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """The adapter in the layout vLLM loads for its base's family: PEFT's unchanged where vLLM reads fused 3D
    expert weights, per-expert keys elsewhere; a family vLLM serves no MoE LoRA for is refused by name."""
    import shutil

    tensors, config, _ = read_adapter(adapter_dir)
    if config is None:
        raise ExportError(f"{adapter_dir}: no adapter_config.json")
    model_type = base_model_type(config, Path(adapter_dir))
    if model_type in VLLM_NO_MOE_LORA:
        raise ExportError(
            f"{model_type}: vLLM {VLLM_VERSION} serves no MoE LoRA for it "
            f"({VLLM_NO_MOE_LORA[model_type]}); use the run's PEFT adapter, or gguf"
        )
    trained = {f"{m['path']}.{m['proj']}" for k in tensors if (m := LINEAR_KEY.fullmatch(k))}
    router, why = VLLM_IGNORED_ROUTER.get(model_type, (None, ""))
    if router in trained:
        raise ExportError(
            f"{model_type}: vLLM {VLLM_VERSION} does not apply a LoRA to this family's router "
            f"({router}: {why}), so it would be ignored; train with lora.router: false"
        )
    ignored = VLLM_IGNORED_MODULE.get(model_type, {})
    if modules := sorted(trained & set(ignored)):
        raise ExportError(
            f"{model_type}: vLLM {VLLM_VERSION} does not apply a LoRA to {', '.join(modules)} "
            f"({ignored[modules[0]]}), so it would be ignored; train without it"
        )
    if vllm_layout(model_type) != "fused-3d":  # per-expert, or its refusal with the reason
        return write_per_expert(adapter_dir, out_dir, rename=VLLM_RENAMED.get(model_type))
    with atomic_dir(out_dir) as tmp:
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            shutil.copyfile(Path(adapter_dir) / name, tmp / name)
    return Path(out_dir)


# ------------------------------------------------------------------------------------------ gguf


def permute_rows_for_rope(b: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row order for llama-architecture models (its converter's `permute`): within each head
    the rotary pairs (i, i + d/2) become adjacent rows."""
    return b.reshape(n_head, 2, b.shape[0] // n_head // 2, *b.shape[1:]).swapaxes(1, 2).reshape(b.shape)


def gguf_tensors(
    tensors: dict[str, torch.Tensor],
    rank: int,
    names: FamilyNames,
    base,
    *,
    fuse_gate_up_exps: bool = False,
    fuse_qkv: bool = False,
) -> dict[str, torch.Tensor]:
    """{llama.cpp tensor name: fp32 tensor in numpy order} for the adapter. `fuse_gate_up_exps` / `fuse_qkv`:
    the base was converted with llama.cpp's flags of those names, which write one ffn_gate_up_exps per layer
    (gate's rows, then up's) and one attn_qkv per attention layer (q's rows, k's, v's; conversion/base.py,
    modify_tensors)."""
    out, factors = {}, linear_factors(tensors)
    for layer, x in expert_layers(tensors, rank, names).items():
        inter = x.gate_up_b.shape[1] // 2
        blk = f"blk.{layer}"
        if names.gated and (names.fused_gate_up or fuse_gate_up_exps):  # the fused LoRA as it is: B's rows are
            # [gate; up] as the tensor's
            out[f"{blk}.ffn_gate_up_exps.weight.lora_a"] = x.gate_up_a
            out[f"{blk}.ffn_gate_up_exps.weight.lora_b"] = x.gate_up_b
        elif names.gated:
            out[f"{blk}.ffn_gate_exps.weight.lora_a"] = x.gate_up_a
            out[f"{blk}.ffn_gate_exps.weight.lora_b"] = x.gate_up_b[:, :inter]
            out[f"{blk}.ffn_up_exps.weight.lora_a"] = x.gate_up_a
            out[f"{blk}.ffn_up_exps.weight.lora_b"] = x.gate_up_b[:, inter:]
        else:  # the up projection alone
            out[f"{blk}.ffn_up_exps.weight.lora_a"] = x.gate_up_a
            out[f"{blk}.ffn_up_exps.weight.lora_b"] = x.gate_up_b
        out[f"{blk}.ffn_down_exps.weight.lora_a"] = x.down_a
        out[f"{blk}.ffn_down_exps.weight.lora_b"] = x.down_b
    n_head = base.num_attention_heads
    n_kv = getattr(base, "num_key_value_heads", None) or n_head
    tensor_names = gguf_name_map(names.gguf_arch, 1 + max((layer for layer, _, _ in factors), default=0))
    for (layer, path, proj), ab in factors.items():
        for piece_path, piece_proj, a, b in gguf_pieces(names.gguf_arch, path, proj, ab["A"], ab["B"], base):
            name = gguf_linear_name(tensor_names, names.gguf_arch, layer, piece_path, piece_proj)
            if names.permute_qk and name.endswith((".attn_q", ".attn_k")):
                b = permute_rows_for_rope(b, n_head if name.endswith(".attn_q") else n_kv)
            if f"{name}.weight.lora_a" in out:  # two modules on one tensor: never write one over the other
                raise ExportError(
                    f"layers.{layer}.{path}.{proj}: its LoRA lands on {name}, which another module's LoRA already fills"
                )
            out[f"{name}.weight.lora_a"] = a
            out[f"{name}.weight.lora_b"] = b
    if fuse_qkv or names.gguf_arch in GGUF_ALWAYS_FUSED_QKV:
        out = fused_qkv(out, always=names.gguf_arch in GGUF_ALWAYS_FUSED_QKV)
    return {k: v.contiguous().clone() for k, v in out.items()}


def gguf_pieces(
    arch: str, path: str, proj: str, a: torch.Tensor, b: torch.Tensor, base
) -> list[tuple[str, str, torch.Tensor, torch.Tensor]]:
    """The LoRA (A (r, in), B (out, r)) of the module `path.proj` as llama.cpp's converter lays out the base's
    weight: [(path, proj, A, B)], each piece under the transformers name of the tensor it lands on. Where the
    converter gathers a weight's rows (a split, a regrouping), B's rows are gathered alike, A shared; where it
    gathers the columns (inputs), A's columns are. Read from llama.cpp 0c1e57098's conversion/qwen.py,
    qwen4exp.py and minimax.py."""
    if arch == "qwen3next" and proj == "in_proj_qkvz":  # one [q | k | v | z] group per key head, apart in llama.cpp
        q, k, v, z = qwen3_next_qkvz_rows(base)
        return [(path, "in_proj_qkv", a, b[torch.cat([q, k, v])]), (path, "in_proj_z", a, b[z])]
    if arch in ("qwen35moe", "qwen4exp") and path.endswith("linear_attn"):
        return [(path, proj, *value_heads_tiled(proj, a, b, base))]
    split_shared = proj == "input_linear" and path.endswith("shared_mlp") and arch in ("granitemoe", "granitehybrid")
    if proj == "gate_up_proj" or split_shared:  # MiniMax-M3's dense and shared MLPs, Granite's shared MLP (kept
        # fused by Granite-MoE-SWA's converter): llama.cpp's ffn_gate and ffn_up, or their _shexp
        half = b.shape[0] // 2
        return [(path, "gate_proj", a, b[:half]), (path, "up_proj", a, b[half:])]
    if proj == "index_qk_proj":  # Qwen4-Exp's indexer: q's rows, then k's (conversion/qwen4exp.py)
        n_q = base.indexer_n_heads * base.indexer_head_dim
        return [(path, "q_proj", a, b[:n_q]), (path, "k_proj", a, b[n_q:])]
    return [(path, proj, a, b)]


def qwen3_next_qkvz_rows(base) -> tuple[torch.Tensor, ...]:
    """Row indices of q, k, v and z in Qwen3-Next's in_proj_qkvz, whose rows are one group per key head g:
    [q_g (dk) | k_g (dk) | v_g (r dv) | z_g (r dv)], r = value heads per key head; llama.cpp's attn_qkv is
    [all q; all k; all v] and its attn_gate all z, each in head order (conversion/qwen.py)."""
    nk, dk, dv = base.linear_num_key_heads, base.linear_key_head_dim, base.linear_value_head_dim
    rdv = base.linear_num_value_heads // nk * dv
    group = torch.arange(nk)[:, None] * (2 * dk + 2 * rdv)
    q, k = group + torch.arange(dk), group + dk + torch.arange(dk)
    v, z = group + 2 * dk + torch.arange(rdv), group + 2 * dk + rdv + torch.arange(rdv)
    return q.flatten(), k.flatten(), v.flatten(), z.flatten()


def value_heads_tiled(proj: str, a: torch.Tensor, b: torch.Tensor, base) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of a Qwen3.5 / Qwen4-Exp linear-attention projection in llama.cpp's value-head order.

    transformers groups the value heads by key head (head g r + j serves key head g, repeat_interleave); ggml
    tiles the key heads instead (ggml_repeat), so the converter moves value head g r + j to j nk + g: in
    in_proj_qkv's value rows (q and k stay), in_proj_z's rows (dv per head), in_proj_a's and in_proj_b's (one
    per head), and out_proj's columns, its input. Nothing moves where nk == nv."""
    nk, nv = base.linear_num_key_heads, base.linear_num_value_heads
    if nk == nv:
        return a, b

    def order(head_dim: int) -> torch.Tensor:
        return torch.arange(nv * head_dim).reshape(nk, nv // nk, head_dim).transpose(0, 1).flatten()

    dv = base.linear_value_head_dim
    if proj == "in_proj_qkv":
        qk = 2 * nk * base.linear_key_head_dim
        return a, b[torch.cat([torch.arange(qk), qk + order(dv)])]
    if proj == "in_proj_z":
        return a, b[order(dv)]
    if proj in ("in_proj_a", "in_proj_b"):
        return a, b[order(1)]
    if proj == "out_proj":
        return a[:, order(dv)], b
    return a, b


def fused_qkv(out: dict[str, torch.Tensor], always: bool = False) -> dict[str, torch.Tensor]:
    """Each layer's q, k and v LoRA as the one attn_qkv LoRA of a base converted with --fuse-qkv: A stacked along
    the rank (3r, in), B block-diagonal (q_out + k_out + v_out, 3r), so that B A = [B_q A_q; B_k A_k; B_v A_v].
    llama.cpp scales each LoRA by alpha over its own rank (B's columns: 3r here), so B is multiplied by 3 to keep
    each block's alpha / r."""
    layers = sorted({int(k.split(".")[1]) for k in out if re.fullmatch(r"blk\.\d+\.attn_[qkv]\.weight\.lora_a", k)})
    for layer in layers:
        pieces = [f"blk.{layer}.attn_{p}.weight" for p in "qkv"]
        if missing := [p.split(".")[2] for p in pieces if f"{p}.lora_a" not in out]:
            how = "" if always else ", or convert the base without --fuse-qkv"
            holds = "this architecture's base always holds" if always else "a base converted with --fuse-qkv holds"
            raise ExportError(
                f"layer {layer}: no LoRA on {', '.join(missing)}; {holds} one attn_qkv, whose LoRA needs "
                f"q, k and v all trained (target q_proj, k_proj and v_proj{how})"
            )
        a = torch.cat([out.pop(f"{p}.lora_a") for p in pieces])
        b = torch.block_diag(*[out.pop(f"{p}.lora_b") for p in pieces]) * len(pieces)
        out[f"blk.{layer}.attn_qkv.weight.lora_a"], out[f"blk.{layer}.attn_qkv.weight.lora_b"] = a, b
    return out


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


def write_gguf(
    adapter_dir: str | Path, out_file: str | Path, *, fuse_gate_up_exps: bool = False, fuse_qkv: bool = False
) -> Path:
    """A llama.cpp LoRA GGUF (fp32 tensors) of `adapter_dir`, written atomically to `out_file`;
    `fuse_gate_up_exps` / `fuse_qkv` for a base converted with llama.cpp's flags of those names."""
    import gguf
    from transformers import AutoConfig

    from moe_qlora.model.tiny import resolve_model_path

    tensors, config, model_type, names = read_run_adapter(adapter_dir)
    if fuse_gate_up_exps and not names.fused_gate_up and names.gguf_arch not in GGUF_FUSABLE_GATE_UP:
        raise ExportError(
            f"{model_type}: llama.cpp's converter cannot fuse gate and up experts for its "
            f"{names.gguf_arch} architecture (--fuse-gate-up-exps is for "
            f"{', '.join(sorted(GGUF_FUSABLE_GATE_UP))}), so no base has ffn_gate_up_exps"
        )
    if fuse_qkv and names.gguf_arch not in GGUF_FUSABLE_QKV | GGUF_ALWAYS_FUSED_QKV:
        raise ExportError(
            f"{model_type}: llama.cpp's converter does not fuse q, k and v for its {names.gguf_arch} "
            "architecture, so no base has attn_qkv; export without --fuse-qkv"
        )
    base = AutoConfig.from_pretrained(resolve_model_path(config["base_model_name_or_path"])).get_text_config()
    converted = gguf_tensors(
        tensors, int(config["r"]), names, base, fuse_gate_up_exps=fuse_gate_up_exps, fuse_qkv=fuse_qkv
    )
    out_file = Path(out_file)
    with unwritable_named(out_file):
        out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(f".{out_file.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), names.gguf_arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(config["lora_alpha"]))
    for name, t in converted.items():
        writer.add_tensor(name, t.numpy())
    try:
        with disk_full_named(out_file, sum(t.numel() * 4 for t in converted.values())), unwritable_named(out_file):
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
            os.replace(tmp, out_file)
    finally:
        tmp.unlink(missing_ok=True)
    return out_file
