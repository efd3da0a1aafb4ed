"""Export adapters in PEFT's own format, experts in the layout PEFT uses for `target_parameters`.

PEFT wraps a 3D expert parameter (E, out, in) in a ParamWrapper holding
  lora_A: Linear(in, r*E), weight (r*E, in), rows expert-major: row e*r + j is A_e[j];
  lora_B: Linear(r*E, out), weight (out, r*E), columns rank-major: column j*E + e is B_e[:, j]
(ParamWrapper.get_delta_weight reshapes A to (E, r, in) and B to (out, r, E)). One wrapper is nested per
targeted parameter, in the module's parameter order: gate_up_proj (up_proj for non-gated experts) is the
inner one, reached as `base_layer`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from moe_qlora.common.fileio import atomic_dir
from moe_qlora.config.sections import LoraSection
from moe_qlora.model.adapters import target_parameter_names
from moe_qlora.model.peft_roundtrip import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    clean_base_config,
    first_few,
    load_like_peft,
)
from moe_qlora.moe.experts import ExpertLoRA, decoded_module_stack, experts_modules, holds_mxfp4, stack_names
from moe_qlora.moe.layer_state import read_state
from moe_qlora.moe.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX

TRAINED_ON = "moe_qlora.json"
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
    return "" if isinstance(model, PeftModel) else "base_model.model."


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


def adapter_config(model, cfg: LoraSection, base_model_name_or_path: str) -> LoraConfig:
    peft = model.peft_config["default"] if isinstance(model, PeftModel) else None
    linear_targets = sorted(peft.target_modules or []) if peft else []
    router_targets = sorted(peft.target_parameters or []) if peft else []
    target_parameters = target_parameter_names(model) + router_targets
    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        # PEFT refuses to load LoRA on parameters (experts, routers) with dropout; it only matters in training
        lora_dropout=0.0 if target_parameters else cfg.dropout,
        # an empty list, not None: given None, PEFT adds LoRA on its own default targets for the family when it
        # loads the adapter (zero-initialized, reported as missing keys: Gemma-4's q_proj and v_proj)
        target_modules=linear_targets,
        target_parameters=target_parameters or None,
        base_model_name_or_path=base_model_name_or_path,
        task_type="CAUSAL_LM",
    )


def base_quantization(model) -> dict[str, bool | str]:
    """How the base was quantized when the adapter was trained: the weights it learned against (double
    quantization changes each decoded weight by up to ~1e-3 of its block's absmax; MXFP4 experts kept as
    published are other weights than their NF4 re-quantization): model.* settings by name."""
    import bitsandbytes as bnb

    nested = {"expert_double_quant": None, "linear_double_quant": None}
    expert_stacks = set()
    for _, m in experts_modules(model):
        if (was_nested := read_state(m).nested_scales) is not None:  # made shardable: scales decoded
            nested["expert_double_quant"] = bool(nested["expert_double_quant"]) or was_nested
        elif not holds_mxfp4(m):  # MXFP4 stacks are the checkpoint's own bytes: nothing to record
            expert_stacks |= {id(getattr(m, n)) for n in stack_names(m)}
    for p in model.parameters():
        if isinstance(p, bnb.nn.Params4bit) and p.quant_state is not None:
            key = "expert_double_quant" if id(p) in expert_stacks else "linear_double_quant"
            nested[key] = bool(nested[key]) or bool(p.quant_state.nested)
    recorded: dict[str, bool | str] = {k: bool(v) for k, v in nested.items() if v is not None}
    if experts_modules(model):
        recorded["expert_format"] = "mxfp4" if any(holds_mxfp4(m) for _, m in experts_modules(model)) else "nf4"
    return recorded


def save_adapter(model, out_dir: str | Path, *, cfg: LoraSection, base_model_name_or_path: str) -> Path:
    """Write adapter_model.safetensors + adapter_config.json atomically into `out_dir`, and beside them
    moe_qlora.json: the base's quantization, so that generate and merge rebuild the weights it was trained on."""
    state = adapter_state_dict(model)
    config = adapter_config(model, cfg, base_model_name_or_path)
    with atomic_dir(out_dir, sum(t.numel() * t.element_size() for t in state.values())) as tmp:
        save_file(state, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / TRAINED_ON).write_text(json.dumps({"base_quantization": base_quantization(model)}, indent=2))
        config_dict = config.to_dict()
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(_jsonable(config_dict), indent=2, sort_keys=True))
    return Path(out_dir)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [_jsonable(v) for v in (sorted(obj) if isinstance(obj, set) else obj)]
    if hasattr(obj, "value"):  # enums
        return obj.value
    return obj


