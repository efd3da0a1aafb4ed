"""The grouped MoE layer reads nothing back from the device, forward or backward (issue 58: zero host syncs in a
layer step, so that the step can be captured as a CUDA graph), proved on the CPU.

The op's own implementation (not only the glue torch.compile traces around it) runs on fake tensors:
FakeTensorMode gives every tensor a shape and a dtype but no values, so any host read of a device value
(.tolist(), .item(), a data-dependent shape, a bool of a tensor) raises. The path is grouped_mm in bf16, as on an
H100 (torch._grouped_mm's meta function takes bf16 only), with nested NF4 scales and expert LoRA, through
bitsandbytes' decode, the routing plan, the grouped GEMMs, the gate, the combine, and the backward's input,
routing-weight and LoRA gradients, with the stacks decoded whole or (under model.dequant_buffer_mb) a window of
columns at a time. The control: decoding a chunk of experts at a time, which needs each chunk's row range on the
host, is caught.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from moe_qlora.moe.grouped_layer import grouped_experts_backward_op, grouped_experts_op

from helpers.oracle import quantized_with_lora

HOST_READS = (DataDependentOutputException, GuardOnDataDependentSymNode)


@pytest.fixture(scope="module")
def experts(tiny_mixtral_dir):
    return quantized_with_lora(tiny_mixtral_dir, "cpu", expert_double_quant=True).model.layers[0].mlp.experts


def op_arguments(module, budget: int | None):
    """grouped_experts_op's arguments for 12 tokens through `module`, in bf16, as moe_lora_experts_grouped builds
    them (budget: grouped_mm's decode limit in bytes)."""
    from moe_qlora.moe.experts import _frozen_experts
    from moe_qlora.moe.grouped_layer import op_inputs
    from moe_qlora.moe.reference_layer import MoEPlan
    from moe_qlora.moe.routing import route

    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 64, generator=g, dtype=torch.bfloat16)
    top_k_index = torch.randint(0, 8, (12, 2), generator=g)
    weights = torch.rand(12, 2, generator=g, dtype=torch.bfloat16)
    lora = tuple(f.detach().bfloat16() for f in module.moe_lora.factors())
    plan = MoEPlan(_frozen_experts(module), route(top_k_index, 8), module.moe_lora.scale)
    return op_inputs(x, weights, lora, plan, "grouped_mm", budget, True)


def on_fake_tensors(mode: FakeTensorMode, values):
    if isinstance(values, torch.Tensor):
        return mode.from_tensor(values)
    if isinstance(values, list | tuple):
        return type(values)(on_fake_tensors(mode, v) for v in values)
    return values


def forward_and_backward(module, budget: int | None = None):
    """The op's forward then its backward, their implementations called on fake tensors."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    x, weights, lora, frozen, floats, ints, kernels, keep_h = on_fake_tensors(mode, op_arguments(module, budget))
    with mode:
        out, h, p1, p2, *stacks = grouped_experts_op._init_fn(x, weights, lora, frozen, floats, ints, kernels, keep_h)
        grads = grouped_experts_backward_op._init_fn(
            torch.ones_like(out), x, weights, [h, p1, p2, *stacks], lora, frozen, floats, ints, kernels
        )
    return out, grads


def test_a_layer_step_reads_nothing_back_from_the_device(experts):
    out, grads = forward_and_backward(experts)
    assert out.shape == (12, 64) and out.dtype == torch.bfloat16
    grad_x, grad_w, *lora_grads = grads
    assert grad_x.shape == (12, 64) and grad_w.shape == (12, 2)
    assert [tuple(g.shape) for g in lora_grads] == [tuple(f.shape) for f in experts.moe_lora.factors()]


ONE_EXPERT = 256 * 64 * 2  # gate_up (2I, H) of one expert in bf16


def test_a_stack_decoded_in_windows_under_a_budget_reads_nothing_back(experts):
    """Under model.dequant_buffer_mb (here one expert's bytes) the stacks are decoded a window of columns at a time,
    each window's GEMM over all rows: nothing read back either."""
    out, grads = forward_and_backward(experts, budget=ONE_EXPERT)
    assert out.shape == (12, 64) and grads[0].shape == (12, 64)


def test_the_decode_by_chunks_of_experts_reads_its_row_ranges_back_and_is_caught(experts, monkeypatch):
    """The control: the same budget with no window possible (an MXFP4 stack, a row that is not whole blocks; forced
    here) decodes a chunk of experts at a time, which needs the offsets on the host."""
    from moe_qlora.moe.kernels import grouped_mm

    monkeypatch.setattr(grouped_mm, "window_columns", lambda weight, itemsize, budget: None)
    with pytest.raises(HOST_READS):
        forward_and_backward(experts, budget=ONE_EXPERT)


class RecordedKernel:
    """Stands in for a jitted Triton kernel on fake tensors: `kernel[grid](*args, **kwargs)` records the grid."""

    def __init__(self, launches: list):
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(grid(kwargs) if callable(grid) else grid)


@pytest.fixture
def triton_launches_recorded(monkeypatch, override_kernel_settings):
    """The Triton kernels replaced by recorders (the launchers, tile maps and row steps run for real on whatever
    tensors they get), as a GPU launches them (sm_90's configs, not the interpreter's blocks), autotuning off; the
    NF4 levels' cached tensor made real before any fake mode."""
    from moe_qlora.moe.kernels import ops, triton_kernels

    launches = []
    for name in ("_grouped_matmul_kernel", "_grouped_outer_product_kernel"):
        monkeypatch.setattr(triton_kernels, name, RecordedKernel(launches))
    override_kernel_settings(autotune=False, interpreted=False, block_override=None, target_arch=90)
    ops._levels("cpu")
    return launches


def test_the_triton_path_launches_read_nothing_back_and_allocate_by_shapes_alone(experts, triton_launches_recorded):
    """Issue 67, item 4 (capture-safety without a GPU): the Triton path's forward and backward, launchers and all
    (tile maps, split-K workspaces, grids, the row steps), run on fake tensors: nothing read back, no allocation
    or grid whose size depends on a value, so a CUDA graph captured for one routing replays for any other of the
    same token count. The grouped_mm path is proven so above. Control: a tile map built from the counts on the
    host is caught."""
    from moe_qlora.moe.kernels import ops

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    x, weights, lora, frozen, floats, ints, _, keep_h = on_fake_tensors(mode, op_arguments(experts, None))
    with mode:
        out, h, p1, p2, *stacks = grouped_experts_op._init_fn(x, weights, lora, frozen, floats, ints, "triton", keep_h)
        grads = grouped_experts_backward_op._init_fn(
            torch.ones_like(out), x, weights, [h, p1, p2, *stacks], lora, frozen, floats, ints, "triton"
        )
    assert out.shape == (12, 64) and [tuple(g.shape) for g in grads[2:]] == [tuple(f.shape) for f in lora]
    # forward: LoRA A, gate_up with its epilogue, down; backward: the input gradients and the weight gradients
    assert len(triton_launches_recorded) >= 10
    assert all(isinstance(dim, int) for grid in triton_launches_recorded for dim in grid)
    host_tiles = ops.expert_tiles

    def tiles_from_host_counts(offsets, num_rows, block_m, group_m=1):
        offsets.tolist()  # what a launcher sizing its grid by the real tiles would do
        return host_tiles(offsets, num_rows, block_m, group_m)

    ops.expert_tiles = tiles_from_host_counts
    try:
        with pytest.raises(HOST_READS), mode:
            grouped_experts_op._init_fn(x, weights, lora, frozen, floats, ints, "triton", keep_h)
    finally:
        ops.expert_tiles = host_tiles
