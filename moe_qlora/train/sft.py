"""The SFT loop: token-normalised loss over accumulated micro-batches, clipping, schedule, logging, export.

One optimizer step sees `grad_accum` micro-batches; each contributes sum(token losses) / N where N is the
number of target tokens in the whole step, so the step's gradient equals that of one big batch.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from moe_qlora.common.memory import release_freed_memory
from moe_qlora.common.reporting import NoReporters, Reporters, read_jsonl
from moe_qlora.config.sections import ConfigError, RunConfig
from moe_qlora.data.examples import IGNORE, Example, apply_reward_weights, build_examples, collate, eval_split
from moe_qlora.model.distributed import (
    SINGLE,
    Ranks,
    any_rank,
    raise_together,
    sum_gradients,
    sum_scalars,
    whole_trainable,
)
from moe_qlora.train.checkpoint import (
    RunProgress,
    checkpoint_tensors,
    config_identity,
    dataset_fingerprint,
    save_checkpoint,
)
from moe_qlora.train.faults import FaultStop, attempt, local_stretch
from moe_qlora.train.losses import token_logprobs
from moe_qlora.train.optim import StepInBackward, build_optimizer
from moe_qlora.train.packing import packed
from moe_qlora.train.position import phase, start_step
from moe_qlora.train.prompt_format import write_prompt_format
from moe_qlora.train.runs import CheckpointPolicy, RunSummary, StopSignals, plain_progress_line
from moe_qlora.train.session import (
    after_step,
    apply_update,
    build_schedule,
    claim_output_dir_together,
    launched,
    load_policy,
    load_tokenizer,
    output_dir_locked,
    resume_if_asked,
    router_load,
    save_verified_adapter,
    seed_everything,
    stop_if_asked,
    truncate_metrics,
    write_adapter,
    write_router_layers,
)
from moe_qlora.train.steps import IDLE, continue_at_world_size, count_steps, optimizer_steps, schedule_at

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    steps: int
    losses: list[float]
    adapter_dir: Path
    metrics_path: Path


def token_loss_sum(
    model, batch: dict[str, torch.Tensor], *, loss_chunk: int = 0
) -> tuple[torch.Tensor, int, float | None]:
    """Sum of next-token cross-entropies over target positions, their count, and the model's MoE auxiliary
    (load-balancing) loss where the family defines one (logged, not trained on). loss_chunk > 0: through the
    output head that many tokens at a time (losses.py), never the whole (B, L, V) logits."""
    extra = {"output_router_logits": True} if hasattr(model.config, "router_aux_loss_coef") else {}
    logp, mask, out = token_logprobs(model, batch, chunk=loss_chunk, **extra)
    targets = batch["labels"][:, 1:]
    token_losses = -logp
    # Each sample's token losses times its weight (1 for SFT): sample i's gradient is w_i (p - onehot), so
    # w = 0 contributes exactly nothing. The caller divides by the unweighted target count of the step, so
    # doubling every weight doubles the gradient.
    weights = batch.get("weights")
    if batch.get("token_weights") is not None:  # packed rows: each token carries its own row's weight
        loss = (token_losses * batch["token_weights"][:, 1:].to(token_losses)).sum()
    elif weights is None:
        loss = token_losses.sum()
    else:
        loss = (token_losses.sum(dim=1) * weights.to(token_losses)).sum()
    aux = getattr(out, "aux_loss", None)
    return loss, int((targets != IGNORE).sum()), None if aux is None else float(aux.detach())


def accumulate_gradients(
    model, batches: list[dict[str, torch.Tensor]], *, loss_chunk: int = 0, ranks: Ranks = SINGLE
) -> tuple[float, int, float | None]:
    """Backward over micro-batches, each scaled by 1/N with N the target tokens of all of them together (on
    every rank), so the gradient is that of the mean token loss over the whole step; with several ranks the
    gradients are then summed across them. Returns (mean loss, N, mean aux loss)."""
    local = sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in batches)
    n_targets = int(sum_scalars(ranks, local)[0])
    if ranks.sharded:  # FSDP gathers and reduces inside them: a rank that fails there cannot meet the others
        total, aux = backward_over(model, batches, n_targets, loss_chunk)
    else:
        total, aux = local_stretch(ranks, backward_over, model, batches, n_targets, loss_chunk)
    if ranks.enabled:
        (total,) = sum_scalars(ranks, total)
        sum_gradients(ranks, [p for p in model.parameters() if p.requires_grad])
    return total / n_targets, n_targets, (sum(aux) / len(aux) if aux else None)


def backward_over(
    model, batches: list[dict[str, torch.Tensor]], n_targets: int, loss_chunk: int
) -> tuple[float, list[float]]:
    """Forward and backward of each micro-batch, its loss sum scaled by 1/n_targets; (summed loss, aux losses)."""
    total, aux = 0.0, []
    for batch in batches:
        with phase("forward"):
            loss_sum, _, aux_loss = token_loss_sum(model, batch, loss_chunk=loss_chunk)
        with phase("backward"):
            (loss_sum / n_targets).backward()
        total += float(loss_sum.detach())
        if aux_loss is not None:
            aux.append(aux_loss)
    return total, aux


def backward_with_updates(model, stepper: StepInBackward, batch: dict[str, torch.Tensor], *, loss_chunk: int = 0):
    """train.optimizer_in_backward: one micro-batch's backward, each LoRA tensor updated inside it. A
    non-finite loss is seen before the backward, so nothing is updated. Returns (mean loss, N, aux loss,
    pre-clip gradient norm, skipped)."""
    n_targets = int((batch["labels"][:, 1:] != IGNORE).sum())
    stepper.begin()
    with phase("forward"):
        loss_sum, _, aux_loss = token_loss_sum(model, batch, loss_chunk=loss_chunk)
    loss = float(loss_sum.detach()) / n_targets
    if math.isfinite(loss):
        with phase("backward (optimizer in backward)"):
            (loss_sum / n_targets).backward()
    del loss_sum
    grad_norm, skipped = stepper.finish(math.isfinite(loss))
    release_freed_memory()
    return loss, n_targets, aux_loss, grad_norm, skipped


def train_step(
    model, optimizer, group, pad_id: int, train_cfg, stepper: StepInBackward | None = None, ranks: Ranks = SINGLE
) -> dict:
    """One optimizer step over the micro-batches in `group` (inside the backward with `stepper`); returns
    its metrics."""
    device = next(model.parameters()).device
    batches = [{k: v.to(device) for k, v in collate(mb, pad_id).items()} for mb in group if mb]
    if stepper is not None:
        (batch,) = batches  # grad_accum is 1 (the config refuses more)
        loss, n_targets, aux_loss, grad_norm, skipped = backward_with_updates(
            model, stepper, batch, loss_chunk=train_cfg.loss_chunk_tokens
        )
    else:
        loss, n_targets, aux_loss = accumulate_gradients(
            model, batches, loss_chunk=train_cfg.loss_chunk_tokens, ranks=ranks
        )
        grad_norm, skipped = local_stretch(ranks, apply_update, optimizer, loss, train_cfg)
    trained = sum(len(e.input_ids) for mb in group for e in mb if not e.source.endswith(IDLE))
    tokens = int(sum_scalars(ranks, trained)[0])
    return {
        "loss": loss,
        "grad_norm": grad_norm,
        "target_tokens": n_targets,
        "tokens": tokens,
        "skipped": skipped,
        "aux_loss": aux_loss,
    }


def prepare(cfg: RunConfig, console: Console, ranks: Ranks = SINGLE):
    """Tokenizer, data, and the quantized model with adapters for an SFT run (sharded when the run is: the
    returned ranks say so)."""
    model_path, tokenizer = load_tokenizer(cfg)
    rwsft = cfg.train.objective == "rwsft"
    examples, stats = build_examples(cfg.data, tokenizer, rewards=rwsft)
    if rwsft:
        examples = apply_reward_weights(examples, cfg.reward)
        weights = [e.weight for e in examples]
        console.print(
            f"rwsft: weights ({cfg.reward.mapping}) from {min(weights):.3g} to {max(weights):.3g}, "
            f"mean {sum(weights) / len(weights):.3g}"
        )
    console.print(
        f"data: {stats.rows} rows -> {len(examples)} examples, {stats.target_tokens} target tokens; "
        f"truncated {stats.truncated}, dropped {stats.dropped_overlength} over max_seq_len and "
        f"{stats.dropped_no_target} with no target left; formats {stats.formats}"
    )
    model, params, ranks = load_policy(cfg, model_path, console, ranks)
    return model_path, tokenizer, examples, model, params, ranks


def held_out_examples(
    cfg: RunConfig, tokenizer, examples: list[Example], console: Console
) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples: data.eval_files tokenized like the training rows, or a seeded
    data.eval_fraction of them held out (never trained on)."""
    if cfg.data.eval_files:
        held, _ = build_examples(cfg.data.model_copy(update={"train_files": cfg.data.eval_files}), tokenizer)
    else:
        examples, held = eval_split(examples, cfg.data.eval_fraction, seed=cfg.train.seed)
    if held:
        targets = sum(sum(t != IGNORE for t in e.labels[1:]) for e in held)
        console.print(f"eval: {len(held)} examples held out, {targets} target tokens")
    return examples, held


