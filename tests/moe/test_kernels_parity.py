"""The grouped MoE layer (MoELoRAGroupedFunction) against transformers' eager experts, as in
test_moe_parity: on the kernels' torch references for every routing case (fast), and on the Triton
kernels for the hardest cases (in the interpreter on a CPU, compiled on a GPU when there is one).
Same oracle, same tolerance (4e-6 * max|ref|, fp32), same broken controls, which must fail."""

import pytest
import torch
from test_moe_parity import BROKEN, CASES, _swap_gate_up, routing_case

from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.model_path import ensure_tiny
from moe_qlora.moe.experts import _frozen_experts, deferred_lora_gradients, set_moe_kernels
from moe_qlora.moe.layer_state import layer_state
from moe_qlora.moe.nf4 import NF4Stack

from helpers.oracle import assert_all_close, quantized_with_lora, run_experts_pair


@pytest.fixture(scope="module")
def quantized(tiny_mixtral_dir, dev):
    return quantized_with_lora(tiny_mixtral_dir, dev)


def run(model, kernels, case, *, layer=0, hidden=64, experts=8, mutate=None):
    set_moe_kernels(model, kernels)
    kind, tokens, k = CASES[case]
    module = model.model.layers[layer].mlp.experts
    idx, weights = routing_case(kind, tokens, experts, k)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(5))
    dev = module.gate_up_proj.device
    return run_experts_pair(module, model.config, x.to(dev), idx.to(dev), weights.to(dev), mutate=mutate)


@pytest.mark.parametrize("kernels", ["torch-grouped", "grouped_mm"])
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_layer_on_torch_backends_matches_eager(quantized, case, kernels):
    """torch-grouped: the kernels' per-expert references; grouped_mm: each NF4 stack decoded whole, then
    torch._grouped_mm (which runs on the CPU too)."""
    assert_all_close(*run(quantized, kernels, case))


@pytest.mark.usefixtures("small_triton_blocks")
@pytest.mark.parametrize("case", ["ragged", "empty_experts", "topk_equals_experts"])
def test_grouped_layer_on_triton_kernels_matches_eager(quantized, case):
    assert_all_close(*run(quantized, "triton", case))


@pytest.mark.parametrize("swap", [False, True], ids=["64_row_tiles", "swapped_16_row_tiles"])
def test_grouped_layer_on_default_triton_blocks_matches_eager(quantized, swap, monkeypatch, override_kernel_settings):
    """At the default blocks (no small-block override) the tiny Mixtral's NF4 stacks take the packed paths in
    all four launches: the forward's gate_up and down read their codes as words along K, both input gradients
    along N; with few rows per expert (SWAP_AB_MAX_ROWS) also their swapped 16-row tiles. The whole layer's
    forward and every gradient then match the eager experts (same oracle and tolerance as above)."""
    from test_kernels import recorded_launches

    from moe_qlora.moe.kernels import tiles

    # not autotuned, on a GPU too: launches reach the recorder, not the autotuner; the bf16 tiles, checked in exact
    # fp32 products
    override_kernel_settings(block_override=None, autotune=False, fp32_own_config=False)
    monkeypatch.setattr(tiles, "SWAP_AB_MAX_ROWS", 10**6 if swap else 0)
    launches = recorded_launches(monkeypatch, override_kernel_settings)
    assert_all_close(*run(quantized, "triton", "ragged"))
    flags = [(kw["K_PACKED"], kw["N_PACKED"], kw["SWAP_AB"]) for kw in launches]
    nf4 = [f for f in flags if f[0] or f[1]]
    assert sum(f[0] for f in nf4) >= 2 and sum(f[1] for f in nf4) >= 2  # forward (K) and input gradients (N)
    assert all(f[2] == swap for f in nf4)


def test_mixtral_gate_runs_fused_and_gpt_oss_gate_does_not(quantized):
    """The parity cases above take the fused silu(gate) * up epilogue (Mixtral's default gate); GPT-OSS's
    clamped, interleaved gate is not fused and runs as the module's own (test below)."""
    assert _frozen_experts(quantized.model.layers[0].mlp.experts).gate_is_silu_mul
    gpt_oss = load_model(LoadOptions(str(ensure_tiny("gpt_oss"))))
    assert not _frozen_experts(gpt_oss.model.layers[0].mlp.experts).gate_is_silu_mul


