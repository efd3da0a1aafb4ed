"""What the MoE layer keeps on each experts module: one plain object, `module.moe_state`, attached once.

Setup writes it (set_moe_kernels, the layout adoptions, offload, make_stacks_shardable, deferred_lora_gradients)
and the forward reads it. It holds settings and handles only, never a parameter: the LoRA factors stay the
registered submodule `module.moe_lora`, whose names checkpoints, PEFT export and FSDP see. A plain dataclass,
so that torch.compile(fullgraph=True) reads its fields like any attribute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from moe_qlora.moe.expert_dispatch import ExpertShard
    from moe_qlora.moe.reference_layer import DeferredWeightGrads
    from moe_qlora.moe.self_check import KernelSelfCheck

STATE_ATTR = "moe_state"

# Rows per expert below which the fused NF4 kernel beats decoding the stack and running grouped GEMMs. Cost
# model (H100): decoding costs ~4 extra bytes of HBM traffic per weight (read 0.5, write 2, read 2 again vs
# 0.5), 1.2e-12 s at 3.35 TB/s; the fused kernel's slower MMA loop (~10% of bf16 peak vs ~60% for CUTLASS)
# costs 2m flops x 8.4e-15 s per weight at m rows. Break-even near m = 70; 64 until measured on a GPU.
FUSED_BELOW_ROWS = 16  # config.sections' default: see its description


@dataclass
class MoELayerState:
    """One experts module's MoE-layer state; the defaults are those of a module never set up.

    Kernels (set_moe_kernels): `kernels`, the backend resolved once by the caller (kernel_names.KERNELS; "auto"
    picks per call from `fused_below_rows`, rows per expert); `dequant_budget`, the bytes grouped_mm may decode at
    once (None: unbounded); `gate_is_silu_mul`, whether the module gates with transformers' silu(gate) * up, which
    the kernels fuse (None: not computed yet; stored because torch.compile cannot trace a method's identity);
    `self_check`, the model's one KernelSelfCheck (None: off).
    Memory: `offload`, (ExpertOffloader, this layer's index) when the stacks live in host memory; `deferred_grads`,
    the store the grouped backward pushes LoRA weight gradients to inside deferred_lora_gradients.
    Sharding (make_stacks_shardable): `shardable_shapes`, each stack's (E, out, in) once its Params4bit became
    `{name}_nf4` / `{name}_absmax` parameters; `nested_scales`, whether those scales were double-quantized.
    Layout (layouts.py): `split_gate_up`, shared experts stored as gate / up / down stacks (Inkling); `adopted`, an
    experts class off transformers' interface given its attributes (Inkling, Llama-4); `top_k`, the block's top-k
    that bounds a dense-input module's picked rows (Llama-4).
    Generation (experts.generation_kernels): `generating`, set while a model generates, so the layer may take the
    path that suits decode steps (few rows per expert, no gradient).
    Chunks (experts.set_token_chunks): `chunk_tokens`, the tokens one call runs at once while gradients are recorded
    (token_chunks.py; 0: all of them).
    Expert parallelism (model.expert_parallel): `expert_shard`, the experts each rank holds (this module keeps only
    its own rows), so every call exchanges its routed rows with the other ranks (expert_dispatch.py).
    """

    kernels: str = "torch"
    fused_below_rows: int = FUSED_BELOW_ROWS
    dequant_budget: int | None = None
    gate_is_silu_mul: bool | None = None
    self_check: KernelSelfCheck | None = None
    offload: tuple[Any, int] | None = None  # Any: offload.py imports this module
    deferred_grads: DeferredWeightGrads | None = None
    shardable_shapes: dict[str, torch.Size] | None = None
    nested_scales: bool | None = None
    split_gate_up: bool = False
    adopted: bool = False
    top_k: int | None = None
    generating: bool = False
    chunk_tokens: int = 0
    expert_shard: ExpertShard | None = None


# What read_state answers for a module with no state attached. Never written: writers go through layer_state.
NEVER_SET = MoELayerState()


def layer_state(module: nn.Module) -> MoELayerState:
    """The module's state, attached on first use: every writer gets the same object."""
    state = getattr(module, STATE_ATTR, None)
    if state is None:
        state = MoELayerState()
        setattr(module, STATE_ATTR, state)
    return state


def read_state(module: nn.Module) -> MoELayerState:
    """The module's state for reading, attaching nothing: the forward stays free of side effects, and the
    predicates that walk every module of a model (quantized_stack_names, is_experts_module) leave them as they are."""
    state = getattr(module, STATE_ATTR, None)
    return NEVER_SET if state is None else state
