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

from moe_qlora.common.fileio import atomic_dir, disk_full_named
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
    "llama4_text": FamilyNames("llama4", "feed_forward.experts", "gate_proj", "up_proj", "down_proj",
                               peft_swapped=True),
    "gpt_oss": FamilyNames("gpt-oss", "mlp.experts", "gate_proj", "up_proj", "down_proj", interleaved_gate_up=True),
    "qwen3_vl_moe": FamilyNames("qwen3vlmoe", **_QWEN_STYLE),
    # Granite: llama.cpp's converter splits input_linear into gate and up halves and permutes q/k (LlamaModel)
    **dict.fromkeys(("granitemoe", "granitemoeshared"), FamilyNames("granitemoe", "block_sparse_moe.experts",
                                                                     "gate_proj", "up_proj", "down_proj",
                                                                     permute_qk=True)),
    "granitemoehybrid": FamilyNames("granitehybrid", "block_sparse_moe.experts", "gate_proj", "up_proj", "down_proj",
                                    permute_qk=True),
    # Gemma-4: experts beside the dense MLP in the decoder layer; llama.cpp keeps gate_up fused
    **dict.fromkeys(("gemma4", "gemma4_text"), FamilyNames("gemma4", "experts", "gate_proj", "up_proj", "down_proj",
                                                           fused_gate_up=True)),
    # no gate; llama.cpp's converter permutes its q/k rows like Llama's (it inherits the Granite converter)
    "nemotron_h": FamilyNames("nemotron_h_moe", "mixer.experts", "", "up_proj", "down_proj", permute_qk=True,
                              gated=False),
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
    "granitemoe_swa": FamilyNames("granite_swa", "block_sparse_moe.experts", "gate_proj", "up_proj", "down_proj",
                                  permute_qk=True, fused_gate_up=True),
}
# No per-expert export for these: vLLM reads GPT-OSS's expert LoRA only in PEFT's fused layout (VLLM_FUSED_3D);
# the per-expert names vLLM's Gemma-4 and Granite classes expect are unchecked
PER_EXPERT_UNREAD = {
    "gpt_oss": "vLLM reads GPT-OSS's expert LoRA in PEFT's fused layout only (use --format vllm)",
    **dict.fromkeys(("gemma4", "gemma4_text"), "the per-expert names vLLM's Gemma-4 class expects are not "
                    "checked (the run's PEFT adapter, or gguf)"),
    **dict.fromkeys(("granitemoe", "granitemoeshared", "granitemoehybrid", "granitemoe_swa"),
                    "Granite's checkpoints hold fused input_linear stacks, and the per-expert names vLLM's Granite "
                    "classes expect are not checked (the run's PEFT adapter, or gguf)"),
}
# llama.cpp tensors (blk.N.<kind>) whose product goes through build_lora_mm, so that a LoRA on them is applied:
# attention, the router, dense MLPs (build_ffn), shared experts and Qwen2-MoE's shared-expert gate.
GGUF_LORA_KINDS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_gate", "ffn_up", "ffn_down",
                   "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp"}  # fmt: skip
GGUF_EXTRA_LORA_KINDS = {"laguna": {"attn_gate"}}  # its g_proj through build_lora_mm (src/models/laguna.cpp)
# Architectures newer than the gguf package's (0.19.0 on PyPI lacks them): the one whose TensorNameMap gives
# the same blk.N names for the family's modules as llama.cpp's own gguf-py at 0c1e57098 (checked name by name,
# and against the converter's output by tests/test_llamacpp.py); general.architecture is still the real one,
# which libllama requires of an adapter.
GGUF_NAMES_FROM = {"cohere2moe": "glm4moe", "deepseek32": "glm-dsa", "dots3note": "glm-dsa", "glm5-next": "kimi-linear",
                   "granite_swa": "granitemoe", "hy_v3": "glm4moe", "hy_v4": "glm-dsa", "laguna": "afmoe",
                   "mellum": "qwen3moe", "qwen4exp": "qwen35moe"}  # fmt: skip
