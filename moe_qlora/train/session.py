"""What `train` and `grpo` share: the tokenizer and the 4-bit model with its adapters, kernels, seeding, the
schedule, the optimizer update with its NaN policy, resume, the stop on a signal, router load, and the
adapter written at the end. Both loops (sft.py, grpo.py) build a run from these.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from transformers import AutoTokenizer

from moe_qlora.common.fileio import atomic_write_text
from moe_qlora.common.lock import LockUnsupported, RunLock
from moe_qlora.common.memory import available_host_bytes, release_freed_memory
from moe_qlora.common.reporting import jsonl_lines
from moe_qlora.config.sections import ConfigError, RunConfig, check_shardable, resolve_compute_dtype
from moe_qlora.export.adapter import load_adapter, save_adapter, verify_adapter
from moe_qlora.model.adapters import attach_adapters, configure_checkpointing, expert_loras, trainable_parameters
from moe_qlora.model.distributed import SINGLE, Ranks, any_rank, device_of, join, leave, raise_together, shard_model
from moe_qlora.model.loading import LoadOptions, check_model_path, load_model, parameter_bytes_by_kind
from moe_qlora.model.tiny import resolve_model_path
from moe_qlora.moe.experts import experts_modules, set_moe_kernels, stack_names
from moe_qlora.moe.kernels.grouped_mm import has_fused_path
from moe_qlora.moe.nf4 import NF4Stack
from moe_qlora.moe.offload import host_layer_bytes, offload_experts
from moe_qlora.train.checkpoint import (
    CheckpointError,
    RunProgress,
    checkpoint_dirs,
    latest_valid_checkpoint,
    load_checkpoint,
    verify,
)
from moe_qlora.train.optim import clip_global_norm, lr_multiplier
from moe_qlora.train.position import phase
from moe_qlora.train.runs import RunInterrupted, StopSignals, claim_output_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def apply_update(optimizer, loss: float, train_cfg) -> tuple[float, bool]:
    """Clip and take the optimizer step on the accumulated gradients unless the loss or the gradient is not
    finite; returns (pre-clip gradient norm, skipped). Gradients are cleared either way."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grad_norm = clip_global_norm(params, train_cfg.max_grad_norm)  # measured before any clipping
    skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
    if not skipped:  # checked before the step: a non-finite one reaches no weight and no AdamW moment
        with phase("optimizer"):
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    release_freed_memory()
    return grad_norm, skipped


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
        return RunProgress(
            step=record["step"],
            epoch=record["epoch"],
            skipped_steps=done.skipped_steps + 1,
            consecutive_skips=consecutive,
            loss_ema=done.loss_ema,
        )
    ema = done.loss_ema
    if spikes and t.spike_factor and ema is not None and record["step"] > 10 and record["loss"] > t.spike_factor * ema:
        record["event"] = "loss_spike"
    ema = record["loss"] if ema is None else 0.9 * ema + 0.1 * record["loss"]
    return RunProgress(step=record["step"], epoch=record["epoch"], skipped_steps=done.skipped_steps, loss_ema=ema)


def write_router_layers(out: Path, model) -> None:
    """router_layers.json: the experts modules in the order of every record's router_load (check-norms --run)."""
    from moe_qlora.export.norms import ROUTER_LAYERS

    names = [name.removesuffix(".moe_lora") for name, _ in expert_loras(model)]
    atomic_write_text(out / ROUTER_LAYERS, json.dumps(names, indent=1))


def router_load(model) -> list[list[float]]:
    """Share of routed rows per expert, per MoE layer, since the last call (then reset). All layers go through
    one collective (data parallel: each rank routes its own rows, the run's load is their sum) and one sync."""
    loras = [lora for _, lora in expert_loras(model)]
    if not loras:
        return []
    sizes = [lora.routed_rows.numel() for lora in loras]
    counts = torch.cat([lora.routed_rows for lora in loras]).double()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(counts)
    for lora in loras:
        lora.routed_rows.zero_()
    shares = torch.cat([part / part.sum().clamp(min=1) for part in counts.split(sizes)]).tolist()
    out, start = [], 0
    for n in sizes:
        out.append([round(s, 4) for s in shares[start : start + n]])
        start += n
    return out


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


