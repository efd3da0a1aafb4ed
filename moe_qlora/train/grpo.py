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
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from moe_qlora.common.reporting import MetricsLog, NoReporters, Reporters
from moe_qlora.config.sections import ConfigError, RunConfig
from moe_qlora.data.examples import IGNORE, Example, collate, epoch_order
from moe_qlora.model.adapters import adapters_disabled
from moe_qlora.model.distributed import (
    SINGLE,
    Ranks,
    any_rank,
    gather_objects,
    raise_together,
    sum_gradients,
    sum_scalars,
)
from moe_qlora.train.checkpoint import RunProgress, config_identity, save_checkpoint
from moe_qlora.train.faults import FaultStop, attempt, local_stretch
from moe_qlora.train.losses import (
    PolicyTerm,
    completion_logprobs,
    completion_logprobs_and_entropy,
    entropy_weights,
    grpo_token_loss,
    token_weights,
    top_entropy_mask,
)
from moe_qlora.train.optim import build_optimizer
from moe_qlora.train.position import phase, start_step
from moe_qlora.train.prompt_format import write_prompt_format
from moe_qlora.train.rewards import flat_groups, group_advantages, nan_std, normalized_then_summed, whitened
from moe_qlora.train.rollout import Rollout, RolloutSource
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
    seed_everything,
    stop_if_asked,
    write_adapter,
    write_router_layers,
)


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


def policy_update(
    model, optimizer, schedule, examples: list[Example], cfg: RunConfig, pad_id: int, ranks: Ranks = SINGLE
) -> dict:
    """`grpo.passes` optimizer steps on one rollout batch; returns the step's training metrics.

    Sequences with advantage 0 are not run when there is no KL term (and the loss type does not normalise per
    micro-batch): their loss and gradient are exactly zero, and the normalisation still counts them, so
    leaving them out changes nothing. Data parallel: `examples` are this rank's; the loss normalisers (tokens,
    sequences, micro-batches) are those of the whole batch, and the gradients and statistics are summed over
    ranks before each update, so every rank takes the one-process step.
    """
    g, device = cfg.grpo, next(model.parameters()).device
    active = rows_to_run(examples, g.loss_type, g.kl_coef, whole_split=split_matters(g))
    groups = micro_batch_indices(active, cfg.train.micro_batch_size)
    batches = [{k: v.to(device) for k, v in collate([examples[i] for i in idx], pad_id).items()} for idx in groups]
    local_tokens = sum(sum(t != IGNORE for t in e.labels[1:]) for e in examples)
    total_tokens, total_sequences, total_batches, trained = map(
        int,
        sum_scalars(ranks, local_tokens, len(examples), len(batches), sum(has_targets(examples[i]) for i in active)),
    )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    chunk = cfg.train.loss_chunk_tokens
    old, ref = local_stretch(ranks, frozen_policies, model, batches, g, chunk)
    record = {"sequences_trained": trained, "passes": 0, "skipped": False, "loss": 0.0, "grad_norm": 0.0}

    term, entropy = PolicyTerm.of(g), g.top_entropy_quantile < 1 or bool(g.entropy_coef)

    def backward_pass() -> dict[str, float]:
        """Forward and backward of every micro-batch against the whole batch's normalisers; the summed stats."""
        sums = dict.fromkeys(("loss", "clip_fraction", *(("kl",) if g.kl_coef else ())), 0.0)  # no rows: zeros
        for batch, old_lp, ref_lp in zip(batches, old, ref, strict=True):
            with phase("forward"):
                if entropy:
                    logp, mask, entropies = completion_logprobs_and_entropy(model, batch, g.temperature, chunk=chunk)
                else:
                    (logp, mask), entropies = completion_logprobs(model, batch, g.temperature, chunk=chunk), None
            loss, stats = micro_batch_loss(
                logp,
                mask,
                entropies,
                old_lp,
                ref_lp,
                batch["weights"],
                g,
                term,
                total_tokens=max(total_tokens, 1),
                total_sequences=total_sequences,
                micro_batches=total_batches,
            )
            with phase("backward"):
                loss.backward()
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        return sums

    for _ in range(g.passes):
        sums = local_stretch(ranks, backward_pass)
        sums = dict(zip(sums, sum_scalars(ranks, *sums.values()), strict=True))
        if "entropy_sum" in sums:
            sums["entropy"] = sums.pop("entropy_sum") / max(total_tokens, 1)
        sum_gradients(ranks, params)
        grad_norm, skipped = local_stretch(ranks, apply_update, optimizer, sums["loss"], cfg.train)
        record.update({k: v for k, v in sums.items()}, grad_norm=grad_norm, skipped=skipped)
        if skipped:
            break
        record["passes"] += 1
        schedule.step()
    return record