# ...except where an architecture's graph multiplies them with a plain ggml_mul_mat: DeepSeek-V2/V3's query
# (wq, and wq_a / wq_b, like the rest of MLA but the output projection).
GGUF_NO_LORA = {
    # (the MLA families of DeepSeek-V2's graph alike: a query without a low-rank projection is wq, unhooked)
    **dict.fromkeys(("deepseek2", "mistral4", "deepseek32", "dots3note", "hy_v4"), {"attn_q"}),
    "glm5-next": {"attn_q", "attn_k", "attn_v", "attn_output"},
    # Kimi-Linear: its delta-attention layers' q/k/v/o and the MLA query (the MLA output is hooked, but shares
    # attn_output with the delta-attention layers, so both are refused)
    "kimi-linear": {"attn_q", "attn_k", "attn_v", "attn_output"},
}
# The architectures whose graphs were read whole (llama.cpp's MLA projections have no LoRA hook): there, a kind
# outside GGUF_LORA_KINDS is known to be multiplied without one.
LEGACY_LORA_ARCHS = {"deepseek2", "glm-dsa", "mistral4", "deepseek32", "dots3note", "hy_v4", "glm5-next"}
# Tensors llama.cpp's converter reorders rows of (a LoRA's B would need the same): not written yet.
GGUF_REORDERED = {
    "qwen3next": ("ssm_in", "ssm_ba"),  # in_proj_qkvz / in_proj_ba regrouped per key head
    "qwen35moe": ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_out"),  # linear attention's value heads
    "qwen4exp": ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_out"),  # as Qwen3.5's (conversion/qwen.py)
}
# Architectures whose ffn_gate_up_exps llama.cpp's --fuse-gate-up-exps writes (MODEL_TENSORS lists it; for
# every other one its converter raises): gguf-py/gguf/constants.py at 0c1e57098. Gemma-4's is always fused.
GGUF_FUSABLE_GATE_UP = {"qwen3next", "qwen35moe", "qwen4exp", "mistral4", "cohere2moe", "granite_swa"}
# ...and whose attn_qkv --fuse-qkv writes (the converter fuses the layers where q, k and v all exist; Jamba's and
# Granite-Hybrid's list attn_qkv too, but their converters write q, k and v apart even so: tests/test_llamacpp.py)
GGUF_FUSABLE_QKV = {"afmoe", "dots1", "ernie4_5-moe", "exaone-moe", "gemma4", "glm4moe", "gpt-oss", "granitemoe",
                    "hunyuan-moe", "kimi-linear", "lfm2moe", "llama", "llama4", "mimo2", "minimax-m2", "nemotron_h_moe",
                    "olmoe", "phimoe", "qwen2moe", "qwen35moe", "qwen3moe", "qwen3next", "qwen3vlmoe",
                    "qwen4exp"}  # fmt: skip
WHY_NOT: dict[str, str] = {}  # families refused by every layout, with the reason a user needs
# Families moe-qlora trains that these formats do not write, with the reason (read from llama.cpp 0c1e57098's
# converters and graphs); the run's own adapter folder (PEFT's format) serves them all
_NO_CONVERTER = "llama.cpp 0c1e57098 has no converter for its checkpoints, so no base GGUF exists to apply a LoRA to"
NOT_EXPORTED = {
    **dict.fromkeys(("aria", "aria_text", "axk1", "axk2", "bailing_hybrid", "beam", "ernie4_5_vl_moe", "flex_olmo",
                     "flint", "inkling2", "inkling2_loop", "inkling2_loop_text", "inkling2_text", "inkling_mm_model",
                     "inkling_text", "kolibri1", "lara_mini", "minimax", "zaya", "sarvam_mla", "hy_v4_vl",
                     "qwen3_omni_moe_thinker", "minimax_m3_vl_text"), _NO_CONVERTER),
    "deepseek_v4": "llama.cpp's deepseek4 converter names its attention from the original checkpoint's keys, "
                   "which gguf's tensor map does not know: not written yet",
    "minimax_m3_vl": "its dense and shared-expert MLPs are one fused gate_up Linear that llama.cpp splits into "
                     "ffn_gate and ffn_up: not written yet",
    "sarvam_moe": "transformers builds it as GLM-4-MoE while llama.cpp converts its checkpoints as bailingmoe2, "
                  "with q, k and v fused into attn_qkv: not written yet",
}  # fmt: skip

