"""An adapter checked against the base its adapter_config.json names, before an export is written: an adapter
moved beside another model's name (another depth or width) would otherwise become a file whose tensors name
layers the base does not have, or shapes its runtime rejects only when it loads them.

Checked from the base's config.json alone and a weightless (meta) skeleton of its text model: every LoRA
tensor's decoder layer exists, and a LoRA on a linear module has that module's inputs (A's columns) and outputs
(B's rows). Expert and router LoRA (PEFT's parameter targets) are checked by layer only: their factors stack the
experts, which the export's own readers check against each other.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from moe_qlora.export.family_tables import ExportError

LAYER_PATH = re.compile(r"(?:^|\.)(?P<path>layers\.(?P<layer>\d+)\..+?)\.lora_(?P<ab>[AB])\.weight$")


def base_text_config(config: dict, where: Path):
    """The text config of the base adapter_config.json names (a local folder, builtin:, or the hub cache)."""
    from transformers import AutoConfig

    from moe_qlora.model.model_path import resolve_model_path

    base = config.get("base_model_name_or_path")
    if not base:
        raise ExportError(f"{where}/adapter_config.json: no base_model_name_or_path")
    try:
        return AutoConfig.from_pretrained(resolve_model_path(base))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{where}: cannot read the base model's config.json ({base}): {exc}") from None


def linear_modules_by_layer_path(full_config) -> dict[str, nn.Linear]:
    """{'layers.N.<path>': module} of every linear module of the base's text model, built on the meta device
    (no memory, a few seconds at most for the largest models); a path two modules share is left out."""
    from moe_qlora.model.classes import text_model_from_config

    with torch.device("meta"):
        model = text_model_from_config(full_config, dtype=torch.float32)
    found: dict[str, nn.Linear | None] = {}
    for name, module in model.named_modules():
        m = LAYER_PATH.search(f"{name}.lora_A.weight")
        if m and isinstance(module, nn.Linear):
            found[m["path"]] = None if m["path"] in found else module
    return {path: module for path, module in found.items() if module is not None}


def refuse_other_base(tensors: dict[str, torch.Tensor], config: dict, where: Path) -> None:
    """Every LoRA tensor fits the base adapter_config.json names (layer, and a linear module's shape), or the
    export is refused naming the first that does not and what the base has."""
    full = base_text_config(config, where)
    text = full.get_text_config()
    layers = getattr(text, "num_hidden_layers", None)
    base = config["base_model_name_or_path"]
    advice = (
        f"an adapter trained on another model? adapter_config.json names {base} as its base; "
        "set base_model_name_or_path to the model it was trained on"
    )
    parsed = {key: m for key in sorted(tensors) if (m := LAYER_PATH.search(key))}
    if layers is not None:
        if beyond := sorted({int(m["layer"]) for m in parsed.values() if int(m["layer"]) >= layers}):
            raise ExportError(
                f"{where}: has LoRA for layer {beyond[0]}"
                + (f" (and {len(beyond) - 1} more)" if len(beyond) > 1 else "")
                + f", and its base has {layers} layer{'s' * (layers != 1)} ({advice})"
            )
    linears = linear_modules_by_layer_path(full)
    for key, m in parsed.items():
        module = linears.get(m["path"])
        if module is None:
            continue
        want = (module.in_features,) if m["ab"] == "A" else (module.out_features,)
        have = tuple(tensors[key].shape[1:]) if m["ab"] == "A" else tuple(tensors[key].shape[:1])
        if have != want:
            side = "inputs" if m["ab"] == "A" else "outputs"
            raise ExportError(
                f"{where}: {key} is LoRA for {have[0]} {side}, and the base's {m['path']} has {want[0]} ({advice})"
            )
