"""Load a MoE checkpoint through `from_pretrained`, quantizing while loading.

A transformers quantizer (a subclass of the bitsandbytes 4-bit one) makes every `nn.Linear` a bitsandbytes
Linear4bit and every fused expert stack (`gate_up_proj`, `down_proj`, 3D) an NF4 Params4bit. transformers
loads one tensor at a time when quantizing on the fly, so the full-precision experts of the whole model
are never in memory together; its checkpoint conversions (per-expert legacy layouts) run before ours.
"""

from __future__ import annotations

import logging
import re
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import bitsandbytes as bnb
import torch
from transformers import BitsAndBytesConfig
from transformers.core_model_loading import ConversionOps
from transformers.integrations.bitsandbytes import Bnb4bitQuantize
from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.quantizers.base import get_keys_to_not_convert
from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer
from transformers.quantizers.quantizers_utils import get_module_from_name

from moe_qlora.common.memory import large_allocations_mapped, release_freed_memory
from moe_qlora.model.attention import choose_attention
from moe_qlora.model.checkpoint_files import (
    check_model_path,
    checkpoint_files,
    lazy_state_dict,
    local_checkpoint,
    read_model_config,
    stored_dtype,
)
from moe_qlora.model.classes import text_generation_class
from moe_qlora.model.distributed import Ranks, shard_rows
from moe_qlora.model.loaded_model import assert_experts_quantized, declared_experts
from moe_qlora.model.published import chosen_expert_format, dequantized_as_read
from moe_qlora.model.published_experts import ExpertReader, stacks_read_by_expert
from moe_qlora.model.published_tensors import ModelLoadError
from moe_qlora.moe.expert_stacks import experts_modules
from moe_qlora.moe.experts import apply_moe_qlora_experts
from moe_qlora.moe.layer_state import read_state
from moe_qlora.moe.layouts import (
    adopt_dense_input_experts,
    adopt_split_gate_up_experts,
    fuse_gate_up,
    quantized_stack_names,
    unsupported_layout,
)
from moe_qlora.moe.nf4 import BLOCKSIZE, quantize_stack
from moe_qlora.moe.offload import move_param
from moe_qlora.moe.stack_surgery import declare_mxfp4_stacks

log = logging.getLogger(__name__)

QUANT_METHOD = "moe_qlora"
# Routers and gates stay in the compute dtype: they are tiny and their precision decides routing.
ROUTER_PATTERNS = ["gate", "router", "shared_expert_gate"]


@register_quantization_config(QUANT_METHOD)
class MoEQLoRAQuantConfig(BitsAndBytesConfig):
    """bitsandbytes NF4 for linears plus NF4 expert stacks; `expert_double_quant` compresses expert scales."""

    def __init__(
        self,
        *,
        expert_double_quant: bool = False,
        experts_mxfp4: bool = False,
        experts_on_host: frozenset[str] = frozenset(),
        stacks_read_by_expert: frozenset[str] = frozenset(),
        expert_shard: Ranks | None = None,
        **kwargs,
    ):
        kwargs.setdefault("load_in_4bit", True)
        kwargs.setdefault("bnb_4bit_quant_type", "nf4")
        super().__init__(**kwargs)
        self.expert_double_quant = expert_double_quant
        self.experts_mxfp4 = experts_mxfp4  # experts kept as the checkpoint's MXFP4 blocks and scales, not NF4
        self.experts_on_host = experts_on_host  # experts modules stored on the host: a loading choice, not saved
        # expert stacks the loader quantizes itself as each expert is decoded (not handed to transformers): not saved
        self.stacks_read_by_expert = stacks_read_by_expert
        self.expert_shard = expert_shard  # FSDP: quantize only the experts this rank keeps (shard_rows); not saved
        self.quant_method = QUANT_METHOD

    def to_dict(self):
        saved = {
            k: v
            for k, v in super().to_dict().items()
            if k not in ("experts_on_host", "stacks_read_by_expert", "expert_shard")
        }
        formats = {"expert_double_quant": self.expert_double_quant, "experts_mxfp4": self.experts_mxfp4}
        return {**saved, **formats, "quant_method": QUANT_METHOD}


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
            if param_name in quantized_stack_names(module):
                config = self.quantizer.quantization_config
                # split gate/up stacks are fused after loading, from every expert's decoded weights: read whole
                held = None if read_state(module).split_gate_up else held_experts(value.shape[0], config.expert_shard)
                result[name] = quantize_stack(value, double_quant=config.expert_double_quant, held=held)
                if name.rsplit(".", 1)[0] in self.quantizer.quantization_config.experts_on_host:
                    move_param(result[name], "cpu")  # stored on the host: the GPU never holds every expert
                module._is_hf_initialized = True
                # Quantizing a stack leaves a heap of freed per-expert temporaries; without handing them back,
                # glibc's heap grows layer after layer (measured: +1 GB over 6 layers of a 3 GB checkpoint).
                release_freed_memory()
            else:
                result.update(self.linear_op.convert({name: value}, model=model, **kwargs))
        return result


