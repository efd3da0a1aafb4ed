"""StepInBackward's undo without waits inside the backward (issue 43, item 5).

The host waits for the device once per step, in finish(), not once per copy inside the hooks: counted through
the device runtime's interface (common/device_runtime.py) with the CountingRuntime stand-in on the CPU, and on
a GPU by CUDA's own sync check. The undo still puts weights and optimizer state back bit for bit, the host block
is allocated in the first two steps and then reused, and a kept step is the same with or without the undo.
"""

import copy

import pytest
import torch
from torch import nn

from moe_qlora.common.device_runtime import CountingRuntime, CpuRuntime
from moe_qlora.train.optim import ClippedAdamW, ClippedAdamW8bit, StepInBackward

LAYERS, WIDTH = 20, 64  # 40 trainable tensors; a 64x64 weight (4,096 elements) gets bitsandbytes' 8-bit state
OPTIMIZERS = {"adamw": lambda groups: ClippedAdamW(groups, lr=1e-2, foreach=False), "adamw_8bit": ClippedAdamW8bit}


def stack(device="cpu") -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).to(device)


def stepper_for(model, optimizer: str, *, undo=True, runtime=None) -> StepInBackward:
    groups = [{"params": [p]} for p in model.parameters()]  # one group per tensor, as build_optimizer makes them
    opt = OPTIMIZERS[optimizer](groups) if optimizer == "adamw" else OPTIMIZERS[optimizer](groups, lr=1e-2)
    return StepInBackward(opt, undo=undo, runtime=runtime)


def batch(step: int, device="cpu") -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step)).to(device)


def backward(model, x: torch.Tensor, *, poisoned=False) -> None:
    """A finite loss; poisoned: the first layer's weight (its gradient complete last) gets a NaN gradient, after
    the other 39 tensors were updated."""
    loss = model(x).pow(2).mean()
    if poisoned:
        w = model[0].weight
        loss = loss + 0 * torch.sqrt(w - w).sum()  # value 0, gradient 0 * inf = NaN
    loss.backward()


def step(stepper, model, x, **kwargs) -> tuple[list, list, list, bool]:
    """One step: (runtime calls in begin(), inside the backward, in finish(), skipped)."""
    log = stepper.runtime.log
    marks = [len(log)]
    stepper.begin()
    marks.append(len(log))
    backward(model, x, **kwargs)
    marks.append(len(log))
    _, skipped = stepper.finish(True)
    return log[marks[0] : marks[1]], log[marks[1] : marks[2]], log[marks[2] :], skipped


def slot_count(stepper) -> int:
    """Tensors the snapshot copies: each trainable and each tensor of its optimizer state."""
    state = stepper.optimizer.state
    return sum(1 + sum(torch.is_tensor(v) for v in state.get(p, {}).values()) for p in stepper._group)


def weights_and_state(stepper) -> list:
    """Every trainable and its optimizer state, copied (tensors cloned, numbers kept with their type)."""
    return [(p.detach().clone(), copy.deepcopy(dict(stepper.optimizer.state.get(p, {})))) for p in stepper._group]


def assert_identical(a: list, b: list) -> None:
    for (wa, sa), (wb, sb) in zip(a, b, strict=True):
        assert torch.equal(wa, wb)
        assert sa.keys() == sb.keys()
        for key in sa:
            assert type(sa[key]) is type(sb[key]), key  # torch's step a host tensor, bitsandbytes' an int
            assert torch.equal(sa[key], sb[key]) if torch.is_tensor(sa[key]) else sa[key] == sb[key], key


# ------------------------------------------------------------------------------------------ waits counted


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit"])
def test_the_backward_waits_for_nothing_and_each_step_once(optimizer):
    """Three steps over 40 tensors: no wait inside the backward, one in finish(); every tensor and state tensor
    copied once a step; the host block allocated at the first step (weights), again at the second (with the
    state the optimizer created in the first), then reused."""
    model, runtime = stack(), CountingRuntime()
    stepper = stepper_for(model, optimizer, runtime=runtime)
    runtime.log.clear()  # the gradient norm's 4 bytes, allocated once by the constructor
    allocations = []
    for i in range(3):
        expected_copies = slot_count(stepper)  # the state as it is before the step
        at_begin, inside, at_finish, skipped = step(stepper, model, batch(i))
        assert not skipped
        assert ("sync",) not in at_begin + inside  # 40 hooks, no wait
        assert [e for e in at_finish if e[0] == "sync"] == [("sync",)]  # exactly one per step
        assert sum(e[0] == "copy" for e in inside) == expected_copies
        allocations.append([e[0] for e in at_begin + inside + at_finish].count("alloc"))
    assert expected_copies > 40  # the state's tensors were copied too, not only the weights
    assert allocations == [1, 1, 0]


