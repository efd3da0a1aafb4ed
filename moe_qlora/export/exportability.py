"""Which export formats will refuse a run's adapter, known when the run starts: its LoRA modules (not their
values) put through the same checks `moe-qlora export` makes, so that a target llama.cpp or vLLM would not apply
is said before the training, with the --set that trains what exports, not after it.

Only the LoRA on linear modules can be refused this way (the experts' is written in every format that takes the
family), so only those tensors are read: a few MB where the experts' LoRA is GBs.
"""

from __future__ import annotations

import torch
from peft import PeftModel, get_peft_model_state_dict

from moe_qlora.export.family_tables import (
    FAMILIES,
    ExportError,
    UnexportableModules,
    retrain_advice,
    tables_model_type,
    vllm_layout,
)
from moe_qlora.export.gguf_lora import gguf_tensors
from moe_qlora.export.vllm_lora import VLLM_IGNORED_MODULE, VLLM_IGNORED_ROUTER, trained_modules, vllm_refusal


def linear_lora_tensors(model) -> dict[str, torch.Tensor]:
    """PEFT's LoRA tensors of the model's linear modules (the per-expert LoRA left out), under the file's keys."""
    if not isinstance(model, PeftModel):
        return {}
    state = get_peft_model_state_dict(model)
    return {k: v.detach().float().cpu() for k, v in state.items() if "moe_lora" not in k and ".experts." not in k}


def export_refusals(model, targets: list[str], rank: int) -> dict[str, str]:
    """{format: why `export --format` will refuse this run's adapter, with the --set that exports}; formats the
    family has no writer for at all are left to the export's own refusal."""
    model_type = tables_model_type(model.config, (*VLLM_IGNORED_MODULE, *VLLM_IGNORED_ROUTER))
    tensors = linear_lora_tensors(model)
    if model_type not in FAMILIES or not tensors:
        return {}
    config = {"target_modules": targets}
    refusals = {}
    if vllm_layout(model_type) != "refused" and (why := vllm_refusal(model_type, trained_modules(tensors), config)):
        refusals["vllm"] = why
    try:
        gguf_tensors(tensors, rank, FAMILIES[model_type], model.config.get_text_config())
    except UnexportableModules as exc:
        refusals["gguf"] = str(exc.with_advice(retrain_advice(config, set(exc.modules), "gguf")))
    except ExportError as exc:
        refusals["gguf"] = str(exc)
    return refusals
