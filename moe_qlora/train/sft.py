"""SFT as a recipe (SftRecipe): token-normalised loss over accumulated micro-batches, the eval split, the best
adapter kept.

One optimizer step sees `grad_accum` micro-batches; each contributes sum(token losses) / N where N is the
number of target tokens in the whole step, so the step's gradient equals that of one big batch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from rich.console import Console

from moe_qlora.common.memory import release_freed_memory
from moe_qlora.config.sections import RunConfig
from moe_qlora.data.examples import (
    IGNORE,
    Example,
    apply_reward_weights,
    build_examples,
    collate,
    dropped_counts,
    eval_split,
)
from moe_qlora.model.build import load_tokenizer
from moe_qlora.model.distributed import SINGLE, Ranks, sum_gradients, sum_scalars
from moe_qlora.train.checkpoint import dataset_fingerprint
from moe_qlora.train.faults import local_stretch
from moe_qlora.train.losses import aux_term, has_router_aux_loss, token_logprobs
from moe_qlora.train.optim import StepInBackward
from moe_qlora.train.packing import packed
from moe_qlora.train.position import StepContext, StepPosition
from moe_qlora.train.recipe import LossRecipe, TrainResult
from moe_qlora.train.resume import best_eval_so_far
from moe_qlora.train.steps import IDLE, count_steps, optimizer_steps
from moe_qlora.train.update import apply_update

log = logging.getLogger(__name__)


def token_loss_sum(
    model, batch: dict[str, torch.Tensor], *, loss_chunk: int = 0
) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """Sum of next-token cross-entropies over target positions, their count, and the model's MoE auxiliary
    (load-balancing) loss where the family defines one (a differentiable scalar: logged, and trained on with
    train.router_aux_loss_coef). loss_chunk > 0: through the output head that many tokens at a time
    (losses.py), never the whole (B, L, V) logits."""
    extra = {"output_router_logits": True} if has_router_aux_loss(model) else {}
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
    return loss, int((targets != IGNORE).sum()), getattr(out, "aux_loss", None)


def target_count(batch: dict[str, torch.Tensor]) -> int:
    """The positions a batch takes a loss on (a label predicted from the position before it)."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def accumulate_gradients(
    model,
    batches: list[dict[str, torch.Tensor]],
    *,
    loss_chunk: int = 0,
    ranks: Ranks = SINGLE,
    position: StepPosition | None = None,
    aux_coef: float = 0.0,
) -> tuple[float, int, float | None]:
    """Backward over micro-batches, each scaled by 1/N with N the target tokens of all of them together (on
    every rank), so the gradient is that of the mean token loss over the whole step (plus aux_coef times the
    mean auxiliary loss of the micro-batches); with several ranks the gradients are then summed across them.
    Returns (mean loss, N, mean aux loss)."""
    local = sum(target_count(b) for b in batches)
    trained = sum(target_count(b) > 0 for b in batches)  # an FSDP idle row adds nothing, its aux loss neither
    n_targets, n_batches = map(int, sum_scalars(ranks, local, trained))
    share = StepShare(n_targets, aux_coef / max(n_batches, 1))
    if ranks.sharded:  # FSDP gathers and reduces inside them: a rank that fails there cannot meet the others
        total, aux = backward_over(model, batches, share, loss_chunk, position)
    else:
        total, aux = local_stretch(ranks, backward_over, model, batches, share, loss_chunk, position)
    if ranks.enabled:
        (total,) = sum_scalars(ranks, total)
        sum_gradients(ranks, [p for p in model.parameters() if p.requires_grad])
    return total / n_targets, n_targets, (sum(aux) / len(aux) if aux else None)


