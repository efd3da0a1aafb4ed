"""An adapter in PEFT's layout: our per-expert LoRA converted to and from PEFT's keys, and read into a model.

PEFT wraps a 3D expert parameter (E, out, in) in a ParamWrapper holding
  lora_A: Linear(in, r*E), weight (r*E, in), rows expert-major: row e*r + j is A_e[j];
  lora_B: Linear(r*E, out), weight (out, r*E), columns rank-major: column j*E + e is B_e[:, j]
(ParamWrapper.get_delta_weight reshapes A to (E, r, in) and B to (out, r, E)). One wrapper is nested per
targeted parameter, in the module's parameter order: gate_up_proj (up_proj for non-gated experts) is the
inner one, reached as `base_layer`. Writing and verifying an adapter folder is export/'s (export.adapter).
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict

from moe_qlora.config.sections import LoraSection
from moe_qlora.model.adapter_file import read_checked_adapter
from moe_qlora.model.peft_roundtrip import PEFT_PREFIX, first_few
from moe_qlora.moe.expert_lora import ExpertLoRA
from moe_qlora.moe.expert_stacks import experts_modules
from moe_qlora.moe.layer_state import read_state

# Keys of each expert LoRA factor relative to the experts module, in PEFT's nesting.
PEFT_EXPERT_KEYS = {
    "gate_up_a": "base_layer.lora_A.weight",
    "gate_up_b": "base_layer.lora_B.weight",
    "down_a": "lora_A.weight",
    "down_b": "lora_B.weight",
}


def _flat_a(a: torch.Tensor) -> torch.Tensor:
    e, r, d = a.shape  # (E, r, in) -> (r*E, in), row e*r + j is A_e[j]
    return a.reshape(e * r, d)


def _flat_b(b: torch.Tensor) -> torch.Tensor:
    e, d, r = b.shape  # (E, out, r) -> (out, r*E), column j*E + e is B_e[:, j]
    return b.permute(1, 2, 0).reshape(d, r * e)


def _unflat_a(flat: torch.Tensor, experts: int) -> torch.Tensor:
    return flat.reshape(experts, -1, flat.shape[1])  # inverse of _flat_a


def _unflat_b(flat: torch.Tensor, experts: int) -> torch.Tensor:
    return flat.reshape(flat.shape[0], -1, experts).permute(2, 0, 1)  # inverse of _flat_b


def _projections():
    """(our factor prefix, PEFT's lora_A key, PEFT's lora_B key) per expert stack."""
    return [(p, PEFT_EXPERT_KEYS[f"{p}_a"], PEFT_EXPERT_KEYS[f"{p}_b"]) for p in ("gate_up", "down")]


def peft_reads_transposed(module) -> bool:
    """True when the stack is stored (E, in, out) but PEFT will read it as (E, out, in): PEFT asks the module
    for `is_transposed`, which the consumer's fresh Llama-4 experts do not have (we set it when adopting)."""
    return bool(getattr(module, "is_transposed", False) and read_state(module).adopted)


def expert_lora_to_peft(lora: ExpertLoRA, *, swap: bool = False) -> dict[str, torch.Tensor]:
    """Our (E, r, in) / (E, out, r) factors as PEFT's flat lora_A / lora_B weights.

    swap: PEFT reads the stack transposed (peft_reads_transposed), so its delta is ours transposed,
    (B A)^T = A^T B^T: its A is our B^T and its B is our A^T.
    """
    out = {}
    for proj, key_a, key_b in _projections():
        a, b = getattr(lora, f"{proj}_a").detach(), getattr(lora, f"{proj}_b").detach()
        if swap:
            a, b = b.transpose(1, 2), a.transpose(1, 2)
        out[key_a], out[key_b] = _flat_a(a), _flat_b(b)
    return {k: v.contiguous().float() for k, v in out.items()}