EXPERT_KEY = re.compile(r"(?P<prefix>.*?)\.layers\.(?P<layer>\d+)\.(?:(?P<path>.+)\.)?experts\.(?P<inner>base_layer\.)?"
                        r"lora_(?P<ab>[AB])\.weight")  # fmt: skip  # path: none for Gemma-4 (layers.N.experts)
LINEAR_KEY = re.compile(r"(?P<prefix>.*?)\.layers\.(?P<layer>\d+)\.(?P<path>.+)\.(?P<proj>[a-z_0-9]+)\.lora_"
                        r"(?P<ab>[AB])\.weight")  # fmt: skip


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
        raise ExportError(f"{model_type}: not written as GGUF ({NOT_EXPORTED[model_type]}), nor per-expert or for "
                          f"vLLM (names unchecked); {PEFT_AS_IS}")  # fmt: skip
    if model_type not in FAMILIES:
        raise ExportError(f"{model_type}: no per-expert / GGUF names known for this family (known: "
                          f"{', '.join(sorted(FAMILIES))}); {PEFT_AS_IS}")  # fmt: skip
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


def expert_layers(tensors: dict[str, torch.Tensor], rank: int, names: FamilyNames | None = None
                  ) -> dict[int, ExpertLayer]:  # fmt: skip
    """Expert LoRA per layer, (E, ...) factors, from our PEFT keys, as the math sees them: B's outputs are the
    projection's rows, gate's first and then up's (Llama-4's swapped roles and GPT-OSS's interleaving undone)."""
    layers = peft_expert_layers(tensors, rank)
    if names is not None:
        layers = {n: canonical(x, names) for n, x in layers.items()}
    return layers


def canonical(x: ExpertLayer, names: FamilyNames) -> ExpertLayer:
    if names.peft_swapped:  # PEFT's delta is ours transposed: (B A)^T = A^T B^T, its A our B^T, its B our A^T
        x = ExpertLayer(x.gate_up_b.transpose(1, 2), x.gate_up_a.transpose(1, 2), x.down_b.transpose(1, 2),
                        x.down_a.transpose(1, 2))  # fmt: skip
    if names.interleaved_gate_up:  # output 2j is gate j, 2j + 1 is up j
        x = ExpertLayer(x.gate_up_a, torch.cat([x.gate_up_b[:, 0::2], x.gate_up_b[:, 1::2]], dim=1), x.down_a,
                        x.down_b)  # fmt: skip
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
        layers[layer] = ExpertLayer(unflatten_a(p["gate_up_a"], e), unflatten_b(p["gate_up_b"], e),
                                    unflatten_a(p["down_a"], e), unflatten_b(p["down_b"], e))  # fmt: skip
    return layers


def linear_factors(tensors: dict[str, torch.Tensor]) -> dict[tuple[int, str, str], dict[str, torch.Tensor]]:
    """{(layer, module path, projection): {"A": (r, in), "B": (out, r)}} of the non-expert LoRA."""
    out: dict = {}
    for key, t in tensors.items():
        if EXPERT_KEY.fullmatch(key):
            continue
        m = LINEAR_KEY.fullmatch(key)
        if m is None:
            raise ExportError(f"{key}: a LoRA tensor outside the decoder layers; these formats cannot place it")
        out.setdefault((int(m["layer"]), m["path"], m["proj"]), {})[m["ab"]] = t.float()
    return out


# ------------------------------------------------------------------------------------------ per-expert


