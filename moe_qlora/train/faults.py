"""What a run does when a step cannot finish (out of memory, a reward function that fails): the step in flight
is abandoned, the last completed step is checkpointed if it is not already, and the run stops with one message
that says what happened, where (the run's StepPosition), and what to change. Shared by `train` and `grpo`.

With several ranks a step fails on one while the others go on to the step's next collective and wait there. So
the parts of a step that run no collective (forward and backward under ddp, the optimizer, sampling and rewards)
go through local_stretch: a failure there is held, its traceback (which keeps the step's activations alive)
dropped, and every rank meets in one all_reduce after the stretch. When any failed, every rank leaves the step;
then, outside any `except`, they exchange what failed, checkpoint together and stop with rank 0's sentence.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_qlora.model.budget import this_gpu_capability
from moe_qlora.model.distributed import SINGLE, RankFailed, Ranks, any_rank, from_main, gather_objects
from moe_qlora.model.fitting import knob_lines, knob_savings
from moe_qlora.train.position import StepPosition, restore_rng_states
from moe_qlora.train.rewards import RewardFailed


class StepFailed(Exception):
    """A step that could not finish; the message says why and where the run can resume (exit code 1)."""


FAULTS = (torch.OutOfMemoryError, RewardFailed)  # what stops a run with a checkpoint and one sentence


class StepAbandoned(Exception):
    """Raised on every rank where they meet after a stretch of the step that failed on at least one: `error` is
    this rank's failure, None on a rank whose stretch went through."""

    def __init__(self, error: BaseException | None):
        super().__init__("the step was abandoned: " + ("it failed here" if error else "it failed on another rank"))
        self.error = error


def detached(exc: BaseException) -> BaseException:
    """`exc` without its traceback and chained exceptions: their frames hold the failed step's activations and
    gradients, which the checkpoint that follows needs the room of. The message is all the run reports."""
    exc.__traceback__ = exc.__context__ = exc.__cause__ = None
    return exc


def local_stretch(ranks: Ranks, fn, *args, **kwargs):
    """fn(*args, **kwargs), a part of a step that runs no collective, then one all_reduce every rank reaches: when
    fn failed on any rank, every rank raises StepAbandoned here, outside the `except` that caught the failure;
    out of memory is held detached. One process: only the faults are caught (a bug raises as it is). A failed
    collective is not caught: the ranks can no longer meet."""
    error = None
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:
        if isinstance(exc, torch.distributed.DistError) or not (ranks.enabled or isinstance(exc, FAULTS)):
            raise
        error = detached(exc) if isinstance(exc, torch.OutOfMemoryError) else exc
    if any_rank(ranks, error is not None):
        raise StepAbandoned(error)
    return result


def run_as_is(ranks: Ranks, fn, *args, **kwargs):
    """fn(*args, **kwargs) with no meeting point: local_stretch's place where fn's forwards hold collectives (fsdp,
    ep: a rank that fails there cannot meet the others), or where an enclosing stretch already meets them."""
    return fn(*args, **kwargs)


@dataclass
class Failure:
    """How a step failed on this rank: `error` (None on a rank that was fine while another failed), and whether
    every rank left the step at the same meeting point (`agreed`: collectives may follow)."""

    error: BaseException | None
    agreed: bool


def attempt(ranks: Ranks, step, *args):
    """(step(*args), None), or (None, Failure) once it failed: abandoned together (StepAbandoned), or out of memory
    outside any local stretch, which one process handles the same way and several cannot (the other ranks may be
    inside a collective: under fsdp, any of those its forward and backward run)."""
    try:
        return step(*args), None
    except StepAbandoned as exc:
        return None, Failure(exc.error, agreed=True)
    except torch.OutOfMemoryError as exc:
        return None, Failure(detached(exc), agreed=not ranks.enabled)


def device_memory(device: torch.device) -> tuple[float, float, str]:
    """(peak GiB used, total GiB, what) on the run's device: CUDA's allocator peak and the card's memory, or on
    the CPU the process's peak resident set and the machine's memory."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return torch.cuda.max_memory_allocated(device) / 2**30, total / 2**30, torch.cuda.get_device_name(device)
    from moe_qlora.common.memory import peak_rss_mib

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return peak_rss_mib() / 1024, total / 2**30, "host memory"


def out_of_memory_head(device: torch.device, plan_text: str, position: StepPosition) -> str:
    """What ran out, where and when: the step and phase, the peak and total memory, and what `plan` predicted."""
    peak, total, what = device_memory(device)
    return (
        f"out of memory at step {position.step} ({position.phase}): peak {peak:.2f} GiB of {total:.2f} GiB "
        f"({what}){plan_text}"
    )


def release_after_failure(model, optimizer) -> None:
    """Drop the abandoned step's gradients and cached blocks, so the checkpoint that follows has room."""
    optimizer.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.grad = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def checkpoint_completed(done, checkpoint, out, position: StepPosition, *, consistent: bool, exists: bool) -> str:
    """Checkpoint the last completed step `done` unless it is already (`exists`: rank 0 sees its folder), there is
    none, or the weights in memory are past it; returns the sentence saying where the run can resume. Every rank
    calls it with the same arguments (under fsdp the checkpoint gathers)."""
    from moe_qlora.train.checkpoint import latest_valid_checkpoint

    existing = out / "checkpoints" / f"step-{done.step:08d}"
    if done.step and consistent and not exists:
        if position.rng is not None:  # as they were when the failed step began
            restore_rng_states(position.rng)
        checkpoint(done)
        return f"Step {done.step}, the last completed, is checkpointed in {existing}"
    if done.step and exists:
        return f"Step {done.step}, the last completed, was already checkpointed in {existing}"
    found = latest_valid_checkpoint(out)
    where = f"the last checkpoint is {found}" if found else "no checkpoint was written yet"
    if not consistent and done.step:
        why = "the optimizer had already updated part of the weights in this step, so they were not saved"
        return f"Not checkpointed: {why}; {where}"
    return "No step had completed: nothing to checkpoint"