def micro_batch_loss(
    logp,
    mask,
    entropies,
    old_lp,
    ref_lp,
    advantages,
    g,
    term: PolicyTerm,
    *,
    total_tokens: int,
    total_sequences: int,
    micro_batches: int,
) -> tuple[torch.Tensor, dict]:
    """One micro-batch's share of the rollout batch's GRPO loss, with its statistics. logp, mask, entropies:
    (B, T) (entropies None unless the quantile or the bonus needs them); advantages: (B,)."""
    weights = token_weights(
        mask,
        g.loss_type,
        total_tokens=total_tokens,
        total_sequences=total_sequences,
        max_new_tokens=g.max_new_tokens,
        micro_batches=micro_batches,
    )
    keep = top_entropy_mask(entropies, mask, g.top_entropy_quantile) if g.top_entropy_quantile < 1 else None
    bonus = None
    if g.entropy_coef:
        covered = mask if keep is None else keep
        bonus = entropy_weights(covered, g.loss_type, total_tokens=total_tokens, micro_batches=micro_batches)
    return grpo_token_loss(
        logp,
        old_lp,
        ref_lp,
        advantages,
        weights,
        kl_coef=g.kl_coef,
        level=g.importance_sampling_level,
        term=term,
        bias_correction_kl=g.use_bias_correction_kl,
        off_policy_threshold=g.off_policy_mask_threshold,
        keep=keep,
        entropies=entropies,
        bonus_weights=bonus,
        entropy_coef=g.entropy_coef,
    )


def batch_moments(values: torch.Tensor, ranks: Ranks = SINGLE) -> tuple[float, float]:
    """Mean and unbiased std of the non-NaN values over every rank's share of the rollout batch (NaN std with
    fewer than two values)."""
    finite = values[~values.isnan()].double()
    n, total, squares = sum_scalars(ranks, finite.numel(), float(finite.sum()), float((finite**2).sum()))
    if n == 0:
        return math.nan, math.nan
    mean = total / n
    if n < 2:
        return mean, math.nan
    if not ranks.enabled:  # one process: the two-pass std, as TRL's nanstd computes it
        return mean, nan_std(finite)
    return mean, math.sqrt(max(squares - total * total / n, 0.0) / (n - 1))


def rollout_advantages(
    rewards: list[float],
    per_fn: dict[str, list[float]],
    group_sizes: list[int],
    g,
    weights: dict[str, float],
    ranks: Ranks = SINGLE,
) -> torch.Tensor:
    """Each completion's advantage from its rewards (NaN: scored by no function), as TRL's
    multi_objective_aggregation and scale_rewards define it; the batch's statistics over all ranks."""
    if g.multi_objective_aggregation == "normalize_then_sum":
        summed = normalized_then_summed(per_fn, weights, group_sizes, eps=g.std_eps)
        mean, std = batch_moments(summed, ranks)
        return whitened(summed, mean, std, g.std_eps)
    r = torch.tensor(rewards, dtype=torch.float64)
    batch_std = batch_moments(r, ranks)[1] if g.scale_rewards == "batch" else None
    return group_advantages(r, group_sizes, scale=g.scale_rewards, eps=g.std_eps, batch_std=batch_std)


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


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values), "min": min(values), "max": max(values)}


def scored(values: list[float]) -> list[float]:
    """The values a reward function gave (NaN: it did not score that sample)."""
    return [v for v in values if not math.isnan(v)]


