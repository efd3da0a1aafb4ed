"""Fused shared-expert stacks (Inkling): quantized, fused into one gate_up stack, and given LoRA like routed
experts. Oracle: transformers' own InklingSharedExperts on the dequantized gate / up / down stacks plus each
expert's LoRA delta, differentiated by autograd; output and the gradients of the tokens, the gammas and the
four LoRA factors within 4e-6 * max|ref| (fp32 reordering only, as in test_moe_parity)."""

import pytest
import torch
from safetensors.torch import load_file
from torch.func import functional_call

from moe_qlora.config.sections import LoraSection
from moe_qlora.model.adapters import attach_adapters
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.model_path import ensure_tiny
from moe_qlora.moe.expert_stacks import experts_modules
from moe_qlora.moe.experts import set_moe_kernels
from moe_qlora.moe.nf4 import dequantize_param, quantize_stack

from helpers.oracle import assert_close_scaled, leaves, lora_delta, randomize_lora_b

NAMES = ["output", "grad x", "grad gammas", "grad A gate_up", "grad B gate_up", "grad A down", "grad B down"]


@pytest.fixture(scope="module")
def inkling():
    path = ensure_tiny("inkling_text")
    model = attach_adapters(load_model(LoadOptions(str(path))), LoraSection(rank=4, alpha=8.0), seed=0)
    randomize_lora_b(model)
    shared = [m for n, m in experts_modules(model) if n.endswith("shared_experts")]
    return path, model, shared[0]


def eager_pair(shared, config, x, gammas, *, swap_gate_up=False):
    """(ours, reference): outputs and the 6 gradients."""
    factors = shared.moe_lora.factors()
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    x1, g1 = leaves(x, gammas)
    for p in factors:
        p.grad = None
    out = shared(x1, g1)
    out.backward(upstream)
    ours = [out.detach(), x1.grad, g1.grad] + [p.grad.clone() for p in factors]

    eager = type(shared)(config)  # a fresh module: transformers' own forward, not adopted
    x2, g2, a1, b1, a2, b2 = leaves(x, gammas, *factors)
    gate_up = dequantize_param(shared.gate_up_proj) + shared.moe_lora.scale * lora_delta(b1, a1, False)
    gate, up = gate_up.chunk(2, dim=1)
    down = dequantize_param(shared.down_proj) + shared.moe_lora.scale * lora_delta(b2, a2, False)
    params = {"gate_proj": up if swap_gate_up else gate, "up_proj": gate if swap_gate_up else up, "down_proj": down}
    ref = functional_call(eager, params, (x2, g2))
    ref.backward(upstream)
    return ours, [ref.detach(), x2.grad, g2.grad, a1.grad, b1.grad, a2.grad, b2.grad]


def inputs():
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, 7, 64, generator=g), torch.rand(2, 7, 2, generator=g)


@pytest.mark.parametrize("kernels", ["torch", "torch-grouped", "triton"])
def test_shared_experts_match_transformers_own(inkling, kernels, small_triton_blocks):
    """On the per-expert reference, the grouped formulation, and the Triton kernels (interpreted on a CPU)."""
    _, model, shared = inkling
    assert type(shared).__name__ == "InklingSharedExperts" and shared.moe_lora.gate_up_b.shape == (2, 128, 4)
    set_moe_kernels(model, kernels)
    try:
        pairs = eager_pair(shared, model.config, *inputs())
    finally:
        set_moe_kernels(model, "torch")
    for name, a, b in zip(NAMES, *pairs, strict=True):
        assert_close_scaled(name, a, b)


def test_gate_and_up_swapped_fails_the_same_comparison(inkling):
    _, model, shared = inkling
    ours, ref = eager_pair(shared, model.config, *inputs(), swap_gate_up=True)
    with pytest.raises(AssertionError):
        assert_close_scaled("output", ours[0], ref[0])


def test_fusing_gate_and_up_is_lossless(inkling):
    """The fused stack decodes to exactly what quantizing the checkpoint's gate_proj and up_proj gives."""
    path, model, shared = inkling
    name = next(n for n, m in experts_modules(model) if m is shared).removeprefix("base_model.model.")
    checkpoint = load_file(str(path / "model.safetensors"))
    fused = dequantize_param(shared.gate_up_proj)
    for half, stack in zip(fused.chunk(2, dim=1), ("gate_proj", "up_proj"), strict=True):
        assert torch.equal(half, dequantize_param(quantize_stack(checkpoint[f"{name}.{stack}"])))