def peft_to_expert_lora(tensors: dict[str, torch.Tensor], lora: ExpertLoRA, *, swap: bool = False) -> None:
    """Load PEFT-layout expert factors (keys as in PEFT_EXPERT_KEYS) into `lora`, in place (inverse of the above)."""
    for proj, key_a, key_b in _projections():
        e = getattr(lora, f"{proj}_a").shape[0]
        a, b = _unflat_a(tensors[key_a], e), _unflat_b(tensors[key_b], e)
        if swap:
            a, b = b.transpose(1, 2), a.transpose(1, 2)
        with torch.no_grad():
            getattr(lora, f"{proj}_a").copy_(a)
            getattr(lora, f"{proj}_b").copy_(b)


# Fused shared-expert modules (experts.SPLIT_GATE_UP_EXPERTS) hold gate_proj, up_proj, down_proj for their
# consumers: three PEFT wrappers, gate_proj innermost. Our fused gate_up LoRA is gate: (A, B[:I]), up: (A, B[I:]).
SPLIT_PEFT_KEYS = {
    "gate": ("base_layer.base_layer.lora_A.weight", "base_layer.base_layer.lora_B.weight"),
    "up": ("base_layer.lora_A.weight", "base_layer.lora_B.weight"),
    "down": ("lora_A.weight", "lora_B.weight"),
}


def split_lora_to_peft(lora: ExpertLoRA) -> dict[str, torch.Tensor]:
    """Our fused gate_up factors as PEFT's separate gate_proj / up_proj LoRA (the same A for both)."""
    a1, b1, a2, b2 = (t.detach() for t in lora.factors())
    half = b1.shape[1] // 2
    pairs = {"gate": (a1, b1[:, :half]), "up": (a1, b1[:, half:]), "down": (a2, b2)}
    out = {}
    for proj, (a, b) in pairs.items():
        key_a, key_b = SPLIT_PEFT_KEYS[proj]
        out[key_a], out[key_b] = _flat_a(a), _flat_b(b)
    return {k: v.float().clone() for k, v in out.items()}  # gate and up share A: separate copies for safetensors


def peft_to_split_lora(tensors: dict[str, torch.Tensor], lora: ExpertLoRA, where: str = "") -> None:
    """Inverse of split_lora_to_peft; gate_proj and up_proj must share their A (else the fused LoRA cannot
    hold them, and the adapter is refused)."""
    e = lora.gate_up_a.shape[0]

    def factors(proj):
        key_a, key_b = SPLIT_PEFT_KEYS[proj]
        return _unflat_a(tensors[key_a], e), _unflat_b(tensors[key_b], e)

    (a_gate, b_gate), (a_up, b_up), (a_down, b_down) = factors("gate"), factors("up"), factors("down")
    if not torch.equal(a_gate, a_up):
        raise AdapterMismatchError(
            f"{where}: gate_proj and up_proj have different LoRA A factors; moe-qlora's fused "
            "gate_up LoRA shares one A, so it cannot hold this adapter"
        )
    with torch.no_grad():
        values = (a_gate, torch.cat([b_gate, b_up], dim=1), a_down, b_down)
        for param, value in zip(lora.factors(), values, strict=True):
            param.copy_(value)


def module_lora_to_peft(module, lora: ExpertLoRA) -> dict[str, torch.Tensor]:
    """The experts module's LoRA under PEFT's keys relative to the module, in the consumer's layout."""
    if read_state(module).split_gate_up:
        return split_lora_to_peft(lora)
    return expert_lora_to_peft(lora, swap=peft_reads_transposed(module))


def peft_to_module_lora(module, tensors: dict[str, torch.Tensor], lora: ExpertLoRA, where: str = "") -> None:
    if read_state(module).split_gate_up:
        peft_to_split_lora(tensors, lora, where)
    else:
        peft_to_expert_lora(tensors, lora, swap=peft_reads_transposed(module))


def peft_keys_of(module) -> list[str]:
    if read_state(module).split_gate_up:
        return [k for pair in SPLIT_PEFT_KEYS.values() for k in pair]
    return list(PEFT_EXPERT_KEYS.values())


def _peft_prefix(model) -> str:
    return "" if isinstance(model, PeftModel) else PEFT_PREFIX