def _mean_std(values: list[float]) -> dict[str, float | None]:
    values = scored(values)
    return {"mean": statistics.fmean(values) if values else None, "std": statistics.pstdev(values) if values else None}


def rollout_metrics(rollouts, rewards, per_fn, advantages, group_sizes) -> dict:
    """Reward (total and per function, over the samples scored), advantage and completion-length statistics."""
    lengths = [len(r.completion_ids) for r in rollouts]
    totals = _mean_std(rewards)
    record = {
        "reward_mean": totals["mean"],
        "reward_std": totals["std"],
        "unscored": len(rewards) - len(scored(rewards)),
        "advantage": _spread(advantages.tolist()),
        "completion_tokens": _spread(lengths),
        "completion_tokens_total": sum(lengths),
        "flat_groups": flat_groups(group_sizes, advantages),
        "groups": len(group_sizes),
        "truncated_fraction": sum(r.truncated for r in rollouts) / len(rollouts),
    }
    for name, values in per_fn.items():
        record[f"reward/{name}"] = _mean_std(values)
    return record


def _json_number(v: float) -> float | None:
    return None if math.isnan(v) else v


def write_rollouts(log: MetricsLog, step: int, rollouts, rewards, per_fn, advantages) -> None:
    for i, (r, reward, adv) in enumerate(zip(rollouts, rewards, advantages.tolist(), strict=True)):
        log.write(
            {
                "step": step,
                "source": r.prompt.source,
                "group": r.group,
                "prompt": r.prompt.text,
                "completion": r.text,
                "completion_tokens": len(r.completion_ids),
                "truncated": r.truncated,
                "reward": _json_number(reward),
                "rewards": {k: _json_number(v[i]) for k, v in per_fn.items()},
                "advantage": adv,
            }
        )


def whole_batch(shares: list[tuple]) -> tuple:
    """The ranks' (rollouts, rewards, rewards per function, group sizes, advantages), in rank order, as one."""
    rollouts = [r for share in shares for r in share[0]]
    rewards = [x for share in shares for x in share[1]]
    names = sorted({k for share in shares for k in share[2]})
    per_fn = {k: [x for share in shares if share[0] for x in share[2][k]] for k in names}
    sizes = [n for share in shares for n in share[3]]
    return rollouts, rewards, per_fn, sizes, torch.tensor([a for share in shares for a in share[4]])


def grpo_step(
    source: RolloutSource,
    batch: list,
    training: dict,
    pad_id: int,
    rollout_log: MetricsLog | None,
    step: int,
    ranks: Ranks = SINGLE,
) -> dict:
    """Collect and score one batch of rollouts, update the policy on their advantages; the step's metrics.
    Data parallel: each rank collects and trains on its share of the prompts, with its groups' advantages;
    the scored rollouts are then gathered, so the metrics (and rank 0's rollouts.jsonl) are the whole batch's."""
    cfg, model = source.cfg, training["model"]
    t0 = time.perf_counter()
    lr = training["optimizer"].param_groups[0]["lr"]
    rollouts, rewards, per_fn, group_sizes = local_stretch(ranks, source.collect_share, model, batch, ranks, step)
    t_gen = time.perf_counter() - t0
    weights = {f.name: f.weight for f in getattr(source, "functions", [])}  # offline: totals only
    advantages = rollout_advantages(rewards, per_fn, group_sizes, cfg.grpo, weights, ranks)
    examples = rollout_examples(rollouts, advantages, mask_truncated=cfg.grpo.mask_truncated_completions)
    record = policy_update(model, training["optimizer"], training["scheduler"], examples, cfg, pad_id, ranks)
    if ranks.enabled:
        rollouts, rewards, per_fn, group_sizes, advantages = whole_batch(
            gather_objects(ranks, [(rollouts, rewards, per_fn, group_sizes, advantages.tolist())])
        )
    if rollout_log is not None:
        write_rollouts(rollout_log, step, rollouts, rewards, per_fn, advantages)
    if source.reward_errors:
        record["reward_errors"] = source.reward_errors
    record.update(
        rollout_metrics(rollouts, rewards, per_fn, advantages, group_sizes),
        step=step,
        lr=lr,
        generation_s=t_gen,
        training_s=time.perf_counter() - t0 - t_gen,
        router_load=router_load(model),
        sources=sorted({r.prompt.source for r in rollouts}),
    )
    return record