@pytest.mark.usefixtures("wide_triton_blocks")
@pytest.mark.parametrize("kernels", ["torch-grouped", "grouped_mm", "triton"])
@pytest.mark.parametrize("broken", list(BROKEN))
def test_broken_controls_fail(quantized, kernels, broken):
    """Each broken control fails the parity check, at any tiling: wide_triton_blocks, the interpreter's fastest
    (the parity tests above run the small and the default blocks)."""
    if broken != "gate_up_swapped":
        with pytest.raises(AssertionError):
            assert_all_close(*run(quantized, kernels, "ragged", mutate=BROKEN[broken]))
        return
    experts = quantized.model.layers[0].mlp.experts
    original = experts.gate_up_proj
    try:
        experts.gate_up_proj = _swap_gate_up(experts)  # what the fused epilogue reads as gate is up
        ours, _ = run(quantized, kernels, "ragged")
        experts.gate_up_proj = original
        _, ref = run(quantized, kernels, "ragged")
    finally:
        experts.gate_up_proj = original
    with pytest.raises(AssertionError):
        assert_all_close(ours, ref)


@pytest.mark.usefixtures("small_triton_blocks")
@pytest.mark.parametrize("kernels", ["torch-grouped", "grouped_mm", "triton"])
def test_gpt_oss_biases_and_transposed_stacks(kernels, dev):
    """GPT-OSS: (E, in, out) stacks, biases on both projections (the routing-weight gradient gets <b2, g>),
    interleaved clamped SwiGLU through the module's own gate."""
    model = quantized_with_lora(ensure_tiny("gpt_oss"), dev)
    assert_all_close(*run(model, kernels, "ragged"))


@pytest.mark.usefixtures("wide_triton_blocks")
@pytest.mark.parametrize("kernels", ["torch-grouped", "grouped_mm", "triton"])
def test_deferred_lora_weight_gradients_equal_direct_ones(quantized, kernels):
    """Pushed to a store in the backward and flushed later, the expert LoRA gradients are bit-identical to
    those computed at once (same operations on the same operands), in a model with 2 MoE layers. The tiling is
    the parity tests' concern: wide_triton_blocks, the interpreter's fastest."""
    set_moe_kernels(quantized, kernels)
    dev = quantized.model.embed_tokens.weight.device
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(11)).to(dev)
    lora_params = {n: p for n, p in quantized.named_parameters() if ".moe_lora." in n}
    assert len(lora_params) == 8

    def expert_lora_grads(deferred: bool):
        quantized.zero_grad(set_to_none=True)
        if not deferred:
            quantized(ids, labels=ids).loss.backward()
            return {n: p.grad.clone() for n, p in lora_params.items()}
        with deferred_lora_gradients(quantized) as store:
            quantized(ids, labels=ids).loss.backward()
        assert len(store) == 2 and all(p.grad is None for p in lora_params.values())  # one push per layer
        store.flush()
        assert len(store) == 0
        return {n: p.grad.clone() for n, p in lora_params.items()}

    direct, deferred = expert_lora_grads(False), expert_lora_grads(True)
    for name in direct:
        assert torch.equal(direct[name], deferred[name]), name
    assert all(direct[n].abs().sum() > 0 for n in direct)


