"""An experts module's quantized stacks: which module is one (transformers' experts interface), the names and sizes
of its two stacks, and each stack read as the MoE layer reads it (NF4Stack or MXFP4Stack, offloaded or sharded),
or decoded to the layout of the module's own parameter; the layouts the layer refuses, named.
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch
from torch import nn

from moe_qlora.moe.layer_state import read_state
from moe_qlora.moe.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX, MXFP4Stack
from moe_qlora.moe.nf4 import NF4Stack
from moe_qlora.moe.offload import OffloadedStack

# Expert stacks: the first projection (gate_up_proj when gated, up_proj when not) and down_proj.
EXPERT_PARAMS = ("gate_up_proj", "up_proj", "down_proj")


class UnsupportedExpertsError(ValueError):
    """An experts module whose layout or math the MoE layer cannot compute exactly."""


def stack_names(module: nn.Module) -> tuple[str, str]:
    """The experts module's two stacks: ('gate_up_proj', 'down_proj'), or ('up_proj', 'down_proj') when the
    experts are not gated (up -> activation -> down, e.g. Nemotron-H's squared ReLU)."""
    return ("gate_up_proj" if getattr(module, "has_gate", True) else "up_proj", "down_proj")


def is_experts_module(module: nn.Module) -> bool:
    """True for a class on transformers' experts interface (its decorator sets has_gate) with its 3D stacks."""
    if not hasattr(module, "has_gate"):
        return False
    shardable = read_state(module).shardable_shapes is not None
    return shardable or all(hasattr(module, n) or hasattr(module, n + BLOCKS_SUFFIX) for n in stack_names(module))


def holds_mxfp4(module: nn.Module) -> bool:
    """Whether an experts module keeps its stacks in MXFP4 (`<stack>_blocks` and `<stack>_scales`)."""
    return hasattr(module, stack_names(module)[0] + BLOCKS_SUFFIX)


def decoded_expert(module: nn.Module, name: str, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Expert e of a quantized stack decoded to the layout of the module's own parameter: (out, in), or (in, out)
    when the module is transposed and the stack is MXFP4 (kept as published, (out, in))."""
    w = quantized_stack(module, name).decode(e, e + 1, dtype)[0]
    return w.T if getattr(module, "is_transposed", False) and holds_mxfp4(module) else w


def decoded_stack(module: nn.Module, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An MXFP4 stack decoded (exactly) to the layout of the module's own parameter: (E, out, in), or (E, in, out)
    when the module is transposed (gpt-oss): what transformers' dequantization of the checkpoint holds."""
    w = quantized_stack(module, name).decode(0, expert_dims(module)[0], dtype)
    return w.transpose(1, 2).contiguous() if getattr(module, "is_transposed", False) else w


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if is_experts_module(m)]


def quantized_stack(module: nn.Module, name: str) -> NF4Stack | MXFP4Stack:
    """The quantized stack `name` of an experts module: its MXFP4 blocks and scales as published; or NF4, its
    bitsandbytes Params4bit, or, once made shardable, the plain parameters `{name}_nf4` and `{name}_absmax`
    (whatever FSDP has gathered into them for this call)."""
    if hasattr(module, name + BLOCKS_SUFFIX):
        return MXFP4Stack.from_published(getattr(module, name + BLOCKS_SUFFIX), getattr(module, name + SCALES_SUFFIX))
    state = read_state(module)
    if state.offload is not None:  # its stacks in host memory: a handle that fetches them when read
        offloader, layer = state.offload
        return OffloadedStack(offloader, layer, name)
    shapes = state.shardable_shapes
    if shapes is not None:
        packed, absmax = getattr(module, f"{name}_nf4"), getattr(module, f"{name}_absmax")
        return NF4Stack(packed.view(-1), absmax.view(-1), None, shapes[name])
    param = getattr(module, name)
    if not isinstance(param, bnb.nn.Params4bit):
        raise UnsupportedExpertsError(
            f"{type(module).__name__}.{name} is not NF4-quantized; "
            "load the model with moe_qlora.model.loading.load_model"
        )
    return NF4Stack.from_param(param)


def check_supported_layout(module: nn.Module, name: str = "experts") -> None:
    """Refuse an experts module the MoE layer would compute wrongly, naming what is unsupported.

    Supported: gate_up_proj / down_proj stacks, stored (E, out, in) or transposed (E, in, out), with or
    without biases, and any gating the module defines in `_apply_gate` (it is called as is, and
    differentiated by autograd), e.g. GPT-OSS's interleaved, clamped SwiGLU; or non-gated up_proj / down_proj
    stacks with the module's own activation `act_fn` between them.
    """
    problems = []
    if getattr(module, "has_post_expert_norm", False):
        problems.append("a norm after each expert (has_post_expert_norm=True)")
    if problems:
        raise UnsupportedExpertsError(
            f"{name} ({type(module).__name__}) has " + ", ".join(problems) + "; moe-qlora computes experts "
            "as down(gate(gate_up(x))) with optional biases. Refusing rather than training on a wrong forward."
        )


def expert_dims(module: nn.Module) -> tuple[int, int, int]:
    """(experts, hidden, intermediate) of an experts module, from its first stack (quantized or not)."""
    if "gate_proj" in module._parameters and read_state(module).split_gate_up:  # not fused yet
        e, inter, hidden = module.gate_proj.shape
        return e, hidden, inter
    if holds_mxfp4(module):
        e, width, hidden = quantized_stack(module, stack_names(module)[0]).shape  # (E, out, in)
        return e, hidden, width // 2 if module.has_gate else width
    stack = getattr(module, stack_names(module)[0])
    e, d1, d2 = stack.quant_state.shape if isinstance(stack, bnb.nn.Params4bit) else stack.shape
    hidden, width = (d1, d2) if getattr(module, "is_transposed", False) else (d2, d1)
    return e, hidden, width // 2 if module.has_gate else width