def run_grpo_steps(
    source: RolloutSource,
    training: dict,
    *,
    total: int,
    done: RunProgress,
    out: Path,
    console: Console,
    checkpoint,
    stop: StopSignals,
    on_failure,
    ranks: Ranks = SINGLE,
) -> tuple[list[float], int]:
    """The rollout batches after `done`, with a progress bar (plain lines when stdout is not a terminal),
    metrics, rollouts, checkpoints by steps and minutes, and a checkpoint then RunInterrupted on a signal. A
    step that fails on any rank (out of memory, a reward function under grpo.reward_errors: abort) raises
    on_failure(last completed progress, failure): a faults.StepFailed on every rank, after checkpointing the last
    completed step.
    Returns the mean rewards of this invocation and the completion tokens it trained on. Rank 0 alone writes."""
    cfg = source.cfg
    metrics = (
        Reporters(out, cfg.output.report_to, project=cfg.output.wandb_project, config=cfg.model_dump(mode="json"))
        if ranks.main
        else NoReporters(out)
    )
    rollout_log = MetricsLog(out / "rollouts.jsonl") if ranks.main else None
    reward_means, tokens, start, first = [], 0, time.perf_counter(), done.step
    policy = CheckpointPolicy(cfg.train.save_every, cfg.train.save_every_minutes)
    columns = [
        TextColumn("[bold]grpo"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
    ]
    try:
        with Progress(*columns, console=console, disable=not console.is_terminal) as bar:
            task = bar.add_task("grpo", total=total, info="", completed=done.step)
            for step, (epoch, batch) in enumerate(batch_prompts(source.items, cfg)):
                if step >= total:
                    break
                if step < done.step:  # done before the checkpoint: the order depends on (seed, epoch) only
                    continue
                stop_if_asked(stop, done, checkpoint, ranks)
                start_step(step + 1)
                record, failure = attempt(
                    ranks,
                    grpo_step,
                    source,
                    batch,
                    training,
                    source.tokenizer.pad_token_id,
                    rollout_log,
                    step + 1,
                    ranks,
                )
                if failure is not None:  # outside the `except`: the failed step's frames are gone
                    raise on_failure(done, failure)
                record["epoch"] = epoch
                try:
                    done = after_step(record, record.pop("sources"), done, cfg, spikes=False)
                finally:  # an aborting step is logged too
                    metrics.write(record)
                reward_means.append(record["reward_mean"])
                tokens += record["completion_tokens_total"]
                info = {
                    "reward": f"{record['reward_mean']:.3f}",
                    "kl": f"{record.get('kl', 0):.4f}",
                    "gen": f"{record['generation_s']:.1f}s",
                    "train": f"{record['training_s']:.1f}s",
                }
                bar.update(task, advance=1, info="  ".join(f"{k} {v}" for k, v in info.items()))
                if not console.is_terminal and ((step + 1) % cfg.train.log_every == 0 or step + 1 == total):
                    console.print(
                        plain_progress_line("grpo", step + 1, total, info, time.perf_counter() - start, first),
                        highlight=False,
                    )
                if done.step < total and any_rank(ranks, policy.due(done.step)):
                    checkpoint(done)
                    policy.saved()
        checkpoint(done)
    finally:
        metrics.close()
        if rollout_log is not None:
            rollout_log.close()
    return reward_means, tokens


def grpo(
    cfg: RunConfig, console: Console | None = None, *, allow_mismatch: bool = False, overwrite: bool = False
) -> GrpoResult:
    """Run GRPO as configured (online sampling, or offline scored completions). Under torchrun each process is
    a data-parallel rank: the prompts of a step are split across the ranks by whole groups; rank 0 writes, and
    holds output.dir's lock for the run (RunDirLocked while another process holds it)."""
    if cfg.grpo is None:
        raise ConfigError("moe-qlora grpo needs a `grpo:` section in the config (reward functions, group size...)")
    if cfg.train.optimizer_in_backward:
        raise ConfigError(
            "train.optimizer_in_backward is for `train` only: a GRPO step sums the gradients of all its rollout "
            "micro-batches (and of several passes) before it can update"
        )
    with launched(cfg, console) as (ranks, console), output_dir_locked(Path(cfg.output.dir), ranks, console):
        return _grpo(cfg, console, ranks, allow_mismatch=allow_mismatch, overwrite=overwrite)


def _grpo(cfg: RunConfig, console: Console, ranks: Ranks, *, allow_mismatch: bool, overwrite: bool) -> GrpoResult:
    out = Path(cfg.output.dir)
    if ranks.enabled and cfg.grpo.top_entropy_quantile < 1:
        raise ConfigError(
            "grpo.top_entropy_quantile < 1 runs in one process for now: TRL takes the quantile over "
            "the micro-batches of every rank together, which moe-qlora does not gather"
        )
    claim_output_dir_together(out, cfg, ranks, console, overwrite=overwrite)
    started = time.perf_counter()
    with StopSignals(console) as stop:
        seed_everything(cfg.train.seed)
        failure = None
        try:
            model_path, tokenizer = load_tokenizer(cfg)
            source = RolloutSource(cfg, tokenizer, console)
            model, params, ranks = load_policy(cfg, model_path, console, ranks, generates=True)
        except Exception as exc:  # a rank that cannot load its prompts or model stops every rank, at once
            failure = exc
        raise_together(ranks, failure)
        if ranks.main:
            write_router_layers(out, model)
        seed_everything(cfg.train.seed)  # what loading consumed must not matter
        optimizer = build_optimizer(params, cfg.train)
        total = count_grpo_steps(len(source.items), cfg)
        training = {
            "model": model,
            "optimizer": optimizer,
            "scheduler": build_schedule(optimizer, total * cfg.grpo.passes, cfg.train),
        }
        identity = {**config_identity(cfg.model_dump(mode="json")), "dataset_fingerprint": source.identity}
        done = resume_if_asked(
            cfg,
            out,
            console,
            allow_mismatch=allow_mismatch,
            identity=identity,
            logs=("metrics.jsonl", "rollouts.jsonl"),
            writer=ranks.main,
            **training,
        )
        if ranks.enabled:
            console.print(
                f"data parallel (ddp): {ranks.world} ranks share each step's {cfg.grpo.prompts_per_step} "
                "prompts by whole groups"
            )
        model.train()

        def checkpoint(progress: RunProgress) -> None:
            if ranks.main:
                save_checkpoint(out, progress=progress, identity=identity, keep=cfg.train.keep_checkpoints, **training)

        on_failure = FaultStop(cfg, model_path, out, training, checkpoint, ranks)
        reward_means, tokens = run_grpo_steps(
            source,
            training,
            total=total,
            done=done,
            out=out,
            console=console,
            checkpoint=checkpoint,
            stop=stop,
            on_failure=on_failure,
            ranks=ranks,
        )
        adapter_dir = write_adapter(model, out, cfg, model_path, console) if ranks.main else out / "adapter"
        if ranks.main:  # how generate renders a prompt as this run did: its prompt rows, or its scored completions
            offline = cfg.grpo.offline_file
            data = cfg.data.model_copy(update={"train_files": [offline]}) if offline else cfg.data
            write_prompt_format(adapter_dir, data)
    RunSummary(
        "grpo",
        len(reward_means),
        time.perf_counter() - started,
        tokens,
        reward_means[-1] if reward_means else None,
        max(reward_means) if reward_means else None,
        adapter_dir,
        out / "metrics.jsonl",
    ).print(console)
    console.print(f"rollouts: {out / 'rollouts.jsonl'}", highlight=False)
    return GrpoResult(len(reward_means), reward_means, adapter_dir, out / "metrics.jsonl", out / "rollouts.jsonl")