def load_tokenizer(cfg: RunConfig):
    """(resolved model path, tokenizer with a pad token)."""
    model_path = resolve_model_path(cfg.model.name_or_path)
    check_model_path(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model_path, tokenizer


def sharding_chosen(
    cfg: RunConfig, ranks: Ranks, model_path: str, console: Console, *, generates: bool = False
) -> bool:
    """train.parallel under several ranks: fsdp as asked, ddp as asked, and auto = ddp when `plan` says the run
    fits one device (always on the CPU, and for a run that `generates`: grpo), fsdp otherwise. What a sharded
    run cannot do is refused here (config.check_shardable), before loading."""
    if not ranks.enabled or cfg.train.parallel == "ddp":
        return False
    if cfg.train.parallel == "auto" and cfg.model.expert_offload != "none":  # offload is how it fits one GPU
        return False
    device = device_of(ranks)
    if cfg.train.parallel == "auto":
        if generates or device.type != "cuda":
            return False
        from moe_qlora.model.plan import plan_run

        need = plan_run(cfg, name_or_path=model_path, device="cuda").total
        have = torch.cuda.get_device_properties(device).total_memory
        console.print(
            f"train.parallel auto: the run needs {need / 2**30:.1f} GiB on one GPU of "
            f"{have / 2**30:.1f} GiB (moe-qlora plan) -> {'fsdp' if need > have else 'ddp'}"
        )
        if need <= have:
            return False
    check_shardable(cfg, generates=generates)
    return True


def load_policy(cfg: RunConfig, model_path: str, console: Console, ranks: Ranks = SINGLE, *, generates: bool = False):
    """The quantized model with its adapters (new, or from lora.init_from) and checkpointing, sharded with FSDP2
    when the run is (sharding_chosen); (model, params, ranks). A sharded run on CUDA loads on the host and
    moves each rank's shards to its GPU, so no GPU ever holds the whole model."""
    device = cfg.model.device if cfg.model.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    sharded = sharding_chosen(cfg, ranks, model_path, console, generates=generates)
    opts = LoadOptions(
        device="cpu" if sharded else device,
        name_or_path=model_path,
        compute_dtype=DTYPES[resolve_compute_dtype(cfg.model.compute_dtype, device)],
        expert_double_quant=cfg.model.expert_double_quant,
        linear_double_quant=cfg.model.linear_double_quant,
        trust_remote_code=cfg.model.trust_remote_code,
        strict=cfg.model.strict_quantization,
        experts_on_host=offloaded_layers(cfg, model_path, device, sharded),
    )
    model = attach_adapters(load_model(opts), cfg.lora, seed=cfg.train.seed, device=opts.device)
    start_expert_offload(model, cfg, opts.experts_on_host, device, console)
    kernels = resolve_kernels(cfg.model.kernels, device, opts.compute_dtype)
    if set_moe_kernels(
        model,
        kernels,
        fused_below_rows=cfg.model.fused_below_rows,
        dequant_buffer_mb=cfg.model.dequant_buffer_mb,
        self_check=cfg.model.kernel_self_check,
    ):
        console.print(f"MoE kernels: {describe_kernels(kernels, cfg.model.fused_below_rows, cfg.model.kernels)}")
    if cfg.lora.init_from:
        n = load_adapter(model, cfg.lora.init_from, cfg.lora)
        console.print(f"LoRA initialised from {cfg.lora.init_from} ({n} tensors)")
    n_ckpt = configure_checkpointing(
        model, enabled=cfg.train.gradient_checkpointing, interval=cfg.train.checkpoint_interval
    )
    if sharded:
        ranks = shard_model(model, ranks)
        move_unsharded_to(model, device_of(ranks))
        console.print(
            f"fsdp: 4-bit experts and linears, frozen weights, LoRA and optimizer state sharded over "
            f"{ranks.world} ranks"
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
    return model, params, ranks


def size(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def offloaded_layers(
    cfg: RunConfig, model_path: str, device: str, sharded: bool, gpu_gib: float | None = None
) -> frozenset[str]:
    """model.expert_offload: the experts modules (by name) whose NF4 stacks are stored in host memory. all: every
    one; auto: the fewest `plan` needs to fit this GPU (`gpu_gib`, default the device's), none on the CPU; none
    under FSDP (all on the CPU: every one, host to host). Decided, and the host's memory checked, from
    config.json before any weight is loaded."""
    mode = cfg.model.expert_offload
    if mode == "none" or sharded or (mode == "auto" and device != "cuda"):
        return frozenset()
    from moe_qlora.model.plan import plan_run

    if device != "cuda":  # all, on the CPU: the same schedule from host to host (what CPU tests drive)
        from moe_qlora.model.budget import meta_model
        from moe_qlora.model.offload_plan import expert_layers

        return frozenset(name for name, _ in expert_layers(meta_model(model_path)))

    gib = gpu_gib if gpu_gib is not None else torch.cuda.get_device_properties(device).total_memory / 2**30
    plan = plan_run(cfg, name_or_path=model_path, device="cuda", gpu_gib=gib)
    if plan.offload is None:
        return frozenset()
    check_host_memory(plan.offload.host_bytes, plan.offload.layers, mode)
    return frozenset(plan.offload.modules)


def check_host_memory(need: int, layers: int, mode: str) -> None:
    """Refuse an offload whose host blocks would not fit in the memory the host has available now."""
    if (available := available_host_bytes()) is not None and need > available:
        raise ConfigError(
            f"model.expert_offload: {mode} needs {size(need)} of host memory for {layers} MoE layers' "
            f"experts; this machine has {size(available)} available. Free memory, "
            "or offload fewer layers (expert_offload: auto)"
        )


def start_expert_offload(model, cfg: RunConfig, on_host: frozenset[str], device: str, console: Console, streams=None):
    """Route the reads of the experts modules stored on the host (`on_host`, by name) through an
    ExpertOffloader: each layer's stacks packed into one page-locked block, copied into one of
    model.offload_resident_layers device buffers when the layer runs (moe/offload.py). Returns it, or None."""
    modules = [(n, m) for n, m in experts_modules(model) if n in on_host or plain_name(n) in on_host]
    if not modules:
        return None
    need = sum(host_layer_bytes({s: NF4Stack.from_param(getattr(m, s)) for s in stack_names(m)}) for _, m in modules)
    offloader = offload_experts(
        [m for _, m in modules], device, max_resident=cfg.model.offload_resident_layers, streams=streams
    )
    release_freed_memory()  # the pageable copies the loader left, now in the page-locked blocks
    total = len(experts_modules(model))
    console.print(
        f"expert offload ({cfg.model.expert_offload}): {len(modules)} of {total} MoE layers' experts "
        f"({size(need)}) in page-locked host memory, at most {cfg.model.offload_resident_layers} layers "
        f"on {device} at once"
    )
    return offloader


def plain_name(name: str) -> str:
    """A module's name without PEFT's wrapper prefix: the name it had when it was loaded."""
    return name.removeprefix("base_model.model.")


def move_unsharded_to(model, device: torch.device) -> None:
    """After fully_shard (which moves the shards it manages to the mesh's device): the bitsandbytes 4-bit linears
    it leaves whole, and the buffers, to `device` too. Nothing to do on the CPU."""
    if device.type == "cpu":
        return
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.to(device)
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


def resolve_kernels(choice: str, device: str, dtype: torch.dtype, capability: tuple[int, int] | None = None) -> str:
    """model.kernels to what runs: auto is the per-call choice between Triton and grouped_mm on CUDA where
    torch._grouped_mm has its CUTLASS kernel (sm_90 / sm_100 in bf16), Triton alone on the other GPUs (the 24 GB
    cards) and dtypes, grouped_mm alone without triton, the torch reference on the CPU; grouped_mm runs anywhere.
    capability: the GPU's (major, minor), read from the device when None."""
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
    if choice == "auto" and not has_fused_path(capability or torch.cuda.get_device_capability(), dtype):
        return "triton"
    return choice


def describe_kernels(kernels: str, fused_below_rows: int, choice: str) -> str:
    """The line a run prints once: what runs the MoE layers, and why when model.kernels is auto."""
    if kernels == "auto":
        return f"auto per layer call: triton below {fused_below_rows} rows per expert, grouped_mm at or above"
    if choice == "auto" and kernels == "triton":
        return (
            "triton (model.kernels: auto; torch._grouped_mm has no fused kernel for this GPU and dtype, only a "
            "loop over experts with host syncs)"
        )
    return kernels + (" (model.kernels: auto)" if choice == "auto" else "")


def seed_everything(seed: int) -> None:
    """torch (CPU and CUDA), python and numpy RNGs from one seed: dropout and anything else random."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


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
    mix the two. Only a `writer` (rank 0) truncates or renames."""
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


def stop_if_asked(stop: StopSignals, done: RunProgress, checkpoint, ranks: Ranks = SINGLE) -> None:
    """After a SIGINT/SIGTERM (on any rank: all stop at the same step): checkpoint the steps done (if any) and
    raise RunInterrupted."""
    if not any_rank(ranks, stop.requested is not None):
        return
    if done.step:
        checkpoint(done)
    raise RunInterrupted(done.step, stop.requested or signal.SIGTERM)


def build_schedule(optimizer, total_updates: int, train_cfg):
    """Warmup then constant, linear or cosine decay over `total_updates` optimizer steps."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_multiplier(
            s, total_steps=total_updates, warmup_steps=train_cfg.warmup_steps, schedule=train_cfg.schedule
        ),
    )


def save_verified_adapter(model, adapter_dir: Path, cfg: RunConfig, model_path: str) -> int:
    """Save the model's adapter to `adapter_dir`, then load it back as PEFT will and check every tensor landed
    (raises AdapterVerificationError if not; the adapter stays written either way). Returns the tensor count."""
    save_adapter(model, adapter_dir, cfg=cfg.lora, base_model_name_or_path=model_path)
    return verify_adapter(model, adapter_dir)


def write_adapter(model, out: Path, cfg: RunConfig, model_path: str, console: Console) -> Path:
    """The run's verified adapter in out/adapter, and the export formats it asks for."""
    adapter_dir = out / "adapter"
    n = save_verified_adapter(model, adapter_dir, cfg, model_path)
    console.print(f"adapter: {adapter_dir} ({n} tensors, each verified to load in PEFT as trained)")
    for fmt in cfg.output.export_formats:
        from moe_qlora.export.formats import write_gguf, write_per_expert, write_vllm

        writer, name = {
            "vllm": (write_vllm, "adapter-vllm"),
            "per-expert": (write_per_expert, "adapter-per-expert"),
            "gguf": (write_gguf, "adapter.gguf"),
        }[fmt]
        console.print(f"{fmt}: {writer(adapter_dir, out / name)}")
    return adapter_dir
