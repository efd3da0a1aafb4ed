"""The device calls expert offload makes (a side copy stream, events, page-locked host memory), behind one narrow
interface, so that the schedule above it is plain logic a CPU test can drive.

Three implementations:
  CudaStreams     a CUDA side stream and events; host blocks page-locked in place (device_runtime.CudaRuntime).
  HostStreams     the CPU: copies done at once, events are nothing (what a CPU run uses).
  CheckedStreams  a CPU stand-in for tests: copies done at once, but it keeps the two streams' order as a GPU
                  would and raises on any of the three hazards of a reused device buffer:
                  a read of a buffer before the compute stream waited for the copy into it; a copy into a buffer
                  not ordered after the compute that last read it; more device buffers alive than allowed.

Host blocks are page-locked in place, whole pages of their own, rather than by `Tensor.pin_memory()`: torch's
pinned allocator rounds every block up to a power of two (+33% for a 192 MiB Qwen3-30B-A3B stack) and keeps freed
blocks cached for the life of the process (device_runtime.py says how).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_qlora.common.device_runtime import CudaRuntime


class HostStreams:
    """The CPU: 'device' buffers are host tensors, a copy is done when it returns, there is nothing to wait for."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of `nbytes` on the device, allocated once by its owner and reused."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def host_block(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 host tensor of `nbytes` that copies to the device can read asynchronously (page-locked on
        a GPU, in pages of its own, unlocked when freed)."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def compute_point(self):
        """An event after all the work queued on the compute stream so far."""
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after=None):
        """Copy host `src` into device `dst` on the copy stream, once `after` (a compute_point) has passed;
        returns the event the compute stream must wait for before reading `dst`."""
        dst.copy_(src)
        return None

    def wait(self, event, buffer: torch.Tensor) -> None:
        """Make the compute stream wait for `event`, the copy into `buffer`."""

    def read(self, buffer: torch.Tensor) -> None:
        """The compute stream is about to read `buffer` (only the checked stand-in records it)."""


class CudaStreams(HostStreams):
    """A CUDA side stream for host-to-device copies and events ordering it with the compute stream."""

    def __init__(self, device: torch.device | str):
        super().__init__(device)
        self.stream = torch.cuda.Stream(self.device)
        self.runtime = CudaRuntime(self.device)

    def host_block(self, nbytes: int) -> torch.Tensor:
        return self.runtime.host_block(nbytes)

    def compute_point(self):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after=None):
        # The buffer is never freed, only overwritten: ordering the copy after the compute that read it is all
        # the allocator-free scheme needs (no record_stream, whose deferred frees let reserved memory grow).
        if after is not None:
            self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait(self, event, buffer: torch.Tensor) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


def streams_for(device: torch.device | str) -> HostStreams:
    device = torch.device(device)
    return CudaStreams(device) if device.type == "cuda" else HostStreams(device)


class StreamHazard(AssertionError):
    """CheckedStreams saw an order a GPU would get wrong."""


@dataclass
class _BufferState:
    copy_seq: int | None = None  # the event of the last copy into it
    waited: bool = True  # has the compute stream waited for that copy
    last_read: int = -1  # compute-stream position of its last read


@dataclass
class CheckedStreams(HostStreams):
    """The CPU stand-in that checks ordering as a GPU would need it (see the module docstring).

    The compute stream is a counter of reads; `compute_point` returns its position; a copy ordered `after` a
    point is safe for a buffer whose last read is at or before it. `log` keeps every call in order."""

    max_buffers: int | None = None
    log: list = field(default_factory=list)
    buffers: dict = field(default_factory=dict)  # data_ptr -> _BufferState
    position: int = 0
    events: int = 0

    def __post_init__(self):
        super().__init__("cpu")

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.buffers[buffer.data_ptr()] = _BufferState()
        self.log.append(("alloc", nbytes))
        if self.max_buffers is not None and len(self.buffers) > self.max_buffers:
            raise StreamHazard(f"{len(self.buffers)} device buffers alive, at most {self.max_buffers} allowed")
        return buffer

    def host_block(self, nbytes: int) -> torch.Tensor:
        self.log.append(("pin", nbytes))
        return super().host_block(nbytes)

    def compute_point(self):
        return self.position

    def _state(self, buffer: torch.Tensor) -> _BufferState:
        base = buffer.untyped_storage().data_ptr()
        if base not in self.buffers:
            raise StreamHazard("a copy or read of memory that is not one of the device buffers")
        return self.buffers[base]

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after=None):
        state = self._state(dst)
        if state.last_read >= 0 and (after is None or after < state.last_read):
            raise StreamHazard(
                f"a copy into a buffer last read at compute position {state.last_read}, ordered "
                f"only after position {after}: it would overwrite data still being read"
            )
        dst.copy_(src)
        self.events += 1
        state.copy_seq, state.waited = self.events, False
        self.log.append(("copy", src.numel() * src.element_size(), after, self.events))
        return self.events

    def wait(self, event, buffer: torch.Tensor) -> None:
        state = self._state(buffer)
        if event == state.copy_seq:
            state.waited = True
        self.log.append(("wait", event))

    def read(self, buffer: torch.Tensor) -> None:
        state = self._state(buffer)
        if not state.waited:
            raise StreamHazard("a read of a device buffer before the compute stream waited for the copy into it")
        self.position += 1
        state.last_read = self.position
        self.log.append(("read", self.position))
