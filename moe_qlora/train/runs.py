"""A run's lifecycle, shared by every recipe: its place among the ranks, the output folder locked and claimed,
seeding, stopping on a signal, when to checkpoint, the plain progress lines a log file gets, the adapter written
and verified at the end, and the summary.

Ctrl-C (SIGINT) or SIGTERM (what a preemptible cloud GPU or a scheduler sends) asks the loop to stop after
the step in flight: it writes a verified checkpoint and raises RunInterrupted, which the CLI turns into
exit 130 or 143 with the command that resumes. A second signal stops at once (KeyboardInterrupt); the
checkpoint write is atomic, so that never leaves a half-written one.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from moe_qlora.common.fileio import atomic_write_text
from moe_qlora.common.lock import LOCK_NAME, LockUnsupported, RunLock
from moe_qlora.config.sections import ConfigError, DataSection, ModelSection, RunConfig
from moe_qlora.export.adapter import save_adapter, verify_adapter
from moe_qlora.export.prompt_format import write_prompt_format
from moe_qlora.export.writers import WRITERS
from moe_qlora.model.build import CHAT_TEMPLATE_FILE
from moe_qlora.model.distributed import SINGLE, Ranks, any_rank, join, leave, raise_together
from moe_qlora.model.model_path import resolve_model_path
from moe_qlora.train.checkpoint import RunProgress, checkpoint_dirs

RUN_FILES = ("metrics.jsonl", "rollouts.jsonl", "adapter")
EXPORTED_AS = {"vllm": "adapter-vllm", "per-expert": "adapter-per-expert", "gguf": "adapter.gguf"}  # in output.dir


class OutputDirInUse(ConfigError):
    """output.dir holds another run and neither --resume nor --overwrite was given."""


class RunInterrupted(Exception):
    """The run stopped on SIGINT or SIGTERM after checkpointing `step` (0: nothing to checkpoint yet)."""

    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum
        super().__init__(f"interrupted ({signal.Signals(signum).name}) at step {step}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def previous_run(out: Path) -> list[str]:
    """What of an earlier run `out` holds: its logs, checkpoints and adapter, as short descriptions."""
    found = [name + ("/" if (out / name).is_dir() else "") for name in RUN_FILES if (out / name).exists()]
    n = len(checkpoint_dirs(out)) if out.is_dir() else 0
    return found + ([f"{n} checkpoint{'s' if n != 1 else ''}"] if n else [])


def claim_output_dir(out: Path, *, resuming: bool, overwrite: bool, console) -> None:
    """Make `out` this run's folder (its lock already held: common/lock.py). A folder holding another run is
    refused unless the run resumes it, or `overwrite` moves it aside to `<out>.old-<UTC time>` (nothing is
    deleted)."""
    found = previous_run(out)
    if found and not resuming:
        if not overwrite:
            raise OutputDirInUse(
                f"{out} already holds a run ({', '.join(found)}); continue it with --resume, or start over with "
                f"--overwrite (moves it aside to {out.name}.old-<time>, deletes nothing)"
            )
        aside = out.with_name(f"{out.name}.old-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}")
        move_run_aside(out, aside)
        console.print(f"moved the previous run in {out} aside to {aside}")
    out.mkdir(parents=True, exist_ok=True)


def move_run_aside(out: Path, aside: Path) -> None:
    """Move everything in `out` but its lock file into the new folder `aside`, by renames (nothing copied or
    deleted). The lock file stays: renaming the whole folder would take this run's lock along with it, and a
    process starting in the new `out` would find it free."""
    aside.mkdir()
    os.chmod(aside, out.stat().st_mode & 0o7777)  # what the folder had, as a rename of it kept
    for entry in out.iterdir():
        if entry.name != LOCK_NAME:
            os.rename(entry, aside / entry.name)


class StopSignals:
    """Within the block, the first SIGINT or SIGTERM is recorded in `requested` (the loop checkpoints and
        stops after its step); a second one raises KeyboardInterrupt at once. Handlers are restored on exit (after a
    requested stop, further signals are ignored while the process exits).
        Outside the main thread (where Python cannot install handlers) this does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, console):
        self.console, self.requested = console, None
        self._previous: dict = {}

    def __enter__(self):
        try:
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        except ValueError:  # not the main thread
            self._previous = {}
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            # After a requested stop the process is on its way out with its checkpoint written: a second signal
            # landing now (it raced the checkpoint) is ignored rather than killing the exit mid-message.
            signal.signal(s, signal.SIG_IGN if self.requested is not None else handler)
        return False

    def _handle(self, signum, frame):
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signum
        self.console.print(
            f"\n{signal.Signals(signum).name}: stopping after this step and writing a checkpoint "
            "(send it again to stop at once, without one)"
        )


class CheckpointPolicy:
    """Checkpoint every `every` steps and every `minutes` of wall time (either 0: off); a run always writes
    one at its end or when it stops on a signal."""

    def __init__(self, every: int, minutes: float):
        self.every, self.seconds, self._last = every, minutes * 60, time.monotonic()

    def due(self, step: int) -> bool:
        by_steps = self.every and step % self.every == 0
        by_time = self.seconds and time.monotonic() - self._last >= self.seconds
        return bool(by_steps or by_time)

    def saved(self) -> None:
        self._last = time.monotonic()


def plain_progress_line(kind: str, step: int, total: int, fields: dict, elapsed: float, done_before: int) -> str:
    """One line for a log file (stdout not a terminal): step, the given fields and the ETA."""
    rate = (step - done_before) / elapsed if elapsed > 0 else 0.0
    eta = (total - step) / rate if rate > 0 else float("nan")
    parts = [f"{kind} step {step}/{total}", *(f"{k} {v}" for k, v in fields.items())]
    return "  ".join(parts) + (f"  ETA {_duration(eta)}" if eta == eta else "")


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


