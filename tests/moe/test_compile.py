"""The grouped MoE layer as a registered op (moe_qlora::grouped_experts): its schema, fake implementation and
autograd formula checked by torch.library.opcheck, and a whole MoE block (the model's router + our experts)
compiled with torch.compile(fullgraph=True), which fails on any graph break, so on any host sync left in the
glue (.tolist(), .item(), data-dependent shapes). Compiled and eager agree within 1e-6 relative in fp32 (the
compiled graph reorders a few fp32 reductions; measured max ~1e-7), forward and every gradient."""

import pytest
import torch
from test_moe_parity import routing_case

from moe_qlora.moe.experts import set_moe_kernels
from moe_qlora.moe.grouped_layer import grouped_experts_backward_op, grouped_experts_op

from helpers.oracle import quantized_with_lora


@pytest.fixture(scope="module")
def quantized(tiny_mixtral_dir):
    return quantized_with_lora(tiny_mixtral_dir, "cpu", expert_double_quant=True)


def _op_args(module, x, idx, weights, stacks=0):
    """The op's arguments for one experts module, as moe_lora_experts_grouped builds them."""
    from moe_qlora.moe.experts import _frozen_experts
    from moe_qlora.moe.grouped_layer import op_inputs
    from moe_qlora.moe.reference_layer import MoEPlan
    from moe_qlora.moe.routing import route

    plan = MoEPlan(_frozen_experts(module), route(idx, 8), module.moe_lora.scale)
    return op_inputs(x, weights, module.moe_lora.factors(), plan, "grouped_mm", None, True, decoded_stacks=stacks)


