"""Resuming a run: the checkpoint `train.resume` names restored, the logs cut back to its step, and checkpoints of
an abandoned continuation set aside.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from rich.console import Console

from moe_qlora.common.fileio import atomic_write_text
from moe_qlora.common.reporting import jsonl_lines, read_jsonl
from moe_qlora.config.sections import RunConfig
from moe_qlora.train.checkpoint import (
    CheckpointError,
    RunProgress,
    checkpoint_dirs,
    latest_valid_checkpoint,
    load_checkpoint,
    verify,
)


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records of steps after `last_step` (done after the checkpoint a run resumes from), and a torn last
    line (read_jsonl), atomically."""
    if not path.exists():
        return
    kept = [line for line, record in jsonl_lines(path) if record.get("step", 0) <= last_step]
    atomic_write_text(path, "".join(line + "\n" for line in kept))


def resume_if_asked(
    cfg: RunConfig,
    out: Path,
    console: Console,
    *,
    allow_mismatch: bool,
    logs: tuple[str, ...] = ("metrics.jsonl",),
    writer: bool = True,
    **training,
) -> RunProgress:
    """Restore the checkpoint `train.resume` names (auto: the newest valid one in output.dir); a fresh
    RunProgress for `never`. Records of `logs` after the checkpoint's step are dropped, since those steps
    will be done again (all of them when there is no checkpoint yet). Checkpoints newer than a named one
    are from a continuation being abandoned: they are renamed aside, so pruning and a later --resume never
    mix the two. Only a `writer` (rank 0) truncates or renames. `training`: the model, optimizer, scheduler and
    the run's identity, as load_checkpoint takes them."""
    if cfg.train.resume == "never":
        return RunProgress()
    if cfg.train.resume == "auto":
        checkpoint = latest_valid_checkpoint(out)
    else:
        checkpoint = Path(cfg.train.resume)
        problem = verify(checkpoint) if checkpoint.is_dir() else "no such checkpoint folder"
        if problem is not None:
            raise CheckpointError(f"--resume {checkpoint}: {problem}")
        if writer:
            set_aside_newer_checkpoints(out, checkpoint, console)
    if checkpoint is None:
        console.print("resume: no valid checkpoint yet, starting from step 0")
        for name in logs if writer else ():
            truncate_metrics(out / name, 0)
        return RunProgress()
    done = load_checkpoint(checkpoint, allow_mismatch=allow_mismatch, **training)
    for name in logs if writer else ():  # data-parallel ranks other than 0 only read
        truncate_metrics(out / name, done.step)
    console.print(f"resumed from {checkpoint} at step {done.step}")
    return done


def set_aside_newer_checkpoints(out: Path, checkpoint: Path, console: Console) -> None:
    newer = [d for d in checkpoint_dirs(out) if d.name > checkpoint.name]
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    for d in newer:
        d.rename(d.with_name(f"{d.name}.superseded-{stamp}"))
    if newer:
        console.print(f"resume: {len(newer)} newer checkpoint(s) renamed *.superseded-{stamp} (kept, not used)")


def best_eval_so_far(metrics_path: Path) -> float:
    """The lowest eval loss logged (after a resume: up to the checkpoint), inf if none."""
    values = [r["eval_loss"] for r in read_jsonl(metrics_path) if "eval_loss" in r]
    return min(values, default=math.inf)
