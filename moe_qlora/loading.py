"""Load a MoE checkpoint through `from_pretrained`, quantizing while loading.

A transformers quantizer (a subclass of the bitsandbytes 4-bit one) makes every `nn.Linear` a bitsandbytes
Linear4bit and every fused expert stack (`gate_up_proj`, `down_proj`, 3D) an NF4 Params4bit. transformers
loads one tensor at a time when quantizing on the fly, so the full-precision experts of the whole model
are never in memory together; its checkpoint conversions (per-expert legacy layouts) run before ours.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import bitsandbytes as bnb
import torch
from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig
from transformers.core_model_loading import ConversionOps
from transformers.integrations.bitsandbytes import Bnb4bitQuantize
from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.quantizers.base import get_keys_to_not_convert
from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer
from transformers.quantizers.quantizers_utils import get_module_from_name

from .experts import EXPERT_PARAMS, apply_moe_qlora_experts, experts_modules, is_experts_module
from .nf4 import quantize_stack, stack_nbytes

log = logging.getLogger(__name__)

QUANT_METHOD = "moe_qlora"
# Routers and gates stay in the compute dtype: they are tiny and their precision decides routing.
ROUTER_PATTERNS = ["gate", "router", "shared_expert_gate"]


class ModelLoadError(ValueError):
    """A model path or checkpoint that cannot be loaded as asked."""


@register_quantization_config(QUANT_METHOD)
class MoEQLoRAQuantConfig(BitsAndBytesConfig):
    """bitsandbytes NF4 for linears plus NF4 expert stacks; `expert_double_quant` compresses expert scales."""

    def __init__(self, *, expert_double_quant: bool = False, **kwargs):
        kwargs.setdefault("load_in_4bit", True)
        kwargs.setdefault("bnb_4bit_quant_type", "nf4")
        super().__init__(**kwargs)
        self.expert_double_quant = expert_double_quant
        self.quant_method = QUANT_METHOD

    def to_dict(self):
        return {**super().to_dict(), "expert_double_quant": self.expert_double_quant, "quant_method": QUANT_METHOD}


class _QuantizeOnLoad(ConversionOps):
    """Quantize one loaded tensor: expert stacks to NF4 Params4bit, linears the bitsandbytes way."""

    def __init__(self, quantizer: MoEQLoRAQuantizer):
        self.quantizer = quantizer
        self.linear_op = Bnb4bitQuantize(quantizer)

    def convert(self, input_dict, model=None, **kwargs):
        result = {}
        for name, value in input_dict.items():
            value = value[0] if isinstance(value, list) else value
            module, param_name = get_module_from_name(model, name)
            if is_experts_module(module) and param_name in EXPERT_PARAMS:
                result[name] = quantize_stack(value, double_quant=self.quantizer.quantization_config.expert_double_quant)
                module._is_hf_initialized = True
            else:
                result.update(self.linear_op.convert({name: value}, model=model, **kwargs))
        return result


@register_quantizer(QUANT_METHOD)
class MoEQLoRAQuantizer(Bnb4BitHfQuantizer):
    """Bitsandbytes 4-bit quantizer that also quantizes fused 3D expert stacks to NF4."""

    def _process_model_before_weight_loading(self, model, device_map, **kwargs):
        skips = set(self.quantization_config.llm_int8_skip_modules or [])
        skips.update(get_keys_to_not_convert(model))
        skips.update(ROUTER_PATTERNS)
        self.quantization_config.llm_int8_skip_modules = sorted(skips)
        super()._process_model_before_weight_loading(model, device_map, **kwargs)

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        module, name = get_module_from_name(model, param_name)
        if is_experts_module(module) and name in EXPERT_PARAMS:
            return True
        return super().param_needs_quantization(model, param_name, **kwargs)

    def get_quantize_ops(self):
        return _QuantizeOnLoad(self)


@dataclass(frozen=True)
class LoadOptions:
    """How to load: where from, the compute dtype, and quantization choices."""

    name_or_path: str
    compute_dtype: torch.dtype = torch.float32
    expert_double_quant: bool = False
    linear_double_quant: bool = False
    trust_remote_code: bool = False
    strict: bool = True
    device: str = "cpu"


def check_model_path(name_or_path: str) -> None:
    """A local-looking path must exist and hold a config and weights; anything else is taken as a hub id."""
    looks_local = os.path.isabs(name_or_path) or name_or_path.startswith((".", "~")) or os.path.exists(name_or_path)
    if not looks_local:
        return
    path = os.path.expanduser(name_or_path)
    if not os.path.isdir(path):
        raise ModelLoadError(f"model path {name_or_path!r} does not exist")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ModelLoadError(f"model path {name_or_path!r} has no config.json")
    if not any(f.endswith(".safetensors") or f.endswith(".safetensors.index.json") for f in os.listdir(path)):
        raise ModelLoadError(f"model path {name_or_path!r} has no .safetensors weights (only safetensors are loaded)")


def load_model(opts: LoadOptions):
    """Load a causal LM with NF4 experts and 4-bit linears, routed through the moe-qlora experts layer."""
    check_model_path(opts.name_or_path)
    config = AutoConfig.from_pretrained(opts.name_or_path, trust_remote_code=opts.trust_remote_code)
    quant = MoEQLoRAQuantConfig(
        expert_double_quant=opts.expert_double_quant,
        bnb_4bit_use_double_quant=opts.linear_double_quant,
        bnb_4bit_compute_dtype=opts.compute_dtype,
    )
    model = AutoModelForCausalLM.from_pretrained(
        opts.name_or_path,
        config=config,
        quantization_config=quant,
        dtype=opts.compute_dtype,
        device_map={"": opts.device},
        trust_remote_code=opts.trust_remote_code,
        use_safetensors=True,
    )
    if opts.compute_dtype != torch.bfloat16:
        keep_linears_in_compute_dtype(model)
    if opts.strict:
        assert_experts_quantized(model)
    if experts_modules(model):
        apply_moe_qlora_experts(model)
    return model


def keep_linears_in_compute_dtype(model) -> None:
    """Stop bitsandbytes from switching 4-bit linears to its bf16 CPU kernel in eval mode.

    On AVX512-BF16 CPUs, Linear4bit (eval mode, no grad) repacks its weight in place and computes in
    bf16 whatever compute dtype was asked; an fp32 run must stay fp32 in training and in generation.
    """
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def assert_experts_quantized(model) -> None:
    """Strict check: no expert stack (any floating-point 3D parameter) was left in high precision."""
    leftovers = [
        f"{name} {tuple(p.shape)} {p.dtype}"
        for name, p in model.named_parameters()
        if p.dim() == 3 and p.is_floating_point() and not isinstance(p, bnb.nn.Params4bit)
    ]
    if leftovers:
        raise ModelLoadError(
            "expert stacks left in high precision (unknown expert layout?): " + "; ".join(leftovers[:8])
            + (f" and {len(leftovers) - 8} more" if len(leftovers) > 8 else "")
        )


def parameter_bytes_by_kind(model) -> dict[str, int]:
    """Bytes of the model's weights, by kind: NF4 experts, other 4-bit weights, LoRA, the rest."""
    kinds = {"experts_nf4": 0, "linear_4bit": 0, "lora": 0, "other": 0}
    for name, p in model.named_parameters():
        if isinstance(p, bnb.nn.Params4bit):
            kind = "experts_nf4" if name.rsplit(".", 1)[-1] in EXPERT_PARAMS else "linear_4bit"
            kinds[kind] += stack_nbytes(p)
        elif p.requires_grad or "lora" in name:
            kinds["lora"] += p.numel() * p.element_size()
        else:
            kinds["other"] += p.numel() * p.element_size()
    return kinds
