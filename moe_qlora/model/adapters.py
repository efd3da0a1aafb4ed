"""Attach the trainable adapters: PEFT LoRA on the 4-bit linears, ours on the NF4 experts.

PEFT does LoRA on bitsandbytes Linear4bit well; for experts it would wrap full-precision 3D weights, so
experts get `ExpertLoRA` (see moe/expert_lora.py). Everything else is frozen.
"""

from __future__ import annotations

import contextlib
import logging
import re

import peft
import torch
from peft import LoraConfig, get_peft_model
from transformers.modeling_layers import GradientCheckpointingLayer

from moe_qlora.common.saved_offload import HostCopies, SavedOffload, copies_for
from moe_qlora.config.sections import ConfigError, LoraSection
from moe_qlora.model.families import resolve_targets
from moe_qlora.model.peft_roundtrip import clean_base_config, first_few, target_modules_failing_round_trip
from moe_qlora.moe.expert_lora import ExpertLoRA, attach_expert_lora
from moe_qlora.moe.expert_stacks import UnsupportedExpertsError, experts_modules
from moe_qlora.moe.layouts import consumer_stack_names

log = logging.getLogger(__name__)


def attach_adapters(model, cfg: LoraSection, *, seed: int, device=None):
    """Freeze the base model, add LoRA on `device` (default: where the model computes, which is not where
    offloaded experts are stored); returns the model to train (a PeftModel when linears are targeted)."""
    for p in model.parameters():
        p.requires_grad_(False)
    targets = resolve_targets(model, cfg.target_modules)
    routers = router_parameter_names(model) if cfg.router else []
    if cfg.router and not routers:
        raise ConfigError("lora.router: true, but this model has no MoE router weight to adapt")
    if targets or routers:
        peft_config = LoraConfig(
            r=cfg.rank,
            lora_alpha=cfg.alpha,
            lora_dropout=cfg.dropout,
            target_modules=targets or None,
            target_parameters=routers or None,
        )
        model = seeded_peft_model(model, peft_config, seed)
    if cfg.experts:
        if not experts_modules(model):
            log.warning("no MoE experts found: training LoRA on the linears only (plain QLoRA)")
        attach_expert_lora(model, rank=cfg.rank, alpha=cfg.alpha, seed=seed, device=device)
    refuse_parameter_lora_peft_would_drop(model, routers)
    return model


def seeded_peft_model(model, peft_config: LoraConfig, seed: int):
    """get_peft_model with its LoRA A matrices drawn from `seed` alone. PEFT draws them from the global RNG,
    whose state by then depends on what loading did: on CUDA `plan` builds a probe adapter to choose the
    offloaded layers, which a run without offload never does, so the two runs started from different LoRA
    (equal first loss, since B is zero; different from the second step on). The caller's RNG is left as it was."""
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        torch.manual_seed(seed)
        return get_peft_model(model, peft_config)


def refuse_parameter_lora_peft_would_drop(model, routers: list[str]) -> None:
    """Expert and router LoRA are written as PEFT `target_parameters`; if the installed PEFT would not load them
    back as trained, refuse now, before training, rather than at the end when the adapter is verified.

    Mistral-Large-4 (transformers 5.24, PEFT 0.21): PEFT applies the family's checkpoint-conversion renamings
    to adapter keys, turning 'mlp.experts.*' into 'mlp.mlp.experts.*', which matches no module.
    """
    parameters = target_parameter_names(model) + routers
    if not parameters:
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    report, _ = target_modules_failing_round_trip(
        clean_base_config(base.config), None, target_parameters=parameters, model_class=type(base)
    )
    if not report.ok:
        raise UnsupportedExpertsError(
            f"LoRA on {first_few(parameters)} would not load as trained in PEFT {peft.__version__}: "
            f"{report.describe(base.config.model_type)}. Train without it (lora.experts: false, lora.router: "
            "false) or use a PEFT that loads this family's expert keys."
        )


def router_parameter_names(model) -> list[str]:
    """PEFT target_parameters for the routers: the 2D weight of the block's router, e.g. 'mlp.gate.weight'."""
    names = set()
    for name, _ in experts_modules(model):
        block = model.get_submodule(name.rsplit(".", 1)[0])
        for child_name, child in block.named_children():
            weight = getattr(child, "weight", None)
            if child_name in ("gate", "router") and isinstance(weight, torch.nn.Parameter) and weight.dim() == 2:
                names.add(re.sub(r"^.*\.layers\.\d+\.", "", f"{name.rsplit('.', 1)[0]}.{child_name}.weight"))
    return sorted(names)


def trainable_parameters(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def expert_loras(model) -> list[tuple[str, ExpertLoRA]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, ExpertLoRA)]


def configure_checkpointing(model, *, enabled: bool, interval: int) -> int:
    """Gradient checkpointing on every `interval`-th decoder layer; returns how many layers are checkpointed."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not enabled:
        base.activation_checkpointing_disable()
        return 0
    base.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=interval
    )
    return sum(1 for m in base.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing)


def offload_layer_inputs(model, device: torch.device, copies: HostCopies | None = None) -> SavedOffload:
    """train.offload_activations: while the decoder runs a training forward (grad on, train mode), the tensors
    autograd saves outside checkpoints, the checkpointed layers' inputs, go to host memory and come back for the
    backward one layer ahead (common/saved_offload.py). `copies`: the device calls (a test's CheckedCopies)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder()
    offload = SavedOffload(copies if copies is not None else copies_for(device), device)
    active = []

    def enter(module, args):
        if module.training and torch.is_grad_enabled():
            hooks = offload.offloading()
            hooks.__enter__()
            active.append(hooks)

    def leave(module, args, output):
        if active:
            active.pop().__exit__(None, None, None)

    decoder.register_forward_pre_hook(enter)
    decoder.register_forward_hook(leave, always_call=True)
    return offload


@contextlib.contextmanager
def adapters_disabled(model):
    """The base model: PEFT's LoRA and the expert LoRA both off inside the block (no second copy of the
    model is needed for a reference policy); restored on exit, even after an error."""
    loras = [lora for _, lora in expert_loras(model)]
    peft_off = model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()
    with peft_off:
        for lora in loras:
            lora.active = False
        try:
            yield model
        finally:
            for lora in loras:
                lora.active = True


def target_parameter_names(model) -> list[str]:
    """PEFT target_parameters for the experts, e.g. ['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']."""
    names = set()
    for name, module in experts_modules(model):
        if getattr(module, "moe_lora", None) is not None:
            inner = re.sub(r"^.*\.layers\.\d+\.", "", name)
            names.update(f"{inner}.{stack}" for stack in consumer_stack_names(module))
    return sorted(names)