@dataclass(frozen=True)
class StepShare:
    """What one micro-batch's loss is scaled by: 1 / the step's target tokens, and the weight of its auxiliary
    loss (train.router_aux_loss_coef / the step's micro-batches on every rank; 0: not trained on)."""

    targets: int
    aux_weight: float = 0.0

    def loss(self, loss_sum: torch.Tensor, aux: torch.Tensor | None, *, trained: bool = True) -> torch.Tensor:
        """The micro-batch's loss; `trained` False (no target: an FSDP idle row) takes no auxiliary term."""
        return loss_sum / self.targets + (aux_term(aux, self.aux_weight) if trained else 0.0)


def backward_over(
    model, batches: list[dict[str, torch.Tensor]], share: StepShare, loss_chunk: int, position: StepPosition | None
) -> tuple[float, list[float]]:
    """Forward and backward of each micro-batch, scaled as `share` says; (summed loss, aux losses)."""
    total, aux, position = 0.0, [], position or StepPosition()
    for batch in batches:
        with position.within("forward"):
            loss_sum, _, aux_loss = token_loss_sum(model, batch, loss_chunk=loss_chunk)
        with position.within("backward"):
            share.loss(loss_sum, aux_loss, trained=target_count(batch) > 0).backward()
        total += float(loss_sum.detach())
        if aux_loss is not None:
            aux.append(float(aux_loss.detach()))
    return total, aux


def backward_with_updates(
    model, stepper: StepInBackward, batch: dict[str, torch.Tensor], *, loss_chunk: int = 0, aux_coef: float = 0.0
):
    """train.optimizer_in_backward: one micro-batch's backward, each LoRA tensor updated inside it. A
    non-finite loss is seen before the backward, so nothing is updated. Returns (mean loss, N, aux loss,
    pre-clip gradient norm, skipped)."""
    n_targets = target_count(batch)
    stepper.begin()
    with stepper.position.within("forward"):
        loss_sum, _, aux_loss = token_loss_sum(model, batch, loss_chunk=loss_chunk)
    loss = float(loss_sum.detach()) / n_targets
    if math.isfinite(loss):
        with stepper.position.within("backward (optimizer in backward)"):
            StepShare(n_targets, aux_coef).loss(loss_sum, aux_loss).backward()
    del loss_sum
    aux_loss = None if aux_loss is None else float(aux_loss.detach())
    grad_norm, skipped = stepper.finish(math.isfinite(loss))
    release_freed_memory()
    return loss, n_targets, aux_loss, grad_norm, skipped


def train_step(model, optimizer, group, pad_id: int, ctx: StepContext, stepper: StepInBackward | None = None) -> dict:
    """One optimizer step over the micro-batches in `group` (inside the backward with `stepper`); returns
    its metrics."""
    device, t = next(model.parameters()).device, ctx.train
    batches = [{k: v.to(device) for k, v in collate(mb, pad_id).items()} for mb in group if mb]
    if stepper is not None:
        (batch,) = batches  # grad_accum is 1 (the config refuses more)
        loss, n_targets, aux_loss, grad_norm, skipped = backward_with_updates(
            model, stepper, batch, loss_chunk=t.loss_chunk_tokens, aux_coef=ctx.aux_coef
        )
    else:
        loss, n_targets, aux_loss = accumulate_gradients(
            model,
            batches,
            loss_chunk=t.loss_chunk_tokens,
            ranks=ctx.ranks,
            position=ctx.position,
            aux_coef=ctx.aux_coef,
        )
        grad_norm, skipped = apply_update(ctx.ranks, optimizer, loss, t, ctx.position)
    trained = sum(len(e.input_ids) for mb in group for e in mb if not e.source.endswith(IDLE))
    tokens = int(sum_scalars(ctx.ranks, trained)[0])
    return {
        "loss": loss,
        "grad_norm": grad_norm,
        "target_tokens": n_targets,
        "tokens": tokens,
        "skipped": skipped,
        "aux_loss": aux_loss,
    }


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


