"""What makes a resume the same run, read without torch: the resumable part of the config, its hash as a checkpoint
records it, and the keys a changed config changed. The CLI compares the config with the run's checkpoints before
any heavy import, so a resume that would be refused is refused before the model loads (minutes for a big one).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

STEP_DIR = re.compile(r"^step-(\d{8})$")
MANIFEST = "manifest.json"  # written last into a checkpoint folder (its files' sha256), before it is renamed final

# model keys that change where the experts live, never a bit of what is computed (tests/moe/test_offload.py): a run
# may resume with expert offload switched on or off.
PLACEMENT = {"expert_offload", "offload_resident_layers"}
# train keys that change when and where a run saves or logs, or where it keeps what it computes, never what it
# computes.
BOOKKEEPING = {
    "resume",
    "save_every",
    "save_every_minutes",
    "keep_checkpoints",
    "log_every",
    "eval_every",
    "keep_best",
    "dist_timeout_s",
    "parallel",
    "ep_size",  # as `parallel`: where the experts are computed, the same sums in another order
    "ep_dense",
    # the long-context memory helpers: the same step, held in less memory (bitwise for the offload, to fp32
    # rounding for the chunks, as for `parallel`): a run out of memory may resume with them turned on
    "mlp_chunk_tokens",
    "offload_activations",
}


def resumable_config(resolved: dict) -> dict:
    """The resolved config without what may change between a run and its resume (output and bookkeeping)."""
    relevant = {k: v for k, v in resolved.items() if k != "output"}
    relevant["train"] = {k: v for k, v in relevant.get("train", {}).items() if k not in BOOKKEEPING}
    relevant["model"] = {k: v for k, v in relevant.get("model", {}).items() if k not in PLACEMENT}
    return relevant


def config_hash(resolved: dict) -> str:
    """sha256 of the resolved config's resumable_config."""
    return hashlib.sha256(json.dumps(resumable_config(resolved), sort_keys=True).encode()).hexdigest()


def config_identity(resolved: dict) -> dict:
    """What a checkpoint records of the config: its hash, which a resume compares, and the resumable config
    itself, so that a refused resume can name the keys that changed."""
    return {"config_hash": config_hash(resolved), "config": resumable_config(resolved)}


def flat_keys(tree: dict, prefix: str = "") -> dict[str, object]:
    """{'train.lr': 2e-4, ...}: the leaves of nested sections under dotted keys (lists are leaves)."""
    out = {}
    for k, v in tree.items():
        out.update(flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


UNSET = "(not set)"  # a key one side has and the other has not (a key added or removed since)


def config_changes(old: dict, new: dict, shown: int = 4) -> str:
    """'train.lr 0.005 -> 0.001, lora.rank 8 -> 16': the keys whose value differs, the first `shown` of them."""
    before, after = flat_keys(old), flat_keys(new)
    keys = sorted(k for k in before.keys() | after.keys() if before.get(k, UNSET) != after.get(k, UNSET))
    parts = [f"{k} {_value(before.get(k, UNSET))} -> {_value(after.get(k, UNSET))}" for k in keys[:shown]]
    return ", ".join(parts) + (f" and {len(keys) - shown} more" if len(keys) > shown else "")


def _value(v) -> str:
    text = v if v is UNSET else json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


def refused_config(run_dir: Path, resume: str, resolved: dict) -> str | None:
    """The sentence refusing a resume of `run_dir` (train.resume: auto, or a checkpoint's path) with the config
    `resolved` when no checkpoint it could resume from was trained with that config: it names the newest one and
    the keys that changed. None when one could (its files are verified when the run resumes) or none records a
    config. Only folders with a manifest count (complete ones; the resume checks their hashes). The dataset is
    compared later, once it is read."""
    if resume == "never":
        return None
    folders = [Path(resume)] if resume != "auto" else checkpoint_folders(run_dir)
    states = [(d, read_state(d)) for d in folders]
    states = [(d, state) for d, state in states if state and "config_hash" in state and (d / MANIFEST).is_file()]
    identity = config_identity(resolved)
    if not states or any(state["config_hash"] == identity["config_hash"] for _, state in states):
        return None
    newest, state = states[0]
    changed = config_changes(state["config"], identity["config"]) if isinstance(state.get("config"), dict) else ""
    return (
        f"{newest}: the configuration differs from the one this checkpoint was trained with"
        f"{f' ({changed})' if changed else ''}; resuming would not continue the same run (pass --resume-anyway "
        "to do it regardless)"
    )


def checkpoint_folders(run_dir: Path) -> list[Path]:
    """run_dir's checkpoint folders under their final names, newest first (temporary folders are not listed)."""
    root = Path(run_dir) / "checkpoints"
    try:
        found = [d for d in root.iterdir() if d.is_dir() and STEP_DIR.match(d.name)] if root.is_dir() else []
    except OSError:  # unreadable: the resume says so when it lists them again
        return []
    return sorted(found, key=lambda d: d.name, reverse=True)


def read_state(checkpoint: Path) -> dict | None:
    """A checkpoint's state.json, or None where it cannot be read (the resume then says why)."""
    try:
        state = json.loads((Path(checkpoint) / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None
