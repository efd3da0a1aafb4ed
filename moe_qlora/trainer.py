"""The SFT loop: token-normalised loss over accumulated micro-batches, clipping, schedule, logging, export.

One optimizer step sees `grad_accum` micro-batches; each contributes sum(token losses) / N where N is the
number of target tokens in the whole step, so the step's gradient equals that of one big batch.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import AutoTokenizer

from .adapters import attach_adapters, configure_checkpointing, expert_loras, trainable_parameters
from .checkpoint import (
    CheckpointError,
    RunProgress,
    checkpoint_dirs,
    config_hash,
    dataset_fingerprint,
    latest_valid_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify,
)
from .config import ConfigError, RunConfig, resolve_compute_dtype
from .data import (
    IGNORE,
    Example,
    apply_reward_weights,
    build_examples,
    collate,
    epoch_order,
    eval_split,
    micro_batches,
    pack_examples,
)
from .experts import set_moe_kernels
from .export import load_adapter, save_adapter, verify_adapter
from .loading import LoadOptions, check_model_path, load_model, parameter_bytes_by_kind
from .losses import token_logprobs
from .memory import release_freed_memory
from .optim import StepInBackward, build_optimizer, clip_global_norm, lr_multiplier
from .runs import (
    CheckpointPolicy,
    RunInterrupted,
    RunSummary,
    StopSignals,
    claim_output_dir,
    plain_progress_line,
)
from .tiny import resolve_model_path

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class MetricsLog:
    """Append-only JSONL of metrics, one object a line, flushed at once (a crash keeps what was logged)."""

    def __init__(self, path: Path):
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


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


def optimizer_steps(examples: list[Example], cfg: RunConfig):
    """Yield (epoch, [micro-batches]) per optimizer step, each epoch in its own seeded order."""
    t = cfg.train
    for epoch in range(t.epochs):
        order = epoch_order(len(examples), seed=t.seed, epoch=epoch)
        group = []
        for mb in micro_batches(examples, order, t.micro_batch_size):
            group.append(mb)
            if len(group) == t.grad_accum:
                yield epoch, group
                group = []
        if group:
            yield epoch, group


def count_steps(num_examples: int, cfg: RunConfig) -> int:
    t = cfg.train
    per_epoch = math.ceil(math.ceil(num_examples / t.micro_batch_size) / t.grad_accum)
    total = per_epoch * t.epochs
    return min(total, t.max_steps) if t.max_steps else total


def accumulate_gradients(
    model, batches: list[dict[str, torch.Tensor]], *, loss_chunk: int = 0
) -> tuple[float, int, float | None]:
    """Backward over micro-batches, each scaled by 1/N with N the target tokens of all of them together,
    so the gradient is that of the mean token loss over the whole step. Returns (mean loss, N, mean aux loss)."""
    n_targets = sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in batches)
    total, aux = 0.0, []
    for batch in batches:
        loss_sum, _, aux_loss = token_loss_sum(model, batch, loss_chunk=loss_chunk)
        (loss_sum / n_targets).backward()
        total += float(loss_sum.detach())
        if aux_loss is not None:
            aux.append(aux_loss)
    return total / n_targets, n_targets, (sum(aux) / len(aux) if aux else None)


def apply_update(optimizer, loss: float, train_cfg) -> tuple[float, bool]:
    """Clip and take the optimizer step on the accumulated gradients unless the loss or the gradient is not
    finite; returns (pre-clip gradient norm, skipped). Gradients are cleared either way."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grad_norm = clip_global_norm(params, train_cfg.max_grad_norm)  # measured before any clipping
    skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
    if not skipped:  # checked before the step: a non-finite one reaches no weight and no AdamW moment
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    release_freed_memory()
    return grad_norm, skipped


