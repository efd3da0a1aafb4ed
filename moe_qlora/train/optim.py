"""AdamW (torch's, or bitsandbytes' 8-bit) with element-wise gradient clipping (`gclip`), global-norm
clipping, and the optimizer step inside the backward.

Order per step: global norm measured (logged pre-clip) -> optional global-norm scaling -> each element
clamped to [-gclip, gclip] -> the AdamW moment update. The clamp bounds what one outlier element can
do to the second moment, which a global-norm clip (one scalar for all) cannot. It acts on the gradient
before the optimizer sees it, so it means the same for every optimizer here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import bitsandbytes as bnb
import torch

from moe_qlora.common.device_runtime import CpuRuntime, runtime_for
from moe_qlora.model.distributed import local_shard, replication
from moe_qlora.train.position import StepPosition


class ElementwiseClip:
    """Mixin for an optimizer class: step() first clamps every gradient element to [-gclip, gclip]
    (0 disables)."""

    def __init__(self, params, *, gclip: float = 0.0, **kwargs):
        if gclip < 0:
            raise ValueError(f"gclip must be >= 0, got {gclip}")
        super().__init__(params, **kwargs)
        self.gclip = gclip

    @torch.no_grad()
    def step(self, closure=None):
        if self.gclip > 0:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.clamp_(-self.gclip, self.gclip)
        return super().step(closure)


class ClippedAdamW(ElementwiseClip, torch.optim.AdamW):
    """torch.optim.AdamW with gclip: fp32 moments, 8 bytes of state a parameter."""


class ClippedAdamW8bit(ElementwiseClip, bnb.optim.AdamW8bit):
    """bitsandbytes' AdamW with block-wise 8-bit moments (2 bytes a parameter, plus an fp32 scale per 256),
    with gclip. Tensors under 4,096 elements keep fp32 moments, as bitsandbytes decides."""


class ClippedPagedAdamW8bit(ElementwiseClip, bnb.optim.PagedAdamW8bit):
    """ClippedAdamW8bit with its state in CUDA unified memory (paged to the host under pressure)."""


OPTIMIZERS = {"adamw": ClippedAdamW, "adamw_8bit": ClippedAdamW8bit, "paged_adamw_8bit": ClippedPagedAdamW8bit}


def is_bitsandbytes(optimizer) -> bool:
    return isinstance(optimizer, bnb.optim.optimizer.Optimizer8bit)


@dataclass
class NormTerms:
    """A step's global gradient norm as this rank computes it alone, before the sum over the ranks.

    parts: this rank's part of each gradient (its shard under fsdp / ep, the gradient itself otherwise);
    whole: the L2 norm (fp32, 0-d) of the gradients every rank holds whole (None when there are none);
    shard_squares: the sharded gradients' squared norms on this rank (fp64, 0-d), each copy of a replicated shard
    counted a part, so that the sum over the ranks counts every element once (None when nothing is sharded)."""

    parts: list[torch.Tensor]
    whole: torch.Tensor | None
    shard_squares: torch.Tensor | None


def gradient_norm_terms(params) -> NormTerms:
    """This rank's terms of the global gradient norm; runs no collective."""
    grads = [p.grad for p in params if p.grad is not None]
    parts = [local_shard(g) for g in grads]
    norms = [torch.linalg.vector_norm(part.float()) for part in parts]
    whole = [n for n, part, g in zip(norms, parts, grads, strict=True) if part is g]
    shard = [
        n.square().double() / replication(g) for n, part, g in zip(norms, parts, grads, strict=True) if part is not g
    ]
    return NormTerms(
        parts,
        torch.linalg.vector_norm(torch.stack(whole)) if whole else None,
        torch.stack(shard).sum() if shard else None,
    )


def summed_norm(terms: NormTerms) -> torch.Tensor:
    """The global norm (0-d) from every rank's terms: one all_reduce when anything is sharded (every rank must
    call it then), none otherwise."""
    if terms.shard_squares is None:
        return terms.whole if terms.whole is not None else torch.zeros(())
    squares = terms.shard_squares
    torch.distributed.all_reduce(squares)
    return (squares + (terms.whole.square().double() if terms.whole is not None else 0.0)).sqrt()