@torch.no_grad()
def eval_loss(model, examples: list[Example], pad_id: int, train_cfg) -> float:
    """Mean token loss over `examples` (unweighted, the training masking and chunked loss), in eval mode
    (no dropout, so the run's RNG is untouched) and without gradients."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for start in range(0, len(examples), train_cfg.micro_batch_size):
            batch = collate(examples[start : start + train_cfg.micro_batch_size], pad_id)
            batch = {k: v.to(device) for k, v in batch.items() if k not in ("weights", "token_weights")}
            loss_sum, n, _ = token_loss_sum(model, batch, loss_chunk=train_cfg.loss_chunk_tokens)
            total, count = total + float(loss_sum), count + n
    finally:
        model.train(was_training)
    return total / max(count, 1)


def best_eval_so_far(metrics_path: Path) -> float:
    """The lowest eval loss logged (after a resume: up to the checkpoint), inf if none."""
    values = [r["eval_loss"] for r in read_jsonl(metrics_path) if "eval_loss" in r]
    return min(values, default=math.inf)


def run_steps(
    cfg: RunConfig,
    examples,
    pad_id: int,
    training: dict,
    *,
    total: int,
    done: RunProgress,
    metrics: Reporters,
    console: Console,
    checkpoint,
    stop: StopSignals,
    on_failure,
    stepper: StepInBackward | None = None,
    evaluate=None,
    ranks: Ranks = SINGLE,
) -> tuple[list[float], int]:
    """The optimizer steps after `done`, with a progress bar (plain lines when stdout is not a terminal),
    metrics, checkpoints by steps and minutes, and a checkpoint then RunInterrupted on SIGINT/SIGTERM; a step that
    fails (out of memory, on any rank) raises on_failure(last completed progress, failure, stepper), a
    faults.StepFailed after its checkpoint, on every rank.
    Returns the losses of this invocation and the tokens it trained on."""
    model, optimizer, schedule = training["model"], training["optimizer"], training["scheduler"]
    losses, tokens, start, first = [], 0, time.perf_counter(), done.step
    policy = CheckpointPolicy(cfg.train.save_every, cfg.train.save_every_minutes)
    columns = [
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console, transient=False, disable=not console.is_terminal) as bar:
        task = bar.add_task("train", total=total, info="", completed=done.step)
        for step, (epoch, group) in enumerate(optimizer_steps(examples, cfg, ranks)):
            if step >= total:
                break
            if step < done.step:  # done before the checkpoint: the order depends on (seed, epoch) only
                continue
            stop_if_asked(stop, done, checkpoint, ranks)
            t0 = time.perf_counter()
            lr = optimizer.param_groups[0]["lr"]
            start_step(step + 1)
            record, failure = attempt(ranks, train_step, model, optimizer, group, pad_id, cfg.train, stepper, ranks)
            if failure is not None:  # outside the `except`: the failed step's frames are gone
                raise on_failure(done, failure, stepper=stepper)
            dt = time.perf_counter() - t0
            record.update(
                step=step + 1,
                epoch=epoch,
                lr=lr,
                step_time_s=dt,
                tokens_per_s=record["tokens"] / dt,
                elapsed_s=time.perf_counter() - start,
                router_load=router_load(model),
            )
            if evaluate is not None and (
                step + 1 == total or (cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0)
            ):
                record.update(evaluate())
            try:
                done = after_step(record, [e.source for mb in group for e in mb], done, cfg)
            finally:  # an aborting step is logged too, with its raw loss
                logged = record["skipped"] or "eval_loss" in record or (step + 1) % cfg.train.log_every == 0
                if logged or step + 1 == total:
                    metrics.write(record)
            if not record["skipped"]:
                schedule.step()  # a skipped step is not taken: the schedule does not move either
            losses.append(record["loss"])
            tokens += record["tokens"]
            info = {"loss": f"{record['loss']:.4f}", "lr": f"{lr:.2e}", "tok/s": f"{record['tokens_per_s']:.0f}"}
            if "eval_loss" in record:
                info["eval"] = f"{record['eval_loss']:.4f}"
            bar.update(task, advance=1, info="  ".join(f"{k} {v}" for k, v in info.items()))
            if not console.is_terminal and ((step + 1) % cfg.train.log_every == 0 or step + 1 == total):
                console.print(
                    plain_progress_line("train", step + 1, total, info, time.perf_counter() - start, first),
                    highlight=False,
                )
            if done.step < total and any_rank(ranks, policy.due(done.step)):  # by minutes: clocks may disagree
                checkpoint(done)
                policy.saved()
    checkpoint(done)
    return losses, tokens


def train(
    cfg: RunConfig, console: Console | None = None, *, allow_mismatch: bool = False, overwrite: bool = False
) -> TrainResult:
    """Run SFT as configured: returns the per-step losses (of this invocation) and where the outputs went.
    Raises RunInterrupted after checkpointing when SIGINT or SIGTERM arrives. Under torchrun (WORLD_SIZE > 1)
    each process is a data-parallel rank (distributed.py); rank 0 alone writes, and holds output.dir's lock for
    the run (RunDirLocked while another process holds it)."""
    out = Path(cfg.output.dir)
    with launched(cfg, console) as (ranks, console), output_dir_locked(out, ranks, console):
        return _train(cfg, console, out, ranks, allow_mismatch=allow_mismatch, overwrite=overwrite)


def _train(
    cfg: RunConfig, console: Console, out: Path, ranks: Ranks, *, allow_mismatch: bool, overwrite: bool
) -> TrainResult:
    if ranks.enabled and cfg.train.optimizer_in_backward:
        raise ConfigError(
            "train.optimizer_in_backward steps inside each rank's backward, before the gradients "
            "of the ranks are summed: set it false for a data-parallel run"
        )
    claim_output_dir_together(out, cfg, ranks, console, overwrite=overwrite)
    started = time.perf_counter()
    with StopSignals(console) as stop:
        seed_everything(cfg.train.seed)  # the run draws from its seed (attach_adapters seeds LoRA on its own)
        failure = None
        try:
            model_path, tokenizer, examples, model, params, ranks = prepare(cfg, console, ranks)
        except Exception as exc:  # a rank that cannot load its data or model stops every rank, at once
            failure = exc
        raise_together(ranks, failure)
        if ranks.main:
            write_router_layers(out, model)
        examples, held_out = held_out_examples(cfg, tokenizer, examples, console)
        if cfg.data.packing:
            examples, held_out = packed(model, examples, held_out, cfg.data.max_seq_len, console)
        seed_everything(cfg.train.seed)  # and again: what loading consumed (e.g. a cold cache) must not matter
        optimizer = build_optimizer(params, cfg.train)
        total = count_steps(len(examples), cfg, ranks.world)
        schedule = build_schedule(optimizer, total, cfg.train)
        identity = {
            **config_identity(cfg.model_dump(mode="json")),
            "dataset_fingerprint": dataset_fingerprint(examples),
            "world": ranks.world,
        }
        training = {"model": model, "optimizer": optimizer, "scheduler": schedule}
        done = resume_if_asked(
            cfg, out, console, allow_mismatch=allow_mismatch, identity=identity, writer=ranks.main, **training
        )
        resumed_at = done.step
        done, total = continue_at_world_size(done, ranks, len(examples), cfg, total, console)
        if done.step != resumed_at:
            training["scheduler"] = schedule_at(optimizer, total, done.step, cfg.train)
            if ranks.main and done.step < resumed_at:  # more ranks: fewer, larger steps; their records start again
                truncate_metrics(out / "metrics.jsonl", done.step)
        if ranks.enabled:
            batch = ranks.world * cfg.train.micro_batch_size * cfg.train.grad_accum
            console.print(
                f"data parallel ({'fsdp' if ranks.sharded else 'ddp'}): {ranks.world} ranks x "
                f"micro_batch_size {cfg.train.micro_batch_size}, global batch {batch}"
            )
        stepper = None
        if cfg.train.optimizer_in_backward:  # undo: a step abandoned part-way (NaN, out of memory) is put back
            stepper = StepInBackward(optimizer, undo=True)
        metrics = (
            Reporters(out, cfg.output.report_to, project=cfg.output.wandb_project, config=cfg.model_dump(mode="json"))
            if ranks.main
            else NoReporters(out)
        )
        model.train()

        def checkpoint(progress: RunProgress) -> None:
            tensors = checkpoint_tensors(model, optimizer) if ranks.sharded else None  # gathered by every rank
            if ranks.main:
                save_checkpoint(
                    out,
                    progress=progress,
                    identity=identity,
                    keep=cfg.train.keep_checkpoints,
                    tensors=tensors,
                    **training,
                )

        best = {"loss": best_eval_so_far(metrics.path)}

        def evaluate() -> dict:
            loss = eval_loss(model, held_out, tokenizer.pad_token_id, cfg.train)
            fields = {"eval_loss": loss}
            if cfg.train.keep_best and loss < best["loss"]:
                best["loss"] = loss
                fields["eval_best"] = True
                with whole_trainable(model, ranks):
                    if ranks.main:
                        save_verified_adapter(model, out / "adapter-best", cfg, model_path)
                        write_prompt_format(out / "adapter-best", cfg.data)
            return fields

        try:
            losses, tokens = run_steps(
                cfg,
                examples,
                tokenizer.pad_token_id,
                training,
                total=total,
                done=done,
                metrics=metrics,
                console=console,
                checkpoint=checkpoint,
                stop=stop,
                stepper=stepper,
                evaluate=evaluate if held_out else None,
                ranks=ranks,
                on_failure=FaultStop(cfg, model_path, out, training, checkpoint, ranks),
            )
        finally:
            metrics.close()
        with whole_trainable(model, ranks):
            adapter_dir = write_adapter(model, out, cfg, model_path, console) if ranks.main else out / "adapter"
            if ranks.main:
                write_prompt_format(adapter_dir, cfg.data)  # how generate renders a prompt as this run did
    finite = [x for x in losses if math.isfinite(x)]
    RunSummary(
        "train",
        len(losses),
        time.perf_counter() - started,
        tokens,
        finite[-1] if finite else None,
        min(finite) if finite else None,
        adapter_dir,
        metrics.path,
    ).print(console)
    return TrainResult(steps=len(losses), losses=losses, adapter_dir=adapter_dir, metrics_path=metrics.path)
