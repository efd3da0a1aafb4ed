"""The independent oracle for the MoE layer: transformers' own eager experts on dequantized weights.

Shared by the parity tests of every family. The eager module is the family's own experts class with
`_experts_implementation = "eager"`, fed W_e + c * B_e A_e per expert (in the family's storage layout)
and differentiated by autograd.
"""

import copy
import inspect

import torch
from torch.func import functional_call

from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.moe.expert_lora import attach_expert_lora
from moe_qlora.moe.expert_stacks import stack_names
from moe_qlora.moe.layer_state import layer_state
from moe_qlora.moe.layouts import DENSE_INPUT_EXPERTS
from moe_qlora.moe.nf4 import dequantize_param

# fp32 reordering error scales with the tensor (see test_moe_parity): max|ours - ref| <= REL_TOL * max|ref|.
REL_TOL = 4e-6


def lora_delta(b, a, transposed):
    """scale-free B_e A_e for every expert, (E, out, in), or (E, in, out) for transposed storage."""
    delta = torch.einsum("eor,eri->eoi", b, a)
    return delta.transpose(1, 2) if transposed else delta


def per_module_sizes(experts) -> dict:
    """Constructor arguments an experts class takes beside the config: ERNIE-4.5-VL builds text and vision experts
    of different widths from one config, passing intermediate_size."""
    takes = inspect.signature(type(experts).__init__).parameters
    return {"intermediate_size": experts.intermediate_dim} if "intermediate_size" in takes else {}


def eager_reference_experts(experts, config):
    """The family's eager experts module and a function giving its explicit weights from the LoRA factors."""
    cfg = copy.deepcopy(config)
    cfg._experts_implementation = "eager"
    eager = type(experts)(cfg, **per_module_sizes(experts))
    first, down = stack_names(experts)
    base = {n: dequantize_param(getattr(experts, n)) for n in (first, down)}
    biases = {f"{n}_bias": getattr(experts, f"{n}_bias").detach() for n in (first, down) if experts.has_bias}
    scale, transposed = experts.moe_lora.scale, getattr(experts, "is_transposed", False)

    def weights(a1, b1, a2, b2):
        return {
            first: base[first] + scale * lora_delta(b1, a1, transposed),
            down: base[down] + scale * lora_delta(b2, a2, transposed),
            **biases,
        }

    return eager, weights


def call_experts(module, x, top_k_index, top_k_weights, params=None):
    """An experts module on (T, H) tokens routed (T, K), called as its block calls it; dense-input experts
    (Llama-4) get every token for every expert, scaled by its routing weight (0 where not picked), and their
    per-expert outputs are summed. `params`: run with these weights instead of the module's (functional_call)."""
    dense = type(module).__name__ in DENSE_INPUT_EXPERTS
    if dense:
        e, t = module.num_experts, x.shape[0]
        layer_state(module).top_k = top_k_index.shape[1]  # as its block's top_k (the bound of the rows it picks)
        scores = x.new_zeros(t, e).scatter(1, top_k_index, top_k_weights)  # (T, E), differentiable in the weights
        args = ((x.unsqueeze(0) * scores.t().unsqueeze(-1)).reshape(e * t, -1),)
    else:
        args = (x, top_k_index, top_k_weights)
    out = module(*args) if params is None else functional_call(module, params, args)
    return out.view(e, t, -1).sum(0) if dense else out


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def randomize_lora_b(model, seed=1, std=0.05):
    """Non-zero B factors, so that every LoRA tensor gets a gradient and changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and ("lora_B" in name or name.endswith("_b")):
                p.copy_(torch.randn(p.shape, generator=g) * std)


def quantized_with_lora(path, device="cpu", **load_options):
    """The checkpoint at `path` loaded in 4-bit with rank-4 expert LoRA whose B factors are non-zero."""
    model = load_model(LoadOptions(str(path), device=device, **load_options))
    attach_expert_lora(model, rank=4, alpha=8.0, seed=0)
    randomize_lora_b(model)
    return model


def run_experts_pair(experts, config, x, top_k_index, top_k_weights, mutate=None):
    """Outputs and gradients (x, routing weights, 4 LoRA factors) of ours and of the eager oracle."""
    factors = experts.moe_lora.factors()
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(x.device)
    x1, w1 = leaves(x, top_k_weights)
    for p in factors:
        p.grad = None
    ours_idx, ours_w = (top_k_index, w1) if mutate is None else mutate(top_k_index, w1)
    out = call_experts(experts, x1, ours_idx, ours_w)
    out.backward(upstream)
    ours = [out.detach(), x1.grad, w1.grad] + [p.grad.clone() for p in factors]

    eager, weights = eager_reference_experts(experts, config)
    x2, w2, *f2 = leaves(x, top_k_weights, *factors)
    ref_out = call_experts(eager, x2, top_k_index, w2, weights(*f2))
    ref_out.backward(upstream)
    ref = [ref_out.detach(), x2.grad, w2.grad] + [f.grad for f in f2]
    return ours, ref


def assert_close_scaled(name, a, b, rel_tol: float = REL_TOL):
    """max |a - b| <= rel_tol * max |b|: fp32 reordering error relative to the tensor's magnitude."""
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err, scale = float((a - b).abs().max()), float(b.abs().max())
    assert scale > 0 and err <= rel_tol * scale, f"{name}: max error {err:.3g} over {rel_tol:g} * {scale:.3g}"


PAIR_NAMES = [
    "output",
    "grad x",
    "grad routing weights",
    "grad A gate_up",
    "grad B gate_up",
    "grad A down",
    "grad B down",
]


def assert_all_close(ours, ref, names=PAIR_NAMES):
    for name, a, b in zip(names, ours, ref, strict=True):
        assert_close_scaled(name, a, b)


def ragged_routing(tokens, experts, k, seed=3):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    return idx, torch.softmax(torch.randn(idx.shape, generator=g), -1)


def gradients_by_adapter_key(model, state_dict) -> dict[str, torch.Tensor]:
    """Each trainable tensor's gradient under its adapter-file key, laid out as the file lays out the weights
    (the export's reshapes and permutations are linear, so they map gradients as they map weights): `state_dict`
    is export.adapter.adapter_state_dict for ours, peft.get_peft_model_state_dict for PEFT's."""
    params = [p for p in model.parameters() if p.requires_grad]
    weights = [p.data for p in params]
    try:
        for p in params:
            p.data = p.grad if p.grad is not None else torch.zeros_like(p)
        return {k: v.detach().clone().float() for k, v in state_dict(model).items()}
    finally:
        for p, w in zip(params, weights, strict=True):
            p.data = w


def next_token_gradients(model, state_dict, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """gradients_by_adapter_key of one next-token loss on `ids` (the labels are the inputs)."""
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return gradients_by_adapter_key(model, state_dict)
