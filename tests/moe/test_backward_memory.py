"""What the grouped layer's backward allocates beyond its own work, and what the kernels cache across calls.

1. The grouped op returns the stacks grouped_mm decoded (and h, p1, p2) only to save them for the backward. Autograd
   hands a Function's backward a gradient for every output, materialized as zeros unless told not to: for
   Qwen3-30B-A3B that was 2.4 GiB of fp32 zeros a layer, the stacks' shapes, in every recomputed layer's backward
   (scripts/bench_memory.py --kernels grouped_mm: 1.38x the plan at 4,096 tokens, 1.08x without them). Checked
   on a tiny Mixtral with its layers checkpointed (the recompute keeps the stacks); control: the same detector
   sees the zeros of a plain Function that does not say so.
2. Tensors cached per device (the NF4 and e2m1 tables, host offsets) are real even when first built under a fake
   mode (torch.compile, the capture-safety tests): a cached fake tensor reached a later real launch.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from moe_qlora.config.sections import LoraSection
from moe_qlora.model.adapters import attach_adapters, configure_checkpointing
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.model_path import ensure_tiny
from moe_qlora.moe.expert_stacks import experts_modules
from moe_qlora.moe.experts import set_moe_kernels


class ZerosOfShape(TorchDispatchMode):
    """Records the zero-filled tensors of the given shapes the dispatcher creates (autograd's materialized grads)."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.seen = {tuple(s) for s in shapes}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default, torch.ops.aten.new_zeros.default):
            self.seen += [tuple(t.shape) for t in tree_flatten(out)[0] if tuple(t.shape) in self.shapes]
        return out


def test_the_grouped_backward_materializes_no_zero_gradient_of_the_decoded_stacks():
    model = attach_adapters(load_model(LoadOptions(str(ensure_tiny("mixtral")))), LoraSection(rank=4), seed=0)
    configure_checkpointing(model, enabled=True, interval=1)
    set_moe_kernels(model, "grouped_mm")
    model.train()
    module = experts_modules(model)[0][1]
    shapes = [module.gate_up_proj.quant_state.shape, module.down_proj.quant_state.shape]
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    with ZerosOfShape(shapes) as zeros:
        loss.backward()
    set_moe_kernels(model, "torch")
    assert zeros.seen == []


class SavesAnUnusedOutput(torch.autograd.Function):
    """The control: an output returned only to be saved, autograd's default for its gradient."""

    @staticmethod
    def forward(ctx, x):
        return x * 2, torch.ones(5, 7)

    @staticmethod
    def backward(ctx, grad, _unused):
        return grad * 2


def test_the_detector_sees_autograd_materialize_a_zero_gradient():
    x = torch.randn(3, requires_grad=True)
    out, _ = SavesAnUnusedOutput.apply(x)
    with ZerosOfShape([(5, 7)]) as zeros:
        out.sum().backward()
    assert zeros.seen == [(5, 7)]


@pytest.mark.parametrize("build", ["nf4_code", "levels", "e2m1_bytes", "offsets"])
def test_tensors_cached_across_calls_are_real_when_first_built_under_a_fake_mode(build):
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    from moe_qlora.moe import mxfp4, nf4
    from moe_qlora.moe.kernels import ops

    cached, call = {
        "nf4_code": (nf4._nf4_code, lambda: nf4._nf4_code("cpu")),
        "levels": (ops._levels, lambda: ops._levels("cpu", True)),
        "e2m1_bytes": (mxfp4._byte_values, lambda: mxfp4._byte_values("cpu")),
        "offsets": (ops._offsets_tensor, lambda: ops._offsets_tensor((0, 3, 5), "cpu")),
    }[build]
    cached.cache_clear()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            call()
        assert not is_fake(call()) and call().device.type == "cpu"
    finally:
        cached.cache_clear()