class SftRecipe(LossRecipe):
    """SFT and reward-weighted SFT (train.objective: rwsft): `train.grad_accum` micro-batches per optimizer step,
    the loss normalised over the step's target tokens; an eval split with the best adapter kept."""

    command = "train"

    def load(self) -> None:
        cfg, console = self.cfg, self.console
        self.model_path, self.tokenizer = load_tokenizer(cfg.model)
        rwsft = cfg.train.objective == "rwsft"
        examples, stats = build_examples(cfg.data, self.tokenizer, rewards=rwsft)
        if rwsft:
            examples = apply_reward_weights(examples, cfg.reward)
            weights = [e.weight for e in examples]
            console.print(
                f"rwsft: weights ({cfg.reward.mapping}) from {min(weights):.3g} to {max(weights):.3g}, "
                f"mean {sum(weights) / len(weights):.3g}"
            )
        console.print(
            f"data: {stats.rows} rows -> {len(examples)} examples, {stats.target_tokens} target tokens; "
            f"truncated {stats.truncated}, dropped {dropped_counts(stats, cfg.data.max_seq_len)}; "
            f"formats {stats.formats}"
        )
        self.examples = examples
        self.load_model()

    def prepare_data(self) -> None:
        self.examples, self.held_out = held_out_examples(self.cfg, self.tokenizer, self.examples, self.console)
        if self.cfg.data.packing:
            self.examples, self.held_out = packed(
                self.model, self.examples, self.held_out, self.cfg.data.max_seq_len, self.console
            )

    def count_steps(self) -> int:
        return count_steps(len(self.examples), self.cfg, self.ranks.world)

    def data_identity(self) -> dict:
        return {"dataset_fingerprint": dataset_fingerprint(self.examples), "world": self.ranks.world}

    def after_resume(self) -> None:
        """The data-parallel layout (continue_data_parallel); train.optimizer_in_backward's stepper (undo: a step
        abandoned part-way, NaN or out of memory, is put back); the best eval loss so far."""
        self.continue_data_parallel(len(self.examples))
        if self.cfg.train.optimizer_in_backward:
            self.stepper = StepInBackward(self.optimizer, undo=True, position=self.position)
        self.best_eval = best_eval_so_far(self.out / "metrics.jsonl") if self.held_out else math.inf

    def batches(self):
        return optimizer_steps(self.examples, self.cfg, self.ranks)

    def step(self, number: int, epoch: int, batch) -> dict:
        lr = self.optimizer.param_groups[0]["lr"]
        pad_id = self.tokenizer.pad_token_id
        record = train_step(self.model, self.optimizer, batch, pad_id, self.context, self.stepper)
        return {**record, "step": number, "epoch": epoch, "lr": lr}

    def evaluate(self) -> dict:
        """The held-out loss; with train.keep_best, the adapter of the best one so far in adapter-best."""
        loss = eval_loss(self.model, self.held_out, self.tokenizer.pad_token_id, self.cfg.train)
        return {"eval_loss": loss, **self.keep_if_best(loss)}

    def progress_info(self, record: dict) -> dict[str, str]:
        info = {
            "loss": f"{record['loss']:.4f}",
            "lr": f"{record['lr']:.2e}",
            "tok/s": f"{record['tokens_per_s']:.0f}",
        }
        if "eval_loss" in record:
            info["eval"] = f"{record['eval_loss']:.4f}"
        return info


def train(
    cfg: RunConfig, console: Console | None = None, *, allow_mismatch: bool = False, overwrite: bool = False
) -> TrainResult:
    """Run SFT as configured: returns the per-step losses (of this invocation) and where the outputs went.
    Raises RunInterrupted after checkpointing when SIGINT or SIGTERM arrives. Under torchrun (WORLD_SIZE > 1)
    each process is a data-parallel rank (distributed.py); rank 0 alone writes, and holds output.dir's lock for
    the run (RunDirLocked while another process holds it)."""
    return SftRecipe(cfg, console, allow_mismatch=allow_mismatch, overwrite=overwrite).run()
