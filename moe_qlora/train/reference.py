"""DPO's reference policy without a second model: the policy at step 0 (the NF4 base plus lora.init_from, or
plus fresh LoRA whose B is zero) scores every pair once, before the first step, and the scores are kept in the
run folder with a fingerprint of what they depend on (the pairs' tokens, the model section and its weights'
identity, the LoRA section and the initial adapter's bytes). A resume reuses them; a changed fingerprint
recomputes them, which needs the step-0 policy: so they are scored before a checkpoint is restored.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

from moe_qlora.common.fileio import atomic_dir
from moe_qlora.config.sections import RunConfig
from moe_qlora.data.preference import PreferencePair
from moe_qlora.model.distributed import Ranks, from_main, gather_objects, rank_slice
from moe_qlora.train.checkpoint import fingerprint
from moe_qlora.train.preference_loss import PairLogps, pair_forward

REFERENCE_DIR = "reference"
LOGPS_FILE = "logps.safetensors"
FIELDS = ("chosen", "rejected", "chosen_tokens", "rejected_tokens")


def reference_fingerprint(cfg: RunConfig, model_path: str, pairs: list[PreferencePair]) -> str:
    """sha256 of what the step-0 scores depend on."""
    records = [
        cfg.model.model_dump(mode="json"),
        cfg.lora.model_dump(mode="json"),
        files_identity(Path(model_path), ("config.json", "*.safetensors", "*.safetensors.index.json")),
        files_digest(Path(cfg.lora.init_from)) if cfg.lora.init_from else None,
        *([p.index, p.chosen.input_ids, p.chosen.labels, p.rejected.input_ids, p.rejected.labels] for p in pairs),
    ]
    return fingerprint(records)


def files_identity(folder: Path, patterns: tuple[str, ...]) -> list:
    """(name, size) of the model's weight files and config.json's text: a changed checkpoint is another model
    (hashing gigabytes of weights at every start would cost minutes)."""
    if not folder.is_dir():
        return [str(folder)]
    found = sorted({p for pattern in patterns for p in folder.glob(pattern)})
    return [(p.name, p.stat().st_size, p.read_text() if p.name == "config.json" else "") for p in found]


def files_digest(folder: Path) -> list:
    """sha256 of every file of an adapter folder (small: its factors decide the reference)."""
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
        save_file(tensors, tmp / LOGPS_FILE, metadata={"fingerprint": key})


@torch.no_grad()
def score_pairs(model, pairs: list[PreferencePair], pad_id: int, size: int, chunk: int, advance) -> list[tuple]:
    """(index, chosen, rejected, chosen tokens, rejected tokens) of each pair, in eval mode (no dropout),
    `size` pairs (2 x size rows) per forward; advance(n) after each."""
    was_training = model.training
    model.eval()
    rows = []
    try:
        for start in range(0, len(pairs), size):
            group = pairs[start : start + size]
            logps = pair_forward(model, group, pad_id, chunk=chunk)[0]
            values = zip(*(getattr(logps, k).tolist() for k in FIELDS), strict=True)
            rows += [(p.index, *v) for p, v in zip(group, values, strict=True)]
            advance(len(group))
    finally:
        model.train(was_training)
    return rows


def reference_logps(
    model, pairs: list[PreferencePair], cfg: RunConfig, model_path: str, pad_id: int, ranks: Ranks, console: Console
) -> PairLogps:
    """The step-0 policy's scores of every pair (indexed by pair.index), from out/reference when its fingerprint
    matches, else computed (each rank a share, then gathered) and stored by rank 0."""
    out = Path(cfg.output.dir)
    key = reference_fingerprint(cfg, model_path, pairs)
    cached = from_main(ranks, read_cached(out / REFERENCE_DIR / LOGPS_FILE, key, len(pairs)) is not None)
    if cached:
        console.print(f"reference: {len(pairs)} pairs' step-0 log-probabilities reused from {out / REFERENCE_DIR}")
        return read_cached(out / REFERENCE_DIR / LOGPS_FILE, key, len(pairs))
    _, mine = rank_slice(pairs, ranks)
    columns = [TextColumn("[bold]reference"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console, disable=not console.is_terminal) as bar:
        task = bar.add_task("reference", total=len(mine))
        t = cfg.train
        rows = score_pairs(model, mine, pad_id, t.micro_batch_size, t.loss_chunk_tokens, lambda n: bar.advance(task, n))
    rows = sorted(gather_objects(ranks, rows))
    logps = PairLogps(*(torch.tensor(column, dtype=torch.float32) for column in list(zip(*rows, strict=True))[1:]))
    if ranks.main:
        write_cached(out, logps, key)
    console.print(f"reference: scored {len(pairs)} pairs with the step-0 policy, kept in {out / REFERENCE_DIR}")
    return logps