@pytest.mark.parametrize("kernels", ["torch-grouped", "grouped_mm", "triton"])
def test_bf16_layer_stays_close_to_the_fp32_reference(quantized, kernels, dev):
    """bf16 activations through the whole grouped layer (output and all 6 gradients) against the fp32
    per-expert reference, max|bf16 - fp32| <= bound * max|fp32|.

    At the blocks a launch takes without an override (the small ones measure the same, 4x slower in the
    interpreter). Rounding to nearest (torch; Triton compiled on a GPU): measured 1.1-1.2% here,
    bound 2.5%. Triton's interpreter rounds fp32 -> bf16 towards zero, which shrinks every rounded stage
    (decoded weights, h, a, y, LoRA projections) by ~2**-8 on average, all the same way: measured 2.8% here
    (2.77% at the small blocks and at the default ones), and on a wider layer
    a uniform scale of 0.973-0.975 on all 7 tensors with a ~1% residual once it is removed; bound 6% there.
    Dropped routing weights (the control) miss by ~155%."""
    module = quantized.model.layers[0].mlp.experts
    factors = module.moe_lora.factors()
    idx, weights = routing_case("ragged", 13, 8, 2)
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(5))
    upstream = torch.randn(13, 64, generator=torch.Generator().manual_seed(7)).to(dev)

    def outputs_and_grads(kind, dtype, routing_weights):
        set_moe_kernels(quantized, kind)
        xi = x.detach().to(dev, dtype).clone().requires_grad_(True)
        wi = routing_weights.detach().to(dev, dtype).clone().requires_grad_(True)
        for p in factors:
            p.grad = None
        out = module(xi, idx.to(dev), wi)
        (out.float() * upstream).sum().backward()
        return [out.float(), xi.grad.float(), wi.grad.float(), *[p.grad.float() for p in factors]]

    def worst_error(got, ref):
        return max(((a - r).abs().max() / r.abs().max()).item() for a, r in zip(got, ref, strict=True))

    ref = outputs_and_grads("torch", torch.float32, weights)
    bound = 0.06 if kernels == "triton" and dev == "cpu" else 0.025
    assert worst_error(outputs_and_grads(kernels, torch.bfloat16, weights), ref) <= bound
    # Control: the same comparison catches dropped routing weights in bf16.
    assert worst_error(outputs_and_grads(kernels, torch.bfloat16, torch.ones_like(weights)), ref) > bound


@pytest.mark.parametrize("decode", ["windows", "experts"])
@pytest.mark.parametrize("case", ["ragged", "empty_experts"])
def test_grouped_mm_decoding_part_of_a_stack_at_a_time_matches_eager(quantized, case, decode, monkeypatch):
    """Above model.dequant_buffer_mb (here 3.5 experts' fp32 bytes) a stack is decoded in parts: windows of output
    columns of every expert (the forward's gate_up in windows of 112, 112 and 32 of its 256 columns, down's 56 and 8
    of 64, the input gradient through down in 2 x 64), or, where no window falls on quant blocks (forced here),
    chunks of experts (3 of 8: 0-2, 3-5, 6-7, some empty). The same oracle and tolerance as the whole layer."""
    from moe_qlora.moe.kernels import grouped_mm
    from moe_qlora.moe.kernels.ops import GroupedWeight

    module = quantized.model.layers[0].mlp.experts
    per_expert = module.gate_up_proj.quant_state.shape[1:].numel() * 4  # fp32 bytes of one decoded expert
    if decode == "experts":
        monkeypatch.setattr(grouped_mm, "window_columns", lambda weight, itemsize, budget: None)
    try:
        set_moe_kernels(quantized, "grouped_mm", dequant_buffer_mb=3.5 * per_expert / 2**20)
        budget = layer_state(module).dequant_budget
        assert grouped_mm.experts_per_chunk(8, per_expert, budget) == 3
        if decode == "windows":
            gate_up = GroupedWeight.quantized(NF4Stack.from_param(module.gate_up_proj), transpose=True)
            down = GroupedWeight.quantized(NF4Stack.from_param(module.down_proj), transpose=True)
            assert grouped_mm.window_columns(gate_up, 4, budget) == 112
            assert grouped_mm.window_columns(down, 4, budget) == 56
        kind, tokens, k = CASES[case]
        idx, weights = routing_case(kind, tokens, 8, k)
        x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(5)).to(module.gate_up_proj.device)
        dev = x.device
        assert_all_close(*run_experts_pair(module, quantized.config, x, idx.to(dev), weights.to(dev)))
        broken, ref = run_experts_pair(
            module, quantized.config, x, idx.to(dev), weights.to(dev), mutate=BROKEN["experts_rolled"]
        )
    finally:
        set_moe_kernels(quantized, "grouped_mm", dequant_buffer_mb=None)
    with pytest.raises(AssertionError):  # control: the chunked layer with rolled experts fails the same check
        assert_all_close(broken, ref)


