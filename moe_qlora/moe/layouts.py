"""Experts layouts off transformers' experts interface: those the MoE layer computes once adopted (Llama-4's
dense-input experts, Inkling's shared experts stored as separate gate and up stacks), and those it refuses, with
the reason a user needs.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from transformers.integrations.moe import _default_apply_gate

from moe_qlora.moe.expert_stacks import is_experts_module, stack_names
from moe_qlora.moe.experts import moe_qlora_experts_forward
from moe_qlora.moe.layer_state import layer_state, read_state

# Experts classes off transformers' interface whose stacks and math the MoE layer computes exactly once they
# carry the interface's attributes. Llama-4: gate_up_proj (E, H, 2I) and down_proj (E, I, H) (transposed),
# up * silu(gate); its block feeds the experts every token for every expert, scaled by the routing score
# (sigmoid, 0 for the experts a token did not pick): routed_in (E*T, H), row e*T + t = s_te x_t.
DENSE_INPUT_EXPERTS = ("Llama4TextExperts",)


# Expert layouts off the interface that moe-qlora refuses, with the reason a user needs.
UNSUPPORTED_LAYOUTS = {
    "LongcatFlashExperts": "LongCat-Flash's zero-computation experts (the router may pick identity experts that "
    "have no weights: its gate_up stack has more experts than its down stack)",
    "JetMoeParallelExperts": "JetMoE's attention experts (a mixture of attention heads, JetMoeMoA) and its "
    "parallel-experts MLP, which are not on transformers' experts interface",
    "DbrxExperts": "DBRX's experts, stored as 2D (experts * ffn, hidden) matrices w1 / v1 / w2 in DbrxExpertGLU "
    "rather than 3D stacks on transformers' experts interface",
    "DogeCDMoE": "Doge's cross-domain MoE, whose experts are embedding tables (down_embed / up_embed)",
}


def unsupported_layout(model: nn.Module) -> str | None:
    """The reason of the first expert layout in `model` that moe-qlora knows it cannot compute, if any."""
    for module in model.modules():
        if (reason := UNSUPPORTED_LAYOUTS.get(type(module).__name__)) is not None:
            return reason
    return None


# Shared experts stored as 3D stacks with separate gate_proj / up_proj (S, I, H) and down_proj (S, H, I),
# every token through each, weighted by a router gamma (Inkling): quantized while loading as three stacks,
# then gate and up fused into one gate_up_proj stack (S, 2I, H), so they run, and get LoRA, like routed experts.
SPLIT_GATE_UP_EXPERTS = ("InklingSharedExperts",)


SPLIT_STACKS = ("gate_proj", "up_proj", "down_proj")


def quantized_stack_names(module: nn.Module) -> tuple[str, ...]:
    """The 3D stacks of `module` the quantizer turns into NF4 (none for a module that holds no experts)."""
    if read_state(module).split_gate_up:
        return SPLIT_STACKS
    return stack_names(module) if is_experts_module(module) else ()


def _adopt(module: nn.Module, *, transposed: bool, forward) -> None:
    module.has_gate, module.has_bias, module.is_transposed, module.is_concatenated = True, False, transposed, True
    module.has_post_expert_norm = False
    layer_state(module).adopted = True
    module._apply_gate = types.MethodType(_default_apply_gate, module)
    module.forward = types.MethodType(forward, module)


def adopt_split_gate_up_experts(model: nn.Module) -> int:
    """Mark fused shared-expert stacks (Inkling) for quantization and give them our forward; `fuse_gate_up`
    makes their gate_up_proj after loading. Returns how many. Instance-level: no class is patched."""
    adopted = 0
    for module in model.modules():
        if type(module).__name__ in SPLIT_GATE_UP_EXPERTS and not read_state(module).split_gate_up:
            layer_state(module).split_gate_up = True
            module.num_experts = module.n_shared_experts
            adopted += 1
    return adopted


def fuse_gate_up(model: nn.Module, quantize) -> int:
    """Replace the NF4 gate_proj and up_proj stacks of split modules by one NF4 gate_up_proj [gate; up] per
    expert. Lossless: NF4 blocks never straddle experts, each block's largest value decodes to +-absmax exactly,
    so re-quantizing the decoded values gives the same codes and scales. `quantize`: (S, 2I, H) -> Params4bit."""
    from moe_qlora.moe.nf4 import dequantize_param

    fused = 0
    for module in model.modules():
        if read_state(module).split_gate_up and "gate_proj" in module._parameters:
            gate, up = (dequantize_param(module._parameters.pop(n), torch.float32) for n in ("gate_proj", "up_proj"))
            module.gate_up_proj = quantize(torch.cat([gate, up], dim=1))
            _adopt(module, transposed=False, forward=split_gate_up_experts_forward)
            fused += 1
    return fused


def split_gate_up_experts_forward(self, hidden_states, gammas):
    """(…, H) tokens through each of the S shared experts, weighted by (…, S) gammas: the MoE layer with
    every token routed to experts 0..S-1 (gamma scales the activation in Inkling's own forward, the same
    thing as scaling the output, since down_proj is linear)."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    experts = torch.arange(self.num_experts, device=x.device).expand(x.shape[0], self.num_experts)
    out = moe_qlora_experts_forward(self, x, experts, gammas.reshape(-1, self.num_experts).to(x.dtype))
    return out.view(shape)


