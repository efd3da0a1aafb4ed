"""The grouped layer's row-wise steps (moe/kernels/rows.py): each Triton kernel, run by Triton's interpreter, against
its torch reference, and the reference against an independent oracle (autograd on silu(gate) * up; a loop over
tokens for the combine). Controls: gate and up swapped, the routing weights dropped, the LoRA term dropped, the
slots rolled.

Tolerances: fp32, 1e-5 relative (the kernel and the reference take the same fp32 products, summed in another order;
autograd rounds nothing more in fp32). bf16, as max |a - b| over max |b|: the interpreter rounds to bf16 towards
zero where torch rounds to nearest, so an intermediate stored in bf16 (h = y + c low, u + c low, act) may differ by
one step (2**-8 of its own size), which the gate turns into up to a few steps of an output element near a zero of
silu; 2**-6 of the tensor's scale bounds that, and a swapped gate or a dropped weight misses by O(1)."""

import pytest
import torch

from moe_qlora.moe.kernels import rows

TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6}


def close(got: torch.Tensor, expected: torch.Tensor, dtype) -> bool:
    """max |got - expected| <= TOL[dtype] * max |expected|."""
    return float((got.float() - expected.float()).abs().max()) <= TOL[dtype] * float(expected.float().abs().max())


def data(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lora", [False, True])
def test_silu_mul_kernel_matches_its_reference_and_the_definition(dtype, lora):
    """13 rows, I = 40 (a block of 64 with masked columns): h = y + c low rounded, act = silu(gate) up."""
    y, low = data((13, 80), dtype, 0), (data((13, 80), dtype, 1) if lora else None)
    y_kernel, y_ref = y.clone(), y.clone()
    act = rows.silu_mul(y_kernel, low, 0.5, True, True)
    expected = rows.silu_mul_reference(y_ref, low, 0.5, True)
    assert close(act.float(), expected.float(), dtype)
    assert close(y_kernel.float(), y_ref.float(), dtype)
    h = (y.float() + 0.5 * low.float()) if lora else y.float()
    definition = torch.nn.functional.silu(h[:, :40]) * h[:, 40:]
    assert close(expected.float(), definition, dtype)
    swapped = torch.nn.functional.silu(h[:, 40:]) * h[:, :40]  # control: gate and up swapped
    assert not close(expected.float(), swapped, dtype)
    if lora:  # control: the LoRA term dropped
        assert not close(expected, torch.nn.functional.silu(y.float()[:, :40]) * y.float()[:, 40:], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("width", "lora"), [(40, False), (40, True), (1100, True)])  # 1100: two blocks of 1024
def test_silu_mul_backward_kernel_matches_its_reference_and_autograd(dtype, width, lora):
    h, u = data((9, 2 * width), dtype, 2), data((9, width), dtype, 3)
    low, w = (data((9, width), dtype, 4) if lora else None), data((9,), dtype, 5).abs()
    got = rows.silu_mul_backward(h, u, low, 0.25, w, True)
    expected = rows.silu_mul_backward_reference(h, u, low, 0.25, w)
    for a, b in zip(got, expected, strict=True):
        assert close(a.float(), b.float(), dtype)
    # the oracle: autograd through silu(gate) * up in fp32, at u (with its LoRA term) times the routing weight
    uu = ((u.float() + 0.25 * low.float()).to(dtype) if lora else u).float()
    hh = h.float().requires_grad_(True)
    act = torch.nn.functional.silu(hh[:, :width]) * hh[:, width:]
    (grad,) = torch.autograd.grad(act, hh, uu * w.float()[:, None], retain_graph=True)
    grad_h, act_out, dot = expected
    assert close(grad_h.float(), grad, dtype)
    assert close(act_out.float(), act.detach(), dtype)
    torch.testing.assert_close(dot, (act_out.float() * uu).sum(-1), rtol=1e-5, atol=1e-5)
    (unweighted,) = torch.autograd.grad(act, hh, uu)  # control: the routing weights dropped
    assert not close(grad_h.float(), unweighted, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("weighted", "lora"), [(True, False), (True, True), (False, True)])
def test_combine_kernel_matches_its_reference_and_a_loop_over_tokens(dtype, weighted, lora):
    """7 tokens, top-3, H = 1100 (two blocks, masked columns), sorted rows in a random order."""
    tokens, k, hidden = 7, 3, 1100
    sorted_rows, low = data((tokens * k, hidden), dtype, 6), (data((tokens * k, hidden), dtype, 7) if lora else None)
    inverse = torch.randperm(tokens * k, generator=torch.Generator().manual_seed(8))
    weights = data((tokens, k), dtype, 9) if weighted else None
    got = rows.combine(sorted_rows, low, 0.5, inverse, weights, k, True)
    expected = rows.combine_reference(sorted_rows, low, 0.5, inverse, weights, k)
    assert close(got.float(), expected.float(), dtype)
    loop = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for slot in range(k):
            r = inverse[t * k + slot]
            v = sorted_rows[r].float() + (0.5 * low[r].float() if lora else 0)
            loop[t] += v * (weights[t, slot].float() if weighted else 1)
    assert close(expected.float(), loop, dtype)
    rolled = rows.combine_reference(sorted_rows, low, 0.5, inverse.roll(1), weights, k)  # control: slots rolled
    assert not close(rolled.float(), loop, dtype)


def test_the_row_steps_are_single_operations_on_fake_tensors():
    """What scripts/layer_traffic.py counts as one launch each: the ops' fake implementations give the shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        h, u, w = torch.empty(5, 8), torch.empty(5, 4), torch.empty(5)
        grad_h, act, dot = rows.silu_mul_backward(h, u, None, 1.0, w, True)
        out = rows.combine(torch.empty(6, 3), None, 1.0, torch.empty(6, dtype=torch.long), None, 2, True)
        a = rows.silu_mul(torch.empty(5, 8), torch.empty(5, 8), 1.0, True, True)
    assert (grad_h.shape, act.shape, dot.shape, dot.dtype) == ((5, 8), (5, 4), (5,), torch.float32)
    assert out.shape == (3, 3) and a.shape == (5, 4)