def cpu_unsafe_linears(model) -> list[str]:
    """Linears bitsandbytes cannot run in 4-bit on the CPU: those they stay in the compute dtype.

    bitsandbytes 0.50's CPU Linear4bit decodes weights whose in_features is not a multiple of the blocksize
    (64) wrongly (errors of order 1 in the output; tested in test_families), so they are left unquantized.
    """
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m.in_features % BLOCKSIZE]
    if names:
        log.warning(
            "keeping %d linear(s) unquantized on CPU (in_features not a multiple of %d): %s",
            len(names),
            BLOCKSIZE,
            ", ".join(names[:6]) + (" ..." if len(names) > 6 else ""),
        )
    return names


def linears_outside_the_text_model(model) -> list[str]:
    """Linears of a multimodal model outside its language model (vision tower, projector): they stay frozen in
    the compute dtype, since only text is trained."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    prefix = next((n for n, m in model.named_modules() if m is decoder), "")
    if decoder is None or not prefix or prefix == getattr(model, "base_model_prefix", None):
        return []
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not n.startswith(prefix + ".") and n != "lm_head"
    ]


def linears_not_quantized(model, *, on_cpu: bool) -> set[str]:
    """Patterns of linears that stay in the compute dtype: the output head, routers and gates, a multimodal
    model's vision parts, the modules the model keeps in fp32 (DeepSeek-V4's compressor), and on the CPU the
    linears bitsandbytes cannot run in 4-bit. The quantizer and `plan` both use this rule."""
    skips = set(get_keys_to_not_convert(model)) | set(ROUTER_PATTERNS) | set(linears_outside_the_text_model(model))
    skips |= set(getattr(model, "_keep_in_fp32_modules", None) or [])  # as transformers' quantizers skip them
    return skips | set(cpu_unsafe_linears(model)) if on_cpu else skips


@register_quantizer(QUANT_METHOD)
class MoEQLoRAQuantizer(Bnb4BitHfQuantizer):
    """Bitsandbytes 4-bit quantizer that also quantizes fused 3D expert stacks to NF4."""

    def _process_model_before_weight_loading(self, model, device_map, **kwargs):
        adopt_dense_input_experts(model)  # before loading, so their stacks are quantized as experts
        adopt_split_gate_up_experts(model)
        if self.quantization_config.experts_mxfp4:
            declare_mxfp4_stacks(model)
        for name in self.quantization_config.stacks_read_by_expert:  # loaded after, by quantize_read_by_expert
            if ignored_on_load(model, name):
                continue
            _, module, stack = stack_of(model, name)
            del module._parameters[stack]
            module._is_hf_initialized = True  # its model's _init_weights would reach for the stack
        skips = set(self.quantization_config.llm_int8_skip_modules or [])
        on_cpu = all(str(d).startswith("cpu") for d in (device_map or {"": "cpu"}).values())
        skips.update(linears_not_quantized(model, on_cpu=on_cpu))
        self.quantization_config.llm_int8_skip_modules = sorted(skips)
        super()._process_model_before_weight_loading(model, device_map, **kwargs)

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        module, name = get_module_from_name(model, param_name)
        if name in quantized_stack_names(module):
            return True
        return super().param_needs_quantization(model, param_name, **kwargs)

    def get_quantize_ops(self):
        return _QuantizeOnLoad(self)


@dataclass(frozen=True)
class LoadOptions:
    """How to load: where from, the compute dtype, and quantization choices. The defaults are the plainest load
    (no nested scales); a run's choices come from its config (build.build_policy: model.expert_double_quant is on
    by default there), which a script measuring what a run does must pass."""

    name_or_path: str
    compute_dtype: torch.dtype = torch.float32
    expert_double_quant: bool = False
    linear_double_quant: bool = False
    trust_remote_code: bool = False
    strict: bool = True
    device: str = "cpu"
    # expert offload: the experts modules (by name) whose NF4 stacks are stored in host memory, each leaving the
    # compute device as soon as it is quantized; everything else is stored where it is computed (`device`)
    experts_on_host: frozenset[str] = frozenset()
    expert_format: str = "auto"  # auto | nf4 | mxfp4 (published.chosen_expert_format)
    # FSDP: this rank's place; each NF4 expert stack is quantized (and, without double quantization, read) for
    # the experts the rank keeps alone, so no rank holds the whole 4-bit model while loading
    expert_shard: Ranks | None = None


def load_model(opts: LoadOptions):
    """Load a causal LM with NF4 experts and 4-bit linears, routed through the moe-qlora experts layer.

    Tensors are quantized from the dtype they are stored in (no whole-model upcast); what stays
    unquantized (norms, router, embeddings) is then cast to the compute dtype.
    """
    check_model_path(opts.name_or_path, tokenizer=False)
    folder = local_checkpoint(opts.name_or_path)
    files = checkpoint_files(folder)
    config = read_model_config(str(folder), trust_remote_code=opts.trust_remote_code)
    expert_format = chosen_expert_format(config, opts.expert_format, folder)
    if expert_format == "mxfp4" and opts.experts_on_host:
        raise ModelLoadError(
            f"{folder}: model.expert_offload with MXFP4 experts is not built yet: set model.expert_offload none, or "
            "model.expert_format nf4 to offload NF4 experts"
        )
    model_class = causal_lm_class(config, folder, opts.trust_remote_code)
    if "Diffusion" in model_class.__name__:
        raise ModelLoadError(
            f"{model_class.__name__}: not supported: a diffusion language model, trained to denoise "
            "masked tokens; moe-qlora trains next-token prediction, the wrong objective for it"
        )
    attention = choose_attention(model_class, opts.device)
    mapped = large_allocations_mapped if opts.expert_shard is not None else nullcontext  # by rank: its bound
    with mapped(), lazy_state_dict(files) as state:
        # FP8 block-scaled weights decoded as read, MXFP4 experts too unless kept; other formats refused
        state = dequantized_as_read(state, config, folder, keep_mxfp4=expert_format == "mxfp4")
        by_expert = stacks_read_by_expert(state, getattr(config, "model_type", None))
        read_by_expert = {fused.name for fused in by_expert.values()}
        state = {k: v for k, v in state.items() if k not in read_by_expert}
        quant = MoEQLoRAQuantConfig(
            expert_double_quant=opts.expert_double_quant,
            experts_mxfp4=expert_format == "mxfp4",
            bnb_4bit_use_double_quant=opts.linear_double_quant,
            bnb_4bit_compute_dtype=opts.compute_dtype,
            experts_on_host=opts.experts_on_host,
            stacks_read_by_expert=frozenset(by_expert),
            expert_shard=opts.expert_shard,
        )
        model = model_class.from_pretrained(
            None,
            config=config,
            **attention.load_kwargs(),
            state_dict=state,
            quantization_config=quant,
            dtype=stored_dtype(state),
            device_map={"": opts.device},
            trust_remote_code=opts.trust_remote_code,
        )
        quantize_read_by_expert(model, by_expert, opts)
    model.name_or_path = str(folder)
    model.expert_format = expert_format
    model.attention_choice = attention.as_loaded(model.config)
    with mapped():
        fuse_gate_up(
            model,
            lambda stack: quantize_stack(
                stack, double_quant=opts.expert_double_quant, held=held_experts(stack.shape[0], opts.expert_shard)
            ),
        )
    cast_unquantized(model, opts.compute_dtype)
    release_freed_memory()
    if torch.device(opts.device).type == "cuda":
        # the bf16 stacks quantized while loading leave freed blocks of their size in the caching allocator: hand
        # them back, so that what stays reserved is what training uses (on an H200 a run's peak reserved was
        # 1.6-1.8x its peak allocated; how much of that came from loading is not measured yet)
        torch.cuda.empty_cache()
    keep_linears_differentiable(model)
    if (reason := unsupported_layout(model)) is not None:
        raise ModelLoadError(f"{type(model).__name__}: not supported: {reason}")
    if opts.strict:
        assert_experts_quantized(model)
    found, declared = experts_modules(model), declared_experts(model.config)
    if declared > 1 and not found:
        raise ModelLoadError(
            f"no experts module on transformers' experts interface (an expert layout moe-qlora does not know), though "
            f"the config of {type(model).__name__} declares {declared} experts: refusing rather than training it as "
            "a dense model with its experts untouched"
        )
    if found:
        apply_moe_qlora_experts(model)
    return model


def quantize_read_by_expert(model, stacks: dict, opts: LoadOptions) -> None:
    """Each stack of `stacks` ({parameter name: published_experts.FusedExpertsTensor}) quantized to NF4 an expert at
    a time as each is decoded, and set on its module: a layer's experts are never whole in bf16."""
    for name, fused in stacks.items():
        if ignored_on_load(model, name):
            continue
        path, module, stack = stack_of(model, name, removed=True)
        reader = ExpertReader(fused)
        held = held_experts(reader.shape[0], opts.expert_shard)
        param = quantize_stack(reader, double_quant=opts.expert_double_quant, device=opts.device, held=held)
        if path in opts.experts_on_host:
            move_param(param, "cpu")
        module.register_parameter(stack, param)
        release_freed_memory()


