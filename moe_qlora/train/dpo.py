"""Preference training as a recipe (DpoRecipe): DPO and its variants on (prompt, chosen, rejected) pairs, the
reference policy scored once before the first step (reference.py), chosen and rejected in one forward.

One optimizer step sees `grad_accum` micro-batches of pairs; each adds its pairs' losses / P, with P the pairs of
the whole step (on every rank), plus nll_weight x its chosen tokens' NLL / C (C: the step's chosen tokens) and
router_aux_loss_coef x its auxiliary loss / M (M: the step's micro-batches), so the step's gradient is that of
the loss over all of its pairs at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
from moe_qlora.train.losses import aux_term, has_router_aux_loss
from moe_qlora.train.position import StepContext
from moe_qlora.train.preference_loss import PairLogps, pair_forward, pair_statistics, preference_losses
from moe_qlora.train.recipe import LossRecipe, TrainResult
from moe_qlora.train.reference import FIELDS, reference_fingerprint, reference_logps
from moe_qlora.train.resume import best_eval_so_far
from moe_qlora.train.steps import count_steps, is_idle, optimizer_steps
from moe_qlora.train.update import apply_update

STATISTICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
LOGPS = ("logps/chosen", "logps/rejected", "log_odds_ratio", "log_odds_chosen", "wpo_weight")


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
    return PairLogps(*(getattr(reference, k)[index].to(device) for k in FIELDS))


def micro_batch_loss(
    model,
    pairs: list[PreferencePair],
    reference: PairLogps | None,
    d: DpoSection,
    totals: StepTotals,
    ctx: StepContext,
    pad_id: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's share of the step's loss, and its sums of the logged statistics. An idle micro-batch (a
    sharded run's rank without pairs: steps.idle_item) runs its forward and backward for the collectives, its
    loss times 0 and its statistics none."""
    logps, aux = pair_forward(
        model,
        pairs,
        pad_id,
        chunk=ctx.train.loss_chunk_tokens,
        ld_alpha=d.ld_alpha,
        wpo=d.use_weighting,
        router_logits=has_router_aux_loss(model),
    )
    loss, stats = pair_batch_loss(logps, reference_of(reference, pairs, logps.chosen.device), d, totals)
    if all(is_idle(p) for p in pairs):
        return loss * 0.0, {}
    if aux is not None:
        stats["aux_loss"] = float(aux.detach()) / totals.micro_batches
    return loss + aux_term(aux, ctx.aux_coef / totals.micro_batches), stats


def pair_batch_loss(
    logps: PairLogps, reference: PairLogps | None, d: DpoSection, totals: StepTotals
) -> tuple[torch.Tensor, dict[str, float]]:
    """A micro-batch's share of the step's preference loss from its pairs' scores: its pairs' losses / P, plus
    nll_weight x its chosen tokens' NLL / C; and its sums of the logged statistics."""
    terms = preference_losses(logps, reference, d)
    loss = terms.losses.sum() / totals.pairs
    stats = {"preference_loss": float(terms.losses.detach().sum()) / totals.pairs, **pair_statistics(terms, logps)}
    if d.nll_weight:
        nll = -logps.chosen_plain.sum() / totals.chosen_tokens
        loss = loss + d.nll_weight * nll
        stats["nll_loss"] = float(nll.detach())
    stats["loss"] = float(loss.detach())  # as eval_loss: without the auxiliary term, as in train and grpo
    return loss, stats


def statistic_names(model, d: DpoSection) -> tuple[str, ...]:
    """What a micro-batch sums, the same on every rank (a rank left without pairs sums zeros under these keys)."""
    optional = {
        "nll_loss": bool(d.nll_weight),
        "aux_loss": has_router_aux_loss(model),
        "log_odds_ratio": d.reference_free == "orpo",
        "log_odds_chosen": d.reference_free == "orpo",
        "wpo_weight": d.use_weighting,
    }
    return (
        "loss",
        "preference_loss",
        *STATISTICS,
        "logps/chosen",
        "logps/rejected",
        *(k for k, v in optional.items() if v),
    )


