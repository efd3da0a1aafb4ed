"""Load an adapter the way PEFT's users do, on a weightless copy of the base model, and report what did not land.

The copy ("skeleton") is the class `AutoModelForCausalLM` picks for the base config, with every weight and
buffer a zero-storage stub: a 0-d CPU tensor expanded to the weight's shape. PEFT wraps and loads it exactly
as it would the real model (its renamings, its re-targeting of MoE names), at no cost in memory whatever the
model's size. With `low_cpu_mem_usage=True` PEFT creates every LoRA tensor on the meta device and swaps in
the file's tensor when a key matches, so a LoRA tensor still on meta afterwards is one PEFT never filled.
"""

from __future__ import annotations

import copy
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file
from torch import nn

from moe_qlora.common.fileio import save_safetensors
from moe_qlora.model.classes import text_model_from_config

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
TRAINED_ON = "moe_qlora.json"  # beside the adapter: the base quantization it was trained on (export.adapter)


def clean_base_config(config):
    """A copy of a loaded model's config as its checkpoint has it: no quantization, transformers' own experts."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if getattr(config, "_experts_implementation", None) is not None:
        config._experts_implementation = "eager"
    return config


def _stub(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=t.dtype).expand(t.shape)


def skeleton(config, *, model_class=None, trust_remote_code: bool = False) -> nn.Module:
    """`model_class` (default: what the consumer's auto class picks) for `config`, with zero-storage weights.

    Built in float32 whatever the checkpoint's dtype: on a bf16 base PEFT's low_cpu_mem_usage load rounds adapter
    tensors through bf16 (257.0 comes back as 256.0), which its default load does not, and which says nothing
    about whether a tensor landed."""
    with torch.device("meta"):
        if model_class is not None:
            model = model_class._from_config(config, dtype=torch.float32)
        else:
            model = text_model_from_config(config, trust_remote_code=trust_remote_code, dtype=torch.float32)
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = nn.Parameter(_stub(p), requires_grad=False)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = _stub(b)
    return model


def module_of_key(key: str) -> str:
    """'base_model.model.model.layers.1.mlp.q_proj.lora_A.weight' -> 'model.layers.1.mlp.q_proj'."""
    return key.removeprefix(PEFT_PREFIX).split(".lora_", 1)[0]


@dataclass
class LoadReport:
    """How an adapter file fared in PEFT's `from_pretrained` (keys in the file's naming)."""

    not_loaded: list[str] = field(default_factory=list)  # in the file, but PEFT left the module's tensor at init
    changed: list[str] = field(default_factory=list)  # loaded with other values or another shape
    no_module: list[str] = field(default_factory=list)  # PEFT has LoRA tensors for these, the file does not
    renamed_to: list[str] = field(default_factory=list)  # what PEFT turned file keys into (matching nothing)
    refused: str | None = None  # PEFT raised instead of loading

    @property
    def ok(self) -> bool:
        return not (self.not_loaded or self.changed or self.no_module or self.refused)

    def failing_modules(self) -> set[str]:
        return {module_of_key(k) for k in self.not_loaded + self.changed + self.no_module}

    def describe(self, model_type: str = "") -> str:
        parts = [f"PEFT refuses to load it: {self.refused}"] if self.refused else []
        if self.not_loaded:
            cause = "PEFT's load renames these keys"
            if self.renamed_to:
                cause += f" (e.g. to {first_few(self.renamed_to)}), so they match no module"
            cause += (
                f": the checkpoint-conversion renamings transformers defines for {model_type!r}, which PEFT "
                "applies to adapter keys too"
                if model_type
                else ""
            )
            parts.append(
                f"{len(self.not_loaded)} tensor(s) stay at their initial value: {first_few(self.not_loaded)}; "
                f"likely cause: {cause}"
            )
        if self.changed:
            parts.append(f"{len(self.changed)} tensor(s) load with other values or shapes: {first_few(self.changed)}")
        if self.no_module:
            parts.append(f"PEFT creates LoRA the file lacks (a target it re-targets?): {first_few(self.no_module)}")
        return "; ".join(parts)


def first_few(keys: list[str], n: int = 4) -> str:
    """'a, b, c, d and 7 more': names in a one-sentence error."""
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def load_like_peft(adapter_dir: Path, config, **skeleton_kwargs) -> LoadReport:
    """`PeftModel.from_pretrained(base, adapter_dir)` on a skeleton of `config`, compared with the file."""
    adapter_dir = Path(adapter_dir)
    saved = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's own missing-keys warning: the report below says it with a cause
        try:
            peft_model = PeftModel.from_pretrained(
                skeleton(config, **skeleton_kwargs), str(adapter_dir), low_cpu_mem_usage=True
            )
        except (ValueError, RuntimeError, KeyError, TypeError) as exc:
            return LoadReport(refused=f"{type(exc).__name__}: {exc}")
        loaded = get_peft_model_state_dict(peft_model)
    report = LoadReport(no_module=sorted(loaded.keys() - saved.keys()))
    for key, tensor in saved.items():
        got = loaded.get(key)
        if got is None or got.is_meta:
            report.not_loaded.append(key)
        elif got.shape != tensor.shape or not torch.equal(got.to(tensor.dtype), tensor):
            report.changed.append(key)
    if report.not_loaded:
        report.renamed_to = _keys_peft_could_not_place(peft_model, adapter_dir)
    return report


def _keys_peft_could_not_place(peft_model: PeftModel, adapter_dir: Path) -> list[str]:
    """The file's keys as PEFT renamed them, where they matched no module (its `unexpected_keys`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = peft_model.load_adapter(str(adapter_dir), adapter_name="probe", low_cpu_mem_usage=True)
    return sorted(k for k in result.unexpected_keys if ".lora_" in k)


def target_modules_failing_round_trip(
    config, target_modules: list[str] | None, *, target_parameters: list[str] | None = None, **skeleton_kwargs
):
    """Modules matched by `target_modules` (or holding `target_parameters`, e.g. 'mlp.experts.down_proj') whose
    LoRA would not load as trained: (report, failing module names).

    A rank-1 adapter on a skeleton, with a distinct value per tensor, is written as our export writes adapters
    and loaded back by PEFT. Done before training, so it follows whatever the installed PEFT does.
    """
    lora = LoraConfig(
        r=1,
        lora_alpha=1,
        target_modules=list(target_modules) if target_modules else None,
        target_parameters=list(target_parameters) if target_parameters else None,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(skeleton(config, **skeleton_kwargs), lora)
        state = get_peft_model_state_dict(peft_model)
    state = {k: torch.full(v.shape, float(i + 1)) for i, (k, v) in enumerate(state.items())}
    with tempfile.TemporaryDirectory(prefix="moe-qlora-probe-") as tmp:
        save_safetensors(state, str(Path(tmp) / ADAPTER_WEIGHTS))
        peft_model.peft_config["default"].save_pretrained(tmp)
        report = load_like_peft(Path(tmp), config, **skeleton_kwargs)
    return report, report.failing_modules()
