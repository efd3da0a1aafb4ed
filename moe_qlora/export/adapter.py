"""Save an adapter in PEFT's own format (experts in the layout PEFT uses for `target_parameters`, converted by
model.peft_adapter), record the base it was trained on, and verify the folder as its consumer will read it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file

from moe_qlora.common.fileio import atomic_dir, save_safetensors
from moe_qlora.config.sections import LoraSection
from moe_qlora.model.adapters import target_parameter_names
from moe_qlora.model.peft_adapter import adapter_state_dict
from moe_qlora.model.peft_roundtrip import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    TRAINED_ON,
    clean_base_config,
    first_few,
    load_like_peft,
)
from moe_qlora.moe.expert_stacks import decoded_stack, experts_modules, holds_mxfp4, stack_names
from moe_qlora.moe.layer_state import read_state
from moe_qlora.moe.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX


def adapter_config(model, cfg: LoraSection, base_model_name_or_path: str) -> LoraConfig:
    peft = model.peft_config["default"] if isinstance(model, PeftModel) else None
    linear_targets = sorted(peft.target_modules or []) if peft else []
    router_targets = sorted(peft.target_parameters or []) if peft else []
    target_parameters = target_parameter_names(model) + router_targets
    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        # PEFT refuses to load LoRA on parameters (experts, routers) with dropout; it only matters in training
        lora_dropout=0.0 if target_parameters else cfg.dropout,
        # an empty list, not None: given None, PEFT adds LoRA on its own default targets for the family when it
        # loads the adapter (zero-initialized, reported as missing keys: Gemma-4's q_proj and v_proj)
        target_modules=linear_targets,
        target_parameters=target_parameters or None,
        base_model_name_or_path=base_model_name_or_path,
        task_type="CAUSAL_LM",
    )


def base_quantization(model) -> dict[str, bool | str]:
    """How the base was quantized when the adapter was trained: the weights it learned against (double
    quantization changes each decoded weight by up to ~1e-3 of its block's absmax; MXFP4 experts kept as
    published are other weights than their NF4 re-quantization): model.* settings by name."""
    import bitsandbytes as bnb

    nested = {"expert_double_quant": None, "linear_double_quant": None}
    expert_stacks = set()
    for _, m in experts_modules(model):
        if (was_nested := read_state(m).nested_scales) is not None:  # made shardable: scales decoded
            nested["expert_double_quant"] = bool(nested["expert_double_quant"]) or was_nested
        elif not holds_mxfp4(m):  # MXFP4 stacks are the checkpoint's own bytes: nothing to record
            expert_stacks |= {id(getattr(m, n)) for n in stack_names(m)}
    for p in model.parameters():
        if isinstance(p, bnb.nn.Params4bit) and p.quant_state is not None:
            key = "expert_double_quant" if id(p) in expert_stacks else "linear_double_quant"
            nested[key] = bool(nested[key]) or bool(p.quant_state.nested)
    recorded: dict[str, bool | str] = {k: bool(v) for k, v in nested.items() if v is not None}
    if experts_modules(model):
        recorded["expert_format"] = "mxfp4" if any(holds_mxfp4(m) for _, m in experts_modules(model)) else "nf4"
    return recorded


def save_adapter(model, out_dir: str | Path, *, cfg: LoraSection, base_model_name_or_path: str) -> Path:
    """Write adapter_model.safetensors + adapter_config.json atomically into `out_dir`, and beside them
    moe_qlora.json: the base's quantization, so that generate and merge rebuild the weights it was trained on."""
    state = adapter_state_dict(model)
    config = adapter_config(model, cfg, base_model_name_or_path)
    with atomic_dir(out_dir, sum(t.numel() * t.element_size() for t in state.values())) as tmp:
        save_safetensors(state, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / TRAINED_ON).write_text(json.dumps({"base_quantization": base_quantization(model)}, indent=2))
        config_dict = config.to_dict()
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(_jsonable(config_dict), indent=2, sort_keys=True))
    return Path(out_dir)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [_jsonable(v) for v in (sorted(obj) if isinstance(obj, set) else obj)]
    if hasattr(obj, "value"):  # enums
        return obj.value
    return obj