def backward_with_updates(model, stepper: StepInBackward, batch: dict[str, torch.Tensor], *, loss_chunk: int = 0):
    """train.optimizer_in_backward: one micro-batch's backward, each LoRA tensor updated inside it. A
    non-finite loss is seen before the backward, so nothing is updated. Returns (mean loss, N, aux loss,
    pre-clip gradient norm, skipped)."""
    n_targets = int((batch["labels"][:, 1:] != IGNORE).sum())
    stepper.begin()
    loss_sum, _, aux_loss = token_loss_sum(model, batch, loss_chunk=loss_chunk)
    loss = float(loss_sum.detach()) / n_targets
    if math.isfinite(loss):
        (loss_sum / n_targets).backward()
    del loss_sum
    grad_norm, skipped = stepper.finish(math.isfinite(loss))
    release_freed_memory()
    return loss, n_targets, aux_loss, grad_norm, skipped


def train_step(model, optimizer, group, pad_id: int, train_cfg, stepper: StepInBackward | None = None) -> dict:
    """One optimizer step over the micro-batches in `group` (inside the backward with `stepper`); returns
    its metrics."""
    device = next(model.parameters()).device
    batches = [{k: v.to(device) for k, v in collate(mb, pad_id).items()} for mb in group]
    if stepper is not None:
        (batch,) = batches  # grad_accum is 1 (config.py refuses more)
        loss, n_targets, aux_loss, grad_norm, skipped = backward_with_updates(
            model, stepper, batch, loss_chunk=train_cfg.loss_chunk_tokens
        )
    else:
        loss, n_targets, aux_loss = accumulate_gradients(model, batches, loss_chunk=train_cfg.loss_chunk_tokens)
        grad_norm, skipped = apply_update(optimizer, loss, train_cfg)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    return {"loss": loss, "grad_norm": grad_norm, "target_tokens": n_targets, "tokens": tokens, "skipped": skipped,
            "aux_loss": aux_loss}  # fmt: skip


class TrainingAborted(RuntimeError):
    """The run stopped on purpose (non-finite loss); the message says where and on which samples."""


def after_step(record: dict, sources: list[str], done: RunProgress, cfg, *, spikes: bool = True) -> RunProgress:
    """Apply the NaN policy and (if `spikes`) loss-spike detection to a finished step; returns the new progress.
    sources: 'file:row' of the step's samples, named when the step is not finite."""
    t = cfg.train
    if record["skipped"]:
        samples = ", ".join(sources)
        where = f"step {record['step']}: loss {record['loss']}, grad norm {record['grad_norm']}, samples {samples}"
        consecutive = done.consecutive_skips + 1
        if t.nan_policy == "abort":
            raise TrainingAborted(f"non-finite loss or gradient at {where} (nan_policy: abort)")
        if consecutive >= t.max_consecutive_skips:
            raise TrainingAborted(f"{consecutive} non-finite steps in a row, the last at {where}")
        return RunProgress(step=record["step"], epoch=record["epoch"], skipped_steps=done.skipped_steps + 1,
                           consecutive_skips=consecutive, loss_ema=done.loss_ema)  # fmt: skip
    ema = done.loss_ema
    if spikes and t.spike_factor and ema is not None and record["step"] > 10 and record["loss"] > t.spike_factor * ema:
        record["event"] = "loss_spike"
    ema = record["loss"] if ema is None else 0.9 * ema + 0.1 * record["loss"]
    return RunProgress(step=record["step"], epoch=record["epoch"], skipped_steps=done.skipped_steps, loss_ema=ema)


def router_load(model) -> list[list[float]]:
    """Share of routed rows per expert, per MoE layer, since the last call (then reset)."""
    loads = []
    for _, lora in expert_loras(model):
        counts = lora.routed_rows.double()
        shares = (counts / counts.sum().clamp(min=1)).tolist()  # one device sync per layer, not per expert
        loads.append([round(s, 4) for s in shares])
        lora.routed_rows.zero_()
    return loads


