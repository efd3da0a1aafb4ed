"""What every training method does after its step's gradients: the update (clipping, and the NaN policy that skips
it), the loss-spike flag, and the router's load per expert.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from moe_qlora.common.fileio import atomic_write_text
from moe_qlora.common.memory import release_freed_memory
from moe_qlora.model.adapters import expert_loras
from moe_qlora.model.distributed import Ranks
from moe_qlora.train.checkpoint import RunProgress
from moe_qlora.train.faults import local_stretch
from moe_qlora.train.optim import NormTerms, gradient_norm_terms, scale_to_norm, summed_norm
from moe_qlora.train.position import StepPosition


def apply_update(
    ranks: Ranks, optimizer, loss: float, train_cfg, position: StepPosition | None = None
) -> tuple[float, bool]:
    """Clip and take the optimizer step on the accumulated gradients unless the loss or the gradient is not
    finite; returns (pre-clip gradient norm, skipped). Gradients are cleared either way. The step is marked as
    the `optimizer` phase of `position`.

    What each rank does alone (its gradients' norm terms, then the clip and the step) runs as two local stretches,
    and the norm's sum over the ranks (fsdp, ep) between them, where every rank arrives: a rank that fails in
    either stretch meets the others at the stretch's own all_reduce, never at the norm's."""
    position = position or StepPosition()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    terms = local_stretch(ranks, measured_terms, params, position)
    norm = summed_norm(terms)  # measured before any clipping
    skipped = not (math.isfinite(loss) and math.isfinite(float(norm)))
    local_stretch(ranks, clip_and_step, optimizer, terms.parts, norm, train_cfg.max_grad_norm, skipped, position)
    return float(norm), skipped


def measured_terms(params, position: StepPosition) -> NormTerms:
    with position.within("gradient norm"):
        return gradient_norm_terms(params)


def clip_and_step(optimizer, parts: list, norm: torch.Tensor, max_norm: float, skipped: bool, position) -> None:
    """Scale the gradients (`parts`, this rank's) from their global `norm` to max_norm and step, unless `skipped`
    (checked before the step: a non-finite one reaches no weight and no AdamW moment); then clear them."""
    if not skipped:
        scale_to_norm(parts, norm, max_norm)
        with position.within("optimizer"):
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    release_freed_memory()


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
    from moe_qlora.export.router_check import ROUTER_LAYERS

    names = [name.removesuffix(".moe_lora") for name, _ in expert_loras(model)]
    atomic_write_text(out / ROUTER_LAYERS, json.dumps(names, indent=1))


def write_run_choices(out: Path, model, cfg, console, *, writer: bool = True) -> None:
    """run_choices.json: what the run chose that its config does not say: the attention it runs and why; and,
    said at the start, a length past the model's positions and the export formats that will refuse the adapter
    (refused here when the run is to write that format at its end: better now than after the training)."""
    from moe_qlora.config.sections import ConfigError
    from moe_qlora.export.exportability import export_refusals
    from moe_qlora.model.attention import position_limit_note

    seq_len = cfg.data.max_seq_len
    peft = getattr(model, "peft_config", {}).get("default")
    refusals = export_refusals(model, sorted(peft.target_modules or []) if peft else [], cfg.lora.rank)
    if asked := [f for f in cfg.output.export_formats if f in refusals]:  # on every rank, so that every rank stops
        raise ConfigError(f"output.export_formats: {asked[0]}, and {refusals[asked[0]]}")
    if not writer:
        return
    if note := position_limit_note(model.config, seq_len):
        console.print(f"note: {note}")
    for fmt, why in refusals.items():
        console.print(f"note: the adapter will not export with --format {fmt}: {why}", highlight=False, markup=False)
    attention = getattr(model, "attention_choice", None)
    if attention is None:  # a model not loaded by load_model (a test's stand-in)
        return
    atomic_write_text(
        out / "run_choices.json",
        json.dumps({"attention": attention.implementation, "attention_why": attention.why, "max_seq_len": seq_len}),
    )


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
