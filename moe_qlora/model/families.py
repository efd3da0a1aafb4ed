"""Per-family entries: the LoRA targets a user fine-tuning that family would pick by default.

Experts get per-expert LoRA (expert_lora.py) in every family; this table names the nn.Linear modules that get
PEFT LoRA: attention projections, and the dense MLPs that shared experts and dense-first layers use.
A family not listed gets the generic names that exist in the model. Whatever the targets, a module whose
LoRA the installed PEFT would not load back as trained (a rank-1 adapter is round-tripped through PEFT to
find out) is left out of `auto` and refused when named.
"""

from __future__ import annotations

import logging

from torch import nn

from moe_qlora.config.sections import ConfigError
from moe_qlora.model.peft_roundtrip import clean_base_config, first_few, target_modules_failing_round_trip

log = logging.getLogger(__name__)

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLA_ATTENTION = ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]  # DeepSeek MLA
DENSE_MLP = ["gate_proj", "up_proj", "down_proj"]  # shared experts and dense layers
GATED_DELTANET = ["in_proj_qkvz", "in_proj_qkv", "in_proj_z", "out_proj"]  # linear attention (not its a/b gates)
MAMBA = ["in_proj"]  # Mamba-2 mixers (PEFT refuses their out_proj)

# Names PEFT would move onto the experts (see peft_remapped_names) are dropped from these at run time.
FAMILY_TARGETS: dict[str, list[str]] = {
    "mixtral": ATTENTION,
    "olmoe": ATTENTION,
    "gpt_oss": ATTENTION,
    "qwen2_moe": ATTENTION + DENSE_MLP,  # shared_expert.*; shared_expert_gate stays frozen (a gate)
    "qwen3_moe": ATTENTION + DENSE_MLP,  # dense mlp_only_layers
    "deepseek_v2": MLA_ATTENTION + DENSE_MLP,  # shared_experts.* and first_k_dense_replace layers
    "deepseek_v3": MLA_ATTENTION + DENSE_MLP,
    "glm4_moe": ATTENTION + DENSE_MLP,
    "laguna": ATTENTION + DENSE_MLP,  # dense first layer; shared_experts.* only where PEFT loads them back
    "qwen3_next": ATTENTION + GATED_DELTANET + DENSE_MLP,
    **dict.fromkeys(
        ("qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp", "qwen4_exp_text"), ATTENTION + GATED_DELTANET + DENSE_MLP
    ),
    "nemotron_h": ATTENTION + MAMBA + ["up_proj", "down_proj"],  # its shared expert is not gated
    # shared experts and dense layers: gate and up fused
    **dict.fromkeys(("minimax_m3_vl", "minimax_m3_vl_text"), ATTENTION + ["gate_up_proj", "down_proj"]),
}
GENERIC_TARGETS = ATTENTION + MLA_ATTENTION + DENSE_MLP
WRAPPED_LINEAR = "linear"  # the Linear's name inside a wrapped projection (Inkling-2's q_proj.linear)


def linear_names(model: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def peft_remapped_names(model_type: str) -> set[str]:
    """Module names PEFT rewrites into fused-expert `target_parameters` for this model type.

    PEFT >= 0.18 converts v4-style targets (`gate_proj`, `up_proj`, `down_proj`, `gate`; `w1`..`w3` for
    Mixtral) of these MoE families into LoRA on the experts' 3D parameters and drops them from
    target_modules, both when creating and when loading an adapter. A dense MLP of the same name (shared
    experts, dense-first layers) then loses its LoRA, and the experts get PEFT's full-precision wrapper,
    so such names cannot be trained through PEFT on these families. Read from PEFT's own table.
    """
    try:
        from peft.utils import transformers_weight_conversion as conversion

        base = conversion._MODEL_TO_CONVERSION_PATTERN.get(model_type)
        return set(conversion._MOE_TARGET_MODULE_MAPPING.get(base, {})) if base else set()
    except (ImportError, AttributeError):  # an older or newer PEFT without the table
        return set()


def default_targets(model: nn.Module) -> list[str]:
    """The family's default PEFT targets, kept to the names this model has (never lm_head or a router)."""
    model_type = getattr(model.config, "model_type", "")
    wanted = FAMILY_TARGETS.get(model_type)
    if wanted is None:
        log.warning("no LoRA defaults for model_type %r: targeting the usual projection names it has", model_type)
        wanted = GENERIC_TARGETS
    present, remapped = linear_names(model), peft_remapped_names(model_type)
    skipped = [t for t in wanted if t in present and t in remapped]
    if skipped:
        log.warning("not targeting %s on %s: PEFT would re-target them onto the experts", skipped, model_type)
    wrapped = wrapped_projection_names(model)
    targets = []
    for t in dict.fromkeys(wanted):
        if t in present and t not in remapped:
            targets += linears_only(model, t)
        if t in wrapped:
            targets += linears_only(model, f"{t}.{WRAPPED_LINEAR}")
    return language_model_only(model, list(dict.fromkeys(targets)))


def language_model_only(model: nn.Module, targets: list[str]) -> list[str]:
    """`targets` narrowed to the decoder layers that hold the MoE experts, where a name also matches Linears of
    a vision tower or an audio encoder (MiniMax-M3-VL's vision layers have q_proj too): a text fine-tune has no
    use for them, and no export writes them (llama.cpp keeps encoders in a separate mmproj file)."""
    from moe_qlora.moe.expert_stacks import experts_modules

    stacks = tuple({n.rsplit(".layers.", 1)[0] + ".layers." for n, _ in experts_modules(model) if ".layers." in n})
    if not stacks:
        return targets
    narrowed = []
    for target in targets:
        matched = modules_matching(model, target)
        text = [n for n in matched if n.startswith(stacks)]
        others = [n for n in matched if not n.startswith(stacks)]
        narrowed += [target] if not others else narrowest_loadable(target, text, others) if text else []
    return list(dict.fromkeys(narrowed))


def linears_only(model: nn.Module, target: str) -> list[str]:
    """`target`, narrowed to suffixes that match only its nn.Linear modules when it also names other modules.

    PEFT refuses a target that matches a module it cannot wrap: on Inkling-2 `q_proj` is a Linear in the
    vision tower and a wrapper module in the text model, so the plain name would fail, not train.
    """
    others = [n for n, m in model.named_modules() if matches_target(n, target) and not isinstance(m, nn.Linear)]
    if not others:
        return [target]
    return narrowest_loadable(target, modules_matching(model, target), others)


def wrapped_projection_names(model: nn.Module) -> set[str]:
    """Names of projections that are wrapper modules holding their nn.Linear as a `linear` child.

    Inkling-2 (transformers 5.24) wraps each attention projection with its norm or short convolution:
    `self_attn.q_proj` is a module and `self_attn.q_proj.linear` the Linear. A family default of `q_proj`
    then names no Linear, so `auto` targets `q_proj.linear` instead of silently leaving attention untrained.
    """
    return {
        name.rsplit(".", 1)[-1]
        for name, m in model.named_modules()
        if not isinstance(m, nn.Linear) and isinstance(getattr(m, WRAPPED_LINEAR, None), nn.Linear)
    }


def matches_target(module_name: str, target: str) -> bool:
    """PEFT's rule for a target_modules entry: the module's full name, or a dotted suffix of it."""
    return module_name == target or module_name.endswith("." + target)


def modules_matching(model: nn.Module, target: str) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and matches_target(n, target)]