def load_tokenizer(cfg: RunConfig):
    """(resolved model path, tokenizer with a pad token)."""
    model_path = resolve_model_path(cfg.model.name_or_path)
    check_model_path(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model_path, tokenizer


def prepare(cfg: RunConfig, console: Console):
    """Tokenizer, data, and the quantized model with adapters for an SFT run."""
    model_path, tokenizer = load_tokenizer(cfg)
    rwsft = cfg.train.objective == "rwsft"
    examples, stats = build_examples(cfg.data, tokenizer, rewards=rwsft)
    if rwsft:
        examples = apply_reward_weights(examples, cfg.reward)
        weights = [e.weight for e in examples]
        console.print(f"rwsft: weights ({cfg.reward.mapping}) from {min(weights):.3g} to {max(weights):.3g}, "
                      f"mean {sum(weights) / len(weights):.3g}")  # fmt: skip
    console.print(
        f"data: {stats.rows} rows -> {len(examples)} examples, {stats.target_tokens} target tokens; "
        f"truncated {stats.truncated}, dropped {stats.dropped_overlength} over max_seq_len and "
        f"{stats.dropped_no_target} with no target left; formats {stats.formats}"
    )
    model, params = load_policy(cfg, model_path, console)
    return model_path, tokenizer, examples, model, params


def held_out_examples(cfg: RunConfig, tokenizer, examples: list[Example], console: Console
                      ) -> tuple[list[Example], list[Example]]:  # fmt: skip
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


def packed(model, examples: list[Example], held_out: list[Example], max_len: int, console: Console
           ) -> tuple[list[Example], list[Example]]:  # fmt: skip
    """data.packing: training and eval rows each packed into max_seq_len sequences (never mixed)."""
    if (reason := packing_unsupported(model)) is not None:
        raise ConfigError(f"data.packing: {reason}; set data.packing: false for this model")
    rows = len(examples)
    examples, held_out = pack_examples(examples, max_len), pack_examples(held_out, max_len) if held_out else []
    fill = sum(len(e.input_ids) for e in examples) / (len(examples) * max_len)
    console.print(f"packing: {rows} rows -> {len(examples)} sequences of up to {max_len} tokens ({fill:.0%} full)")
    return examples, held_out


RECURRENT_LAYER_KINDS = ("linear_attention", "mamba", "conv", "recurrent")


def packing_unsupported(model) -> str | None:
    """Why packed rows would see each other in this model, or None.

    Restarting position ids make transformers mask attention per row, where the model hands them to its mask
    builder (GPT-OSS does not); the state of recurrent or convolutional mixers runs across rows regardless.
    Decided by a probe, two rows packed against the second alone, named by the layer kinds where known."""
    config = model.config.get_text_config()
    kinds = set(getattr(config, "layer_types", None) or []) | set(getattr(config, "layers_block_type", None) or [])
    recurrent = sorted(k for k in kinds if any(r in k for r in RECURRENT_LAYER_KINDS))
    if recurrent:
        return f"{', '.join(recurrent)} layers carry state across packed rows (only attention restarts per row)"
    if rows_leak_when_packed(model):
        return (f"in {type(model).__name__} a packed row sees the rows before it (its attention masks do not "
                "restart at the positions, or a convolution or recurrent mixer runs across rows)")  # fmt: skip
    return None


@torch.no_grad()
def rows_leak_when_packed(model, n: int = 8) -> bool:
    """True when the logits of a row packed after another differ from the row alone (fp32: ~1e-6; bf16
    kernels: ~1e-2 of the logits' scale; a leak: O(1))."""
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    first = torch.arange(3, 3 + n, device=device)[None] % vocab
    second = torch.arange(3 + n, 3 + 2 * n, device=device)[None] % vocab
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            alone = model(input_ids=second, use_cache=False).logits.float()
            positions = torch.arange(n, device=device).repeat(1, 2)
            both = model(input_ids=torch.cat([first, second], 1), position_ids=positions, use_cache=False)
    finally:
        model.train(was_training)
    tol = 1e-3 if both.logits.dtype == torch.float32 else 5e-2
    return float((both.logits[:, n:].float() - alone).abs().max()) > tol * max(1.0, float(alone.abs().max()))


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
    if not metrics_path.exists():
        return math.inf
    values = [r["eval_loss"] for r in map(json.loads, metrics_path.read_text().splitlines()) if "eval_loss" in r]
    return min(values, default=math.inf)


def load_policy(cfg: RunConfig, model_path: str, console: Console):
    """The quantized model with its adapters (new, or from lora.init_from) and checkpointing; (model, params)."""
    device = cfg.model.device if cfg.model.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    opts = LoadOptions(
        device=device,
        name_or_path=model_path,
        compute_dtype=DTYPES[resolve_compute_dtype(cfg.model.compute_dtype, device)],
        expert_double_quant=cfg.model.expert_double_quant,
        linear_double_quant=cfg.model.linear_double_quant,
        trust_remote_code=cfg.model.trust_remote_code,
        strict=cfg.model.strict_quantization,
    )
    model = attach_adapters(load_model(opts), cfg.lora, seed=cfg.train.seed)
    kernels = resolve_kernels(cfg.model.kernels, device)
    if set_moe_kernels(model, kernels, fused_below_rows=cfg.model.fused_below_rows,
                       dequant_buffer_mb=cfg.model.dequant_buffer_mb):  # fmt: skip
        console.print(f"MoE kernels: {describe_kernels(kernels, cfg.model.fused_below_rows)}"
                      + (" (model.kernels: auto)" if cfg.model.kernels == "auto" else ""))  # fmt: skip
    if cfg.lora.init_from:
        n = load_adapter(model, cfg.lora.init_from, cfg.lora)
        console.print(f"LoRA initialised from {cfg.lora.init_from} ({n} tensors)")
    n_ckpt = configure_checkpointing(
        model, enabled=cfg.train.gradient_checkpointing, interval=cfg.train.checkpoint_interval
    )
    params = trainable_parameters(model)
    if not params:
        raise ValueError("no trainable parameters: lora.target_modules matched nothing and the model has no experts")
    sizes = parameter_bytes_by_kind(model)
    console.print(
        f"model on {device}: "
        + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sizes.items())
        + f"; {sum(p.numel() for p in params):,} trainable parameters; {n_ckpt} layers checkpointed"
    )
    return model, params


