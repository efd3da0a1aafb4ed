"""Host memory hygiene: hand freed heap pages back to the OS.

glibc keeps freed blocks below its mmap threshold in the heap, so after loading (thousands of per-expert
temporaries) or a training step the process keeps hundreds of MiB it no longer uses, and the next peak
stacks on top of them. malloc_trim(0) returns them; elsewhere (macOS, musl) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from contextlib import contextmanager

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
GLIBC_MAPPED_FROM = 32 * 2**20  # the highest mmap threshold glibc's own grows to: above it, always a fresh mapping
_mapped_from = [GLIBC_MAPPED_FROM]


@functools.cache
def _libc_function(name: str):
    lib = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(lib), name) if lib else None
    except (OSError, AttributeError):
        return None


@contextmanager
def large_allocations_mapped(threshold: int = 2**20):
    """Within the block glibc serves each host allocation of `threshold` bytes or more by its own mmap (mallopt
    M_MMAP_THRESHOLD): freed, its pages go back to the OS at once instead of staying in the heap under the next
    peak (a layer's stored tensors, read and quantized one after another, left ~20 MiB a layer resident on a
    loading rank), and allocated by `unwritten`, they are resident only where written. After it the threshold
    stays fixed at 32 MiB, the highest glibc's own grows to. Elsewhere (macOS, musl) this does nothing. Used where
    a rank loads its share alone (fsdp, ep): the page faults cost a one-process load ~10% of its time (7.9 ->
    8.7 s loading a 1 GiB Mixtral checkpoint on 2 cores) for ~7% of its peak (371 -> 346 MiB)."""
    mallopt = _libc_function("mallopt")
    if mallopt is None or not mallopt(M_MMAP_THRESHOLD, threshold):
        yield
        return
    _mapped_from[0] = threshold
    try:
        yield
    finally:
        mallopt(M_MMAP_THRESHOLD, GLIBC_MAPPED_FROM)
        _mapped_from[0] = GLIBC_MAPPED_FROM


def release_freed_memory() -> None:
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


def peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM), in MiB.

    Not getrusage's ru_maxrss: Linux carries that across execve, so a subprocess would report its parent's
    peak whenever the parent's was higher.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_mib() -> float:
    """This process's resident memory now (VmRSS), in MiB (NaN where /proc is missing)."""
    kib = _status_kib("VmRSS")
    return float("nan") if kib is None else kib / 1024


def reset_peak_rss() -> bool:
    """Restart the peak-RSS watermark (VmHWM) from the current RSS (Linux: clear_refs 5). False if unsupported,
    in which case peak_rss_mib stays the process's peak so far."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def available_host_bytes() -> int | None:
    """Host memory the kernel says a new allocation can take without swapping (MemAvailable); None where
    /proc/meminfo does not exist."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def unwritten(numel: int, dtype, device):
    """(numel,) zeros whose pages are not resident until written: on the CPU an allocation over glibc's mmap
    threshold (32 MiB, or large_allocations_mapped's) is fresh zeroed pages, so it is left as allocated; smaller
    ones may reuse heap memory and are zeroed. Elsewhere plain zeros."""
    import torch

    out = torch.empty(numel, dtype=dtype, device=device)
    small = numel * out.element_size() <= _mapped_from[0]
    return out.zero_() if small or out.device.type != "cpu" else out


def written_only(t, start: int, end: int):
    """A copy of the 1-D tensor `t` holding its elements start..end-1 alone, the rest unwritten zeros."""
    out = unwritten(t.numel(), t.dtype, t.device)
    out[start:end] = t[start:end]
    return out
