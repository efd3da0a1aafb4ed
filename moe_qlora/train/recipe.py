"""The shape every training method has, after torchtune's recipes. Construction checks the config once (every
run-time check of a method in its `check_config`); `setup()` puts the model, optimizer, schedule and data on the
object; `train()` runs the loop every method shares (progress, skipping to a resumed step, the stop on a signal,
the NaN policy, metrics, checkpoints by steps and minutes); `step()` is what each method defines;
`save_checkpoint()`, `save_adapter()` and `cleanup()` complete it. A new method is a `step()` and a data source.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from moe_qlora.common.reporting import NoReporters, Reporters, read_jsonl
from moe_qlora.config.methods import check_method
from moe_qlora.config.sections import DataSection, RunConfig
from moe_qlora.model.build import load_policy
from moe_qlora.model.distributed import any_rank, launched_world_size, raise_together, whole_trainable
from moe_qlora.train.checkpoint import RunProgress, checkpoint_tensors, save_checkpoint
from moe_qlora.train.faults import FaultStop, attempt
from moe_qlora.train.losses import router_aux_coefficient
from moe_qlora.train.optim import build_optimizer
from moe_qlora.train.position import StepContext, StepPosition
from moe_qlora.train.resume import resume_if_asked, truncate_metrics
from moe_qlora.train.run_identity import config_identity
from moe_qlora.train.runs import (
    CheckpointPolicy,
    RunSummary,
    StopSignals,
    claim_output_dir_together,
    launched,
    output_dir_locked,
    plain_progress_line,
    record_rendering,
    save_verified_adapter,
    seed_everything,
    stop_if_asked,
    write_adapter,
)
from moe_qlora.train.schedule import lr_schedule
from moe_qlora.train.steps import continue_at_world_size
from moe_qlora.train.update import after_step, router_load, write_router_layers, write_run_choices


class Recipe(ABC):
    """One training run of one method. A method sets `command` and defines the abstract methods (a subclass that
    misses one cannot be built); the hooks with defaults here are what else differs between methods."""

    command = "train"  # the progress bar's label and the summary's
    logs: tuple[str, ...] = ("metrics.jsonl",)  # the JSONL files a resume cuts back to its step
    spikes = True  # flag loss spikes (a loss against its moving average)

    def __init__(
        self,
        cfg: RunConfig,
        console: Console | None = None,
        *,
        allow_mismatch: bool = False,
        overwrite: bool = False,
        source: str = "the config",
    ):
        """Checks `cfg` for this method (ConfigError naming `source` and the key) before anything is loaded or
        launched. allow_mismatch: resume although the config or data changed; overwrite: move another run in
        output.dir aside."""
        self.check_config(cfg, world=launched_world_size(), source=source)
        self.cfg, self.console = cfg, console
        self.allow_mismatch, self.overwrite = allow_mismatch, overwrite
        self.out = Path(cfg.output.dir)
        self.stepper = None  # train.optimizer_in_backward's StepInBackward (sft only)
        self.position = StepPosition()  # the step in flight and its phase, passed to what the step calls
        self.history: list[float] = []  # this invocation's headline per step (loss, or mean reward)
        self.tokens = 0

    @classmethod
    def check_config(cls, cfg: RunConfig, *, world: int, source: str) -> None:
        """Every run-time check of this method's config, in one place: config/methods.py, by command (torch-free,
        so the CLI runs the same checks before any heavy import)."""
        check_method(cls.command, cfg, world=world, source=source)

    # ------------------------------------------------------------------------------------- the run

    def run(self):
        """Launch (one process, or a rank under torchrun), lock and claim output.dir, set up, train, write the
        adapter; returns `result()`. Raises RunInterrupted after checkpointing on SIGINT or SIGTERM."""
        with launched(self.cfg, self.console) as (self.ranks, self.console):
            with output_dir_locked(self.out, self.ranks, self.console):
                claim_output_dir_together(self.out, self.cfg, self.ranks, self.console, overwrite=self.overwrite)
                started = time.perf_counter()
                with StopSignals(self.console) as self.stop:
                    self.setup()
                    try:
                        self.train()
                    finally:
                        self.cleanup()
                    adapter_dir = self.save_adapter()
                return self.result(adapter_dir, time.perf_counter() - started)

    def setup(self) -> None:
        """Data and model (a rank that cannot load them stops every rank), then the optimizer, the schedule, the
        run's identity and the resumed progress."""
        cfg = self.cfg
        seed_everything(cfg.train.seed)  # the run draws from its seed (attach_adapters seeds LoRA on its own)
        failure = None
        try:
            self.load()
        except Exception as exc:
            failure = exc
        raise_together(self.ranks, failure)
        aux_coef = router_aux_coefficient(self.model, cfg.train.router_aux_loss_coef)
        self.context = StepContext(cfg.train, self.ranks, self.position, aux_coef)
        write_run_choices(self.out, self.model, cfg, self.console, writer=self.ranks.main)  # may refuse: every rank
        if self.ranks.main:
            write_router_layers(self.out, self.model)
        self.prepare_data()
        seed_everything(cfg.train.seed)  # and again: what loading consumed (e.g. a cold cache) must not matter
        self.optimizer = build_optimizer(self.params, cfg.train)
        self.total = self.count_steps()
        self.scheduler = self.schedule_after(0)
        self.identity = {**config_identity(cfg.model_dump(mode="json")), **self.data_identity()}
        self.done = resume_if_asked(
            cfg,
            self.out,
            self.console,
            allow_mismatch=self.allow_mismatch,
            identity=self.identity,
            logs=self.logs,
            writer=self.ranks.main,
            **self.training,
        )
        self.after_resume()
        self.metrics = self.open_logs()
        self.model.train()
        self.on_failure = FaultStop(
            cfg, self.model_path, self.out, self.training, self.save_checkpoint, self.position, self.ranks
        )

    def load_model(self) -> None:
        """The model as the run config places it, from lora.init_from when given: model, params, ranks."""
        self.model, self.params, self.ranks = load_policy(self.cfg, self.model_path, self.console, self.ranks)

    @property
    def training(self) -> dict:
        """What a checkpoint holds and a resume restores."""
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler}

    def open_logs(self) -> Reporters:
        cfg = self.cfg
        if not self.ranks.main:
            return NoReporters(self.out)
        return Reporters(
            self.out, cfg.output.report_to, project=cfg.output.wandb_project, config=cfg.model_dump(mode="json")
        )

    def train(self) -> None:
        """The steps after `done`, with a progress bar (plain lines when stdout is not a terminal), checkpoints by
        steps and minutes, and a checkpoint then RunInterrupted on SIGINT/SIGTERM (on any rank). A step that
        fails on any rank raises on_failure's faults.StepFailed on every rank, after checkpointing the last
        completed step."""
        cfg, console, total = self.cfg, self.console, self.total
        self.started, first = time.perf_counter(), self.done.step
        policy = CheckpointPolicy(cfg.train.save_every, cfg.train.save_every_minutes)
        with Progress(*progress_columns(self.command), console=console, disable=not console.is_terminal) as bar:
            task = bar.add_task(self.command, total=total, info="", completed=first)
            for index, (epoch, batch) in enumerate(self.batches()):
                if index >= total:
                    break
                if index < self.done.step:  # done before the checkpoint: the order depends on (seed, epoch) only
                    continue
                stop_if_asked(self.stop, self.done, self.save_checkpoint, self.ranks)
                info = self.progress_info(self.run_step(index + 1, epoch, batch))
                bar.update(task, advance=1, info="  ".join(f"{k} {v}" for k, v in info.items()))
                if not console.is_terminal and ((index + 1) % cfg.train.log_every == 0 or index + 1 == total):
                    elapsed = time.perf_counter() - self.started
                    line = plain_progress_line(self.command, index + 1, total, info, elapsed, first)
                    console.print(line, highlight=False)
                if self.done.step < total and any_rank(self.ranks, policy.due(self.done.step)):  # clocks may differ
                    self.save_checkpoint(self.done)
                    policy.saved()
        self.save_checkpoint(self.done)

    def run_step(self, number: int, epoch: int, batch) -> dict:
        """Step `number` (from 1) on `batch`, failures agreed across ranks, then the NaN policy and the log."""
        started = time.perf_counter()
        self.position.start(number)
        record, failure = attempt(self.ranks, self.step, number, epoch, batch)
        if failure is not None:  # outside the `except`: the failed step's frames are gone
            raise self.on_failure(self.done, failure, stepper=self.stepper)
        self.complete(record, batch, time.perf_counter() - started)
        try:
            self.done = after_step(record, self.sources(record, batch), self.done, self.cfg, spikes=self.spikes)
        finally:  # an aborting step is logged too, with its raw values
            if self.logged(record, number):
                self.metrics.write(record)
        self.after_update(record)
        return record

    def save_checkpoint(self, progress: RunProgress) -> None:
        """A checkpoint of `progress` (a sharded run's LoRA and optimizer state gathered by every rank first)."""
        if not (self.ranks.main or self.ranks.sharded):
            return
        tensors = checkpoint_tensors(self.model, self.optimizer, keep=self.ranks.main)
        if self.ranks.main:
            cfg = self.cfg.train
            save_checkpoint(
                self.out, tensors, self.scheduler, progress=progress, identity=self.identity, keep=cfg.keep_checkpoints
            )

    def save_adapter(self) -> Path:
        """The run's verified adapter, its export formats, and how its prompts were rendered (for generate)."""
        adapter_dir = self.out / "adapter"
        with whole_trainable(self.model, self.ranks):
            if self.ranks.main:
                write_adapter(self.model, self.out, self.cfg, self.model_path, self.console)
                record_rendering(adapter_dir, self.prompt_data(), self.cfg.model, self.tokenizer)
        return adapter_dir

    def cleanup(self) -> None:
        self.metrics.close()

    # ------------------------------------------------------------- shared by the methods that need it

    def schedule_after(self, steps: int):
        """The LR schedule over the run's `total` steps, as it stands after `steps` of them: the one place a
        recipe's steps become the schedule's optimizer updates (x updates_per_step), for the schedule setup()
        starts with and the one a resume at another world size is put back on alike."""
        per_step = self.updates_per_step()
        return lr_schedule(
            self.optimizer, self.cfg.train, total_updates=self.total * per_step, done_updates=steps * per_step
        )

    def continue_data_parallel(self, num_items: int) -> None:
        """After a resume: a checkpoint of another world size goes on from the same place in the data (its
        steps, schedule and records follow: steps.continue_at_world_size); then the data-parallel line."""
        cfg, ranks = self.cfg, self.ranks
        resumed_at = self.done.step
        self.done, self.total = continue_at_world_size(self.done, ranks, num_items, cfg, self.total, self.console)
        if self.done.step != resumed_at:
            self.scheduler = self.schedule_after(self.done.step)
            if ranks.main and self.done.step < resumed_at:  # more ranks: fewer, larger steps; records start again
                truncate_metrics(self.out / "metrics.jsonl", self.done.step)
        if ranks.enabled:
            batch = ranks.world * cfg.train.micro_batch_size * cfg.train.grad_accum
            self.console.print(
                f"data parallel ({ranks.layout}): {ranks.world} ranks x "
                f"micro_batch_size {cfg.train.micro_batch_size}, global batch {batch}"
            )

    def keep_if_best(self, eval_loss: float) -> dict:
        """train.keep_best: the adapter of the lowest eval loss so far in adapter-best/ (verified); the record's
        eval_best flag when this one is."""
        if not (self.cfg.train.keep_best and eval_loss < self.best_eval):
            return {}
        self.best_eval = eval_loss
        with whole_trainable(self.model, self.ranks):
            if self.ranks.main:
                save_verified_adapter(self.model, self.out / "adapter-best", self.cfg, self.model_path)
                record_rendering(self.out / "adapter-best", self.prompt_data(), self.cfg.model, self.tokenizer)
        return {"eval_best": True}

    # ------------------------------------------------------------------------- what methods define

    @abstractmethod
    def load(self) -> None:
        """Set model_path, tokenizer, the data, model, params (trainable) and ranks (sharded ones if the model is)."""

    def prepare_data(self) -> None:
        """After the model is loaded: e.g. the held-out split and packing."""
        return None  # a hook: nothing by default

    @abstractmethod
    def count_steps(self) -> int:
        """How many steps the run has."""

    def updates_per_step(self) -> int:
        """Optimizer updates (schedule steps) per step."""
        return 1

    @abstractmethod
    def data_identity(self) -> dict:
        """What of the data a checkpoint must match to be resumed."""

    def after_resume(self) -> None:
        """After the checkpoint is restored: e.g. a resume at another world size."""
        return None  # a hook: nothing by default

    @abstractmethod
    def batches(self) -> Iterator[tuple[int, object]]:
        """(epoch, what one step trains on), in the run's order from its first step."""

    @abstractmethod
    def step(self, number: int, epoch: int, batch) -> dict:
        """One step: forward, backward and update on `batch`; its metrics (loss, grad_norm, skipped...)."""

    def complete(self, record: dict, batch, seconds: float) -> None:
        """Add what is measured after the step (outside its failure handling) to its record."""
        return None  # a hook: nothing by default

    @abstractmethod
    def sources(self, record: dict, batch) -> list[str]:
        """'file:row' of the step's samples, named when it is not finite."""

    def logged(self, record: dict, number: int) -> bool:
        return True

    def after_update(self, record: dict) -> None:
        """After the NaN policy accepted the step: the schedule, the headline and the token count."""
        return None  # a hook: nothing by default

    @abstractmethod
    def progress_info(self, record: dict) -> dict[str, str]:
        """The fields the progress bar (and a log file's plain line) shows for a step."""

    def prompt_data(self) -> DataSection:
        """The rows whose prompt rendering generate repeats."""
        return self.cfg.data

    @abstractmethod
    def result(self, adapter_dir: Path, seconds: float):
        """Print the run's summary; what train() / grpo() return."""