def resolve_kernels(choice: str, device: str) -> str:
    """model.kernels to what runs: auto is the per-call choice between Triton and grouped_mm on CUDA (grouped_mm
    alone without triton), the torch reference on the CPU; grouped_mm runs anywhere."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if choice in ("torch", "grouped_mm"):
        return choice
    if choice == "auto" and device != "cuda":
        return "torch"
    if importlib.util.find_spec("triton") is None:
        if choice == "auto":
            return "grouped_mm"
        raise ConfigError("model.kernels: triton, but triton is not installed (pip install -e '.[gpu]')")
    if device != "cuda" and not interpreted:
        raise ConfigError("model.kernels: triton needs a CUDA device (or TRITON_INTERPRET=1, as the tests use)")
    return choice


def describe_kernels(kernels: str, fused_below_rows: int) -> str:
    if kernels == "auto":
        return f"auto per layer call: triton below {fused_below_rows} rows per expert, grouped_mm at or above"
    return kernels


def seed_everything(seed: int) -> None:
    """torch (CPU and CUDA), python and numpy RNGs from one seed: dropout and anything else random."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records of steps after `last_step` (done after the checkpoint a run resumes from), atomically."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def resume_if_asked(cfg: RunConfig, out: Path, console: Console, *, allow_mismatch: bool,
                    logs: tuple[str, ...] = ("metrics.jsonl",), **training) -> RunProgress:  # fmt: skip
    """Restore the checkpoint `train.resume` names (auto: the newest valid one in output.dir); a fresh
    RunProgress for `never`. Records of `logs` after the checkpoint's step are dropped, since those steps
    will be done again (all of them when there is no checkpoint yet). Checkpoints newer than a named one
    are from a continuation being abandoned: they are renamed aside, so pruning and a later --resume never
    mix the two."""
    if cfg.train.resume == "never":
        return RunProgress()
    if cfg.train.resume == "auto":
        checkpoint = latest_valid_checkpoint(out)
    else:
        checkpoint = Path(cfg.train.resume)
        problem = verify(checkpoint) if checkpoint.is_dir() else "no such checkpoint folder"
        if problem is not None:
            raise CheckpointError(f"--resume {checkpoint}: {problem}")
        set_aside_newer_checkpoints(out, checkpoint, console)
    if checkpoint is None:
        console.print("resume: no valid checkpoint yet, starting from step 0")
        for name in logs:
            truncate_metrics(out / name, 0)
        return RunProgress()
    done = load_checkpoint(checkpoint, allow_mismatch=allow_mismatch, **training)
    for name in logs:
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


