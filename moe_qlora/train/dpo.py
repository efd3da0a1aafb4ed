"""Preference training as a recipe (DpoRecipe): DPO and its variants on (prompt, chosen, rejected) pairs, the
reference policy scored once before the first step (reference.py), chosen and rejected in one forward.

One optimizer step sees `grad_accum` micro-batches of pairs; each adds its pairs' losses / P, with P the pairs of
the whole step (on every rank), plus sft_weight x its chosen tokens' NLL / C (C: the step's chosen tokens) and
router_aux_loss_coef x its auxiliary loss / M (M: the step's micro-batches), so the step's gradient is that of
the loss over all of its pairs at once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from moe_qlora.config.preference import DpoSection
from moe_qlora.config.sections import RunConfig
from moe_qlora.data.examples import IGNORE, eval_split
from moe_qlora.data.preference import PreferencePair, build_pairs
from moe_qlora.model.build import load_tokenizer
from moe_qlora.model.distributed import sum_gradients, sum_scalars
from moe_qlora.train.checkpoint import fingerprint
from moe_qlora.train.faults import local_stretch
from moe_qlora.train.losses import has_router_aux_loss
from moe_qlora.train.position import StepContext
from moe_qlora.train.preference_loss import PairLogps, pair_forward, pair_statistics, preference_losses
from moe_qlora.train.recipe import Recipe
from moe_qlora.train.reference import reference_logps
from moe_qlora.train.resume import best_eval_so_far
from moe_qlora.train.runs import RunSummary
from moe_qlora.train.steps import count_steps, optimizer_steps
from moe_qlora.train.update import apply_update, router_load

STATISTICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
LOGPS = ("logps/chosen", "logps/rejected", "log_odds_ratio", "log_odds_chosen")


@dataclass
class DpoResult:
    steps: int
    losses: list[float]
    adapter_dir: Path
    metrics_path: Path


@dataclass(frozen=True)
class StepTotals:
    """A step's normalisers over every rank: its pairs, its chosen completion tokens, its micro-batches."""

    pairs: int
    chosen_tokens: int
    micro_batches: int


def chosen_targets(pair: PreferencePair) -> int:
    return sum(t != IGNORE for t in pair.chosen.labels[1:])


def reference_of(reference: PairLogps | None, pairs: list[PreferencePair], device) -> PairLogps | None:
    """The reference scores of `pairs`, by their index."""
    if reference is None:
        return None
    index = torch.tensor([p.index for p in pairs])
    return PairLogps(
        *(getattr(reference, k)[index].to(device) for k in ("chosen", "rejected", "chosen_tokens", "rejected_tokens"))
    )