def per_expert_tensors(tensors: dict[str, torch.Tensor], rank: int, names: FamilyNames) -> dict[str, torch.Tensor]:
    """Our PEFT tensors with the expert LoRA rewritten under per-expert module names (attention unchanged)."""
    prefix = next((m["prefix"] for k in tensors if (m := EXPERT_KEY.fullmatch(k) or LINEAR_KEY.fullmatch(k))), None)
    if prefix is None:
        raise ExportError(f"no LoRA tensor under the decoder layers (keys such as {next(iter(tensors), None)!r})")
    out = {hub_linear_key(k, names): v for k, v in tensors.items() if not EXPERT_KEY.fullmatch(k)}
    for layer, x in expert_layers(tensors, rank, names).items():
        inter = x.gate_up_b.shape[1] // 2
        for e in range(x.gate_up_a.shape[0]):
            base = f"{prefix}.layers.{layer}.{names.experts}.{e}"
            pieces = {names.gate: (x.gate_up_a[e], x.gate_up_b[e, :inter]),
                      names.up: (x.gate_up_a[e], x.gate_up_b[e, inter:]),
                      names.down: (x.down_a[e], x.down_b[e])} if names.gated else {
                      names.up: (x.gate_up_a[e], x.gate_up_b[e]), names.down: (x.down_a[e], x.down_b[e])}  # fmt: skip
            for proj, (a, b) in pieces.items():
                # gate and up share A: one copy each, contiguous (Llama-4's factors are transposed views)
                out[f"{base}.{proj}.lora_A.weight"] = a.clone(memory_format=torch.contiguous_format)
                out[f"{base}.{proj}.lora_B.weight"] = b.clone(memory_format=torch.contiguous_format)
    return out


def hub_linear_key(key: str, names: FamilyNames) -> str:
    """A non-expert LoRA key under the hub checkpoint's module names: transformers v5 calls Mixtral's MoE block
    `mlp` where the checkpoints (and vLLM) say `block_sparse_moe`, so its router `mlp.gate` is renamed back."""
    block = names.experts.rsplit(".", 1)[0]
    m = LINEAR_KEY.fullmatch(key)
    if m is None or block == "mlp" or not (m["path"] == "mlp" or m["path"].startswith("mlp.")):
        return key
    path = block + m["path"].removeprefix("mlp")
    return f"{m['prefix']}.layers.{m['layer']}.{path}.{m['proj']}.lora_{m['ab']}.weight"


def write_per_expert(adapter_dir: str | Path, out_dir: str | Path, *, rename: tuple[str, str] | None = None
                     ) -> Path:  # fmt: skip
    """The per-expert PEFT adapter of `adapter_dir` in `out_dir` (atomically); `rename`: (old, new) module path
    fragment of the runtime's own names."""
    tensors, config, model_type, names = read_run_adapter(adapter_dir)
    if model_type in PER_EXPERT_UNREAD:
        raise ExportError(f"{model_type}: {PER_EXPERT_UNREAD[model_type]}")
    converted = per_expert_tensors(tensors, int(config["r"]), names)
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
    **dict.fromkeys(("qwen3_moe", "exaone_moe", "deepseek_v2", "deepseek_v3", "glm_moe_dsa", "qwen3_next",
                     "qwen3_5_moe", "qwen3_5_moe_text", "deepseek_v32", "qwen4_exp", "qwen4_exp_text",
                     "glm5_next"), ("mlp.gate", _RUNNER_GATE)),
}  # fmt: skip
_TRANSFORMERS_BACKEND = ("served by vLLM's Transformers backend, whose expert mapping lists both the gate_proj "
                         "and the w1 names, so a per-expert adapter fails its packing assertion (lora_weights.py)")
VLLM_NO_MOE_LORA = {
    "kimi_linear": "KimiLinearForCausalLM implements no LoRA",
    "mimo_v2_flash": "MiMoV2FlashForCausalLM implements no LoRA",
    "dots1": "Dots1ForCausalLM was removed in vLLM 0.23.0",
    "cohere2_moe": "Cohere2MoeForCausalLM implements no LoRA",
    **dict.fromkeys(("dots3_note", "dots3_note_text"), "Dots3NoteForCausalLM implements no LoRA"),
    **dict.fromkeys(("hunyuan_v1_moe", "solar_open", "mellum"), _TRANSFORMERS_BACKEND),
    "mistral4": "no vLLM class of its own: its HF checkpoints fall back to the Transformers backend",
}
# Modules vLLM's class names otherwise than transformers (a LoRA under transformers' name would load unused)
# (Laguna's is mlp.shared_expert there, but a LoRA on its shared expert does not load in PEFT: refused in training)
VLLM_RENAMED = {"hy_v3": ("mlp.shared_experts.", "mlp.shared_mlp.")}


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
        raise ExportError(f"{model_type}: vLLM {VLLM_VERSION} serves no MoE LoRA for it "
                          f"({VLLM_NO_MOE_LORA[model_type]}); use the run's PEFT adapter, or gguf")  # fmt: skip
    router, why = VLLM_IGNORED_ROUTER.get(model_type, (None, ""))
    if router and any((m := LINEAR_KEY.fullmatch(k)) and f"{m['path']}.{m['proj']}" == router for k in tensors):
        raise ExportError(f"{model_type}: vLLM {VLLM_VERSION} does not apply a LoRA to this family's router "
                          f"({router}: {why}), so it would be ignored; train with lora.router: false")
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