@dataclass
class Report:
    """What one rank says about a failed step: its failure (`head`, and `tail` printed after where the run
    resumes; `kind` the exception's type, `fault` whether it is one of FAULTS or a bug), and what the checkpoint
    needs to know."""

    rank: int
    head: str | None
    tail: str
    kind: str
    fault: bool
    consistent: bool  # the weights in memory are the last completed step's
    exists: bool  # the last completed step's checkpoint folder is there (rank 0's view decides)


@dataclass
class FaultStop:
    """How a run stops on a failed step (the loops call it with the last completed progress and the Failure):
    the half-stepped tensors restored (optimizer_in_backward), the step's gradients and cached blocks released,
    then, when every rank met, one exchange of what failed, the last completed step checkpointed together, and
    the exception every rank raises: a StepFailed with rank 0's sentence. A bug rather than a fault is raised on
    its rank as it is, and as a RankFailed on the others, with no checkpoint."""

    cfg: object
    model_path: str
    out: Path
    training: dict
    checkpoint: Callable
    position: StepPosition
    ranks: Ranks = SINGLE

    def __call__(self, done, failure: Failure, stepper=None) -> BaseException:
        consistent = not self.position.updated
        if stepper is not None:
            stepper.finish(False)  # with undo (always on with optimizer_in_backward): every stepped tensor restored
            consistent = True
        release_after_failure(self.training["model"], self.training["optimizer"])
        mine = self.report(failure.error, consistent, done)
        if not failure.agreed:  # no collective can follow: this rank stops alone, and says so
            return self.failed(f"{mine.head}. {self.alone(done)}." + mine.tail, failure)
        reports = gather_objects(self.ranks, [mine])
        failed = [r for r in reports if r.head is not None]
        first = failed[0]
        if not first.fault:
            own = failure.error
            return own if own is not None else RankFailed(f"rank {first.rank} failed ({first.kind}): {first.head}")
        saved = checkpoint_completed(
            done,
            self.checkpoint,
            self.out,
            self.position,
            consistent=all(r.consistent for r in reports),
            exists=reports[0].exists,
        )
        also = f" (rank(s) {', '.join(str(r.rank) for r in failed[1:])} failed too)" if failed[1:] else ""
        return self.failed(from_main(self.ranks, f"{first.head}{also}. {saved}." + first.tail), failure)

    @staticmethod
    def failed(message: str, failure: Failure) -> StepFailed:
        """The StepFailed to raise, caused by this rank's failure (what --debug shows: a reward function's
        traceback; nothing of an out-of-memory one's, dropped with the step's activations)."""
        stop = StepFailed(message)
        stop.__cause__ = failure.error
        return stop

    def report(self, error: BaseException | None, consistent: bool, done) -> Report:
        """This rank's Report: what failed (prefixed with the rank when there are several), or None."""
        exists = (self.out / "checkpoints" / f"step-{done.step:08d}").is_dir()
        if error is None:
            return Report(self.ranks.rank, None, "", "", False, consistent, exists)
        head, tail = self.out_of_memory() if isinstance(error, torch.OutOfMemoryError) else (str(error), "")
        fault = isinstance(error, FAULTS)
        if self.ranks.enabled and fault:
            head = f"rank {self.ranks.rank}: {head}"
        return Report(self.ranks.rank, head, tail, type(error).__name__, fault, consistent, exists)

    def out_of_memory(self) -> tuple[str, str]:
        """(what ran out, where, and what `plan` predicted; the knobs to turn, on lines of their own)."""
        device = next(self.training["model"].parameters()).device
        gpu = {"capability": this_gpu_capability()} if device.type == "cuda" else {}
        planned, savings = knob_savings(self.cfg, self.model_path, device.type, **gpu)
        plan_text = f"; moe-qlora plan predicted {planned:.2f} GiB" if planned is not None else ""
        lines = knob_lines(savings)
        return out_of_memory_head(device, plan_text, self.position), "\n" + lines if lines else ""

    def alone(self, done) -> str:
        """Where a run stopped by one rank alone can resume: no checkpoint is written (the others are inside one
        of the step's collectives, which a checkpoint's gather would meet out of turn)."""
        from moe_qlora.train.checkpoint import latest_valid_checkpoint

        found = latest_valid_checkpoint(self.out)
        where = f"the last checkpoint is {found}" if found else "no checkpoint was written yet"
        return f"Not checkpointed: the other ranks were inside one of the step's collectives; {where}"