def plain_key(name: str) -> str:
    """A parameter name of the adapted model as the plain transformers model names it."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def dequantized_base_state_dict(model, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The base model's weights as the training model sees them (4-bit ones dequantized), under the
    names of the plain transformers model: what a merge, or an exact reference model, starts from."""
    import bitsandbytes as bnb

    from moe_qlora.moe.nf4 import dequantize_param

    state = {}
    for name, p in model.named_parameters():
        if "lora" in name:
            continue
        key = plain_key(name)
        state[key] = dequantize_param(p, dtype) if isinstance(p, bnb.nn.Params4bit) else p.detach().to(dtype)
    for name, module in experts_modules(model):  # fused shared-expert stacks back to the checkpoint's gate / up
        if holds_mxfp4(module):  # the published MXFP4 bytes decoded (exactly) to the module's own stacks
            key = name.removeprefix(PEFT_PREFIX)
            for stack in stack_names(module):
                state.pop(f"{key}.{stack}{BLOCKS_SUFFIX}"), state.pop(f"{key}.{stack}{SCALES_SUFFIX}")
                state[f"{key}.{stack}"] = decoded_stack(module, stack, dtype)
        if read_state(module).split_gate_up:
            key = name.removeprefix(PEFT_PREFIX)
            state[f"{key}.gate_proj"], state[f"{key}.up_proj"] = state.pop(f"{key}.gate_up_proj").chunk(2, dim=1)
    return state


class AdapterVerificationError(RuntimeError):
    """A written adapter that does not hold the run's LoRA, or that PEFT would not load as trained."""


def _base_model(model):
    return model.get_base_model() if isinstance(model, PeftModel) else model


def untracked_trainables(model) -> list[str]:
    """Trainable parameters the export has no key for: anything but PEFT's LoRA (exported by PEFT's own state
    dict) and the expert LoRA of experts modules (exported by module_lora_to_peft)."""
    exported = {
        id(p) for _, m in experts_modules(model) if (lora := getattr(m, "moe_lora", None)) for p in lora.factors()
    }
    return sorted(
        n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n and id(p) not in exported
    )


def verify_adapter(model, adapter_dir: str | Path) -> int:
    """Check a written adapter the way its consumer will read it; returns the number of tensors checked.

    1. Every trainable tensor of the run is in the file, with the values the run has (in PEFT's layout).
    2. `PeftModel.from_pretrained` on the base model (a weightless skeleton of it) puts every tensor of the
       file into a module with the same values, and creates no LoRA tensor the file lacks.
    Raises AdapterVerificationError naming the keys and the likely cause; the adapter is left as written.
    """
    adapter_dir = Path(adapter_dir)
    expected = adapter_state_dict(model)
    saved = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    problems = []
    if untracked := untracked_trainables(model):
        problems.append(f"trainable parameters with no key in the export: {first_few(untracked)}")
    if missing := sorted(expected.keys() - saved.keys()):
        problems.append(f"tensors of the run missing from the file: {first_few(missing)}")
    if extra := sorted(saved.keys() - expected.keys()):
        problems.append(f"tensors in the file the run does not have: {first_few(extra)}")
    if differ := sorted(k for k in expected.keys() & saved.keys() if not torch.equal(expected[k], saved[k])):
        problems.append(f"tensors whose values differ from the run's: {first_few(differ)}")
    base = _base_model(model)
    report = load_like_peft(adapter_dir, clean_base_config(base.config), model_class=type(base))
    if not report.ok:
        problems.append("loaded by PEFT's from_pretrained, " + report.describe(base.config.model_type))
    if problems:
        raise AdapterVerificationError(
            f"the adapter written to {adapter_dir} would not load as trained: "
            + "; ".join(problems)
            + ". The file is kept as written."
        )
    return len(saved)
