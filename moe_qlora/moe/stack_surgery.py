"""Parameter surgery on experts modules, before loading or before sharding: the stacks of a checkpoint published in
MXFP4 declared as its uint8 blocks and scales (so they are read as stored), and NF4 stacks made plain parameters
with the experts on dim 0 (so FSDP2 shards them by expert).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_qlora.common.memory import unwritten
from moe_qlora.moe.expert_stacks import experts_modules, holds_mxfp4, is_experts_module, stack_names
from moe_qlora.moe.layer_state import layer_state, read_state
from moe_qlora.moe.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX, check_encodable, published_shapes, stack_shape_of
from moe_qlora.moe.nf4 import NF4Stack


def declare_mxfp4_stacks(model: nn.Module) -> int:
    """Before loading a checkpoint published in MXFP4: every experts module's stacks become the uint8
    `<stack>_blocks` (E, out, in/32, 16) and `<stack>_scales` (E, out, in/32) parameters the checkpoint holds (on
    the meta device, as transformers builds models before loading), so they are read as stored, never decoded.
    Returns how many stacks."""
    count = 0
    for name, module in experts_modules(model):
        for stack in stack_names(module):
            stored = module._parameters.pop(stack)
            shape = stack_shape_of(tuple(stored.shape), getattr(module, "is_transposed", False))
            check_encodable(shape, f"{name}.{stack}")
            for suffix, part in zip((BLOCKS_SUFFIX, SCALES_SUFFIX), published_shapes(shape), strict=True):
                empty = torch.empty(part, dtype=torch.uint8, device="meta")
                module.register_parameter(stack + suffix, nn.Parameter(empty, requires_grad=False))
            count += 1
        module._is_hf_initialized = True  # its model's _init_weights would reach for the stacks no longer there
    return count


def make_stacks_shardable(model: nn.Module) -> int:
    """Replace every NF4 expert stack (a Params4bit, whose block scales live in its quant_state where FSDP cannot
    see them) by two frozen parameters with the experts on dim 0, so FSDP2 shards them by expert:
    `{name}_nf4` (E, O*I/2) uint8 codes and `{name}_absmax` (E, O*I/64) fp32 scales, nested scales decoded
    (the same fp32 values the kernels decode on the fly, so results do not change). Returns how many stacks.

    A stack loaded for one rank's shard (quantize_stack's `held`) is copied for those experts alone, into
    (E, ...) tensors whose other rows are never written: fully_shard reads only the rank's rows, so the whole
    stack is never resident in host memory."""
    converted = 0
    for module in model.modules():
        if not is_experts_module(module) or read_state(module).shardable_shapes is not None or holds_mxfp4(module):
            continue  # MXFP4 blocks and scales are plain parameters with the experts on dim 0 already
        shapes, nested = {}, False
        for name in stack_names(module):
            param = getattr(module, name)
            stack = NF4Stack.from_param(param)
            nested |= stack.nested is not None
            packed, absmax = expert_rows(stack, getattr(param, "held_experts", None))
            del module._parameters[name]
            module.register_parameter(f"{name}_nf4", nn.Parameter(packed, requires_grad=False))
            module.register_parameter(f"{name}_absmax", nn.Parameter(absmax, requires_grad=False))
            shapes[name] = stack.shape
            converted += 1
        state = layer_state(module)
        state.shardable_shapes, state.nested_scales = shapes, nested
    return converted


def expert_rows(stack: NF4Stack, held: range | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, N/2) uint8 codes and (E, N/B) fp32 scales of `stack`, a fresh copy; only experts `held` when given
    (the other rows unwritten zeros: common.memory.unwritten)."""
    e = stack.num_experts
    held = range(e) if held is None else held
    packed = unwritten(e * stack.expert_numel // 2, torch.uint8, stack.packed.device).view(e, -1)
    absmax = unwritten(e * stack.expert_numel // stack.blocksize, torch.float32, stack.packed.device).view(e, -1)
    if len(held):
        packed[held.start : held.stop] = stack.experts_codes(held.start, held.stop).view(len(held), -1)
        absmax[held.start : held.stop] = stack.experts_absmax(held.start, held.stop).view(len(held), -1).float()
    return packed, absmax