# bf16 at rank 4: grouped_mm pads the rank to 8 (16 bytes) and slices it back, the case whose strides once
# differed from the fake's; fp32: no padding. stacks: the decoded stacks' outputs, none, their shapes only (a
# checkpointed layer's first forward), the stacks (its recompute; the backward reads them).
@pytest.mark.parametrize("stacks", [0, 1, 2], ids=["no_stacks", "stack_shapes", "kept_stacks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_registered_ops_pass_opcheck(quantized, dtype, stacks):
    """Schema, fake (meta) shapes and strides, autograd registration and dispatch of moe_qlora::grouped_experts
    and of its backward op (whose dA1 is OUT_PROD_ID's transposed result)."""
    module = quantized.model.layers[0].mlp.experts
    assert module.gate_up_proj.quant_state.nested  # nested scales go through the op too
    idx, weights = routing_case("ragged", 7, 8, 2)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_(True)
    args = _op_args(module, x, idx, weights.to(dtype).requires_grad_(True), stacks)
    torch.library.opcheck(
        grouped_experts_op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration")
    )
    x, weights, lora, frozen, floats, ints, kernels, _ = args
    _, h, p1, p2, gate_up, down, kept = grouped_experts_op(*args)
    held = gate_up.numel() > 0 and gate_up.stride(0) > 0  # the stack itself, not one zero expanded to its shape
    assert (gate_up.numel() > 0, held, bool(kept)) == (stacks > 0, stacks == 2, stacks == 2)
    assert kept.device.type == "cpu"  # read by the backward without waiting for the device
    backward_args = (
        torch.randn_like(x),
        x.detach(),
        weights.detach(),
        [h, p1, p2, gate_up, down, kept],
        lora,
        frozen,
        floats,
        ints,
        kernels,
    )
    torch.library.opcheck(grouped_experts_backward_op, backward_args, test_utils=("test_schema", "test_faketensor"))


GRAPHS = []


def _recording_aot_eager(gm, example_inputs):
    """aot_eager (AOTAutograd traces the backward too, through the op's registered autograd), keeping the
    dynamo graph so a test can see what was captured."""
    from torch._dynamo.backends.registry import lookup_backend

    GRAPHS.append(gm)
    return lookup_backend("aot_eager")(gm, example_inputs)


def _block_outputs_and_grads(block, x, upstream, backend=None):
    """[output, grad x, grads of the 4 expert LoRA factors]: eager, or compiled by `backend` (fullgraph)."""
    lora = [p for n, p in block.named_parameters() if "moe_lora" in n]
    for p in lora:
        p.grad = None
    xi = x.clone().requires_grad_(True)
    run = torch.compile(block, fullgraph=True, backend=backend) if backend is not None else block
    out = run(xi)
    out = out[0] if isinstance(out, tuple) else out
    (out * upstream).sum().backward()
    return [out.detach(), xi.grad, *[p.grad.clone() for p in lora]]


@pytest.mark.parametrize("kernels", ["grouped_mm", "torch-grouped"])
def test_a_whole_moe_block_compiles_without_graph_breaks_and_matches_eager(quantized, kernels):
    torch._dynamo.reset()
    set_moe_kernels(quantized, kernels)
    try:
        block = quantized.model.layers[0].mlp  # MixtralSparseMoeBlock: router linear, softmax, top-k, experts
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(2, 9, 64, generator=gen)
        upstream = torch.randn(2, 9, 64, generator=gen)
        eager = _block_outputs_and_grads(block, x, upstream)
        compiled = _block_outputs_and_grads(block, x, upstream, backend=_recording_aot_eager)
    finally:
        set_moe_kernels(quantized, "torch")
    assert len(GRAPHS) == 1  # one graph: fullgraph=True would have raised on a break anyway
    targets = [str(n.target) for n in GRAPHS.pop().graph.nodes if n.op == "call_function"]
    assert "moe_qlora.grouped_experts.default" in targets  # our experts, as one node of the block's graph
    assert any("topk" in t for t in targets)  # and the model's own router around it
    assert len(eager) == 6  # output, grad x, 4 expert LoRA factors
    for name, got, ref in zip(["out", "x", "A1", "B1", "A2", "B2"], compiled, eager, strict=True):
        err, scale = float((got - ref).abs().max()), float(ref.abs().max())
        assert scale > 0 and err <= 1e-6 * scale, f"{name}: {err:.3g} vs {scale:.3g}"


def test_the_block_compiled_by_inductor_trains_like_eager(quantized):
    """The default backend, which generates code from the fake implementations' strides (aot_eager never reads
    them): forward and every gradient within 1e-6 relative of eager, fp32. With the backward op's dA1 returned
    as the transposed view it once was, inductor's stride assertion stops the backward."""
    torch._dynamo.reset()
    set_moe_kernels(quantized, "grouped_mm")
    try:
        block = quantized.model.layers[0].mlp
        gen = torch.Generator().manual_seed(5)
        x, upstream = torch.randn(2, 9, 64, generator=gen), torch.randn(2, 9, 64, generator=gen)
        eager = _block_outputs_and_grads(block, x, upstream)
        compiled = _block_outputs_and_grads(block, x, upstream, backend="inductor")
    finally:
        set_moe_kernels(quantized, "torch")
        torch._dynamo.reset()
    for name, got, ref in zip(["out", "x", "A1", "B1", "A2", "B2"], compiled, eager, strict=True):
        err, scale = float((got - ref).abs().max()), float(ref.abs().max())
        assert scale > 0 and err <= 1e-6 * scale, f"{name}: {err:.3g} vs {scale:.3g}"


def test_a_host_sync_in_the_glue_breaks_the_compile(quantized, monkeypatch):
    """Control: the same compile fails once the routing reads its offsets on the host (the old bincount +
    .tolist() dispatch), so the test above does detect a sync."""
    import moe_qlora.moe.experts as experts

    real_route = experts.route

    def syncing_route(top_k_index, num_experts):
        rt = real_route(top_k_index, num_experts)
        rt.offsets  # noqa: B018 (the host copy: a .tolist() of device values)
        return rt

    monkeypatch.setattr(experts, "route", syncing_route)
    torch._dynamo.reset()
    set_moe_kernels(quantized, "grouped_mm")
    try:
        block = quantized.model.layers[0].mlp
        with pytest.raises(torch._dynamo.exc.Unsupported, match="tolist"):
            torch.compile(block, fullgraph=True, backend="aot_eager")(torch.randn(1, 5, 64))
    finally:
        set_moe_kernels(quantized, "torch")
        torch._dynamo.reset()


@pytest.mark.parametrize("family,op_calls", [("mixtral", 2), ("gpt_oss", 0)])
def test_default_gates_take_the_op_and_other_gates_the_function(quantized, family, op_calls, monkeypatch):
    """Every layer with transformers' default silu(gate) * up (Mixtral: 2 layers) runs the registered op;
    GPT-OSS's clamped, interleaved gate runs the autograd Function, which calls the module's own gate."""
    import moe_qlora.moe.grouped_layer as grouped_layer
    from moe_qlora.model.loading import LoadOptions, load_model
    from moe_qlora.model.model_path import ensure_tiny

    calls = []
    real = grouped_layer.grouped_experts_op
    monkeypatch.setattr(grouped_layer, "grouped_experts_op", lambda *a: calls.append(1) or real(*a))
    model = quantized if family == "mixtral" else load_model(LoadOptions(str(ensure_tiny("gpt_oss"))))
    set_moe_kernels(model, "grouped_mm")
    try:
        model(torch.randint(3, 200, (1, 6)))
    finally:
        set_moe_kernels(model, "torch")
    assert len(calls) == op_calls