@dataclass
class RunSummary:
    command: str  # train | grpo | dpo
    steps: int
    seconds: float
    tokens: int
    final: float | None  # the last step's loss (train, dpo) or mean reward (grpo)
    best: float | None  # the lowest loss or highest mean reward
    adapter: Path
    metrics: Path

    def print(self, console) -> None:
        what = "mean reward" if self.command == "grpo" else "loss"
        console.print(
            f"done: {self.steps} steps in {_duration(self.seconds)}, {self.tokens:,} tokens"
            + (f"; {what} {self.final:.4f} at the end, best {self.best:.4f}" if self.final is not None else ""),
            highlight=False,
        )
        # soft_wrap: a path or a command stays one line, whatever the terminal's width, so it copies whole
        console.print(f"adapter: {self.adapter}\nmetrics: {self.metrics}", highlight=False, soft_wrap=True)
        console.print(
            "next:\n"
            f"  moe-qlora check-norms {self.adapter}      # are the LoRA factors healthy?\n"
            f'  moe-qlora generate --adapter {self.adapter} "your prompt"      # try it (--no-adapter: the base)\n'
            f"  moe-qlora export {self.adapter} --format gguf --out {self.adapter}.gguf      # llama.cpp\n"
            f'  or with PEFT: PeftModel.from_pretrained(base_model, "{self.adapter}") (see the README)',
            highlight=False,
            soft_wrap=True,
        )


@contextmanager
def launched(cfg: RunConfig, console: Console | None) -> Iterator[tuple[Ranks, Console]]:
    """This process's place in the run (one process, or a rank under torchrun / accelerate launch) and its
    console (quiet on ranks other than 0); the process group is left at the end, however the run ends."""
    # A builtin model is generated before the process group exists: once it does, transformers'
    # save_pretrained writes nothing on ranks other than 0, and a rank would cache a model without weights.
    resolve_model_path(cfg.model.name_or_path)
    ranks = join(cfg.train.dist_timeout_s)
    try:
        yield ranks, (console or Console()) if ranks.main else Console(quiet=True)
    except BaseException:
        leave(ranks, together=False)
        raise
    leave(ranks)


@contextmanager
def output_dir_locked(out: Path, ranks: Ranks, console: Console) -> Iterator[None]:
    """Within the block rank 0 holds the lock of `out` (common/lock.py), taken before anything in it is read;
    when another process holds it, every rank stops with rank 0's sentence naming that process. A filesystem
    that cannot lock gets a warning and an unlocked run."""
    lock, failure = None, None
    if ranks.main:
        try:
            lock = RunLock.acquire(out)
        except LockUnsupported as exc:
            console.print(f"warning: {exc}; nothing stops a second run from writing into it", highlight=False)
        except Exception as exc:
            failure = exc
    try:
        raise_together(ranks, failure)
        yield
    finally:
        if lock is not None:
            lock.release()


def claim_output_dir_together(out: Path, cfg: RunConfig, ranks: Ranks, console: Console, *, overwrite: bool) -> None:
    """Rank 0 claims output.dir (runs.claim_output_dir); when it cannot, every rank stops with its message
    instead of waiting for rank 0."""
    failure = None
    if ranks.main:
        try:
            claim_output_dir(out, resuming=cfg.train.resume != "never", overwrite=overwrite, console=console)
        except Exception as exc:
            failure = exc
    raise_together(ranks, failure)


def seed_everything(seed: int) -> None:
    """torch (CPU and CUDA), python and numpy RNGs from one seed: dropout and anything else random."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def stop_if_asked(stop: StopSignals, done: RunProgress, checkpoint, ranks: Ranks = SINGLE) -> None:
    """After a SIGINT/SIGTERM (on any rank: all stop at the same step): checkpoint the steps done (if any) and
    raise RunInterrupted."""
    if not any_rank(ranks, stop.requested is not None):
        return
    if done.step:
        checkpoint(done)
    raise RunInterrupted(done.step, stop.requested or signal.SIGTERM)


def save_verified_adapter(model, adapter_dir: Path, cfg: RunConfig, model_path: str) -> int:
    """Save the model's adapter to `adapter_dir`, then load it back as PEFT will and check every tensor landed
    (raises AdapterVerificationError if not; the adapter stays written either way). Returns the tensor count."""
    save_adapter(model, adapter_dir, cfg=cfg.lora, base_model_name_or_path=model_path)
    return verify_adapter(model, adapter_dir)


def record_rendering(adapter_dir: Path, data: DataSection, model_cfg: ModelSection, tokenizer) -> None:
    """How the run rendered its prompts, beside its adapter: the prompt format (moe_qlora.json) and, with
    model.chat_template, the template itself (chat_template.jinja), which generate and merge then use."""
    write_prompt_format(adapter_dir, data)
    if model_cfg.chat_template:
        atomic_write_text(adapter_dir / CHAT_TEMPLATE_FILE, tokenizer.chat_template)


def write_adapter(model, out: Path, cfg: RunConfig, model_path: str, console: Console) -> Path:
    """The run's verified adapter in out/adapter, and the export formats it asks for."""
    adapter_dir = out / "adapter"
    n = save_verified_adapter(model, adapter_dir, cfg, model_path)
    console.print(f"adapter: {adapter_dir} ({n} tensors, each verified to load in PEFT as trained)")
    for fmt in cfg.output.export_formats:
        console.print(f"{fmt}: {WRITERS[fmt](adapter_dir, out / EXPORTED_AS[fmt])}")
    return adapter_dir
