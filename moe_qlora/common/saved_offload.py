"""Host offload of the tensors autograd saves outside any checkpoint: the checkpointed decoder layers' inputs.

With every decoder layer checkpointed, what the forward leaves on the GPU for the backward is mostly each layer's
input, (tokens, hidden) in the compute dtype: at 131,072 tokens Qwen3-30B-A3B's 48 layers keep 24 GiB of them.
Inside the `offloading` block each such tensor saved for the backward is copied to page-locked host memory on a
side stream as soon as the forward has made it, and its GPU copy is given back once that copy has finished; in the
backward, when one is read back (a layer's recompute starts), the one saved before it starts coming back on the
side stream, so the copy overlaps this layer's recompute and backward. The GPU holds about two layers' inputs.
Tensors saved inside a checkpoint never come here: torch.utils.checkpoint's own hooks take those.

What is offloaded: contiguous floating-point tensors on the device of at least `min_bytes`, not parameters
(their storage stays anyway). A stride-0 (expanded) tensor stays: copying it would store it whole.

The device calls go through a `Copies` object: CudaCopies on a GPU, HostCopies on the CPU (host to host, at once),
and the tests' CheckedCopies, which completes copies only when told and raises on the orders a GPU gets wrong.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from moe_qlora.common.device_runtime import CudaRuntime
from moe_qlora.common.settings import ReadOnce

MIN_OFFLOAD_BYTES = 1 << 20  # smaller saved tensors (positions, masks, a short batch) are not worth a copy
# MOE_QLORA_OFFLOAD_MIN_BYTES replaces it, read once: how the multi-process tests offload a tiny model's inputs.
MIN_BYTES = ReadOnce(lambda: int(os.environ.get("MOE_QLORA_OFFLOAD_MIN_BYTES", MIN_OFFLOAD_BYTES)))


class HostCopies:
    """The CPU: copies are done when they return, there is nothing to wait for."""

    def host_block(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def device_empty(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor):
        """Queue dst (host) <- src (device) on the side stream after the compute queued so far; its event."""
        dst.copy_(src)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor):
        """Queue dst (device) <- src (host) on the side stream; its event."""
        dst.copy_(src)

    def done(self, event) -> bool:
        """Whether the copy of `event` has finished (without waiting)."""
        return True

    def wait(self, event) -> None:
        """Make the compute stream wait for the copy of `event` before what it queues next."""

    def release(self, tensor: torch.Tensor) -> None:
        """The offload lets go of a device tensor (the checked stand-in asserts its copy out had finished)."""

    def read(self, tensor: torch.Tensor) -> None:
        """The backward is handed `tensor` (the checked stand-in asserts the compute stream waited for it)."""


class CudaCopies(HostCopies):
    """A CUDA side stream for both directions, events ordering it with the compute stream, page-locked blocks."""

    def __init__(self, device: torch.device):
        self.device, self.stream, self.runtime = device, torch.cuda.Stream(device), CudaRuntime(device)

    def host_block(self, nbytes: int) -> torch.Tensor:
        return self.runtime.host_block(nbytes)

    def _on_side_stream(self, dst: torch.Tensor, src: torch.Tensor):
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def to_host(self, dst, src):
        return self._on_side_stream(dst, src)

    def to_device(self, dst, src):
        # dst was allocated on the compute stream and is first written here: the compute stream waits for this
        # copy before it reads dst, and nothing else uses dst before, so no record_stream is needed.
        return self._on_side_stream(dst, src)

    def done(self, event) -> bool:
        return event is None or event.query()

    def wait(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


@dataclass
class Saved:
    """One offloaded tensor: its host copy (a view of a pooled block), and while in flight its device copy."""

    host: torch.Tensor
    block: torch.Tensor
    device_tensor: torch.Tensor | None  # until the copy to the host finished; again while prefetched
    event: object = None  # the copy to the host, then the copy back
    back: bool = False  # whether device_tensor is a copy back from the host (not the original)
    index: int = 0  # its place in the forward's order: the one before it is read next in the backward


@dataclass
class SavedOffload:
    """The saved-tensor hooks and their schedule for one model (see the module docstring)."""

    copies: HostCopies
    device: torch.device
    min_bytes: int = field(default_factory=MIN_BYTES.current)
    order: list[Saved] = field(default_factory=list)  # this forward's offloaded tensors, in the order saved
    pool: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # free host blocks by size
    fetched_late: int = 0  # tensors the backward read before a prefetch had started them back (it waited whole)
    in_flight: dict[int, Saved] = field(default_factory=dict)  # id of a device tensor still held -> its entry

    def begin(self) -> None:
        """A forward starts. A host block goes back to the pool when autograd drops the tensor it holds (its graph
        freed by the backward, or deleted), not here: two graphs may be alive at once."""
        self.order, self.fetched_late, self.in_flight = [], 0, {}

    def worth_offloading(self, t: torch.Tensor) -> bool:
        return (
            t.device.type == self.device.type
            and t.is_floating_point()
            and not isinstance(t, torch.nn.Parameter)
            and t.is_contiguous()
            and t.numel() * t.element_size() >= self.min_bytes
        )

    def pack(self, t: torch.Tensor):
        if not self.worth_offloading(t):
            return t
        self.release_finished()
        if (same := self.in_flight.get(id(t))) is not None and same.device_tensor is t:
            return same  # saved again by another op (a layer's input is often saved twice): one copy
        nbytes = t.numel() * t.element_size()
        free = self.pool.get(nbytes)
        block = free.pop() if free else self.copies.host_block(nbytes)
        host = block.view(t.dtype).view(t.shape)
        saved = Saved(host, block, t, self.copies.to_host(host, t), index=len(self.order))
        weakref.finalize(saved, self.pool.setdefault(nbytes, []).append, block)
        self.order.append(saved)
        self.in_flight[id(t)] = saved
        return saved

    def release_finished(self) -> None:
        """Let go of the device tensors whose copy to the host has finished (checked without waiting)."""
        for key, saved in list(self.in_flight.items()):
            if self.copies.done(saved.event):
                del self.in_flight[key]
                self.copies.release(saved.device_tensor)
                saved.device_tensor = None

    def unpack(self, saved):
        if not isinstance(saved, Saved):
            return saved
        if saved.device_tensor is None:  # not prefetched: fetch it now
            self.fetched_late += 1
            self.fetch(saved)
        self.copies.wait(saved.event)
        tensor = saved.device_tensor
        self.copies.read(tensor)
        if saved.back:  # a copy back is read once; the host copy stays for a second read
            saved.device_tensor, saved.back = None, False
        if 0 < saved.index < len(self.order) and self.order[saved.index] is saved:  # of the last forward
            self.fetch(self.order[saved.index - 1])  # the one read next in the backward: on its way now
        return tensor

    def fetch(self, saved: Saved) -> None:
        if saved.device_tensor is not None:  # still on the device (its copy out not yet released) or prefetched
            return
        saved.device_tensor = self.copies.device_empty(saved.host.shape, saved.host.dtype, self.device)
        saved.event, saved.back = self.copies.to_device(saved.device_tensor, saved.host), True

    @contextmanager
    def offloading(self) -> Iterator[None]:
        """Within the block, tensors autograd saves outside checkpoints go to the host (the forward's)."""
        self.begin()
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield


def copies_for(device: torch.device) -> HostCopies:
    return CudaCopies(device) if device.type == "cuda" else HostCopies()


class CopyHazard(AssertionError):
    """CheckedCopies saw an order a GPU would get wrong."""


@dataclass
class CheckedCopies(HostCopies):
    """The CPU stand-in for tests: each copy is made at once, but its event completes only `lag` copies later, as
    a copy engine behind the compute would; it raises on a device tensor let go of before its copy out finished,
    and on a tensor handed to the backward before the compute stream waited for its copy back. `log` keeps the
    calls in order."""

    lag: int = 1
    log: list = field(default_factory=list)
    events: int = 0
    copied_out: dict = field(default_factory=dict)  # id of a device tensor -> the event of its copy to the host
    copied_back: dict = field(default_factory=dict)  # id of a device tensor -> the event of its copy back
    waited: set = field(default_factory=set)

    def _copy(self, kind: str, dst: torch.Tensor, src: torch.Tensor) -> int:
        dst.copy_(src)
        self.events += 1
        self.log.append((kind, src.numel() * src.element_size(), self.events))
        return self.events

    def to_host(self, dst, src):
        event = self._copy("to_host", dst, src)
        self.copied_out[id(src)] = event
        return event

    def to_device(self, dst, src):
        event = self._copy("to_device", dst, src)
        self.copied_back[id(dst)] = event
        return event

    def done(self, event) -> bool:
        return event is None or event <= self.events - self.lag

    def wait(self, event) -> None:
        self.waited.add(event)
        self.log.append(("wait", event))

    def release(self, tensor) -> None:
        event = self.copied_out.pop(id(tensor), None)
        if event is not None and not self.done(event):
            raise CopyHazard(f"a device tensor let go of before its copy to the host (event {event}) finished")
        self.log.append(("release", event))

    def read(self, tensor) -> None:
        event = self.copied_back.pop(id(tensor), None)
        if event is not None and event not in self.waited:
            raise CopyHazard(f"a tensor handed to the backward before the compute stream waited for its copy {event}")
        self.log.append(("read", event))
