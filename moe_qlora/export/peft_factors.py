"""The run's PEFT adapter read back as the factors every export format lays out: the expert LoRA per layer as
(E, ...) tensors (ExpertLayer), the other LoRA by (layer, module path, projection), all of it checked to lie in
one stack of decoder layers; read_run_adapter refuses a family or an adapter no format writes, by name.

Expert factors in our PEFT file (export/adapter.py): lora_A (r*E, in) rows expert-major (row e*r + j is A_e[j]);
lora_B (out, r*E) columns rank-major (column j*E + e is B_e[:, j]); expert e's delta is scale * B_e A_e.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_qlora.export.base_fit import refuse_other_base
from moe_qlora.export.family_tables import (
    FAMILIES,
    NOT_EXPORTED,
    PEFT_AS_IS,
    ExportError,
    FamilyNames,
    base_model_type,
)
from moe_qlora.export.norms import read_adapter_tensors
from moe_qlora.model.adapter_file import refuse_non_finite

EXPERT_KEY = re.compile(
    r"(?P<prefix>.*?)\.layers\.(?P<layer>\d+)\.(?:(?P<path>.+)\.)?experts\.(?P<inner>base_layer\.)?"
    r"lora_(?P<ab>[AB])\.weight"
)  # path: none for Gemma-4 (layers.N.experts)
LINEAR_KEY = re.compile(
    r"(?P<prefix>.*?)\.layers\.(?P<layer>\d+)\.(?P<path>.+)\.(?P<proj>[a-z_0-9]+)\.lora_"
    r"(?P<ab>[AB])\.weight"
)


@dataclass
class ExpertLayer:
    """One layer's expert LoRA: gate_up A (E, r, H), B (E, 2I, r); down A (E, r, I), B (E, H, r)."""

    gate_up_a: torch.Tensor
    gate_up_b: torch.Tensor
    down_a: torch.Tensor
    down_b: torch.Tensor


def unflatten_a(flat: torch.Tensor, experts: int) -> torch.Tensor:
    return flat.reshape(experts, -1, flat.shape[1])


def unflatten_b(flat: torch.Tensor, experts: int) -> torch.Tensor:
    return flat.reshape(flat.shape[0], -1, experts).permute(2, 0, 1)