def held_experts(num_experts: int, shard: Ranks | None) -> range | None:
    """The experts a rank quantizes when loading for FSDP (those its shard keeps), or None: all of them."""
    return None if shard is None or not shard.enabled else shard_rows(num_experts, shard)


def ignored_on_load(model, name: str) -> bool:
    """Whether transformers leaves the checkpoint's key `name` unloaded on purpose (the model's
    `_keys_to_ignore_on_load_unexpected`: DeepSeek-V3's and V4's multi-token-prediction layers, which the model
    has no module for), with or without the base model's prefix."""
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    prefix = getattr(model, "base_model_prefix", "")
    keys = {name, f"{prefix}.{name}"} if prefix else {name}
    return any(re.search(pattern, key) for pattern in patterns for key in keys)


def stack_of(model, name: str, *, removed: bool = False) -> tuple[str, torch.nn.Module, str]:
    """(module path, module, parameter) of the checkpoint's stack `name` in the model: as named, or with the base
    model's prefix, which a checkpoint saved without it lacks (DeepSeek-V4's release names its layers `layers.N`)
    and transformers' loader adds. removed: the quantizer has taken the parameter out already."""
    prefix = getattr(model, "base_model_prefix", "")
    for candidate in dict.fromkeys([name, f"{prefix}.{name}" if prefix else name]):
        path, _, stack = candidate.rpartition(".")
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        if removed or stack in module._parameters:
            return path, module, stack
    raise ModelLoadError(f"{name}: a stack of the checkpoint that is no parameter of the model")


