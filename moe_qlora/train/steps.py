"""Which examples each optimizer step takes on each rank, how many steps a run has, and where a resumed run at
another world size continues.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import replace

from rich.console import Console

from moe_qlora.config.sections import RunConfig
from moe_qlora.data.examples import IGNORE, Example, epoch_order, micro_batches
from moe_qlora.data.preference import PreferencePair
from moe_qlora.model.distributed import SINGLE, Ranks
from moe_qlora.train.checkpoint import RunProgress


def optimizer_steps(examples: list[Example], cfg: RunConfig, ranks: Ranks = SINGLE):
    """Yield (epoch, [micro-batches]) per optimizer step, each epoch in its own seeded order. With several
    ranks a global micro-batch holds micro_batch_size x ranks examples and this rank takes its slice, so the
    global batch is the same whatever the world size (a slice may be short, or empty, at an epoch's end)."""
    t = cfg.train
    size = t.micro_batch_size
    for epoch in range(t.epochs):
        order = epoch_order(len(examples), seed=t.seed, epoch=epoch)
        group = []
        for mb in micro_batches(examples, order, size * ranks.world):
            mine = mb[ranks.rank * size : (ranks.rank + 1) * size]
            if not mine and ranks.sharded:  # every fsdp / ep rank runs each forward: a row that trains nothing
                mine = [idle_item(mb[0])]
            group.append(mine)
            if len(group) == t.grad_accum:
                yield epoch, group
                group = []
        if group:
            yield epoch, group


def step_end_positions(num_examples: int, cfg: RunConfig, world: int) -> list[int]:
    """Where each optimizer step of a run over `world` ranks ends in the data: the examples consumed since the
    run's start (epoch after epoch), as optimizer_steps lays them out."""
    t = cfg.train
    per_step = t.micro_batch_size * world * t.grad_accum
    return [
        epoch * num_examples + min(num_examples, start + per_step)
        for epoch in range(t.epochs)
        for start in range(0, num_examples, per_step)
    ]


def continue_at_world_size(
    done: RunProgress, ranks: Ranks, num_examples: int, cfg: RunConfig, total: int, console: Console
) -> tuple[RunProgress, int]:
    """A checkpoint written by another number of ranks: the global batch (micro_batch_size x ranks x grad_accum)
    has changed, so step k no longer names the same data. The run goes on from the same global position in the
    data order, as if it had been launched at this world size: returns the step of the new layout to go on
    after (the first not wholly done; the examples between its start and the position are trained on again, and
    said so) and the run's total steps (ending where the checkpoint's run would have: train.max_steps counted
    in that run's steps). (done, total) unchanged otherwise."""
    if done.world in (0, ranks.world) or done.step == 0:
        return done, total
    old_ends, ends = (step_end_positions(num_examples, cfg, w) for w in (done.world, ranks.world))
    position, end = old_ends[done.step - 1], old_ends[count_steps(num_examples, cfg, done.world) - 1]
    step, total = bisect.bisect_right(ends, position), bisect.bisect_left(ends, end) + 1
    again = position - (ends[step - 1] if step else 0)
    old_batch, new_batch = (cfg.train.micro_batch_size * w * cfg.train.grad_accum for w in (done.world, ranks.world))
    console.print(
        f"[yellow]warning:[/] the checkpoint was written by {done.world} rank(s), this run has "
        f"{ranks.world}: the global batch changes from {old_batch} to {new_batch} examples. The data order "
        f"continues from the same global position (example {position:,} of the run): step {done.step} of "
        f"the checkpoint's run is step {step} here, of {total}"
        + (f", and {again} example(s) before the position are trained on again" if again else "")
        + "; the LR schedule goes on from the same "
        "point. The result will not be bit-identical to an uninterrupted run."
    )
    return replace(done, step=step, epoch=min(position // num_examples, cfg.train.epochs - 1)), total


IDLE = " (idle)"  # the source suffix of an idle row


def idle_row(example: Example) -> Example:
    """`example` with no target and weight 0: its forward and backward run (the collectives FSDP makes every rank
    join) and add exactly nothing to the loss, the gradient or the target count (nor to the tokens logged)."""
    return replace(
        example,
        labels=[IGNORE] * len(example.labels),
        source=example.source + IDLE,
        weight=0.0,
        token_weights=None if example.token_weights is None else [0.0] * len(example.token_weights),
    )


def idle_item(item):
    """An example as idle_row makes it, or a preference pair marked idle (its source): the pair keeps its tokens,
    so its forward computes finite scores, and the DPO step multiplies its loss by 0 and counts it nowhere."""
    if isinstance(item, PreferencePair):
        return replace(item, source=item.source + IDLE)
    return idle_row(item)


def is_idle(item) -> bool:
    return item.source.endswith(IDLE)


def count_steps(num_examples: int, cfg: RunConfig, world: int = 1) -> int:
    t = cfg.train
    per_epoch = math.ceil(math.ceil(num_examples / (t.micro_batch_size * world)) / t.grad_accum)
    total = per_epoch * t.epochs
    return min(total, t.max_steps) if t.max_steps else total