def read_run_adapter(adapter_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict, str, FamilyNames]:
    """(tensors, adapter_config, model_type, the family's names) of a PEFT adapter folder."""
    tensors, config, source = read_adapter_tensors(adapter_dir)
    if config is None:
        raise ExportError(f"{adapter_dir}: no adapter_config.json beside {source.name}")
    refuse_non_finite(tensors, source, "export")
    model_type = base_model_type(config, Path(adapter_dir))
    if model_type in NOT_EXPORTED:
        raise ExportError(
            f"{model_type}: not written as GGUF ({NOT_EXPORTED[model_type]}), nor per-expert or for "
            f"vLLM (names unchecked); {PEFT_AS_IS}"
        )
    if model_type not in FAMILIES:
        raise ExportError(
            f"{model_type}: no per-expert / GGUF names known for this family (known: "
            f"{', '.join(sorted(FAMILIES))}); {PEFT_AS_IS}"
        )
    if config.get("use_rslora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ExportError(f"{adapter_dir}: rsLoRA or per-module ranks/alphas are not written by these formats")
    refuse_other_base(tensors, config, Path(adapter_dir))
    return tensors, config, model_type, FAMILIES[model_type]


def expert_layers(
    tensors: dict[str, torch.Tensor], rank: int, names: FamilyNames | None = None
) -> dict[int, ExpertLayer]:
    """Expert LoRA per layer, (E, ...) factors, from our PEFT keys, as the math sees them: B's outputs are the
    projection's rows, gate's first and then up's (Llama-4's swapped roles and GPT-OSS's interleaving undone)."""
    layers = peft_expert_layers(tensors, rank)
    if names is not None:
        layers = {n: canonical(x, names) for n, x in layers.items()}
    return layers


def canonical(x: ExpertLayer, names: FamilyNames) -> ExpertLayer:
    if names.peft_swapped:  # PEFT's delta is ours transposed: (B A)^T = A^T B^T, its A our B^T, its B our A^T
        x = ExpertLayer(
            x.gate_up_b.transpose(1, 2), x.gate_up_a.transpose(1, 2), x.down_b.transpose(1, 2), x.down_a.transpose(1, 2)
        )
    if names.interleaved_gate_up:  # output 2j is gate j, 2j + 1 is up j
        x = ExpertLayer(x.gate_up_a, torch.cat([x.gate_up_b[:, 0::2], x.gate_up_b[:, 1::2]], dim=1), x.down_a, x.down_b)
    return x


def peft_expert_layers(tensors: dict[str, torch.Tensor], rank: int) -> dict[int, ExpertLayer]:
    """Expert LoRA per layer, (E, ...) factors, as our PEFT keys hold them."""
    parts: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = EXPERT_KEY.fullmatch(key)
        if m:
            which = ("gate_up_" if m["inner"] else "down_") + m["ab"].lower()
            parts.setdefault(int(m["layer"]), {})[which] = t.float()
    layers = {}
    for layer, p in sorted(parts.items()):
        if set(p) != {"gate_up_a", "gate_up_b", "down_a", "down_b"}:
            raise ExportError(f"layer {layer}: expert LoRA has {sorted(p)}, expected gate_up and down A and B")
        e = p["gate_up_a"].shape[0] // rank
        layers[layer] = ExpertLayer(
            unflatten_a(p["gate_up_a"], e),
            unflatten_b(p["gate_up_b"], e),
            unflatten_a(p["down_a"], e),
            unflatten_b(p["down_b"], e),
        )
    return layers


def linear_factors(tensors: dict[str, torch.Tensor]) -> dict[tuple[int, str, str], dict[str, torch.Tensor]]:
    """{(layer, module path, projection): {"A": (r, in), "B": (out, r)}} of the non-expert LoRA."""
    check_one_decoder(tensors)
    out: dict = {}
    for key, t in tensors.items():
        if EXPERT_KEY.fullmatch(key):
            continue
        m = LINEAR_KEY.fullmatch(key)
        if m is None:
            raise ExportError(f"{key}: a LoRA tensor outside the decoder layers; these formats cannot place it")
        out.setdefault((int(m["layer"]), m["path"], m["proj"]), {})[m["ab"]] = t.float()
    return out


def check_one_decoder(tensors: dict[str, torch.Tensor]) -> str:
    """The module path of the decoder layers the adapter's LoRA is in (where the experts are), or an
    ExportError for LoRA in another stack of layers: a vision tower's (MiniMax-M3-VL's has q_proj too) would
    land on the text layer of the same index, and no format here can hold it (llama.cpp keeps encoders in a
    separate mmproj file)."""
    experts = {m["prefix"] for k in tensors if (m := EXPERT_KEY.fullmatch(k))}
    linears: dict[str, str] = {}  # prefix: its first key
    for k in sorted(tensors):
        if (m := LINEAR_KEY.fullmatch(k)) and not EXPERT_KEY.fullmatch(k):
            linears.setdefault(m["prefix"], k)
    decoder = experts or set(linears)
    if len(decoder) == 1 and set(linears) <= decoder:
        return next(iter(decoder))
    if not decoder:
        raise ExportError(f"no LoRA tensor under the decoder layers (keys such as {next(iter(tensors), None)!r})")
    if experts:
        found = f"outside the experts' decoder layers ({', '.join(sorted(experts))}): " + ", ".join(
            sorted(k for p, k in linears.items() if p not in experts)
        )
    else:
        found = "in several stacks of layers: " + ", ".join(sorted(linears.values()))
    raise ExportError(
        f"LoRA {found}; a vision or audio encoder's LoRA has no place in these formats (llama.cpp "
        "keeps encoders in a separate mmproj file). Train with lora.target_modules: auto, which keeps "
        "to the language model, or name its modules by a longer suffix (language_model.layers...)"
    )