def causal_lm_class(config, folder: Path, trust_remote_code: bool):
    """The model class AutoModelForCausalLM would pick (a state dict load takes no path to pick from)."""
    remote = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM")
    if remote and trust_remote_code:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return get_class_from_dynamic_module(remote, str(folder))
    model_class = text_generation_class(config)
    if model_class is None:
        hint = " (its code ships with the checkpoint: set model.trust_remote_code: true)" if remote else ""
        raise ModelLoadError(f"{folder}: {type(config).__name__} is not a causal LM transformers knows{hint}")
    return model_class


def cast_unquantized(model, dtype: torch.dtype) -> None:
    """Floating parameters that are not 4-bit to `dtype`; 4-bit linears dequantize straight to `dtype`."""
    for p in model.parameters():
        if isinstance(p, bnb.nn.Params4bit):
            p.quant_state.dtype = dtype  # decode level * scale in `dtype`, not in the stored dtype
        elif p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    model.config.dtype = dtype


def keep_linears_differentiable(model) -> None:
    """Stop bitsandbytes from switching 4-bit linears to its packed bf16 CPU kernel.

    On AVX512-BF16 CPUs, Linear4bit repacks its weight in place at its first eval-mode, no-grad call (the
    chunked-loss check before the first step, an eval, a GRPO rollout) and from then on sends every call, training
    included, through `gemv_4bit`, which has no autograd formula: the gradient through the layer's input is
    silently dropped (bitsandbytes 0.50.2: x.grad stays None), and an fp32 run computes those layers in bf16.
    """
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