def scale_to_norm(parts: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale the gradients (in place, this rank's parts) to max_norm when their global `norm` is above (0
    disables)."""
    if max_norm > 0 and norm > max_norm:
        for part in parts:
            part.mul_((max_norm / (norm + 1e-6)).to(part.dtype))


def clip_global_norm(params, max_norm: float) -> float:
    """The gradients' global L2 norm before clipping; scales them to max_norm when above (0 disables)."""
    terms = gradient_norm_terms(params)
    if not terms.parts:
        return 0.0
    norm = summed_norm(terms)
    scale_to_norm(terms.parts, norm, max_norm)
    return float(norm)


def build_optimizer(params, train_cfg) -> torch.optim.Optimizer:
    """train.optimizer over `params`; with train.optimizer_in_backward, one param group per tensor so that
    StepInBackward can step each alone (the schedule sets the same LR on all of them)."""
    cls = OPTIMIZERS[train_cfg.optimizer]
    groups = [{"params": [p]} for p in params] if train_cfg.optimizer_in_backward else params
    kwargs = {"foreach": False} if cls is ClippedAdamW else {}
    return cls(
        groups,
        lr=train_cfg.lr,
        betas=tuple(train_cfg.betas),
        eps=train_cfg.eps,
        weight_decay=train_cfg.weight_decay,
        gclip=train_cfg.gclip,
        **kwargs,
    )


class StepInBackward:
    """The optimizer step of each trainable tensor taken inside the backward, as soon as its gradient is
    complete (a post-accumulate-grad hook), then its gradient freed: the gradients of the whole model never
    exist at once, only those of the tensors in flight.

    A step is all-or-nothing under the NaN policy, but a non-finite gradient may show up after other tensors
    were updated. With `undo`, each tensor's weight and optimizer state are copied to the host before its
    update (HostSnapshot) and put back by `finish()` when the step turns out non-finite (host memory of one more
    copy of the trainables and their state, page-locked on a GPU and kept from step to step). Without it
    (nan_policy: abort), the run stops and writes nothing more, so the saved checkpoints and adapter are
    untouched either way.

    The hooks never wait for the device: the copies to the host and the gradient norm are queued, and the host
    waits once, in `finish()` (twice when it undoes the step). `runtime` (common/device_runtime.py) makes those
    calls; by default the one for the trainables' device.

    Use: `begin()`, one backward, `finish(loss_is_finite)` -> (gradient norm before clipping, skipped).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        undo: bool,
        runtime: CpuRuntime | None = None,
        position: StepPosition | None = None,
    ):
        self.optimizer, self.undo = optimizer, undo
        self.position = position if position is not None else StepPosition()  # where each tensor's step is marked
        self._group = {}
        for group in optimizer.param_groups:
            if len(group["params"]) != 1:
                raise ValueError("StepInBackward needs one param group per tensor (build_optimizer does that)")
            self._group[group["params"][0]] = group
        params = list(self._group)
        self.runtime = runtime if runtime is not None else runtime_for(params[0].device if params else "cpu")
        self._snapshot = HostSnapshot(self.runtime, params) if undo else None
        self._norm_host = self.runtime.host_block(4).view(torch.float32)  # (1,): the summed squares, read once
        self._handles = [p.register_post_accumulate_grad_hook(self._step_one) for p in self._group]
        self._sq_norm: torch.Tensor | None = None

    def begin(self) -> None:
        self._sq_norm = None
        if self._snapshot is not None:
            self._snapshot.prepare(self.optimizer)

    @torch.no_grad()
    def _step_one(self, p: torch.Tensor) -> None:
        sq = p.grad.float().pow(2).sum()  # stays on the device: the norm is read once, in finish()
        self._sq_norm = sq if self._sq_norm is None else self._sq_norm + sq
        if self._snapshot is not None:
            self._snapshot.take(p, self.optimizer.state.get(p, {}))
        everything = self.optimizer.param_groups
        self.optimizer.param_groups = [self._group[p]]
        try:
            with self.position.within("optimizer (in backward)"):
                self.optimizer.step()
        finally:
            self.optimizer.param_groups = everything
        p.grad = None

    @torch.no_grad()
    def finish(self, loss_is_finite: bool) -> tuple[float, bool]:
        grad_norm = self._read_norm()
        skipped = not (loss_is_finite and math.isfinite(grad_norm))
        if self._snapshot is not None:
            if skipped:
                self._snapshot.restore(self.optimizer)
            self._snapshot.forget()
        return (grad_norm if loss_is_finite else float("nan")), skipped

    def _read_norm(self) -> float:
        """The gradient norm, sqrt of the squares summed on the device: queued to the host, then the step's one
        wait, which also completes the snapshot's copies queued before it. 0 when no tensor was stepped."""
        if self._sq_norm is None:
            return 0.0
        self.runtime.copy(self._norm_host, self._sq_norm.reshape(1))
        self.runtime.synchronize()
        return math.sqrt(float(self._norm_host))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class HostSnapshot:
    """Host copies of trainable tensors and their optimizer state, each queued just before the tensor's step
    inside the backward, put back when the step is abandoned; in one host block reused from step to step.

    The block has a slot for each tensor and for each tensor its optimizer state holds (torch's moments and,
    unless capturable or fused, its host `step`; bitsandbytes' 8-bit states, absmax and code maps). The state's
    numbers (bitsandbytes' int `step`) are kept as they are. The layout follows the tensors' state, read at each
    `prepare()`: a new block is allocated at the first step, again at the second once the optimizer has created
    its state (and when a tensor first gets a gradient later), else the block is reused.

    Between `take()` and the next wait (StepInBackward.finish) the host must not read the slots, nor the next
    step overwrite them: the copies may still be in flight.
    """

    def __init__(self, runtime: CpuRuntime, params: list[torch.Tensor]):
        self.runtime, self.params = runtime, params
        self._layout: tuple | None = None
        self._block: torch.Tensor | None = None
        self._slots: dict = {}  # p -> (weight slot, {state key: slot}), views of _block
        self._taken: dict = {}  # p -> (weight slot, saved state: slots and numbers), this step's

    def prepare(self, optimizer) -> None:
        """Start a step: a block for the state as it now is, the previous step's copies forgotten."""
        if self._taken:  # a step that never reached finish(): its copies may still be in flight
            self.runtime.synchronize()
            self._taken = {}
        layout = tuple((p.shape, p.dtype, _state_layout(optimizer.state.get(p, {}))) for p in self.params)
        if layout != self._layout:
            self._allocate(layout)

    def _allocate(self, layout: tuple) -> None:
        """One host block for every slot: per tensor its own, then its state's, each at a 64-byte boundary (a
        view of any dtype needs its offset aligned to the dtype's size)."""
        self._block, self._slots = None, {}  # the old block goes first (a page-locked one is unregistered)
        shapes = [entry for shape, dtype, state in layout for entry in [(shape, dtype), *state.values()]]
        block = self.runtime.host_block(sum(_padded(shape, dtype) for shape, dtype in shapes))
        views, offset = [], 0
        for shape, dtype in shapes:
            nbytes = math.prod(shape) * dtype.itemsize
            views.append(block[offset : offset + nbytes].view(dtype).view(shape))
            offset += _padded(shape, dtype)
        views = iter(views)
        for p, (_, _, state) in zip(self.params, layout, strict=True):
            self._slots[p] = (next(views), {key: next(views) for key in state})
        self._block, self._layout = block, layout

    def take(self, p: torch.Tensor, state: dict) -> None:
        """Queue the copies of p and its optimizer state `state` to the host, before p's step (queued, not
        waited for; a second call in the same step keeps the first)."""
        if p in self._taken:
            return
        weight, slots = self._slots[p]
        tensors = {k: v for k, v in state.items() if torch.is_tensor(v)}
        if _state_layout(tensors) != {k: (s.shape, s.dtype) for k, s in slots.items()}:
            raise RuntimeError("optimizer state changed between begin() and the tensor's step")
        self.runtime.copy(weight, p)
        for key, value in tensors.items():
            self.runtime.copy(slots[key], value)
        numbers = {k: v for k, v in state.items() if k not in tensors}
        self._taken[p] = (weight, {**numbers, **{k: slots[k] for k in tensors}})

    def restore(self, optimizer) -> None:
        """Put back every tensor stepped since prepare() and its state; waits once, so that the next step may
        overwrite the slots the copies read (no wait when nothing was stepped)."""
        if not self._taken:
            return
        for p, (weight, state) in self._taken.items():
            self.runtime.copy(p, weight)
            restore_state(optimizer, p, state, copy=self.runtime.copy)
        self.runtime.synchronize()

    def forget(self) -> None:
        """The step is over (kept or restored): nothing of it is to be put back any more."""
        self._taken = {}


def _padded(shape, dtype: torch.dtype) -> int:
    """Bytes of a tensor of `shape` and `dtype`, rounded up to a multiple of 64."""
    return -(-math.prod(shape) * dtype.itemsize // 64) * 64


def _state_layout(state: dict) -> dict:
    """{key: (shape, dtype)} of the tensors in an optimizer state."""
    return {k: (v.shape, v.dtype) for k, v in state.items() if torch.is_tensor(v)}


@torch.no_grad()
def restore_state(optimizer, p: torch.Tensor, saved: dict, *, copy=torch.Tensor.copy_) -> None:
    """Put `saved` (tensors and numbers, e.g. read from a checkpoint) back as p's optimizer state; `copy(dst, src)`
    writes a saved tensor into the state's own (StepInBackward's undo queues it, see CpuRuntime.copy).

    bitsandbytes' state is first allocated by the optimizer itself and then overwritten in place, so paged
    buffers stay paged and its integer step stays an int. torch's state is assigned, its step kept on the
    host as torch keeps it. Empty `saved`: p has taken no step yet.
    """
    if not saved:
        optimizer.state.pop(p, None)
        return
    state = optimizer.state[p]
    if is_bitsandbytes(optimizer) and not state:
        gindex, pindex = next(
            (gi, pi) for gi, g in enumerate(optimizer.param_groups) for pi, q in enumerate(g["params"]) if q is p
        )
        optimizer.init_state(optimizer.param_groups[gindex], p, gindex, pindex)
    for key, value in saved.items():
        current = state.get(key)
        if torch.is_tensor(current) and torch.is_tensor(value) and current.shape == value.shape:
            copy(current, value)
        elif isinstance(current, int) and not isinstance(current, bool):
            state[key] = int(value)
        elif torch.is_tensor(value) and key != "step":
            state[key] = value.to(p.device, copy=True)
        else:
            state[key] = value.clone() if torch.is_tensor(value) else value
