"""GRPO in one process on the 4-bit model: sample G completions per prompt, score them, train on the
group-relative advantages with the clipped-ratio policy gradient and an optional KL to the base model.

Per completion token t of completion i (A_i its advantage, rho = exp(logp - logp_old)):
    L_t = -min(rho A_i, clip(rho, 1 - eps, 1 + eps_high) A_i) + beta * KL_t,
    KL_t = exp(ref - logp) - (ref - logp) - 1      (k3 estimator, >= 0; ref: adapters disabled)
With one pass per batch logp_old is logp itself (detached): rho = 1 and the gradient is A_i grad logp,
the plain policy gradient. The reference policy is the same model with the adapters off: never a copy.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from moe_qlora.common.reporting import MetricsLog
from moe_qlora.config.sections import DataSection, RunConfig
from moe_qlora.data.examples import IGNORE, Example, collate, epoch_order
from moe_qlora.model.adapters import adapters_disabled
from moe_qlora.model.build import load_tokenizer
from moe_qlora.model.distributed import gather_objects, sum_gradients, sum_scalars
from moe_qlora.train.faults import local_stretch, run_as_is
from moe_qlora.train.grpo_loss import (
    MicroBatchTerms,
    Objective,
    entropy_weights,
    grpo_token_loss,
    token_weights,
    top_entropy_mask,
)
from moe_qlora.train.losses import aux_term, completion_logprobs, has_router_aux_loss, token_logprobs
from moe_qlora.train.position import StepContext
from moe_qlora.train.recipe import Recipe
from moe_qlora.train.rewards import rollout_advantages
from moe_qlora.train.rollout import Rollout, RolloutSource
from moe_qlora.train.rollout_metrics import rollout_metrics, whole_batch, write_rollouts
from moe_qlora.train.runs import RunSummary
from moe_qlora.train.update import apply_update, router_load


@dataclass
class GrpoResult:
    steps: int
    reward_means: list[float]
    adapter_dir: Path
    metrics_path: Path
    rollouts_path: Path


# ------------------------------------------------------------------------------------------ one step


def rollout_examples(
    rollouts: list[Rollout], advantages: torch.Tensor, *, mask_truncated: bool = False
) -> list[Example]:
    """prompt + completion as a training sequence, labels only on the completion, weight = advantage. With
    `mask_truncated`, a completion cut by max_new_tokens keeps no labels: it adds nothing to the loss nor to
    the token counts (TRL's mask_truncated_completions)."""
    examples = []
    for r, a in zip(rollouts, advantages.tolist(), strict=True):
        masked = mask_truncated and r.truncated
        labels = [IGNORE] * len(r.prompt.ids) + ([IGNORE] * len(r.completion_ids) if masked else r.completion_ids)
        examples.append(Example(r.prompt.ids + r.completion_ids, labels, r.prompt.source, 0.0 if masked else float(a)))
    return examples


def has_targets(example: Example) -> bool:
    return any(t != IGNORE for t in example.labels)


def split_matters(g) -> bool:
    """Does the result depend on how the rollout batch is split into micro-batches? bnpo divides by each
    micro-batch's tokens, the entropy quantile is taken per micro-batch and the bonus of the per-completion
    loss types averages per micro-batch, as in TRL."""
    return g.loss_type == "bnpo" or g.top_entropy_quantile < 1 or bool(g.entropy_coef)


def rows_to_run(examples: list[Example], loss_type: str, kl_coef: float, *, whole_split: bool = False) -> list[int]:
    """The rollout rows the policy update runs, in order. Where the split matters (bnpo, the entropy quantile
    or bonus: `whole_split`, split_matters), every row keeps its place in the split, as in TRL, rows without
    targets (masked truncated completions) and with advantage 0 included: dropping them would move later rows
    up and shrink the count (bnpo: 3 micro-batches of 3 where TRL has 4, a gradient 4/3 of TRL's). Otherwise no
    normaliser depends on the split, so rows whose loss and gradient are exactly zero are left out: no
    targets, or advantage 0 without a KL term."""
    if whole_split or loss_type == "bnpo":
        return list(range(len(examples)))
    return [i for i, e in enumerate(examples) if (e.weight != 0 or kl_coef) and has_targets(e)]


def micro_batch_indices(active: list[int], size: int) -> list[list[int]]:
    return [active[i : i + size] for i in range(0, len(active), size)]


@torch.no_grad()
def frozen_logprobs(model, batches, temperature: float, *, reference: bool, chunk: int = 0) -> list[torch.Tensor]:
    """Per micro-batch log-probs of the sampling policy (adapters on) or the reference (adapters off)."""
    was_training = model.training
    model.eval()
    try:
        if reference:
            with adapters_disabled(model):
                return [completion_logprobs(model, b, temperature, chunk=chunk)[0] for b in batches]
        return [completion_logprobs(model, b, temperature, chunk=chunk)[0] for b in batches]
    finally:
        model.train(was_training)


def policy_update(model, optimizer, schedule, examples: list[Example], g, pad_id: int, ctx: StepContext) -> dict:
    """`grpo.passes` optimizer steps on one rollout batch (`g`: the grpo section); returns the step's training
    metrics.

    Sequences with advantage 0 are not run when there is no KL term (and the loss type does not normalise per
    micro-batch): their loss and gradient are exactly zero, and the normalisation still counts them, so
    leaving them out changes nothing. Data parallel: `examples` are this rank's; the loss normalisers (tokens,
    sequences, micro-batches) are those of the whole batch, and the gradients and statistics are summed over
    ranks before each update, so every rank takes the one-process step.
    """
    device, ranks = next(model.parameters()).device, ctx.ranks
    active = rows_to_run(examples, g.loss_type, g.kl_coef, whole_split=split_matters(g))
    groups = micro_batch_indices(active, ctx.train.micro_batch_size)
    batches = [{k: v.to(device) for k, v in collate([examples[i] for i in idx], pad_id).items()} for idx in groups]
    local_tokens = sum(sum(t != IGNORE for t in e.labels[1:]) for e in examples)
    total_tokens, total_sequences, total_batches, trained = map(
        int,
        sum_scalars(ranks, local_tokens, len(examples), len(batches), sum(has_targets(examples[i]) for i in active)),
    )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if ranks.sharded:  # every rank joins each forward: as many micro-batches on each, the extra ones idle
        most = max(gather_objects(ranks, [len(batches)]))
        batches += [idle_batch(examples, pad_id, device)] * (most - len(batches))
    stretch = run_as_is if ranks.sharded else local_stretch  # collectives inside: no rank may stop alone
    frozen = stretch(ranks, frozen_policies, model, batches, g, ctx.train.loss_chunk_tokens)
    totals = BatchTotals(max(total_tokens, 1), total_sequences, total_batches)
    record = {"sequences_trained": trained, "passes": 0, "skipped": False, "loss": 0.0, "grad_norm": 0.0}
    for _ in range(g.passes):
        sums = stretch(ranks, backward_pass, model, batches, frozen, g, totals, ctx)
        sums = dict(zip(sums, sum_scalars(ranks, *sums.values()), strict=True))
        if "entropy_sum" in sums:
            sums["entropy"] = sums.pop("entropy_sum") / max(total_tokens, 1)
        sum_gradients(ranks, params)
        grad_norm, skipped = apply_update(ranks, optimizer, sums["loss"], ctx.train, ctx.position)
        record.update({k: v for k, v in sums.items()}, grad_norm=grad_norm, skipped=skipped)
        if skipped:
            break
        record["passes"] += 1
        schedule.step()
    return record


IDLE_KEY = "idle"  # marks an idle micro-batch: its router auxiliary loss is not trained on either


def idle_batch(examples: list[Example], pad_id: int, device) -> dict:
    """A micro-batch that trains nothing (no target, weight 0) for a sharded run's rank with fewer micro-batches
    than another: its forward and backward join the others' collectives and add exactly 0."""
    ids = examples[0].input_ids if examples else [pad_id, pad_id]
    idle = Example(ids, [IGNORE] * len(ids), "idle", 0.0)
    return {**{k: v.to(device) for k, v in collate([idle], pad_id).items()}, IDLE_KEY: True}


def backward_pass(model, batches: list[dict], frozen: tuple, g, totals: BatchTotals, ctx: StepContext) -> dict:
    """Forward and backward of every micro-batch against the whole batch's normalisers (`totals`); the summed
    statistics. frozen: per micro-batch log-probs of the sampling policy and of the reference (frozen_policies)."""
    objective, entropy = Objective.of(g), g.top_entropy_quantile < 1 or bool(g.entropy_coef)
    chunk, position = ctx.train.loss_chunk_tokens, ctx.position
    router_logits = has_router_aux_loss(model)
    kept = ("loss", "clip_fraction", *(("kl",) if g.kl_coef else ()), *(("aux_loss",) if router_logits else ()))
    sums = dict.fromkeys(kept, 0.0)  # a rank with no rows: zeros, under the same keys as the others'
    for batch, old_lp, ref_lp in zip(batches, *frozen, strict=True):
        with position.within("forward"):
            logp, mask, out = token_logprobs(
                model,
                batch,
                scale=1.0 / g.temperature,
                chunk=chunk,
                entropy=entropy,
                **({"output_router_logits": True} if router_logits else {}),
            )
        entropies, aux = getattr(out, "token_entropy", None), getattr(out, "aux_loss", None)
        loss, stats = micro_batch_loss(
            (logp, mask, entropies), (old_lp, ref_lp), batch["weights"], g, objective, totals
        )
        if batch.get(IDLE_KEY):
            aux = None  # its loss is 0 (no target); the router's auxiliary loss must add nothing either
        if aux is not None:  # the mean over the batch's micro-batches, times train.router_aux_loss_coef
            stats["aux_loss"] = float(aux.detach()) / totals.micro_batches
        loss = loss + aux_term(aux, ctx.aux_coef / totals.micro_batches)
        with position.within("backward"):
            loss.backward()
        for k, v in stats.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    return sums


@dataclass(frozen=True)
class BatchTotals:
    """The whole rollout batch's loss normalisers, over every rank: target tokens, sequences, micro-batches."""

    tokens: int
    sequences: int
    micro_batches: int


def micro_batch_loss(
    current: tuple, frozen: tuple, advantages: torch.Tensor, g, objective: Objective, totals: BatchTotals
) -> tuple[torch.Tensor, dict]:
    """One micro-batch's share of the rollout batch's GRPO loss, with its statistics. current: (logp, mask,
    entropies), each (B, T) (entropies None unless the quantile or the bonus needs them); frozen: (the sampling
    policy's, the reference's) log-probs, (B, T) or None; advantages: (B,)."""
    (logp, mask, entropies), (old_lp, ref_lp) = current, frozen
    weights = token_weights(
        mask,
        g.loss_type,
        total_tokens=totals.tokens,
        total_sequences=totals.sequences,
        max_new_tokens=g.max_new_tokens,
        micro_batches=totals.micro_batches,
    )
    keep = top_entropy_mask(entropies, mask, g.top_entropy_quantile) if g.top_entropy_quantile < 1 else None
    bonus = None
    if g.entropy_coef:
        covered = mask if keep is None else keep
        bonus = entropy_weights(covered, micro_batches=totals.micro_batches)
    terms = MicroBatchTerms(logp, old_lp, ref_lp, advantages, weights, keep, entropies, bonus)
    return grpo_token_loss(terms, objective)


def frozen_policies(model, batches, g, chunk: int) -> tuple[list, list]:
    """Per micro-batch log-probs of the sampling policy (when several passes clip against it) and of the
    reference (when there is a KL term); Nones otherwise."""
    none = [None] * len(batches)
    old = frozen_logprobs(model, batches, g.temperature, reference=False, chunk=chunk) if g.passes > 1 else none
    ref = frozen_logprobs(model, batches, g.temperature, reference=True, chunk=chunk) if g.kl_coef else none
    return old, ref


# ------------------------------------------------------------------------------------------ the loop


def batch_prompts(items: list, cfg: RunConfig):
    """Yield (epoch, items of one rollout batch) in each epoch's seeded order."""
    per_step = cfg.grpo.prompts_per_step
    for epoch in range(cfg.train.epochs):
        order = epoch_order(len(items), seed=cfg.train.seed, epoch=epoch)
        for i in range(0, len(order), per_step):
            yield epoch, [items[j] for j in order[i : i + per_step]]


def count_grpo_steps(num_items: int, cfg: RunConfig) -> int:
    total = math.ceil(num_items / cfg.grpo.prompts_per_step) * cfg.train.epochs
    return min(total, cfg.train.max_steps) if cfg.train.max_steps else total


def grpo_step(
    source: RolloutSource, batch: list, training: dict, rollout_log: MetricsLog | None, ctx: StepContext
) -> dict:
    """Collect and score one batch of rollouts, update the policy on their advantages; the step's metrics.
    Data parallel: each rank collects and trains on its share of the prompts, with its groups' advantages;
    the scored rollouts are then gathered, so the metrics (and rank 0's rollouts.jsonl) are the whole batch's."""
    cfg, model, ranks, step = source.cfg, training["model"], ctx.ranks, ctx.position.step
    pad_id = source.tokenizer.pad_token_id
    t0 = time.perf_counter()
    lr = training["optimizer"].param_groups[0]["lr"]
    stretch = run_as_is if ranks.sharded else local_stretch  # sampling's forwards hold collectives there
    rollouts, rewards, per_fn, group_sizes = stretch(ranks, source.collect_share, model, batch, ranks, ctx.position)
    t_gen = time.perf_counter() - t0
    weights = {f.name: f.weight for f in getattr(source, "functions", [])}  # offline: totals only
    advantages = rollout_advantages(rewards, per_fn, group_sizes, cfg.grpo, weights, ranks)
    examples = rollout_examples(rollouts, advantages, mask_truncated=cfg.grpo.mask_truncated_completions)
    record = policy_update(model, training["optimizer"], training["scheduler"], examples, cfg.grpo, pad_id, ctx)
    if ranks.enabled:
        rollouts, rewards, per_fn, group_sizes, advantages = whole_batch(
            gather_objects(ranks, [(rollouts, rewards, per_fn, group_sizes, advantages.tolist())])
        )
    if rollout_log is not None:
        write_rollouts(rollout_log, step, rollouts, rewards, per_fn, advantages)
    if source.reward_errors:
        record["reward_errors"] = source.reward_errors
    record.update(rollout_metrics(rollouts, rewards, per_fn, advantages, group_sizes))
    record.update(
        rollout_tokens_per_s=rollout_speed(record["completion_tokens_total"], source.sampling_s),
        step=step,
        lr=lr,
        generation_s=t_gen,
        training_s=time.perf_counter() - t0 - t_gen,
        router_load=router_load(model),
        sources=sorted({r.prompt.source for r in rollouts}),
    )
    return record


def rollout_speed(tokens: int, sampling_s: float) -> float:
    """Completion tokens sampled per second: the whole batch's tokens over this rank's time in generate (ranks
    sample their shares at once); 0 for offline rollouts, which sample nothing."""
    return tokens / sampling_s if sampling_s > 0 else 0.0


class GrpoRecipe(Recipe):
    """GRPO (online sampling, or offline scored completions): one step is one rollout batch, `grpo.passes`
    optimizer updates on it. Data parallel: the prompts of a step are split across the ranks by whole groups."""

    command = "grpo"
    logs = ("metrics.jsonl", "rollouts.jsonl")
    spikes = False

    def load(self) -> None:
        for note in self.cfg.grpo.advice():
            self.console.print(f"[yellow]note:[/] {note}")
        self.model_path, self.tokenizer = load_tokenizer(self.cfg.model)
        self.source = RolloutSource(self.cfg, self.tokenizer, self.console)
        self.load_model()

    def count_steps(self) -> int:
        return count_grpo_steps(len(self.source.items), self.cfg)

    def updates_per_step(self) -> int:
        return self.cfg.grpo.passes

    def data_identity(self) -> dict:
        return {"dataset_fingerprint": self.source.identity}

    def after_resume(self) -> None:
        if self.ranks.enabled:
            self.console.print(
                f"data parallel ({self.ranks.layout}): {self.ranks.world} ranks share each step's "
                f"{self.cfg.grpo.prompts_per_step} prompts by whole groups"
            )

    def open_logs(self):
        metrics = super().open_logs()
        self.rollout_log = MetricsLog(self.out / "rollouts.jsonl") if self.ranks.main else None
        return metrics

    def batches(self):
        return batch_prompts(self.source.items, self.cfg)

    def step(self, number: int, epoch: int, batch) -> dict:
        record = grpo_step(self.source, batch, self.training, self.rollout_log, self.context)
        record["epoch"] = epoch
        return record

    def sources(self, record: dict, batch) -> list[str]:
        return record.pop("sources")

    def after_update(self, record: dict) -> None:
        self.history.append(record["reward_mean"])
        self.tokens += record["completion_tokens_total"]

    def progress_info(self, record: dict) -> dict[str, str]:
        return {
            "reward": f"{record['reward_mean']:.3f}",
            "kl": f"{record.get('kl', 0):.4f}",
            "gen": f"{record['generation_s']:.1f}s",
            "tok/s": f"{record['rollout_tokens_per_s']:,.0f}",
            "train": f"{record['training_s']:.1f}s",
        }

    def cleanup(self) -> None:
        super().cleanup()
        if self.rollout_log is not None:
            self.rollout_log.close()

    def prompt_data(self) -> DataSection:
        """Its prompt rows, or its scored completions (offline)."""
        offline = self.cfg.grpo.offline_file
        return self.cfg.data.model_copy(update={"train_files": [offline]}) if offline else self.cfg.data

    def result(self, adapter_dir: Path, seconds: float) -> GrpoResult:
        means, metrics = self.history, self.out / "metrics.jsonl"
        last, best = (means[-1], max(means)) if means else (None, None)
        RunSummary("grpo", len(means), seconds, self.tokens, last, best, adapter_dir, metrics).print(self.console)
        self.console.print(f"rollouts: {self.out / 'rollouts.jsonl'}", highlight=False)
        return GrpoResult(len(means), means, adapter_dir, metrics, self.out / "rollouts.jsonl")


def grpo(
    cfg: RunConfig, console: Console | None = None, *, allow_mismatch: bool = False, overwrite: bool = False
) -> GrpoResult:
    """Run GRPO as configured (online sampling, or offline scored completions). Under torchrun each process is
    a data-parallel rank: the prompts of a step are split across the ranks by whole groups; rank 0 writes, and
    holds output.dir's lock for the run (RunDirLocked while another process holds it)."""
    return GrpoRecipe(cfg, console, allow_mismatch=allow_mismatch, overwrite=overwrite).run()
