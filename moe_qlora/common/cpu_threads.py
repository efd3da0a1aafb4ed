"""The CPU threads a command's torch computes with, chosen before torch is imported: the cores this process may
run on, less those other processes keep busy (the load average), at least one. OpenMP threads that spin while
they wait for each other collapse on a busy machine: the demo took 16 min with its two threads sharing two cores
with two other processes, and 61 s with one thread. Where the machine is busy at the start, the threads also wait
passively (OMP_WAIT_POLICY), so load that arrives later costs a slower run, not a stalled one. A user's own
OMP_NUM_THREADS (or OMP_WAIT_POLICY) is kept as it is.
"""

from __future__ import annotations

import math
import os
from collections.abc import MutableMapping
from dataclasses import dataclass

BUSY = 0.5  # runnable processes of other programs, on average, from which a core counts as taken


@dataclass(frozen=True)
class CpuThreads:
    """What a command runs with: `threads` of `cores`, with `busy` cores' worth of other load at its start."""

    threads: int
    cores: int
    busy: float

    @property
    def passive(self) -> bool:
        return self.busy >= BUSY


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's limit), else the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def other_load() -> float:
    """Runnable processes over the last minute, on average (0 where the system does not say)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def threads_for(cores: int, busy: float) -> CpuThreads:
    """One thread a core the load leaves free, at least one: two threads on two cores beside two busy processes
    would each wait for the other's time slice at every parallel region."""
    taken = math.floor(busy + 1 - BUSY)  # a core is taken from BUSY of a runnable process on
    return CpuThreads(max(1, min(cores, cores - taken)), cores, busy)


def choose_cpu_threads(environ: MutableMapping[str, str] = os.environ) -> CpuThreads | None:
    """Set OMP_NUM_THREADS (and, on a busy machine, OMP_WAIT_POLICY=PASSIVE) in `environ` for the torch this
    process imports next; None, leaving both as they are, where the user set OMP_NUM_THREADS."""
    if "OMP_NUM_THREADS" in environ:
        return None
    chosen = threads_for(usable_cores(), other_load())
    environ["OMP_NUM_THREADS"] = str(chosen.threads)
    if chosen.passive:
        environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return chosen