@pytest.mark.parametrize("garbage", [False, True], ids=["exact", "unwritten_empty_groups"])
def test_grouped_mm_lora_gradients_of_experts_without_rows_are_zero(quantized, garbage, monkeypatch):
    """torch._grouped_mm's ragged-K mode on sm_100 leaves the groups of experts without rows unwritten
    (pytorch/pytorch#172439): simulated here by NaN in those groups, the layer still matches eager (the
    empty experts' LoRA gradients exactly zero), on the routing case with empty experts."""
    real = torch._grouped_mm

    def leaves_empty_groups_unwritten(a, b, offs=None, **kwargs):
        out = real(a, b, offs=offs, **kwargs)
        if out.dim() == 3:  # the 2D x 2D mode: one (M, N) sum per group
            starts = torch.cat([offs.new_zeros(1), offs[:-1]])
            out[offs == starts] = float("nan")
        return out

    if garbage:
        monkeypatch.setattr(torch, "_grouped_mm", leaves_empty_groups_unwritten)
    ours, ref = run(quantized, "grouped_mm", "empty_experts")
    assert_all_close(ours, ref)


def test_a_recomputed_layer_hands_its_decoded_stacks_to_its_backward(quantized, monkeypatch):
    """Under activation checkpointing (torch.utils.checkpoint without reentrance, as training runs it), the grouped_mm
    layer's recomputed forward runs inside the backward, decodes both stacks whole, and its own backward reads them
    instead of decoding them again: 4 decodes a step, not 6. The gradients are bit for bit those of the layer that
    decodes again (the same decode). Control: a first forward outside any backward keeps nothing.

    Saved tensors stored densely on the host (save_on_cpu on a GPU, activation offload) turn the first forward's
    placeholders into stacks of zeros: the backward still tells them from the stacks, by the flag saved with them,
    and decodes again (a backward that judged by the tensors' strides took the zeros for weights)."""
    from torch.utils.checkpoint import checkpoint

    from moe_qlora.moe import grouped_layer
    from moe_qlora.moe.nf4 import NF4Stack

    module = quantized.model.layers[0].mlp.experts
    dev = module.gate_up_proj.device
    factors = module.moe_lora.factors()
    idx, weights = (t.to(dev) for t in routing_case("ragged", 13, 8, 2))
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(5)).to(dev)
    upstream = torch.randn(13, 64, generator=torch.Generator().manual_seed(7)).to(dev)
    decodes = []
    real_decode = NF4Stack.decode
    monkeypatch.setattr(NF4Stack, "decode", lambda self, *a: decodes.append(self.shape) or real_decode(self, *a))

    def offloaded(*args):
        # what save_on_cpu(pin_memory=True) does on a GPU: each saved tensor copied into a new dense host tensor
        # (on a CPU save_on_cpu keeps host tensors as they are)
        def pack(t):
            return t.device, torch.empty(t.shape, dtype=t.dtype).copy_(t)

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: packed[1].to(packed[0])):
            return module(*args)

    def step(run):
        decodes.clear()
        xi = x.clone().requires_grad_(True)
        for p in factors:
            p.grad = None
        (run(xi) * upstream).sum().backward()
        return len(decodes), [xi.grad, *[p.grad.clone() for p in factors]]

    set_moe_kernels(quantized, "grouped_mm")
    try:
        kept, grads = step(lambda xi: checkpoint(module, xi, idx, weights, use_reentrant=False))
        dense, grads_dense = step(lambda xi: offloaded(xi, idx, weights))
        monkeypatch.setattr(grouped_layer, "_recomputing", lambda: False)
        again, grads_again = step(lambda xi: checkpoint(module, xi, idx, weights, use_reentrant=False))
    finally:
        set_moe_kernels(quantized, "torch")
    assert (kept, dense, again) == (4, 4, 6)
    for a, b, c in zip(grads, grads_dense, grads_again, strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)
