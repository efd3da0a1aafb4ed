"""Where the run is: the step in flight and its phase (forward, backward, optimizer, generation, rewards), and every
generator's state when the step began. A failure message names the phase; a failure checkpoint restores the states.
A recipe owns one StepPosition and passes it (in a StepContext) to what its step calls: no global holds it.

MOE_QLORA_INJECT_OOM=STEP:PHASE raises torch.OutOfMemoryError on entering that phase (the exception exists on
CPU builds too): the tests' stand-in for a GPU running out of memory. It is read once (common/injection.py, whose
`injected(oom=...)` sets it in-process), not at every entry.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from moe_qlora.common.injection import OOM_ENV, injected_faults
from moe_qlora.config.sections import TrainSection
from moe_qlora.model.distributed import SINGLE, Ranks


@dataclass
class StepPosition:
    """The step in flight (from 1; 0 before the first), the phase it is in, and what a failure needs to know."""

    step: int = 0
    phase: str = "setup"
    updated: bool = False  # an optimizer step ran in this step: the weights in memory are no longer `done`'s
    entries: dict = field(default_factory=dict)  # phase -> how many times this step entered it
    rng: tuple | None = None  # every generator's state when the step began: what its checkpoint must hold

    def start(self, step: int) -> None:
        """Step `step` begins: no phase entered yet, and the generators' states as they are now."""
        self.step, self.phase, self.updated, self.entries = step, "setup", False, {}
        self.rng = rng_states()

    @contextmanager
    def within(self, name: str) -> Iterator[None]:
        """Mark the code inside as phase `name` of this step. MOE_QLORA_INJECT_OOM=STEP:PHASE fires at its first
        entry in that step, STEP:PHASE#N at its Nth (e.g. the third tensor stepped inside the backward). On an
        exception the phase is left set: it is where the step failed."""
        outer, self.phase = self.phase, name
        self.updated |= name == "optimizer"
        count = self.entries[name] = self.entries.get(name, 0) + 1
        if injected_faults().oom_on_entering(self.step, name, count):
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (injected by {OOM_ENV})")
        yield
        self.phase = outer


@dataclass(frozen=True)
class StepContext:
    """What a step's functions need besides their data, the same for every step of a run: the run's place among
    the ranks, its position (to mark phases in), the train section, and the weight of the MoE auxiliary loss in
    the loss (train.router_aux_loss_coef resolved for the model: losses.router_aux_coefficient)."""

    train: TrainSection
    ranks: Ranks = SINGLE
    position: StepPosition = field(default_factory=StepPosition)
    aux_coef: float = 0.0


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
