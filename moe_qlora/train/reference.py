"""DPO's reference policy without a second model: the policy at step 0 (the NF4 base plus lora.init_from, or
plus fresh LoRA whose B is zero) scores every pair once, before the first step, and the scores are kept in the
run folder with a fingerprint of what they depend on (the pairs' tokens, the weights' identity, quantization and
compute dtype, the LoRA shape and the initial adapter's bytes). A resume reuses them; a changed fingerprint
recomputes them, which needs the step-0 policy: so they are scored before a checkpoint is restored.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch
from huggingface_hub import try_to_load_from_cache
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open

from moe_qlora.common.fileio import atomic_dir, save_safetensors
from moe_qlora.config.sections import RunConfig, resolve_compute_dtype
from moe_qlora.data.preference import PreferencePair
from moe_qlora.model.device_choice import policy_device
from moe_qlora.model.distributed import Ranks, from_main, gather_objects, rank_slice
from moe_qlora.train.checkpoint import fingerprint
from moe_qlora.train.faults import local_stretch
from moe_qlora.train.preference_loss import PairLogps, pair_forward
from moe_qlora.train.steps import idle_item, is_idle

REFERENCE_DIR = "reference"
LOGPS_FILE = "logps.safetensors"
FIELDS = ("chosen", "rejected", "chosen_tokens", "rejected_tokens")


def reference_fingerprint(cfg: RunConfig, model_path: str, pairs: list[PreferencePair]) -> str:
    """sha256 of what the step-0 scores depend on: the weights (by identity), how they are quantized and in which
    dtype they compute, the adapter they start from, and the pairs' tokens. Not what only places or schedules
    the computation (device, kernels, offload, batch sizes): those move the scores by fp32 rounding only."""
    m, lora = cfg.model, cfg.lora
    records = [
        [m.expert_double_quant, m.linear_double_quant, resolve_compute_dtype(m.compute_dtype, policy_device(m))],
        [lora.rank, lora.alpha, lora.experts, lora.router, lora.target_modules],
        weights_identity(model_path),
        files_digest(Path(lora.init_from)) if lora.init_from else None,
        *([p.index, p.chosen.input_ids, p.chosen.labels, p.rejected.input_ids, p.rejected.labels] for p in pairs),
    ]
    if cfg.dpo.ld_alpha is not None:  # LD-DPO's sums; without it the records (and older runs' keys) are as before
        records.append(["ld_alpha", cfg.dpo.ld_alpha])
    return fingerprint(records)


WEIGHT_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json")


def weights_identity(model_path: str) -> list:
    """(name, size) of the checkpoint's weight files and config.json's text, from its folder: a local one, or the
    hub cache's snapshot of a hub id (named by its commit). Hashing gigabytes of weights at every start would
    cost minutes; a changed checkpoint changes a size, the config or the commit."""
    folder = Path(model_path)
    if not folder.is_dir():
        cached = try_to_load_from_cache(model_path, "config.json")
        if not isinstance(cached, str):
            return [model_path]  # not in the cache (the load itself would have failed)
        folder = Path(cached).parent  # .../snapshots/<commit>/
    found = sorted({p for pattern in WEIGHT_FILES for p in folder.glob(pattern)})
    return [folder.name, *((p.name, p.stat().st_size, p.read_text() if p.suffix == ".json" else "") for p in found)]


def files_digest(folder: Path) -> list:
    """sha256 of every file of the initial adapter: its factors decide the reference (a rank-8 adapter of a 30B
    MoE, ~1.2 GiB, reads in a few seconds)."""
    return [(p.name, hashlib.sha256(p.read_bytes()).hexdigest()) for p in sorted(folder.glob("*")) if p.is_file()]


def read_cached(path: Path, expected: str, count: int) -> PairLogps | None:
    """The stored scores if they are there, readable, and of this fingerprint; None otherwise."""
    try:
        with safe_open(str(path), "pt") as f:
            if (f.metadata() or {}).get("fingerprint") != expected:
                return None
        tensors = load_file(str(path))
    except (OSError, SafetensorError):
        return None
    if any(tensors.get(k) is None or tensors[k].shape != (count,) for k in FIELDS):
        return None
    return PairLogps(*(tensors[k] for k in FIELDS))


def write_cached(out: Path, logps: PairLogps, key: str) -> None:
    tensors = {k: getattr(logps, k).contiguous() for k in FIELDS}
    with atomic_dir(out / REFERENCE_DIR) as tmp:
        save_safetensors(tensors, tmp / LOGPS_FILE, metadata={"fingerprint": key})


@torch.no_grad()
def score_pairs(
    model,
    pairs: list[PreferencePair],
    pad_id: int,
    size: int,
    chunk: int,
    advance,
    ld_alpha=None,
) -> list[tuple]:
    """(index, chosen, rejected, chosen tokens, rejected tokens) of each pair, in eval mode (no dropout),
    `size` pairs (2 x size rows) per forward; advance(n) after each. ld_alpha: LD-DPO's weighting of the sums.
    An idle pair (steps.idle_item: a sharded run's filler, so every rank runs as many forwards) is scored and
    dropped."""
    was_training = model.training
    model.eval()
    rows = []
    try:
        for start in range(0, len(pairs), size):
            group = pairs[start : start + size]
            logps = pair_forward(model, group, pad_id, chunk=chunk, ld_alpha=ld_alpha)[0]
            values = zip(*(getattr(logps, k).tolist() for k in FIELDS), strict=True)
            scored = [(p.index, *v) for p, v in zip(group, values, strict=True) if not is_idle(p)]
            rows += scored
            advance(len(scored))
    finally:
        model.train(was_training)
    return rows


def reference_logps(
    model, pairs: list[PreferencePair], key: str, cfg: RunConfig, pad_id: int, ranks: Ranks, console: Console
) -> PairLogps:
    """The step-0 policy's scores of every pair (indexed by pair.index), from out/reference when they were stored
    under `key` (reference_fingerprint), else computed (each rank a share, then gathered) and stored by rank 0.
    Rank 0 reads the stored ones and hands them to every rank; a rank that fails to score stops every rank."""
    out = Path(cfg.output.dir)
    path = out / REFERENCE_DIR / LOGPS_FILE
    cached = from_main(ranks, read_cached(path, key, len(pairs)) if ranks.main else None)
    if cached is not None:
        console.print(f"reference: {len(pairs)} pairs' step-0 log-probabilities reused from {out / REFERENCE_DIR}")
        return cached
    _, mine = rank_slice(pairs, ranks)
    columns = [TextColumn("[bold]reference"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console, disable=not console.is_terminal) as bar:
        task = bar.add_task("reference", total=len(mine))
        t = cfg.train
        advance = functools.partial(bar.advance, task)
        size, chunk, ld_alpha = t.micro_batch_size, t.loss_chunk_tokens, cfg.dpo.ld_alpha
        if ranks.sharded:  # every rank joins as many forwards as the largest share takes, idle pairs after its own
            share = -(-len(pairs) // ranks.world)
            filled = mine + [idle_item(pairs[0])] * (-(-share // size) * size - len(mine))
            rows = score_pairs(model, filled, pad_id, size, chunk, advance, ld_alpha)
        else:
            rows = local_stretch(ranks, score_pairs, model, mine, pad_id, size, chunk, advance, ld_alpha)
    rows = sorted(gather_objects(ranks, rows))
    logps = PairLogps(*(torch.tensor(column, dtype=torch.float32) for column in list(zip(*rows, strict=True))[1:]))
    if ranks.main:
        write_cached(out, logps, key)
    console.print(f"reference: scored {len(pairs)} pairs with the step-0 policy, kept in {out / REFERENCE_DIR}")
    return logps
