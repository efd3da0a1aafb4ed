"""`--format vllm`: the adapter in the layout vLLM loads for the base's family (family_tables.vllm_layout): PEFT's
unchanged where vLLM's class reads fused 3D expert LoRA, the per-expert layout elsewhere, a refusal by name for a
family vLLM serves no MoE LoRA for; and a LoRA vLLM would load but never apply (a router, a module it multiplies
from the weight) refused by name rather than written to be ignored.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from moe_qlora.common.fileio import atomic_dir
from moe_qlora.export.base_fit import base_text_config, refuse_other_base
from moe_qlora.export.family_tables import (
    VLLM_NO_MOE_LORA,
    VLLM_VERSION,
    ExportError,
    base_model_type,
    retrain_advice,
    vllm_layout,
)
from moe_qlora.export.norms import read_adapter_tensors
from moe_qlora.export.peft_factors import LINEAR_KEY
from moe_qlora.export.per_expert_lora import write_per_expert
from moe_qlora.model.adapter_file import refuse_non_finite

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
# The shared expert's gate of the Qwen2-MoE block and the blocks built like it: vLLM wraps mlp.shared_expert_gate
# with the LoRA layer, but the shared expert multiplies through its own expert_gate attribute, which still holds
# the unwrapped layer (qwen2_moe.py's Qwen2MoeMLP, reused by qwen3_next.py and qwen3_5.py)
_SHARED_GATE = {
    "mlp.shared_expert_gate": "the shared expert calls its expert_gate attribute, which holds the unwrapped layer "
    "(models/qwen2_moe.py, Qwen2MoeMLP)"
}
VLLM_IGNORED_MODULE.update(dict.fromkeys(("qwen2_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"), _SHARED_GATE))
# Llama-4: Llama4ForCausalLM.load_weights reorders q_proj's and k_proj's rows for its rotary kernel
# (permute_qk_weight_for_rotary: each head's rows (i, j) for j in its 2 halves go to (j, i)) and leaves their LoRA
# as loaded, so B's rows are reordered alike here (found by vLLM's own loading: tests/export/test_vllm_oracle.py)
VLLM_ROTARY_PERMUTED = {"llama4", "llama4_text"}


def rows_permuted_for_rotary(tensors: dict[str, torch.Tensor], heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    """q_proj's and k_proj's lora_B (out, r) with rows in vLLM's Llama-4 order: per head, (out/heads/2, 2) -> (2,
    out/heads/2), what permute_qk_weight_for_rotary does to the weight."""
    out = dict(tensors)
    for key, b in tensors.items():
        if ".lora_B." in key and (".q_proj." in key or ".k_proj." in key):
            n = kv_heads if ".k_proj." in key else heads
            rows, r = b.shape
            out[key] = b.view(n, rows // n // 2, 2, r).transpose(1, 2).reshape(rows, r).contiguous()
    return out


# Modules vLLM's class names otherwise than transformers (a LoRA under transformers' name would load unused)
# (Laguna's is mlp.shared_expert there, but a LoRA on its shared expert does not load in PEFT: refused in training)
VLLM_RENAMED = {
    "hy_v3": ("mlp.shared_experts.", "mlp.shared_mlp."),
    # Granite's and PhiMoE's router: block_sparse_moe.router in transformers v5, a GateLinear named gate in vLLM
    # (PhiMoE's under the other name: vLLM refuses the whole adapter, "expected target modules in ...")
    **dict.fromkeys(
        ("granitemoe", "granitemoeshared", "granitemoe_swa", "phimoe"),
        ("block_sparse_moe.router.", "block_sparse_moe.gate."),
    ),
}


def trained_modules(keys) -> set[str]:
    """'mlp.shared_expert_gate', 'self_attn.q_proj', ...: each LoRA key's module path inside its decoder layer."""
    return {f"{m['path']}.{m['proj']}" for k in keys if (m := LINEAR_KEY.fullmatch(k))}


def vllm_refusal(model_type: str, trained: set[str], config: dict | None = None) -> str | None:
    """Why vLLM would load this family's LoRA on one of the `trained` modules and never apply it (a router, a
    module its forward bypasses), with what to do (the --set of the adapter_config's targets that exports, given
    `config`); None when it applies every one."""
    router, why = VLLM_IGNORED_ROUTER.get(model_type, (None, ""))
    if router in trained:
        return (
            f"{model_type}: vLLM {VLLM_VERSION} does not apply a LoRA to this family's router "
            f"({router}: {why}), so it would be ignored; train with lora.router: false"
        )
    ignored = VLLM_IGNORED_MODULE.get(model_type, {})
    if modules := sorted(trained & set(ignored)):
        return (
            f"{model_type}: vLLM {VLLM_VERSION} does not apply a LoRA to {', '.join(modules)} "
            f"({ignored[modules[0]]}), so it would be ignored; "
            + (retrain_advice(config, set(modules), "vllm") if config else "train without it")
        )
    return None


def write_vllm(adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """The adapter in the layout vLLM loads for its base's family: PEFT's unchanged where vLLM reads fused 3D
    expert weights, per-expert keys elsewhere; a family vLLM serves no MoE LoRA for is refused by name."""
    import shutil

    tensors, config, source = read_adapter_tensors(adapter_dir)
    if config is None:
        raise ExportError(f"{adapter_dir}: no adapter_config.json")
    refuse_non_finite(tensors, source, "export")
    model_type = base_model_type(config, Path(adapter_dir))
    if model_type in VLLM_NO_MOE_LORA:
        raise ExportError(
            f"{model_type}: vLLM {VLLM_VERSION} serves no MoE LoRA for it "
            f"({VLLM_NO_MOE_LORA[model_type]}); use the run's PEFT adapter, or gguf"
        )
    if refusal := vllm_refusal(model_type, trained_modules(tensors), config):
        raise ExportError(refusal)
    if vllm_layout(model_type) != "fused-3d":  # per-expert, or its refusal with the reason
        transform = None
        if model_type in VLLM_ROTARY_PERMUTED:
            text = base_text_config(config, Path(adapter_dir)).get_text_config()
            heads, kv = text.num_attention_heads, text.num_key_value_heads
            transform = partial(rows_permuted_for_rotary, heads=heads, kv_heads=kv)
        return write_per_expert(adapter_dir, out_dir, rename=VLLM_RENAMED.get(model_type), transform=transform)
    refuse_other_base(tensors, config, Path(adapter_dir))  # (write_per_expert checks its own)
    with atomic_dir(out_dir) as tmp:
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            shutil.copyfile(Path(adapter_dir) / name, tmp / name)
    return Path(out_dir)
