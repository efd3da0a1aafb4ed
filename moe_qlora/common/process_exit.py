"""How a `moe-qlora` process ends: as an exit would, less the interpreter's finalization.

An exit's observable work is done first, in CPython's order: the non-daemon threads are joined, the exit handlers
run (logging's, W&B's, a failed rank's parting wait, a user's), the Python file objects still open are flushed
and closed as finalization would close them, and C's stdio buffers are flushed. Then `os._exit(code)`: the
interpreter does not free its objects one by one. Two reasons:

- **A finished rank aborted.** gloo's worker threads outlive `destroy_process_group` (its backend has no
  shutdown; they stop when the group's C++ object is freed, if ever). A worker that finished a collective drops
  its tensors; one whose Python object outlived Python's last reference to it takes the GIL to free it. When the
  interpreter has begun finalizing meanwhile, CPython 3.11 ends that thread with pthread_exit, whose unwinding
  through the tensor's noexcept destructor is std::terminate ("terminate called without an active exception",
  SIGABRT), and torchrun calls a finished run failed. A barrier does not prevent it: a collective's work is
  complete before its worker drops it, and a worker descheduled in between (a loaded machine) drops it at exit.
  Seen three times in CI; tests/model/test_rank_exit.py makes the race certain.
- **Time.** Finalizing an interpreter that imported torch, transformers and peft took 1.0-1.3 s on a 2-core
  machine (`moe-qlora plan` on the demo: 6.8 -> 5.7 s), spent freeing what the OS frees at once.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import io
import os
import sys
import threading
from typing import NoReturn

STANDARD_STREAMS = ("stdout", "stderr", "__stdout__", "__stderr__")


def exit_without_finalizing(code: int) -> NoReturn:
    """End the process with status `code` after doing what an exit observably does (see the module)."""
    shutdown_threads = getattr(threading, "_shutdown", None)  # what Py_Finalize calls first: joins them
    if shutdown_threads is not None:
        shutdown_threads()
    atexit._run_exitfuncs()
    close_open_files()
    flush_standard_streams()
    os._exit(code)


def close_open_files() -> None:
    """Close every Python file object still open for writing (flushing it), as finalization's freeing would: a
    user's reward module that wrote to a file it never closed keeps what it wrote. Wrappers first (text, then a file
    written in Python such as gzip's, then buffered, then raw), so none is closed under its wrapper; one on the
    standard streams' descriptors is flushed, not closed. Looked for only when this process holds a descriptor
    open for writing beyond the standard streams (cheap on Linux; scanning the heap costs about 0.4 s after
    torch's imports)."""
    if not writable_descriptors_beyond_the_standard_streams():
        return
    objects = gc.get_objects()
    file_types = {t for t in {type(o) for o in objects} if issubclass(t, io.IOBase)}
    files = [(o, fd) for o in objects if type(o) in file_types and (fd := writable_descriptor(o)) is not None]
    for obj, fd in sorted(files, key=lambda file: wrapping_order(file[0])):
        try:
            if fd > 2:
                obj.close()
            else:
                obj.flush()
        except (OSError, ValueError):  # a full disk, a pipe gone: finalization would lose it too
            pass


def writable_descriptor(obj: io.IOBase) -> int | None:
    """The descriptor of an open file object written to; None for one read, closed or in memory (nothing to keep)."""
    try:
        return obj.fileno() if not obj.closed and obj.writable() else None
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation: no descriptor
        return None


def wrapping_order(obj: io.IOBase) -> int:
    """0 text (it wraps the others), 1 a file written in Python (gzip's), 2 buffered, 3 raw."""
    if isinstance(obj, io.TextIOBase):
        return 0
    if type(obj).__module__ not in ("_io", "io"):
        return 1
    return 2 if isinstance(obj, io.BufferedIOBase) else 3


def writable_descriptors_beyond_the_standard_streams() -> bool:
    """Whether a descriptor above 2 is open for writing (/proc/self/fdinfo's flags); True where /proc is not
    there, so the caller looks."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fdinfo") if int(fd) > 2]
    except OSError:
        return True
    for fd in fds:
        try:
            with open(f"/proc/self/fdinfo/{fd}") as info:
                flags = next((line for line in info if line.startswith("flags:")), "flags: 0")
        except OSError:  # closed since the listing (the listing's own descriptor)
            continue
        if int(flags.split()[1], 8) & (os.O_WRONLY | os.O_RDWR) and os.path.isfile(f"/proc/self/fd/{fd}"):
            return True
    return False


def flush_standard_streams() -> None:
    for name in STANDARD_STREAMS:
        stream = getattr(sys, name, None)
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # closed, or a pipe gone: nothing left to lose
            pass
    try:
        ctypes.CDLL(None).fflush(None)  # C's stdio buffers (a library's printf), which exit() would flush
    except (OSError, AttributeError, TypeError):  # no C library to ask (not a POSIX system)
        pass
