"""Training checkpoints that resume exactly: complete, atomic, verified.

A checkpoint is a folder `checkpoints/step-NNNNNNNN/` holding the trainable tensors, AdamW's moments and
the RNG states in safetensors, everything else (step, epoch, scheduler, python RNG, config hash, dataset
fingerprint, versions) in JSON, and last a manifest with the sha256 of every file. It is written into a
temporary folder, fsynced, then renamed into place, so a folder under its final name is complete; resume
takes the newest one whose manifest verifies. No pickle anywhere.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from moe_qlora.common.fileio import atomic_dir, save_safetensors
from moe_qlora.common.injection import injected_faults
from moe_qlora.model.distributed import full_tensor, shard_like
from moe_qlora.train.optim import restore_state
from moe_qlora.train.run_identity import MANIFEST, config_changes
from moe_qlora.train.run_identity import checkpoint_folders as checkpoint_dirs

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from as asked (mismatch, nothing valid)."""


@dataclass
class RunProgress:
    """Where the run is: steps done (taken or skipped), the epoch of the last one, skip counters, loss EMA."""

    step: int = 0
    epoch: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0
    loss_ema: float | None = None
    world: int = 0  # ranks of the run that wrote the checkpoint resumed from (0: not from a checkpoint, or unknown)


def failpoint(name: str, step: int) -> None:
    """Fail here when MOE_QLORA_FAILPOINT (read once: common/injection.py) names this point and step, for the crash
    tests.

    `checkpoint-write@6`: die by a real SIGKILL, as a crash would; `checkpoint-write:enospc@6`: raise what
    safetensors' save_file raises on a full disk (SafetensorError, not an OSError).
    """
    wanted = injected_faults().failpoint
    if wanted == f"{name}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)
    if wanted == f"{name}:enospc@{step}":
        from safetensors import SafetensorError

        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def dataset_fingerprint(examples) -> str:
    """sha256 of the tokenized training data (source, ids, labels, weight; packed rows' token weights) in order."""
    return fingerprint(
        [e.source, e.input_ids, e.labels, e.weight, *([e.token_weights] if e.token_weights else [])] for e in examples
    )


