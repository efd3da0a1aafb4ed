"""The MoE layer against transformers' own eager experts on the same dequantized weights.

Oracle: transformers' `MixtralExperts` eager forward (its per-expert loop), fed the explicit
per-expert weights W_e + c * B_e A_e, differentiated by autograd. Ours never merges LoRA and has its own backward.
Tolerance (fp32): both sides do the same products in fp32 in a different order (LoRA unmerged vs merged,
sorted-row vs per-expert accumulation), so the error scales with the tensor: measured worst case
6.5e-7 * max|ref| (about 5 ulps of the largest value). We require max|ours - ref| <= 4e-6 * max|ref|
(~6x headroom); the broken controls miss by a factor of ~1e4. Every comparison also runs with a broken
control that must fail.
"""

import copy

import pytest
import torch
from torch.func import functional_call

from moe_qlora.moe.nf4 import NF4Stack, dequantize_stack, quantize_stack

from helpers.oracle import (
    assert_all_close,
    assert_close_scaled,
    eager_reference_experts,
    leaves,
    quantized_with_lora,
    run_experts_pair,
)


@pytest.fixture(scope="module")
def quantized(tiny_mixtral_dir):
    """The tiny Mixtral loaded in 4-bit with expert LoRA whose B factors are non-zero (so every grad is)."""
    return quantized_with_lora(tiny_mixtral_dir)


run_pair = run_experts_pair


def routing_case(kind, tokens, experts, k):
    g = torch.Generator().manual_seed(3)
    if kind == "ragged":
        idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    elif kind == "one_expert":
        idx = torch.full((tokens, 1), 5)
    elif kind == "all_experts":
        idx = torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)])
    weights = torch.softmax(torch.randn(idx.shape, generator=g), -1)
    return idx, weights


CASES = {
    "ragged": ("ragged", 13, 2),  # odd token count, uneven groups
    "empty_experts": ("ragged", 2, 2),  # 4 rows over 8 experts: at least 4 experts get nothing
    "one_expert": ("one_expert", 9, 1),  # every token on expert 5
    "topk_equals_experts": ("all_experts", 3, 8),  # each token uses all 8 experts
}


@pytest.mark.parametrize("case", list(CASES))
def test_experts_match_transformers_eager(quantized, case):
    kind, tokens, k = CASES[case]
    experts = quantized.model.layers[0].mlp.experts
    idx, weights = routing_case(kind, tokens, 8, k)
    if case == "empty_experts":
        assert len(set(idx.reshape(-1).tolist())) < 8
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(5))
    assert_all_close(*run_pair(experts, quantized.config, x, idx, weights))


def _swap_gate_up(experts):
    """A layout bug: our gate_up stack with gate and up halves exchanged (restored after)."""
    w = dequantize_stack(NF4Stack.from_param(experts.gate_up_proj))
    inter = w.shape[1] // 2
    return quantize_stack(torch.cat([w[:, inter:], w[:, :inter]], dim=1))


BROKEN = {
    "gate_up_swapped": None,
    "routing_weights_dropped": lambda idx, w: (idx, torch.ones_like(w)),
    "experts_rolled": lambda idx, w: ((idx + 1) % 8, w),
}


@pytest.mark.parametrize("broken", list(BROKEN))
def test_broken_controls_fail_the_same_comparison(quantized, broken):
    experts = quantized.model.layers[0].mlp.experts
    idx, weights = routing_case("ragged", 13, 8, 2)
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(5))
    original = experts.gate_up_proj
    try:
        if broken == "gate_up_swapped":
            experts.gate_up_proj = _swap_gate_up(experts)
            ours, _ = run_pair(experts, quantized.config, x, idx, weights)
            experts.gate_up_proj = original
            _, ref = run_pair(experts, quantized.config, x, idx, weights)
        else:
            ours, ref = run_pair(experts, quantized.config, x, idx, weights, mutate=BROKEN[broken])
    finally:
        experts.gate_up_proj = original
    with pytest.raises(AssertionError):
        assert_all_close(ours, ref)


def test_moe_block_with_router_matches_eager_block(quantized):
    """The whole sparse block (the model's own router + experts): output and grads incl. the router weight."""
    block = quantized.model.layers[1].mlp
    cfg = copy.deepcopy(quantized.config)
    cfg._experts_implementation = "eager"
    ref_block = type(block)(cfg)
    eager, weights = eager_reference_experts(block.experts, quantized.config)
    ref_block.experts = eager
    x = torch.randn(2, 11, 64, generator=torch.Generator().manual_seed(9))
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(10))

    x1 = x.clone().requires_grad_(True)
    block.gate.weight.grad = None
    out = block(x1)
    out.backward(upstream)
    ours = [out.detach(), x1.grad, block.gate.weight.grad.clone()]

    x2, router, *f2 = leaves(x, block.gate.weight, *block.experts.moe_lora.factors())
    params = {"gate.weight": router, **{f"experts.{k}": v for k, v in weights(*f2).items()}}
    ref_out = functional_call(ref_block, params, (x2,))
    ref_out.backward(upstream)
    refs = [ref_out.detach(), x2.grad, router.grad]
    for name, a, b in zip(["output", "grad x", "grad router"], ours, refs, strict=True):
        assert_close_scaled(name, a, b)
    counts = torch.bincount(block.gate(x.reshape(-1, 64))[2].reshape(-1), minlength=8)
    assert int(counts.sum()) == 2 * 11 * 2