def run_steps(cfg: RunConfig, examples, pad_id: int, training: dict, *, total: int, done: RunProgress,
              metrics: MetricsLog, console: Console, checkpoint, stop: StopSignals,
              stepper: StepInBackward | None = None, evaluate=None) -> tuple[list[float], int]:  # fmt: skip
    """The optimizer steps after `done`, with a progress bar (plain lines when stdout is not a terminal),
    metrics, checkpoints by steps and minutes, and a checkpoint then RunInterrupted on SIGINT/SIGTERM.
    Returns the losses of this invocation and the tokens it trained on."""
    model, optimizer, schedule = training["model"], training["optimizer"], training["scheduler"]
    losses, tokens, start, first = [], 0, time.perf_counter(), done.step
    policy = CheckpointPolicy(cfg.train.save_every, cfg.train.save_every_minutes)
    columns = [TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeRemainingColumn()]  # fmt: skip
    with Progress(*columns, console=console, transient=False, disable=not console.is_terminal) as bar:
        task = bar.add_task("train", total=total, info="", completed=done.step)
        for step, (epoch, group) in enumerate(optimizer_steps(examples, cfg)):
            if step >= total:
                break
            if step < done.step:  # done before the checkpoint: the order depends on (seed, epoch) only
                continue
            stop_if_asked(stop, done, checkpoint)
            t0 = time.perf_counter()
            lr = optimizer.param_groups[0]["lr"]
            record = train_step(model, optimizer, group, pad_id, cfg.train, stepper)
            dt = time.perf_counter() - t0
            record.update(step=step + 1, epoch=epoch, lr=lr, step_time_s=dt, tokens_per_s=record["tokens"] / dt,
                          elapsed_s=time.perf_counter() - start, router_load=router_load(model))  # fmt: skip
            if evaluate is not None and (step + 1 == total or (cfg.train.eval_every and
                                                               (step + 1) % cfg.train.eval_every == 0)):  # fmt: skip
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
                console.print(plain_progress_line("train", step + 1, total, info, time.perf_counter() - start, first),
                              highlight=False)  # fmt: skip
            if done.step < total and policy.due(done.step):
                checkpoint(done)
                policy.saved()
    checkpoint(done)
    return losses, tokens


def stop_if_asked(stop: StopSignals, done: RunProgress, checkpoint) -> None:
    """After a SIGINT/SIGTERM: checkpoint the steps done (if any) and raise RunInterrupted."""
    if stop.requested is None:
        return
    if done.step:
        checkpoint(done)
    raise RunInterrupted(done.step, stop.requested)