def adopt_dense_input_experts(model: nn.Module) -> int:
    """Give every dense-input experts module (Llama-4) the experts-interface attributes and our forward, so
    it is quantized and computed like the others; returns how many. Instance-level: no class is patched."""
    adopted = 0
    for block in model.modules():
        module = getattr(block, "experts", None)
        if type(module).__name__ in DENSE_INPUT_EXPERTS and not hasattr(module, "has_gate"):
            _adopt(module, transposed=True, forward=dense_input_experts_forward)
            layer_state(module).top_k = getattr(block, "top_k", None)  # bounds the picked rows: no sync to count them
            adopted += 1
    return adopted


def dense_input_experts_forward(self, routed_in, top_k_index=None, top_k_weights=None):
    """routed_in (E*T, H), each expert's rows scaled by its score -> (E*T, H), through our MoE layer.

    Only the rows of picked experts are computed: a zero row gives E_e(0) = 0, and every gradient through it
    is 0 too (silu(0) = 0 and the up projection of 0 is 0, so the Jacobian at 0 vanishes), so skipping it is
    exact. Each picked (expert, token) row is one routed row with weight 1: its score is already in the input.
    Called with (hidden, top_k_index, top_k_weights) it is the ordinary experts interface.
    """
    if top_k_index is not None:
        return moe_qlora_experts_forward(self, routed_in, top_k_index, top_k_weights)
    rows, tokens = routed_in.shape[0], routed_in.shape[0] // self.num_experts
    nonzero = routed_in.ne(0).any(-1)
    top_k = read_state(self).top_k
    if top_k:  # the block's top-k bounds the picked rows: a static size, so no host sync to count them
        size = tokens * top_k
        torch._assert_async(nonzero.sum() <= size, f"more than top_k = {top_k} experts fed per token")
        # padding entries hold E*T: they read row E*T - 1 zeroed, and write their zero output to an extra row
        picked = torch.nonzero_static(nonzero, size=size, fill_value=rows).squeeze(1)
    else:
        picked = nonzero.nonzero().squeeze(1)  # (S,) rows e*T + t with a non-zero input
    real = (picked < rows).unsqueeze(1)  # (S, 1)
    inputs = routed_in[picked.clamp(max=rows - 1)] * real
    expert = (picked // tokens).clamp(max=self.num_experts - 1).unsqueeze(1)  # (S, 1)
    out = moe_qlora_experts_forward(self, inputs, expert, real.to(routed_in.dtype))
    return routed_in.new_zeros(rows + 1, routed_in.shape[1]).index_copy(0, picked, out)[:rows]


def consumer_stack_names(module) -> tuple[str, ...]:
    """The module's expert stacks as its consumers (PEFT, a merge) see them."""
    return SPLIT_STACKS if read_state(module).split_gate_up else stack_names(module)