def modules_peft_would_not_load(model: nn.Module, targets: list[str]):
    """(report, module names) for the targeted modules whose LoRA PEFT would not load back as written."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return target_modules_failing_round_trip(clean_base_config(base.config), targets, model_class=type(base))


def narrowest_loadable(target: str, ok: list[str], failing: list[str]) -> list[str]:
    """Suffixes that match every module in `ok` and none in `failing`, as short as possible.

    'gate_proj' on Laguna: the dense layer's 'mlp.gate_proj' loads, 'mlp.shared_experts.gate_proj' does not,
    so the target becomes 'mlp.gate_proj'. The full module names always separate them.
    """
    depth = max((len(n.split(".")) for n in ok), default=0)
    for d in range(len(target.split(".")) + 1, depth + 1):
        suffixes = sorted({".".join(n.split(".")[-d:]) for n in ok})
        if not any(matches_target(f, s) for f in failing for s in suffixes):
            return suffixes
    return sorted(ok)


def keep_loadable_targets(model: nn.Module, targets: list[str]) -> list[str]:
    """`targets` narrowed to the modules whose LoRA the installed PEFT loads back as trained."""
    if not targets:
        return targets
    report, failing = modules_peft_would_not_load(model, targets)
    if not failing:
        return targets
    kept = []
    for target in targets:
        matched = modules_matching(model, target)
        ok, bad = [n for n in matched if n not in failing], [n for n in matched if n in failing]
        kept += [target] if not bad else narrowest_loadable(target, ok, bad) if ok else []
    log.warning("not targeting %s: %s", first_few(sorted(failing)), report.describe(model.config.model_type))
    return list(dict.fromkeys(kept))


def refuse_unloadable_targets(model: nn.Module, targets: list[str]) -> None:
    """An explicit target whose LoRA PEFT would not load back as trained is a config error, with the reason."""
    if not targets:  # experts only: nothing for PEFT to load
        return
    try:
        report, failing = modules_peft_would_not_load(model, targets)
    except ValueError as exc:  # PEFT refuses the target outright (e.g. a Mamba mixer's out_proj)
        raise ConfigError(f"lora.target_modules {targets}: {exc}") from None
    if failing:
        bad = [t for t in targets if any(matches_target(f, t) for f in failing)]
        raise ConfigError(
            f"lora.target_modules {bad} would not load as trained in PEFT ({first_few(sorted(failing))}): "
            f"{report.describe(model.config.model_type)}. Drop them, or name only the modules that load."
        )


def resolve_targets(model: nn.Module, target_modules: list[str] | str) -> list[str]:
    """`auto` -> the family defaults; an explicit list must name modules that exist and PEFT keeps as they are."""
    if target_modules == "auto":
        return keep_loadable_targets(model, default_targets(model))
    model_type = getattr(model.config, "model_type", "")
    remapped = [t for t in target_modules if t.rsplit(".", 1)[-1] in peft_remapped_names(model_type)]
    if remapped:
        raise ConfigError(
            f"lora.target_modules {remapped} cannot be trained on {model_type}: PEFT rewrites these names into LoRA on "
            "the fused expert parameters (its transformers v4->v5 conversion), so the adapter would not load as "
            "trained. Experts already get per-expert LoRA (lora.experts); drop these names."
        )
    present = linear_names(model)
    missing = [t for t in target_modules if not modules_matching(model, t)]
    if missing:
        raise ConfigError(
            f"lora.target_modules names no nn.Linear of this model: {missing}; its linears: {sorted(present)}"
        )
    refuse_unloadable_targets(model, list(target_modules))
    if outside := sorted(set(target_modules) - set(language_model_only(model, list(target_modules)))):
        log.warning(
            "lora.target_modules %s also name modules outside the language model's decoder layers (a vision "
            "or audio encoder's): trained, but no export writes their LoRA (auto keeps to the language "
            "model; or name them by a longer suffix, language_model.layers...)",
            outside,
        )
    return list(target_modules)