def gguf_tensors(tensors: dict[str, torch.Tensor], rank: int, names: FamilyNames, heads: tuple[int, int], *,
                 fuse_gate_up_exps: bool = False, fuse_qkv: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
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
    n_head, n_kv = heads
    tensor_names = gguf_name_map(names.gguf_arch, 1 + max((layer for layer, _, _ in factors), default=0))
    for (layer, path, proj), ab in factors.items():
        name = gguf_linear_name(tensor_names, names.gguf_arch, layer, path, proj)
        a, b = ab["A"], ab["B"]
        if names.permute_qk and name.endswith((".attn_q", ".attn_k")):
            b = permute_rows_for_rope(b, n_head if name.endswith(".attn_q") else n_kv)
        out[f"{name}.weight.lora_a"] = a
        out[f"{name}.weight.lora_b"] = b
    if fuse_qkv:
        out = fused_qkv(out)
    return {k: v.contiguous().clone() for k, v in out.items()}


def fused_qkv(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layer's q, k and v LoRA as the one attn_qkv LoRA of a base converted with --fuse-qkv: A stacked along
    the rank (3r, in), B block-diagonal (q_out + k_out + v_out, 3r), so that B A = [B_q A_q; B_k A_k; B_v A_v].
    llama.cpp scales each LoRA by alpha over its own rank (B's columns: 3r here), so B is multiplied by 3 to keep
    each block's alpha / r."""
    layers = sorted({int(k.split(".")[1]) for k in out if re.fullmatch(r"blk\.\d+\.attn_[qkv]\.weight\.lora_a", k)})
    for layer in layers:
        pieces = [f"blk.{layer}.attn_{p}.weight" for p in "qkv"]
        if missing := [p.split(".")[2] for p in pieces if f"{p}.lora_a" not in out]:
            raise ExportError(f"layer {layer}: no LoRA on {', '.join(missing)}; a base converted with --fuse-qkv holds "
                              "one attn_qkv, whose LoRA needs q, k and v all trained (target q_proj, k_proj and "
                              "v_proj, or convert the base without --fuse-qkv)")  # fmt: skip
        a = torch.cat([out.pop(f"{p}.lora_a") for p in pieces])
        b = torch.block_diag(*[out.pop(f"{p}.lora_b") for p in pieces]) * len(pieces)
        out[f"blk.{layer}.attn_qkv.weight.lora_a"], out[f"blk.{layer}.attn_qkv.weight.lora_b"] = a, b
    return out


def gguf_name_map(arch: str, layers: int):
    """gguf's TensorNameMap of llama.cpp architecture `arch`: transformers module names -> blk.N.<kind>."""
    import gguf

    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    return gguf.get_tensor_name_map(by_name[GGUF_NAMES_FROM.get(arch, arch)], layers)


def gguf_lora_kinds(arch: str) -> set[str]:
    """The blk.N.<kind>s whose LoRA llama.cpp's `arch` graph applies (the experts aside)."""
    return (GGUF_LORA_KINDS | GGUF_EXTRA_LORA_KINDS.get(arch, set())) - GGUF_NO_LORA.get(arch, set())


def gguf_linear_name(tensor_names, arch: str, layer: int, path: str, proj: str) -> str:
    """blk.N.<kind> of the non-expert module layers.N.path.proj; an ExportError for a module llama.cpp has no
    tensor for, or one it multiplies without its LoRA (which would then be silently dropped)."""
    module = f"layers.{layer}.{path}.{proj}"
    # the hub checkpoint's root (gguf maps those names): model, or backbone (Nemotron-H, which transformers v5
    # loads as model)
    # (Granite's router, a module of its own in transformers v5, is router.layer in its checkpoints)
    candidates = [f"{root}.{m}" for root in ("model", "backbone") for m in (module, f"{module}.layer")]
    name = next((n for c in candidates if (n := tensor_names.get_name(c))), None)
    if name is None:
        if arch in GGUF_NAMES_FROM:
            raise ExportError(f"{module}: no llama.cpp name known for this LoRA target in {arch} (named as gguf's "
                              f"{GGUF_NAMES_FROM[arch]}): not written by this export yet ({PEFT_KEEPS})")
        raise ExportError(f"{module}: llama.cpp has no tensor for this LoRA target in this architecture")
    kind, kinds = name.split(".", 2)[2], gguf_lora_kinds(arch)
    if kind in GGUF_NO_LORA.get(arch, ()) or (kind not in kinds and arch in LEGACY_LORA_ARCHS):
        raise ExportError(f"{module}: llama.cpp's {arch} graph multiplies {name} without applying LoRA to it, so "
                          f"its LoRA would be ignored (it applies LoRA to the experts and "
                          f"{', '.join(sorted(kinds))})")  # fmt: skip
    if kind in GGUF_REORDERED.get(arch, ()):
        raise ExportError(f"{module}: llama.cpp's converter reorders the rows of {name} for {arch}; a LoRA's B "
                          f"would need the same order, which this export does not write yet ({PEFT_KEEPS})")
    if kind not in kinds:
        raise ExportError(f"{module}: a LoRA on llama.cpp's {name} ({arch}) is not written by this export yet: only "
                          f"{', '.join(sorted(kinds))} and the experts are ({PEFT_KEEPS})")
    return name


def write_gguf(adapter_dir: str | Path, out_file: str | Path, *, fuse_gate_up_exps: bool = False,
               fuse_qkv: bool = False) -> Path:  # fmt: skip
    """A llama.cpp LoRA GGUF (fp32 tensors) of `adapter_dir`, written atomically to `out_file`;
    `fuse_gate_up_exps` / `fuse_qkv` for a base converted with llama.cpp's flags of those names."""
    import gguf
    from transformers import AutoConfig

    from moe_qlora.model.tiny import resolve_model_path

    tensors, config, model_type, names = read_run_adapter(adapter_dir)
    if fuse_gate_up_exps and not names.fused_gate_up and names.gguf_arch not in GGUF_FUSABLE_GATE_UP:
        raise ExportError(f"{model_type}: llama.cpp's converter cannot fuse gate and up experts for its "
                          f"{names.gguf_arch} architecture (--fuse-gate-up-exps is for "
                          f"{', '.join(sorted(GGUF_FUSABLE_GATE_UP))}), so no base has ffn_gate_up_exps")  # fmt: skip
    if fuse_qkv and names.gguf_arch not in GGUF_FUSABLE_QKV:
        raise ExportError(f"{model_type}: llama.cpp's converter does not fuse q, k and v for its {names.gguf_arch} "
                          "architecture, so no base has attn_qkv; export without --fuse-qkv")  # fmt: skip
    base = AutoConfig.from_pretrained(resolve_model_path(config["base_model_name_or_path"])).get_text_config()
    heads = (base.num_attention_heads, getattr(base, "num_key_value_heads", None) or base.num_attention_heads)
    converted = gguf_tensors(tensors, int(config["r"]), names, heads, fuse_gate_up_exps=fuse_gate_up_exps,
                             fuse_qkv=fuse_qkv)  # fmt: skip
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(f".{out_file.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), names.gguf_arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(config["lora_alpha"]))
    for name, t in converted.items():
        writer.add_tensor(name, t.numpy())
    try:
        with disk_full_named(out_file, sum(t.numel() * 4 for t in converted.values())):
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
            os.replace(tmp, out_file)
    finally:
        tmp.unlink(missing_ok=True)
    return out_file