def backward_over(model, groups, reference, d: DpoSection, totals: StepTotals, ctx: StepContext, pad_id: int) -> dict:
    """Forward and backward of each micro-batch of pairs; the summed statistics. Under torch.no_grad (the eval)
    the loss has no graph, and only the forward runs."""
    sums = dict.fromkeys(statistic_names(model, d), 0.0)
    for pairs in groups:
        with ctx.position.within("forward"):
            loss, stats = micro_batch_loss(model, pairs, reference, d, totals, ctx, pad_id)
        if loss.requires_grad:
            with ctx.position.within("backward"):
                loss.backward()
        for k, v in stats.items():
            sums[k] += v
    return sums


def dpo_step(
    model, optimizer, group: list[list[PreferencePair]], reference, d: DpoSection, pad_id: int, ctx: StepContext
) -> dict:
    """One optimizer step over the micro-batches of pairs in `group` (this rank's); its metrics: the loss, TRL's
    rewards and log-probabilities as means over the step's pairs, the gradient norm."""
    ranks, groups = ctx.ranks, [mb for mb in group if mb]
    local = [p for mb in groups for p in mb if not is_idle(p)]
    trained = [mb for mb in groups if not all(is_idle(p) for p in mb)]
    pairs, chosen, batches, tokens = map(
        int,
        sum_scalars(
            ranks,
            len(local),
            sum(chosen_targets(p) for p in local),
            len(trained),
            sum(len(p.chosen.input_ids) + len(p.rejected.input_ids) for p in local),
        ),
    )
    totals = StepTotals(pairs, max(chosen, 1), max(batches, 1))
    if ranks.sharded:  # collectives inside the forward and backward: a rank that fails there cannot meet the others
        sums = backward_over(model, groups, reference, d, totals, ctx, pad_id)
    else:
        sums = local_stretch(ranks, backward_over, model, groups, reference, d, totals, ctx, pad_id)
    sums = dict(zip(sums, sum_scalars(ranks, *sums.values()), strict=True))
    sum_gradients(ranks, [p for p in model.parameters() if p.requires_grad])
    grad_norm, skipped = apply_update(ranks, optimizer, sums["loss"], ctx.train, ctx.position)
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
    groups = [pairs[start : start + size] for start in range(0, len(pairs), size)]
    try:
        sums = backward_over(model, groups, reference, d, totals, quiet, pad_id)
    finally:
        model.train(was_training)
    record = {"eval_loss": sums["loss"]}
    record.update({f"eval_{k}": sums[k] / len(pairs) for k in (*STATISTICS, *LOGPS) if k in sums})
    return record


class DpoRecipe(LossRecipe):
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
        self.reference, self.reference_key = None, None
        if cfg.dpo.uses_reference:
            every = sorted(self.pairs + self.held_out, key=lambda p: p.index)
            self.reference_key = reference_fingerprint(cfg, self.model_path, every)
            pad_id = self.tokenizer.pad_token_id
            self.reference = reference_logps(
                self.model, every, self.reference_key, cfg, pad_id, self.ranks, self.console
            )

    def count_steps(self) -> int:
        return count_steps(len(self.pairs), self.cfg, self.ranks.world)

    def data_identity(self) -> dict:
        records = (
            [p.source, p.chosen.input_ids, p.chosen.labels, p.rejected.input_ids, p.rejected.labels] for p in self.pairs
        )
        # A checkpoint goes on only against the reference it was trained against (--resume-anyway otherwise).
        return {"dataset_fingerprint": fingerprint(records), "reference": self.reference_key, "world": self.ranks.world}

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

    def evaluate(self) -> dict:
        pad_id = self.tokenizer.pad_token_id
        fields = evaluate_pairs(self.model, self.held_out, self.reference, self.cfg.dpo, pad_id, self.context)
        return {**fields, **self.keep_if_best(fields["eval_loss"])}

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


def dpo(
    cfg: RunConfig, console: Console | None = None, *, allow_mismatch: bool = False, overwrite: bool = False
) -> TrainResult:
    """Run preference training as configured (cfg.dpo). Under torchrun each process is a data-parallel rank;
    rank 0 writes, and holds output.dir's lock for the run."""
    return DpoRecipe(cfg, console, allow_mismatch=allow_mismatch, overwrite=overwrite).run()
