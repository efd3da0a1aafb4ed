"""An adapter folder's files read once, the same way by every command that reads one (generate, merge, export,
check-norms, a run starting from an adapter): a file that safetensors cannot read, or a tensor holding NaN or
inf, is said in one sentence naming the file and the tensor, never a traceback or the wrong cause.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from moe_qlora.model.peft_roundtrip import ADAPTER_CONFIG, ADAPTER_WEIGHTS, first_few


class AdapterReadError(ValueError):
    """The file cannot be read as a LoRA adapter, or holds values no finished run writes (exit code 2)."""


def adapter_weights_path(path: str | Path) -> Path:
    """adapter_model.safetensors of a folder, or the file itself; refused when it is not there."""
    path = Path(path)
    weights = path / ADAPTER_WEIGHTS if path.is_dir() else path
    if not weights.is_file():
        raise AdapterReadError(
            f"{path}: no such adapter file (an adapter is a folder holding {ADAPTER_WEIGHTS} and {ADAPTER_CONFIG}, "
            "as a run writes into output.dir/adapter)"
        )
    return weights


def read_safetensors(weights: Path) -> dict[str, torch.Tensor]:
    """Every tensor of `weights`; a truncated or garbled file is named with what safetensors found wrong."""
    try:
        with safe_open(str(weights), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterReadError(f"{weights}: not a readable safetensors file ({exc})") from None


def read_adapter_config(path: Path) -> dict:
    """adapter_config.json as a dict; a file that is not a JSON object is named with the line at fault."""
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise AdapterReadError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except OSError as exc:
        raise AdapterReadError(f"{path}: not readable ({exc.strerror or exc})") from None
    if not isinstance(config, dict):
        raise AdapterReadError(f"{path}: expected a JSON object of PEFT's LoRA settings, found {type(config).__name__}")
    return config


def non_finite_counts(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """{key: how many NaN or inf values} for every tensor holding any, in key order."""
    counts = {k: int((~torch.isfinite(t)).sum()) for k, t in sorted(tensors.items()) if t.is_floating_point()}
    return {k: n for k, n in counts.items() if n}


def refuse_non_finite(tensors: dict[str, torch.Tensor], weights: Path, doing: str) -> None:
    """An adapter with NaN or inf anywhere is refused before `doing` anything with it, naming the tensors: merged
    or exported, it would spread them into every output; loaded, nothing it computes means anything."""
    if counts := non_finite_counts(tensors):
        first = next(iter(counts))
        raise AdapterReadError(
            f"{weights}: {first} holds {counts[first]} NaN or inf value(s) of {tensors[first].numel()}"
            + (
                f", and {len(counts) - 1} more tensor(s) do too ({first_few(list(counts)[1:])})"
                if len(counts) > 1
                else ""
            )
            + f"; refusing to {doing} it (the run that wrote it diverged, or the file was damaged; "
            "`moe-qlora check-norms` lists every such tensor, and an earlier checkpoint's adapter may be sound)"
        )


def read_checked_adapter(adapter_dir: str | Path, doing: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, adapter_config) of an adapter folder, readable and finite, before `doing` anything with it."""
    weights = adapter_weights_path(adapter_dir)
    tensors = read_safetensors(weights)
    config_path = weights.parent / ADAPTER_CONFIG
    if not config_path.is_file():
        raise AdapterReadError(f"{weights.parent}: no {ADAPTER_CONFIG} beside {weights.name}")
    config = read_adapter_config(config_path)
    refuse_non_finite(tensors, weights, doing)
    return tensors, config
