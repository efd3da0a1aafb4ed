"""Where the run is: the step in flight and its phase (forward, backward, optimizer, generation, rewards), and every
generator's state when the step began. A failure message names the phase; a failure checkpoint restores the states.

MOE_QLORA_INJECT_OOM=STEP:PHASE raises torch.OutOfMemoryError on entering that phase (the exception exists on
CPU builds too): the tests' stand-in for a GPU running out of memory.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

OOM_ENV = "MOE_QLORA_INJECT_OOM"


@dataclass
class StepPosition:
    step: int = 0
    phase: str = "setup"
    updated: bool = False  # an optimizer step ran in this step: the weights in memory are no longer `done`'s
    entries: dict = field(default_factory=dict)  # phase -> how many times this step entered it
    rng: tuple | None = None  # every generator's state when the step began: what its checkpoint must hold


POSITION = StepPosition()


def start_step(step: int) -> None:
    POSITION.step, POSITION.phase, POSITION.updated, POSITION.entries = step, "setup", False, {}
    POSITION.rng = rng_states()


def rng_states() -> tuple:
    """torch (CPU and CUDA), python and numpy generator states: a checkpoint written after a step failed part-way
    must hold them as they were before it (dropout and sampling draw from them), or its resume differs."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()


def restore_rng_states(states: tuple) -> None:
    cpu, cuda, python, numpy_state = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(python)
    np.random.set_state(numpy_state)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark the code inside as phase `name` of the current step. MOE_QLORA_INJECT_OOM=STEP:PHASE fires at its
    first entry in that step, STEP:PHASE#N at its Nth (e.g. the third tensor stepped inside the backward). On an
    exception the phase is left set: it is where the step failed."""
    outer, POSITION.phase = POSITION.phase, name
    POSITION.updated |= name == "optimizer"
    count = POSITION.entries[name] = POSITION.entries.get(name, 0) + 1
    if os.environ.get(OOM_ENV) in (f"{POSITION.step}:{name}#{count}", *((f"{POSITION.step}:{name}",) * (count == 1))):
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (injected by {OOM_ENV})")
    yield
    POSITION.phase = outer