@dataclass
class TrainResult:
    """What a loss-minimising run returns: this invocation's per-step losses and where its outputs went."""

    steps: int
    losses: list[float]
    adapter_dir: Path
    metrics_path: Path


class LossRecipe(Recipe):
    """A method whose step lowers a loss over its examples (train, dpo): each step's timing and router load, the
    held-out evaluation every train.eval_every steps and at the end (`evaluate`), a record every log_every steps
    (and on a skip, an eval, the last step), the schedule stepped unless the step was skipped, the summary."""

    held_out: list = []  # set by prepare_data

    @abstractmethod
    def evaluate(self) -> dict:
        """The held-out metrics (eval_loss first), with keep_if_best's flag."""

    def complete(self, record: dict, batch, seconds: float) -> None:
        record.update(
            step_time_s=seconds,
            tokens_per_s=record["tokens"] / seconds,
            elapsed_s=time.perf_counter() - self.started,
            router_load=router_load(self.model),
        )
        number, every = record["step"], self.cfg.train.eval_every
        if self.held_out and (number == self.total or (every and number % every == 0)):
            record.update(self.evaluate())

    def sources(self, record: dict, batch) -> list[str]:
        """A step is micro-batches of examples (or pairs), each naming its 'file:row'."""
        return [item.source for micro_batch in batch for item in micro_batch]

    def logged(self, record: dict, number: int) -> bool:
        every = record["skipped"] or "eval_loss" in record or number % self.cfg.train.log_every == 0
        return every or number == self.total

    def logged_losses(self) -> list[float]:
        """The finite losses of metrics.jsonl: the whole run's, so the summary's best counts steps before a resume."""
        logged = [r.get("loss") for r in read_jsonl(Path(self.metrics.path))] if self.metrics.path else []
        return [x for x in logged if isinstance(x, int | float) and math.isfinite(x)]

    def after_update(self, record: dict) -> None:
        if not record["skipped"]:
            self.scheduler.step()  # a skipped step is not taken: the schedule does not move either
        self.history.append(record["loss"])
        self.tokens += record["tokens"]

    def result(self, adapter_dir: Path, seconds: float) -> TrainResult:
        losses = self.history
        finite = [x for x in losses if math.isfinite(x)]
        last, best = finite[-1] if finite else None, min(finite + self.logged_losses(), default=None)
        metrics = self.metrics.path
        RunSummary(self.command, len(losses), seconds, self.tokens, last, best, adapter_dir, metrics).print(
            self.console
        )
        return TrainResult(steps=len(losses), losses=losses, adapter_dir=adapter_dir, metrics_path=metrics)


def progress_columns(label: str) -> list:
    return [
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
    ]