def test_control_a_wait_per_copy_is_counted_inside_the_backward():
    """Broken control: a runtime whose copies wait for the device, as the old undo's `.cpu()` did on a GPU,
    shows a wait per copied tensor inside the backward (40 at the first step), which the test above refuses."""

    class WaitingCopies(CountingRuntime):
        def copy(self, dst, src):
            super().copy(dst, src)
            self.synchronize()

    model = stack()
    stepper = stepper_for(model, "adamw", runtime=WaitingCopies())
    _, inside, _, _ = step(stepper, model, batch(0))
    assert sum(e == ("sync",) for e in inside) == LAYERS * 2
    _, inside, _, _ = step(stepper, model, batch(1))
    assert sum(e == ("sync",) for e in inside) == LAYERS * 2 * 4  # weight, exp_avg, exp_avg_sq, step


def test_without_undo_the_step_still_waits_once_for_the_norm():
    model, runtime = stack(), CountingRuntime()
    stepper = stepper_for(model, "adamw", undo=False, runtime=runtime)
    at_begin, inside, at_finish, _ = step(stepper, model, batch(0))
    assert at_begin + inside == [] and at_finish == [("copy", 4), ("sync",)]


def test_a_step_that_updates_nothing_waits_for_nothing():
    """A non-finite loss is seen before the backward: no hook ran, nothing to read back or undo."""
    model, runtime = stack(), CountingRuntime()
    stepper = stepper_for(model, "adamw", runtime=runtime)
    runtime.log.clear()
    stepper.begin()
    assert stepper.finish(False)[1] and runtime.count("sync") == 0


# ------------------------------------------------------------------------------------------ undo, bit for bit


def run(optimizer, steps, *, undo=True, runtime=None, device="cpu"):
    """Steps (batch seed, poisoned) in order; returns the stepper, the state before each step and the skips."""
    model = stack(device)
    stepper = stepper_for(model, optimizer, undo=undo, runtime=runtime)
    before, skips = [], []
    for seed, poisoned in steps:
        before.append(weights_and_state(stepper))
        stepper.begin()
        backward(model, batch(seed, device), poisoned=poisoned)
        skips.append(stepper.finish(True)[1])
    return stepper, before, skips


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit"])
def test_the_undo_restores_weights_and_state_bit_for_bit(optimizer):
    """Kept, poisoned, kept, poisoned: each poisoned step leaves everything as before it, bit for bit (torch's
    step tensor and bitsandbytes' int step included), and the run ends where the two kept steps alone end. The
    second undo reads the reused block, rewritten by the kept step between. A skipped step waits twice: for the
    norm, then for the restoring copies, before the next step may overwrite the block they read."""
    runtime = CountingRuntime()
    stepper, before, skips = run(optimizer, [(0, False), (1, True), (1, False), (2, True)], runtime=runtime)
    assert skips == [False, True, False, True]
    assert runtime.count("sync") == 1 + 2 + 1 + 2
    assert_identical(before[1], before[2])  # the first undo
    assert_identical(before[3], weights_and_state(stepper))  # the second
    reference, _, _ = run(optimizer, [(0, False), (1, False)], undo=False)
    assert_identical(weights_and_state(reference), weights_and_state(stepper))  # kept steps as without undo


def test_control_without_undo_the_poisoned_step_keeps_its_partial_update():
    """Broken control: without undo, the 39 tensors stepped before the NaN stay updated, and the first layer's
    weight turns NaN."""
    stepper, before, skips = run("adamw", [(0, False), (1, True)], undo=False)
    now = weights_and_state(stepper)
    assert skips == [False, True]
    assert now[0][0].isnan().all()
    assert all(
        w.isfinite().all() and not torch.equal(w, b[0]) for (w, _), b in zip(now[1:], before[1][1:], strict=True)
    )


# ------------------------------------------------------------------------------------------ on a GPU


class BlockingCopies(CpuRuntime):
    """Copies the host waits for, as the old undo's `.cpu()` (a GPU control)."""

    def copy(self, dst, src):
        dst.copy_(src)


def backward_refusing_syncs(stepper, model, x, **kwargs) -> None:
    stepper.begin()
    torch.cuda.set_sync_debug_mode("error")  # any stream sync or blocking copy in the backward raises
    try:
        backward(model, x, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_on_a_gpu_the_backward_never_syncs_and_the_undo_is_exact():
    """CUDA's own check: no stream sync and no blocking copy inside a backward over 40 tensors (torch's AdamW;
    bitsandbytes' step does a device-wide synchronize of its own per tensor, which this check does not see),
    page-locked slots; then the undo of a poisoned step is exact. Control: copies that wait raise."""
    from moe_qlora.common.device_runtime import CudaRuntime

    model = stack("cuda")
    stepper = stepper_for(model, "adamw")
    assert isinstance(stepper.runtime, CudaRuntime)
    for i in range(2):
        backward_refusing_syncs(stepper, model, batch(i, "cuda"))
        assert not stepper.finish(True)[1]
    assert stepper._snapshot._block.is_pinned() and stepper._norm_host.is_pinned()  # registered in place
    before = weights_and_state(stepper)
    backward_refusing_syncs(stepper, model, batch(2, "cuda"), poisoned=True)
    assert stepper.finish(True)[1]
    assert_identical(before, weights_and_state(stepper))
    model = stack("cuda")
    control = stepper_for(model, "adamw", runtime=BlockingCopies())
    with pytest.raises(RuntimeError, match="synchroniz"):
        backward_refusing_syncs(control, model, batch(0, "cuda"))