def build_schedule(optimizer, total_updates: int, train_cfg):
    """Warmup then constant, linear or cosine decay over `total_updates` optimizer steps."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_multiplier(
            s, total_steps=total_updates, warmup_steps=train_cfg.warmup_steps, schedule=train_cfg.schedule
        ),  # fmt: skip
    )


def write_adapter(model, out: Path, cfg: RunConfig, model_path: str, console: Console) -> Path:
    """Save the run's adapter, then load it back as PEFT will and check every tensor landed (raises if not;
    the adapter stays written either way)."""
    adapter_dir = save_adapter(model, out / "adapter", cfg=cfg.lora, base_model_name_or_path=model_path)
    n = verify_adapter(model, adapter_dir)
    console.print(f"adapter: {adapter_dir} ({n} tensors, each verified to load in PEFT as trained)")
    for fmt in cfg.output.export_formats:
        from .formats import write_gguf, write_per_expert

        path = write_per_expert(adapter_dir, out / "adapter-per-expert") if fmt == "per-expert" else write_gguf(
            adapter_dir, out / "adapter.gguf")  # fmt: skip
        console.print(f"{fmt}: {path}")
    return adapter_dir


def train(cfg: RunConfig, console: Console | None = None, *, allow_mismatch: bool = False,
          overwrite: bool = False) -> TrainResult:  # fmt: skip
    """Run SFT as configured: returns the per-step losses (of this invocation) and where the outputs went.
    Raises RunInterrupted after checkpointing when SIGINT or SIGTERM arrives."""
    console = console or Console()
    out = Path(cfg.output.dir)
    claim_output_dir(out, resuming=cfg.train.resume != "never", overwrite=overwrite, console=console)
    started = time.perf_counter()
    with StopSignals(console) as stop:
        seed_everything(cfg.train.seed)  # LoRA initialisation (PEFT draws from the global RNG)
        model_path, tokenizer, examples, model, params = prepare(cfg, console)
        examples, held_out = held_out_examples(cfg, tokenizer, examples, console)
        if cfg.data.packing:
            examples, held_out = packed(model, examples, held_out, cfg.data.max_seq_len, console)
        seed_everything(cfg.train.seed)  # and again: what loading consumed (e.g. a cold cache) must not matter
        optimizer = build_optimizer(params, cfg.train)
        total = count_steps(len(examples), cfg)
        schedule = build_schedule(optimizer, total, cfg.train)
        identity = {"config_hash": config_hash(cfg.model_dump(mode="json")),
                    "dataset_fingerprint": dataset_fingerprint(examples)}  # fmt: skip
        training = {"model": model, "optimizer": optimizer, "scheduler": schedule}
        done = resume_if_asked(cfg, out, console, allow_mismatch=allow_mismatch, identity=identity, **training)
        stepper = None
        if cfg.train.optimizer_in_backward:
            stepper = StepInBackward(optimizer, undo=cfg.train.nan_policy == "skip")
        metrics = MetricsLog(out / "metrics.jsonl")
        model.train()

        def checkpoint(progress: RunProgress) -> None:
            save_checkpoint(out, progress=progress, identity=identity, keep=cfg.train.keep_checkpoints, **training)

        best = {"loss": best_eval_so_far(metrics.path)}

        def evaluate() -> dict:
            loss = eval_loss(model, held_out, tokenizer.pad_token_id, cfg.train)
            fields = {"eval_loss": loss}
            if cfg.train.keep_best and loss < best["loss"]:
                best["loss"] = loss
                fields["eval_best"] = True
                save_adapter(model, out / "adapter-best", cfg=cfg.lora, base_model_name_or_path=model_path)
            return fields

        try:
            losses, tokens = run_steps(cfg, examples, tokenizer.pad_token_id, training, total=total, done=done,
                                       metrics=metrics, console=console, checkpoint=checkpoint, stop=stop,
                                       stepper=stepper, evaluate=evaluate if held_out else None)  # fmt: skip
        finally:
            metrics.close()
        adapter_dir = write_adapter(model, out, cfg, model_path, console)
    finite = [x for x in losses if math.isfinite(x)]
    RunSummary("train", len(losses), time.perf_counter() - started, tokens, finite[-1] if finite else None,
               min(finite) if finite else None, adapter_dir, metrics.path).print(console)  # fmt: skip
    return TrainResult(steps=len(losses), losses=losses, adapter_dir=adapter_dir, metrics_path=metrics.path)
