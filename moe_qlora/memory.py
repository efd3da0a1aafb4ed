"""Host memory hygiene: hand freed heap pages back to the OS.

glibc keeps freed blocks below its mmap threshold in the heap, so after loading (thousands of per-expert
temporaries) or a training step the process keeps hundreds of MiB it no longer uses, and the next peak
stacks on top of them. malloc_trim(0) returns them; elsewhere (macOS, musl) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    trim = _libc_trim()
    if trim is not None:
        trim(0)
