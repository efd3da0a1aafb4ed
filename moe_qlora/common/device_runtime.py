"""The device calls that a host copy of device tensors needs (page-locked host memory, copies queued without
waiting, one wait), behind one narrow interface, so that the code above it is plain logic a CPU test can count.

Used by the optimizer-in-backward undo (train/optim.py): each tensor's weight and optimizer state are copied to
the host inside the backward with no wait, and the host waits once, when the step ends.

Three implementations:
  CudaRuntime      host blocks page-locked in place (cudaHostRegister); copies queued on the current stream;
                   `synchronize` waits for the whole device.
  CpuRuntime       the CPU: plain host tensors, a copy is done when it returns, nothing to wait for.
  CountingRuntime  a CPU stand-in for tests: CpuRuntime that logs every call, so a test counts the waits.

Why page-locked: a copy from the device into pageable memory makes the host wait for it (the driver stages it
through a page-locked buffer), so a queued copy needs a page-locked destination. Why registering an exact-size
tensor rather than `pin_memory=True`: torch's pinned allocator rounds each block up to a power of two (up to 2x
for a block of LoRA weights and moments) and caches freed blocks for the life of the process.

Beside them, host_flag / read_host_flag: a value known on the host carried through autograd's saved tensors as a
() CPU tensor and read back without waiting for the device (the grouped MoE layer's kept-stacks flag).
"""

from __future__ import annotations

import mmap
import weakref
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily


class CpuRuntime:
    """The CPU: host blocks are plain tensors, a copy is done when it returns, there is nothing to wait for."""

    def host_block(self, nbytes: int) -> torch.Tensor:
        """A flat (nbytes,) uint8 host tensor that queued copies may read and write; its owner keeps it and
        reuses it (allocating one may stall the device, see CudaRuntime)."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue dst <- src (same shape; one on the host, in a host_block, the other on the device, or both on
        the host). Neither may be touched by the host, nor `dst` read, before the next `synchronize`."""
        dst.copy_(src)

    def synchronize(self) -> None:
        """Wait until every queued copy and every kernel queued before it has finished."""


class CudaRuntime(CpuRuntime):
    """A CUDA device: page-locked host blocks, copies queued with `non_blocking=True`, a device-wide wait."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)

    def host_block(self, nbytes: int) -> torch.Tensor:
        # Registration covers whole pages, and two registrations may not share one: the block is cut from a
        # pageable tensor at a page boundary and registered in whole pages that lie inside that tensor alone.
        page = mmap.PAGESIZE
        size = -(-max(nbytes, 1) // page) * page
        raw = torch.empty(size + page, dtype=torch.uint8)
        start = -raw.data_ptr() % page
        # A tensor whose storage starts at the boundary (a plain slice's would start at `raw`), so that torch
        # sees it as page-locked: `is_pinned()` asks about the storage's first byte.
        pages = raw.numpy()[start : start + nbytes]
        block = torch.from_numpy(pages)
        status = torch.cuda.cudart().cudaHostRegister(block.data_ptr(), size, 0)
        if getattr(status, "value", status) != 0:
            raise RuntimeError(f"cudaHostRegister of {size} bytes failed with CUDA error {status}")
        # Unregistered when the memory is given back (memory freed while still registered would make a later
        # registration that overlaps it fail): `pages` lives as long as any tensor viewing it, not just `block`.
        weakref.finalize(pages, _unregister, block.data_ptr())
        return block

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # Queued on the current stream, behind the kernels that wrote `src` and before the optimizer's step that
        # overwrites it next: torch's kernels queue on that stream too, bitsandbytes' on the legacy default
        # stream, which is the current one unless a side stream is set.
        dst.copy_(src, non_blocking=True)

    def synchronize(self) -> None:
        # The whole device, not the current stream: autograd runs a leaf's hooks on the stream of its forward,
        # so the copies of one backward may sit on more than one stream.
        torch.cuda.synchronize(self.device)


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)  # best effort: its status is of no use at garbage collection


@dataclass
class CountingRuntime(CpuRuntime):
    """CpuRuntime that logs each call in order: ("alloc", nbytes), ("copy", nbytes), ("sync",)."""

    log: list = field(default_factory=list)

    def host_block(self, nbytes: int) -> torch.Tensor:
        self.log.append(("alloc", nbytes))
        return super().host_block(nbytes)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append(("copy", src.numel() * src.element_size()))
        super().copy(dst, src)

    def synchronize(self) -> None:
        self.log.append(("sync",))

    def count(self, kind: str) -> int:
        """How many calls of `kind` ("alloc", "copy", "sync") the log holds."""
        return sum(1 for entry in self.log if entry[0] == kind)


def runtime_for(device: torch.device | str) -> CpuRuntime:
    """The runtime for tensors on `device`: CudaRuntime on a CUDA device, else CpuRuntime."""
    device = torch.device(device)
    return CudaRuntime(device) if device.type == "cuda" else CpuRuntime()


def host_flag(value: bool) -> torch.Tensor:
    """A () bool tensor on the host holding `value`, real even under FakeTensorMode (its value is known on the
    host, so reading it back is no device read)."""
    with unset_fake_temporarily():
        return torch.tensor(value)


def read_host_flag(flag: torch.Tensor) -> bool:
    """host_flag's value, read without a device sync (the flag lives on the host). A fake flag (a compiled graph's
    trace, which never runs the real backward) reads as False."""
    if is_fake(flag):
        return False
    with unset_fake_temporarily():
        return bool(flag)
