"""The faults a test asks a run to meet, in one record read once: a MoE path that computes wrong, raises or faults
on the device (MOE_QLORA_INJECT_KERNEL_FAULT=<path>:wrong|raise|device, comma-separated), an out-of-memory error on
entering a phase (MOE_QLORA_INJECT_OOM=STEP:PHASE or STEP:PHASE#N), a crash or a full disk at a failpoint
(MOE_QLORA_FAILPOINT=NAME@STEP or NAME:enospc@STEP).

The environment is read at the first question (the crash and fault tests start their runs as subprocesses with
these variables set); a test in the same process sets the record with `injected(...)` instead. The sites that fire
(moe/self_check.py, train/position.py, train/checkpoint.py) read its fields, never the environment: one of them
runs for every MoE call, another for every tensor the optimizer steps inside the backward.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from moe_qlora.common.settings import ReadOnce

KERNEL_FAULT_ENV = "MOE_QLORA_INJECT_KERNEL_FAULT"
OOM_ENV = "MOE_QLORA_INJECT_OOM"
FAILPOINT_ENV = "MOE_QLORA_FAILPOINT"
KERNEL_FAULTS = ("wrong", "raise", "device")


@dataclass(frozen=True)
class InjectedFaults:
    """The faults requested, parsed: {MoE path: 'wrong' | 'raise' | 'device'}, the out-of-memory point as
    STEP:PHASE[#N] ('' for none) and the failpoint as NAME[:enospc]@STEP ('' for none)."""

    kernel_faults: dict[str, str] = field(default_factory=dict)
    oom: str = ""
    failpoint: str = ""

    def kernel_fault(self, path: str) -> str | None:
        """The fault injected into MoE path `path`, or None."""
        return self.kernel_faults.get(path)

    def oom_on_entering(self, step: int, phase: str, entry: int) -> bool:
        """Whether the `entry`th entry into `phase` during `step` runs out of memory: STEP:PHASE names the first,
        STEP:PHASE#N the Nth (e.g. the third tensor stepped inside the backward)."""
        if not self.oom:
            return False
        return self.oom == f"{step}:{phase}#{entry}" or (entry == 1 and self.oom == f"{step}:{phase}")


def kernel_faults_of(spec: str) -> dict[str, str]:
    """`<path>:<fault>,...` as {path: fault}; an unknown fault is ignored, and a path named twice keeps its first."""
    faults: dict[str, str] = {}
    for entry in spec.split(","):
        path, _, fault = entry.strip().partition(":")
        if fault in KERNEL_FAULTS:
            faults.setdefault(path, fault)
    return faults


def faults_requested(kernel_fault: str = "", oom: str = "", failpoint: str = "") -> InjectedFaults:
    """The record of the faults requested in the environment variables' syntax."""
    return InjectedFaults(kernel_faults_of(kernel_fault), oom, failpoint)


def _faults_from_environment() -> InjectedFaults:
    """The environment's request."""
    env = os.environ
    return faults_requested(env.get(KERNEL_FAULT_ENV, ""), env.get(OOM_ENV, ""), env.get(FAILPOINT_ENV, ""))


_FAULTS = ReadOnce(_faults_from_environment)


def injected_faults() -> InjectedFaults:
    """The faults in force: the innermost injected() block's, else the environment's (read at the first call)."""
    return _FAULTS.current()


@contextmanager
def injected(*, kernel_fault: str = "", oom: str = "", failpoint: str = "") -> Iterator[InjectedFaults]:
    """Inside the block these faults (in the environment variables' syntax), and only these, are injected:
    injected(kernel_fault="grouped_mm:wrong"), injected(oom="7:optimizer"), injected(failpoint="save@6")."""
    with _FAULTS.overriding(faults_requested(kernel_fault, oom, failpoint)) as faults:
        yield faults