def test_routing_weight_dot_uses_fp32_products_in_bf16(monkeypatch):
    """The routing-weight gradient <a_s, u_s> over I = 768 columns in bf16, against fp64 on the same bf16
    inputs. With fp32 products (each bf16 x bf16 product is exact in fp32) only the fp32 summation errs: median
    relative error < 1e-6 (measured ~7e-8). The old form, (a * u).sum(-1, dtype=float32), rounded every product
    to bf16 first: its median error is ~1e-3, the broken control. Both backward paths (the per-expert reference
    and the grouped one) call it."""
    import inspect

    from moe_qlora.moe import grouped_layer, reference_layer
    from moe_qlora.moe.reference_layer import routing_weight_dot

    g = torch.Generator().manual_seed(0)
    a, u = (torch.randn(4096, 768, generator=g).bfloat16() for _ in range(2))
    exact = (a.double() * u.double()).sum(-1)

    def median_relative_error(dot):
        return ((dot.double() - exact).abs() / exact.abs().clamp_min(1e-3)).median().item()

    assert median_relative_error(routing_weight_dot(a, u)) < 1e-6
    assert median_relative_error((a * u).sum(-1, dtype=torch.float32)) > 1e-4
    # chunked over rows (fp32 copies bounded) gives the same values as one piece
    monkeypatch.setattr(reference_layer, "_DOT_CHUNK_ELEMENTS", 768 * 1000)
    assert torch.equal(routing_weight_dot(a, u), (a.float() * u.float()).sum(-1))
    for function in (reference_layer.MoELoRAFunction.backward, grouped_layer.grouped_backward):
        assert "routing_weight_dot(" in inspect.getsource(function)


def _padded_everywhere(monkeypatch):
    """The CPU bf16 row padding (reference_layer.matmul_rows) turned on in fp32, where the oracle's tolerance is
    tight enough to see a wrong padding row."""
    from moe_qlora.moe import reference_layer

    monkeypatch.setattr(reference_layer, "matmul_rows", lambda n, x: reference_layer.row_grid(n))


@pytest.mark.parametrize("tokens", [13, 200])
def test_expert_rows_padded_for_onednn_are_exact(quantized, monkeypatch, tokens):
    """Zero padding rows add nothing to the outputs, the input gradient, the routing-weight gradient or the LoRA
    gradients (sums over rows): the same fp32 tolerance as unpadded. 13 tokens: every expert padded from a few rows
    to 16; 200: ~50 rows each, padded to multiples of 16."""
    _padded_everywhere(monkeypatch)
    experts = quantized.model.layers[0].mlp.experts
    idx, weights = routing_case("ragged", tokens, 8, 2)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(5))
    assert_all_close(*run_pair(experts, quantized.config, x, idx, weights))


def test_padding_rows_that_are_not_zero_fail_the_comparison(quantized, monkeypatch):
    """The broken control: padding rows of ones (in the gathered rows and the padded routing weights, h and LoRA
    projections) leak into the sums over rows."""
    from moe_qlora.moe import reference_layer

    _padded_everywhere(monkeypatch)
    zero_gathered, zero_padded = reference_layer.gather_rows, reference_layer.pad_rows

    def ones_after(out, n):
        out = out.clone()
        out[n:] = 1.0
        return out

    monkeypatch.setattr(reference_layer, "gather_rows", lambda x, i, m: ones_after(zero_gathered(x, i, m), i.numel()))
    monkeypatch.setattr(reference_layer, "pad_rows", lambda t, m: ones_after(zero_padded(t, m), t.shape[0]))
    experts = quantized.model.layers[0].mlp.experts
    idx, weights = routing_case("ragged", 13, 8, 2)
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(5))
    with pytest.raises(AssertionError, match="grad"):
        assert_all_close(*run_pair(experts, quantized.config, x, idx, weights))


def test_rows_are_padded_only_for_onednn_dtypes_and_onto_a_small_grid():
    from moe_qlora.moe.reference_layer import matmul_rows, row_grid

    assert matmul_rows(37, torch.zeros(1, 4)) == 37  # fp32: MKL's GEMM, no per-shape kernels
    assert matmul_rows(37, torch.zeros(1, 4, dtype=torch.bfloat16)) == 48
    for n in range(1, 20000):
        grid = row_grid(n)
        assert n <= grid <= max(n + 15, n * 1.125), n
    assert len({row_grid(n) for n in range(64, 1025)}) <= 32  # a few dozen kernels per product, not ~1000