def fingerprint(records) -> str:
    """sha256 of JSON-serialisable records, in order."""
    h = hashlib.sha256()
    for record in records:
        h.update(json.dumps(record, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _trainable(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def checkpoint_tensors(model, optimizer, *, keep: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """The trainable tensors and the optimizer state, whole and on the CPU. Sharded (FSDP) tensors are gathered:
    a collective, so every rank calls it; the checkpoint then does not depend on the world size. With `keep`
    False (a rank that writes nothing) each gathered tensor is dropped as it arrives, so the whole state is held
    on the writing rank's host alone (DeepSeek-V3's recipe: 9 GiB of fp32 expert LoRA and 18 of moments, once)."""
    trainable = {}
    for n, p in _trainable(model).items():
        whole = full_tensor(p.detach())
        if keep:
            trainable[n] = whole.cpu().contiguous()
        del whole
    return {"trainable": trainable, "optimizer": _optimizer_tensors(model, optimizer, keep)}


def _optimizer_tensors(model, optimizer, keep: bool) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in _trainable(model).items()}
    out, seen = {}, set()
    for p, state in optimizer.state.items():
        for key, value in state.items():
            whole = full_tensor(value) if torch.is_tensor(value) else value
            if not keep:
                continue
            t = torch.as_tensor(whole).detach().cpu().contiguous()
            if t.data_ptr() in seen:  # bitsandbytes shares its quantization maps between tensors
                t = t.clone()
            seen.add(t.data_ptr())
            out[f"{names[id(p)]}::{key}"] = t
    return out


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {
        "torch_cpu": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np.random.get_state()[1].astype(np.int64)),
    }
    if torch.cuda.is_available():
        out.update({f"torch_cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return out


def _versions() -> dict[str, str]:
    import bitsandbytes
    import peft
    import transformers

    from moe_qlora import __version__

    return {
        "moe_qlora": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "bitsandbytes": bitsandbytes.__version__,
    }


def save_checkpoint(
    run_dir: Path, tensors: dict, scheduler, *, progress: RunProgress, identity: dict, keep: int
) -> Path:
    """Write a complete checkpoint atomically; keep the newest `keep` (those past it removed before writing, the
    oldest of the rest after). tensors: checkpoint_tensors(model,
    optimizer) (gathered by every rank first in sharded runs). `identity`: config hash (and the config:
    config_identity), dataset fp."""
    target = Path(run_dir) / "checkpoints" / f"step-{progress.step:08d}"
    scheduler_state = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    needed = sum(t.numel() * t.element_size() for part in tensors.values() for t in part.values())
    # Room first: checkpoints past `keep` go before this one is written, so a run stopped by a full disk resumes
    # once train.keep_checkpoints is lowered; `keep` of them stay while it is written, should the write fail.
    prune_checkpoints(Path(run_dir), keep)
    with atomic_dir(target, needed) as tmp:
        save_safetensors(tensors["trainable"], tmp / "trainable.safetensors")
        save_safetensors(tensors["optimizer"], tmp / "optimizer.safetensors")
        save_safetensors(_rng_tensors(), tmp / "rng.safetensors")
        failpoint("checkpoint-write", progress.step)
        _, _, pos, has_gauss, cached = np.random.get_state()
        state = {
            "progress": asdict(progress),
            "scheduler": scheduler_state,
            "python_rng": random.getstate(),
            "numpy_rng": [int(pos), int(has_gauss), float(cached)],
            **identity,
            "versions": _versions(),
        }
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        files = sorted(f.name for f in tmp.iterdir())
        (tmp / MANIFEST).write_text(json.dumps({f: sha256_file(tmp / f) for f in files}, indent=1))
    prune_checkpoints(Path(run_dir), keep)
    return target


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    for old in checkpoint_dirs(run_dir)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    root = Path(run_dir) / "checkpoints"
    for leftover in root.glob(".step-*.tmp-*") if root.is_dir() else []:  # from a run killed while saving
        shutil.rmtree(leftover, ignore_errors=True)


def verify(checkpoint: Path) -> str | None:
    """None if every file the manifest lists is there with its sha256; else what is wrong."""
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"no readable manifest ({exc})"
    for name, digest in manifest.items():
        if not (checkpoint / name).is_file():
            return f"{name} is missing"
        if sha256_file(checkpoint / name) != digest:
            return f"{name} does not match its sha256"
    return None


def latest_valid_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint that verifies; corrupt or partial ones are skipped with a warning."""
    for d in checkpoint_dirs(run_dir):
        problem = verify(d)
        if problem is None:
            return d
        log.warning("skipping checkpoint %s: %s", d, problem)
    return None


def check_same_run(checkpoint: Path, state: dict, identity: dict) -> None:
    """CheckpointError when the config or the dataset differs from the checkpoint's, naming the changed keys
    where both sides recorded their config (checkpoints written before they did only have its hash)."""
    for key, label in (("config_hash", "configuration"), ("dataset_fingerprint", "dataset")):
        if state.get(key) == identity.get(key):
            continue
        changed = ""
        if key == "config_hash" and "config" in state and "config" in identity:
            changed = config_changes(state["config"], identity["config"])
        raise CheckpointError(
            f"{checkpoint}: the {label} differs from the one this checkpoint was trained with"
            f"{f' ({changed})' if changed else ''}; resuming would not continue the same run (pass --resume-anyway "
            "to do it regardless)"
        )


def load_checkpoint(
    checkpoint: Path, *, model, optimizer, scheduler, identity: dict, allow_mismatch: bool
) -> RunProgress:
    """Restore trainable tensors, optimizer, scheduler and RNG from `checkpoint`; returns where to go on."""
    state = json.loads((checkpoint / "state.json").read_text())
    if not allow_mismatch:
        check_same_run(checkpoint, state, identity)
    params = _trainable(model)
    saved = load_file(str(checkpoint / "trainable.safetensors"))
    if saved.keys() != params.keys():
        raise CheckpointError(f"{checkpoint}: trainable tensors differ from this model's (another adapter layout?)")
    if reshaped := [n for n, p in params.items() if tuple(saved[n].shape) != tuple(p.shape)]:
        name = reshaped[0]
        raise CheckpointError(
            f"{checkpoint}: {len(reshaped)} trainable tensor(s) have another shape than this run's ({name}: "
            f"{tuple(saved[name].shape)} saved, {tuple(params[name].shape)} now; lora.rank changed?): a resume, even "
            "with --resume-anyway, goes on with the same LoRA; start a new run (another output.dir) for this one"
        )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(shard_like(p, saved[name]))  # a sharded run takes its shard of the whole tensor
    moments = load_file(str(checkpoint / "optimizer.safetensors"))
    for name, p in params.items():
        own = {k.split("::", 1)[1]: v for k, v in moments.items() if k.startswith(f"{name}::")}
        restore_state(optimizer, p, {k: shard_like(p, v) if v.shape == p.shape else v for k, v in own.items()})
    scheduler.load_state_dict({**scheduler.state_dict(), **state["scheduler"]})
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    rng = load_file(str(checkpoint / "rng.safetensors"))
    torch.set_rng_state(rng["torch_cpu"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state_all([rng[k] for k in sorted(k for k in rng if k.startswith("torch_cuda_"))])
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    pos, has_gauss, cached = state["numpy_rng"]
    np.random.set_state(("MT19937", rng["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    return RunProgress(**{**state["progress"], "world": state.get("world", 0)})