def plain_key(name: str) -> str:
    """A parameter name of the adapted model as the plain transformers model names it."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def dequantized_base_state_dict(model, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The base model's weights as the training model sees them (4-bit ones dequantized), under the
    names of the plain transformers model: what a merge, or an exact reference model, starts from."""
    import bitsandbytes as bnb

    from moe_qlora.moe.nf4 import dequantize_param

    state = {}
    for name, p in model.named_parameters():
        if "lora" in name:
            continue
        key = plain_key(name)
        state[key] = dequantize_param(p, dtype) if isinstance(p, bnb.nn.Params4bit) else p.detach().to(dtype)
    for name, module in experts_modules(model):  # fused shared-expert stacks back to the checkpoint's gate / up
        if holds_mxfp4(module):  # the published MXFP4 bytes decoded (exactly) to the module's own stacks
            key = name.removeprefix(PEFT_PREFIX)
            for stack in stack_names(module):
                state.pop(f"{key}.{stack}{BLOCKS_SUFFIX}"), state.pop(f"{key}.{stack}{SCALES_SUFFIX}")
                state[f"{key}.{stack}"] = decoded_module_stack(module, stack, dtype)
        if read_state(module).split_gate_up:
            key = name.removeprefix(PEFT_PREFIX)
            state[f"{key}.gate_proj"], state[f"{key}.up_proj"] = state.pop(f"{key}.gate_up_proj").chunk(2, dim=1)
    return state


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
    try:
        saved = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
        config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterMismatchError(f"{adapter_dir}: not a readable adapter ({exc})") from None
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


class AdapterVerificationError(RuntimeError):
    """A written adapter that does not hold the run's LoRA, or that PEFT would not load as trained."""


def _base_model(model):
    return model.get_base_model() if isinstance(model, PeftModel) else model


def untracked_trainables(model) -> list[str]:
    """Trainable parameters the export has no key for: anything but PEFT's LoRA (exported by PEFT's own state
    dict) and the expert LoRA of experts modules (exported by module_lora_to_peft)."""
    exported = {
        id(p) for _, m in experts_modules(model) if (lora := getattr(m, "moe_lora", None)) for p in lora.factors()
    }
    return sorted(
        n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n and id(p) not in exported
    )


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


def verify_adapter(model, adapter_dir: str | Path) -> int:
    """Check a written adapter the way its consumer will read it; returns the number of tensors checked.

    1. Every trainable tensor of the run is in the file, with the values the run has (in PEFT's layout).
    2. `PeftModel.from_pretrained` on the base model (a weightless skeleton of it) puts every tensor of the
       file into a module with the same values, and creates no LoRA tensor the file lacks.
    Raises AdapterVerificationError naming the keys and the likely cause; the adapter is left as written.
    """
    adapter_dir = Path(adapter_dir)
    expected = adapter_state_dict(model)
    saved = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    problems = []
    if untracked := untracked_trainables(model):
        problems.append(f"trainable parameters with no key in the export: {first_few(untracked)}")
    if missing := sorted(expected.keys() - saved.keys()):
        problems.append(f"tensors of the run missing from the file: {first_few(missing)}")
    if extra := sorted(saved.keys() - expected.keys()):
        problems.append(f"tensors in the file the run does not have: {first_few(extra)}")
    if differ := sorted(k for k in expected.keys() & saved.keys() if not torch.equal(expected[k], saved[k])):
        problems.append(f"tensors whose values differ from the run's: {first_few(differ)}")
    base = _base_model(model)
    report = load_like_peft(adapter_dir, clean_base_config(base.config), model_class=type(base))
    if not report.ok:
        problems.append("loaded by PEFT's from_pretrained, " + report.describe(base.config.model_type))
    if problems:
        raise AdapterVerificationError(
            f"the adapter written to {adapter_dir} would not load as trained: "
            + "; ".join(problems)
            + ". The file is kept as written."
        )
    return len(saved)
