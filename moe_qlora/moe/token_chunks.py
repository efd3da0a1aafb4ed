"""The MLP half of a decoder layer over its tokens a chunk at a time: the MoE experts, shared experts and dense MLPs.

Every token goes through these on its own (the block routes each token itself), so a micro-batch of N tokens can
run them C tokens at a time. Each chunk is its own non-reentrant checkpoint: the forward keeps only the chunk's
input (C x H), and the backward recomputes one chunk, takes its gradients and frees its rows before the next. So
the rows the grouped layer works on (N x K of them, each 2I + I + H wide in its backward) peak at a chunk's, not
the micro-batch's: at 131,072 tokens Qwen3-30B-A3B's 16.5 GiB of `moe_backward` becomes 0.5 GiB at C = 4,096.
Inside a layer that is itself checkpointed the chunks nest (torch.utils.checkpoint supports nesting when
non-reentrant): the layer's recompute runs them again without keeping their rows, and each chunk is computed
once more in its own backward, one MLP forward more per step than unchunked. `mlp_chunk_tokens: auto` turns it
on only where `plan` needs it to fit (model.plan); a shorter micro-batch than C runs as one call, unchanged.

Gradients: each token's output and input gradient are computed from the same rows in the same order as unchunked;
the LoRA weight gradients are a sum over tokens, which chunks add up one chunk at a time (a different order of
fp32 additions, so equal to rounding, not bitwise: tests/moe/test_token_chunks.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

UNCHUNKED_FORWARD = "_moe_qlora_unchunked_forward"  # the module's own forward, kept while a chunked one stands in


def over_token_chunks(fn: Callable[..., torch.Tensor], chunk: int, *tensors: torch.Tensor) -> torch.Tensor:
    """fn(*tensors) computed `chunk` tokens at a time (tokens on dim 0 of every tensor), each chunk
    checkpointed; the outputs concatenated on dim 0. One call as is when chunk is 0, the tokens fit one chunk, or
    no gradient is being recorded (generation, scoring: nothing is kept, so there is nothing to save)."""
    tokens = tensors[0].shape[0]
    if not chunk or tokens <= chunk or not torch.is_grad_enabled():
        return fn(*tensors)
    parts = [
        checkpoint(fn, *(t[start : start + chunk] for t in tensors), use_reentrant=False)
        for start in range(0, tokens, chunk)
    ]
    return torch.cat(parts)


def chunk_module_tokens(module: nn.Module, chunk: int) -> None:
    """Run `module` (an MLP: (..., H) -> (..., H'), each token on its own) over its tokens `chunk` at a time;
    chunk 0 restores its own forward. The leading dims are flattened to tokens and restored on the output."""
    forward = getattr(module, UNCHUNKED_FORWARD, None) or module.forward
    if not chunk:
        if hasattr(module, UNCHUNKED_FORWARD):
            del module.forward
            delattr(module, UNCHUNKED_FORWARD)
        return

    def chunked_forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs:  # not the one-tensor MLP call this was set up for: as the module itself runs it
            return forward(x, *args, **kwargs)
        out = over_token_chunks(forward, chunk, x.reshape(-1, x.shape[-1]))
        return out.reshape(*x.shape[:-1], out.shape[-1])

    setattr(module, UNCHUNKED_FORWARD, forward)
    module.forward = chunked_forward


DENSE_MLP_NAMES = ("mlp", "feed_forward", "ffn")


def token_wise_mlps(model: nn.Module, is_experts: Callable[[nn.Module], bool]) -> list[tuple[str, nn.Module]]:
    """The MLPs of `model` that chunking covers besides the experts: a MoE block's shared experts (a child named
    shared_* holding linears, not an experts module itself) and each dense MLP (a child named in DENSE_MLP_NAMES of
    a module that also holds an attention, with no experts inside: DeepSeek's first layers, Llama-4's dense
    layers). Names as model.named_modules gives them."""
    found = []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        holds_experts = any(is_experts(c) for c in children.values())
        for child_name, child in children.items():
            if not _an_mlp(child, is_experts):
                continue
            shared = holds_experts and child_name.startswith("shared_")
            dense = child_name in DENSE_MLP_NAMES and _has_attention(children) and not _holds_experts(child, is_experts)
            if shared or dense:
                found.append((f"{name}.{child_name}" if name else child_name, child))
    return found


def _an_mlp(module: nn.Module, is_experts: Callable[[nn.Module], bool]) -> bool:
    """A module of linears (not a linear itself, nor PEFT's wrapper of one, nor an experts module)."""
    if is_experts(module) or isinstance(module, nn.Linear) or hasattr(module, "base_layer"):
        return False
    return any(isinstance(m, nn.Linear) for m in module.modules())


def _has_attention(children: dict[str, nn.Module]) -> bool:
    return any("attn" in name or "attention" in name for name in children)


def _holds_experts(module: nn.Module, is_experts: Callable[[nn.Module], bool]) -> bool:
    return any(is_experts(m) for m in module.modules())