def adapter_state_dict(model) -> dict[str, torch.Tensor]:
    """Every LoRA tensor of `model` under the key PEFT's `PeftModel.from_pretrained` expects, in host memory
    (the file, PEFT's loader and every comparison with a loaded file are on the host; the run may be on a GPU)."""
    state = {}
    if isinstance(model, PeftModel):
        peft_state = get_peft_model_state_dict(model)
        state.update({k: v.detach().float() for k, v in peft_state.items() if "moe_lora" not in k})
    prefix = _peft_prefix(model)
    for name, module in experts_modules(model):
        lora = getattr(module, "moe_lora", None)
        if lora is not None:
            factors = module_lora_to_peft(module, lora)
            state.update({f"{prefix}{name}.{k}": v for k, v in factors.items()})
    return {k: v.detach().to("cpu") for k, v in state.items()}


class AdapterMismatchError(ValueError):
    """An adapter that does not fit this model: made for another base model or another LoRA layout."""


def load_adapter(model, adapter_dir: str | Path, cfg: LoraSection) -> int:
    """Load an exported adapter (this project's or PEFT's, same layout) into `model`'s LoRA; returns tensors set.

    The file must hold exactly this model's LoRA tensors with their shapes, and the scale must match;
    otherwise the adapter belongs to another base model or LoRA layout and is refused, naming the keys.
    After loading, every tensor must be in its module with the file's values (PEFT's own loading can rename
    keys and drop them silently), else the load is refused too.
    """
    adapter_dir = Path(adapter_dir)
    saved, config = read_checked_adapter(adapter_dir, "load")
    other_scaling = {k: config[k] for k in ("use_rslora", "alpha_pattern", "rank_pattern") if config.get(k)}
    if other_scaling:  # PEFT would scale these by alpha/sqrt(r) or per module; this run's LoRA uses alpha/r
        raise AdapterMismatchError(
            f"{adapter_dir}: adapter_config.json sets {other_scaling}; this tool trains and "
            "loads one rank and alpha for every module, scaled by alpha/r"
        )
    if (config.get("r"), config.get("lora_alpha")) != (cfg.rank, cfg.alpha):
        raise AdapterMismatchError(
            f"{adapter_dir}: trained with r={config.get('r')}, lora_alpha={config.get('lora_alpha')}; "
            f"this run has lora.rank={cfg.rank}, lora.alpha={cfg.alpha}"
        )
    expected = adapter_state_dict(model)
    check_adapter_keys(adapter_dir, saved, expected)
    prefix, expert_keys = _peft_prefix(model), set()
    for name, module in experts_modules(model):
        lora = getattr(module, "moe_lora", None)
        if lora is not None:
            keys = {k: f"{prefix}{name}.{k}" for k in peft_keys_of(module)}
            peft_to_module_lora(module, {k: saved[full] for k, full in keys.items()}, lora, f"{adapter_dir}: {name}")
            expert_keys.update(keys.values())
    if isinstance(model, PeftModel):
        set_peft_model_state_dict(model, {k: v for k, v in saved.items() if k not in expert_keys})
    loaded = adapter_state_dict(model)
    not_landed = sorted(k for k, v in saved.items() if not torch.equal(loaded[k], v.float()))
    if not_landed:
        raise AdapterMismatchError(
            f"{adapter_dir}: {len(not_landed)} tensor(s) did not load into their modules: {first_few(not_landed)} "
            "(PEFT renamed or re-targeted them on load?); refusing to train from a partly loaded adapter"
        )
    return len(expected)


def check_adapter_keys(adapter_dir: Path, saved: dict, expected: dict) -> None:
    """The file must hold exactly this model's LoRA tensors, shapes included; every mismatch is named."""
    missing = sorted(expected.keys() - saved.keys())
    if missing:
        raise AdapterMismatchError(
            f"{adapter_dir}: has no {first_few(missing)} ({len(missing)} tensor(s) this model's "
            "LoRA needs; an adapter for another model or targets?)"
        )
    for key, tensor in expected.items():
        if saved[key].shape != tensor.shape:
            raise AdapterMismatchError(
                f"{adapter_dir}: {key} has shape {tuple(saved[key].shape)}, this model needs {tuple(tensor.shape)} "
                "(an adapter for another base model)"
            )
    extra = sorted(saved.keys() - expected.keys())
    if extra:
        raise AdapterMismatchError(f"{adapter_dir}: tensors this model has no LoRA for: {first_few(extra)}")