def micro_batch_loss(
    model,
    pairs: list[PreferencePair],
    reference: PairLogps | None,
    d: DpoSection,
    totals: StepTotals,
    ctx: StepContext,
    pad_id: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's share of the step's loss, and its sums of the logged statistics."""
    logps, aux = pair_forward(
        model, pairs, pad_id, chunk=ctx.train.loss_chunk_tokens, router_logits=has_router_aux_loss(model)
    )
    terms = preference_losses(logps, reference_of(reference, pairs, logps.chosen.device), d)
    loss = terms.losses.sum() / totals.pairs
    stats = {"preference_loss": float(terms.losses.detach().sum()) / totals.pairs, **pair_statistics(terms, logps)}
    if d.sft_weight:
        nll = -logps.chosen.sum() / totals.chosen_tokens
        loss = loss + d.sft_weight * nll
        stats["nll_loss"] = float(nll.detach())
    if aux is not None:
        stats["aux_loss"] = float(aux.detach()) / totals.micro_batches
        if ctx.aux_coef:
            loss = loss + ctx.aux_coef / totals.micro_batches * aux
    stats["loss"] = float(loss.detach())
    return loss, stats


def backward_over(model, groups, reference, d: DpoSection, totals: StepTotals, ctx: StepContext, pad_id: int) -> dict:
    """Forward and backward of each micro-batch of pairs; the summed statistics."""
    sums: dict[str, float] = {}
    for pairs in groups:
        with ctx.position.within("forward"):
            loss, stats = micro_batch_loss(model, pairs, reference, d, totals, ctx, pad_id)
        with ctx.position.within("backward"):
            loss.backward()
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + v
    return sums


def dpo_step(
    model, optimizer, group: list[list[PreferencePair]], reference, d: DpoSection, pad_id: int, ctx: StepContext
) -> dict:
    """One optimizer step over the micro-batches of pairs in `group` (this rank's); its metrics: the loss, TRL's
    rewards and log-probabilities as means over the step's pairs, the gradient norm."""
    ranks, groups = ctx.ranks, [mb for mb in group if mb]
    local = [p for mb in groups for p in mb]
    pairs, chosen, batches, tokens = map(
        int,
        sum_scalars(
            ranks,
            len(local),
            sum(chosen_targets(p) for p in local),
            len(groups),
            sum(len(p.chosen.input_ids) + len(p.rejected.input_ids) for p in local),
        ),
    )
    totals = StepTotals(pairs, max(chosen, 1), batches)
    sums = local_stretch(ranks, backward_over, model, groups, reference, d, totals, ctx, pad_id)
    names = sorted(sums)
    sums = dict(zip(names, sum_scalars(ranks, *(sums[k] for k in names)), strict=True)) if ranks.enabled else sums
    sum_gradients(ranks, [p for p in model.parameters() if p.requires_grad])
    grad_norm, skipped = local_stretch(ranks, apply_update, optimizer, sums["loss"], ctx.train, ctx.position)
    means = {k: sums[k] / pairs for k in (*STATISTICS, *LOGPS) if k in sums}
    extra = {k: sums[k] for k in ("nll_loss", "aux_loss", "preference_loss") if k in sums}
    return {
        "loss": sums["loss"],
        **means,
        **extra,
        "grad_norm": grad_norm,
        "skipped": skipped,
        "pairs": pairs,
        "tokens": tokens,
    }


@torch.no_grad()
def evaluate_pairs(model, pairs: list[PreferencePair], reference, d: DpoSection, pad_id: int, ctx: StepContext) -> dict:
    """The held-out pairs' loss and TRL's statistics (eval_ prefixed), in eval mode (no dropout, the run's RNG
    untouched), without gradients and without the auxiliary loss."""
    was_training = model.training
    model.eval()
    quiet = StepContext(ctx.train, ctx.ranks, ctx.position, aux_coef=0.0)
    totals = StepTotals(len(pairs), max(sum(chosen_targets(p) for p in pairs), 1), 1)
    size = ctx.train.micro_batch_size
    sums: dict[str, float] = {}
    try:
        for start in range(0, len(pairs), size):
            _, stats = micro_batch_loss(model, pairs[start : start + size], reference, d, totals, quiet, pad_id)
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v
    finally:
        model.train(was_training)
    record = {"eval_loss": sums["loss"]}
    record.update({f"eval_{k}": sums[k] / len(pairs) for k in (*STATISTICS, *LOGPS) if k in sums})
    return record


class DpoRecipe(Recipe):
    """`moe-qlora dpo`: preference pairs, `train.grad_accum` micro-batches of pairs per optimizer step, the
    reference scored before the first step (not for simpo and orpo), an eval split with TRL's metrics."""

    command = "dpo"

    def load(self) -> None:
        cfg = self.cfg
        self.model_path, self.tokenizer = load_tokenizer(cfg.model)
        self.pairs, stats = build_pairs(cfg.data, self.tokenizer)
        self.console.print(
            f"data: {stats.rows} rows -> {len(self.pairs)} preference pairs, {stats.target_tokens} completion "
            f"tokens; truncated {stats.truncated}, dropped {stats.dropped_overlength} over max_seq_len and "
            f"{stats.dropped_no_target} with no completion token left; formats {stats.formats}"
        )
        self.held_out = []
        if cfg.data.eval_files:
            self.held_out, _ = build_pairs(cfg.data, self.tokenizer, cfg.data.eval_files, start=len(self.pairs))
        self.load_model()

    def prepare_data(self) -> None:
        """The held-out split, then the reference's scores of every pair: before a checkpoint is restored, so
        the model is still the step-0 policy."""
        cfg = self.cfg
        if not cfg.data.eval_files:
            self.pairs, self.held_out = eval_split(self.pairs, cfg.data.eval_fraction, seed=cfg.train.seed)
        if self.held_out:
            self.console.print(f"eval: {len(self.held_out)} preference pairs held out")
        self.reference = None
        if cfg.dpo.uses_reference:
            every = sorted(self.pairs + self.held_out, key=lambda p: p.index)
            self.reference = reference_logps(
                self.model, every, cfg, self.model_path, self.tokenizer.pad_token_id, self.ranks, self.console
            )

    def count_steps(self) -> int:
        return count_steps(len(self.pairs), self.cfg, self.ranks.world)

    def data_identity(self) -> dict:
        records = (
            [p.source, p.chosen.input_ids, p.chosen.labels, p.rejected.input_ids, p.rejected.labels] for p in self.pairs
        )
        return {"dataset_fingerprint": fingerprint(records), "world": self.ranks.world}

    def after_resume(self) -> None:
        self.continue_data_parallel(len(self.pairs))
        self.best_eval = best_eval_so_far(self.out / "metrics.jsonl") if self.held_out else math.inf

    def batches(self):
        return optimizer_steps(self.pairs, self.cfg, self.ranks)

    def step(self, number: int, epoch: int, batch) -> dict:
        lr = self.optimizer.param_groups[0]["lr"]
        record = dpo_step(
            self.model, self.optimizer, batch, self.reference, self.cfg.dpo, self.tokenizer.pad_token_id, self.context
        )
        return {**record, "step": number, "epoch": epoch, "lr": lr}

    def complete(self, record: dict, batch, seconds: float) -> None:
        record.update(
            step_time_s=seconds,
            tokens_per_s=record["tokens"] / seconds,
            elapsed_s=time.perf_counter() - self.started,
            router_load=router_load(self.model),
        )
        number, every = record["step"], self.cfg.train.eval_every
        if self.held_out and (number == self.total or (every and number % every == 0)):
            fields = evaluate_pairs(
                self.model, self.held_out, self.reference, self.cfg.dpo, self.tokenizer.pad_token_id, self.context
            )
            record.update(fields, **self.keep_if_best(fields["eval_loss"]))

    def sources(self, record: dict, batch) -> list[str]:
        return [p.source for mb in batch for p in mb]

    def logged(self, record: dict, number: int) -> bool:
        every = record["skipped"] or "eval_loss" in record or number % self.cfg.train.log_every == 0
        return every or number == self.total

    def after_update(self, record: dict) -> None:
        if not record["skipped"]:
            self.scheduler.step()
        self.history.append(record["loss"])
        self.tokens += record["tokens"]

    def progress_info(self, record: dict) -> dict[str, str]:
        info = {
            "loss": f"{record['loss']:.4f}",
            "acc": f"{record['rewards/accuracies']:.2f}",
            "margin": f"{record['rewards/margins']:.3f}",
            "lr": f"{record['lr']:.2e}",
        }
        if "eval_loss" in record:
            info["eval acc"] = f"{record['eval_rewards/accuracies']:.2f}"
        return info

    def result(self, adapter_dir: Path, seconds: float) -> DpoResult:
        losses = self.history
        finite = [x for x in losses if math.isfinite(x)]
        last, best = (finite[-1], min(finite)) if finite else (None, None)
        metrics = self.out / "metrics.jsonl"
        RunSummary("dpo", len(losses), seconds, self.tokens, last, best, adapter_dir, metrics).print(self.console)
        return DpoResult(steps=len(losses), losses=losses, adapter_dir=adapter_dir, metrics_path=metrics)


def dpo(
    cfg: RunConfig, console: Console | None = None, *, allow_mismatch: bool = False, overwrite: bool = False
) -> DpoResult:
    """Run preference training as configured (cfg.dpo). Under torchrun each process is a data-parallel rank;
    rank 0 writes, and holds output.dir's lock for the run."""
    return DpoRecipe(cfg, console, allow_mismatch=allow_mismatch, overwrite=overwrite).run()
