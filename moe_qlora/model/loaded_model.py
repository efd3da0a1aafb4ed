"""What a loaded model holds: the experts its config declares, every expert stack in 4-bit (else refused, naming
what was left in high precision and why), and its weights' bytes by kind.
"""

from __future__ import annotations

import bitsandbytes as bnb

from moe_qlora.model.distributed import local_shard
from moe_qlora.model.published_tensors import ModelLoadError
from moe_qlora.moe.expert_stacks import EXPERT_PARAMS, is_experts_module
from moe_qlora.moe.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX
from moe_qlora.moe.nf4 import stack_nbytes

EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def declared_experts(config) -> int:
    """The number of routed experts a config declares (0 for a dense model)."""
    for key in EXPERT_COUNT_FIELDS:
        try:
            value = getattr(config, key, None)
        except Exception:  # a per-layer attribute of a heterogeneous config
            continue
        if isinstance(value, int) and value > 1:
            return value
    return getattr(getattr(config, "ffn_config", None), "moe_num_experts", 0) or 0


def looks_like_experts(name: str, module) -> bool:
    """An experts container by its name (class `...Experts`, attribute `experts` / `shared_experts`)."""
    return type(module).__name__.lower().endswith("experts") or name.rsplit(".", 1)[-1] in ("experts", "shared_experts")


def unquantized_expert_stacks(model) -> list[str]:
    """Expert stacks left in high precision, each with why.

    Experts are found by what they are: modules on transformers' experts interface (their stacks must be NF4
    now), and modules that hold 3D expert-like stacks but are not on that interface (a layout moe-qlora does
    not compute). Other 3D weights (the short convolutions of Mamba / linear-attention layers) are not experts.
    """
    found = []
    for name, module in model.named_modules():
        stacks = {n: p for n, p in module.named_parameters(recurse=False) if p.dim() == 3 and p.is_floating_point()}
        stacks = {n: p for n, p in stacks.items() if not isinstance(p, bnb.nn.Params4bit)}
        if not stacks:
            continue
        if is_experts_module(module):
            why = "the quantizer did not convert"
        elif looks_like_experts(name, module):
            why = f"{type(module).__name__} is not on transformers' experts interface (an unknown expert layout)"
        else:
            continue
        found += [f"{why}: {name}.{n} {tuple(p.shape)} {p.dtype}" for n, p in stacks.items()]
    return found


def assert_experts_quantized(model) -> None:
    """Strict check: every expert stack is NF4; names what was found unquantized and why."""
    leftovers = unquantized_expert_stacks(model)
    if leftovers:
        raise ModelLoadError(
            "expert stacks moe-qlora cannot keep in NF4: "
            + "; ".join(leftovers[:4])
            + (f" and {len(leftovers) - 4} more" if len(leftovers) > 4 else "")
        )


def parameter_bytes_by_kind(model) -> dict[str, int]:
    """Bytes of the model's weights this process holds, by kind: NF4 experts, MXFP4 experts, other 4-bit weights,
    LoRA, the rest (of a sharded model: this rank's shards, the experts' codes and scales as parameters of their
    own)."""
    kinds = {"experts_nf4": 0, "linear_4bit": 0, "lora": 0, "other": 0}  # and experts_mxfp4 where there are
    shardable = tuple(f"{n}_{part}" for n in EXPERT_PARAMS for part in ("nf4", "absmax"))
    mxfp4 = tuple(f"{n}{part}" for n in EXPERT_PARAMS for part in (BLOCKS_SUFFIX, SCALES_SUFFIX))
    for name, p in model.named_parameters():
        local = local_shard(p)
        if name.rsplit(".", 1)[-1] in mxfp4:
            kinds["experts_mxfp4"] = kinds.get("experts_mxfp4", 0) + local.numel() * local.element_size()
        elif isinstance(p, bnb.nn.Params4bit):
            kind = "experts_nf4" if name.rsplit(".", 1)[-1] in EXPERT_PARAMS else "linear_4bit"
            kinds[kind] += stack_nbytes(p)
        elif name.rsplit(".", 1)[-1] in shardable:
            kinds["experts_nf4"] += local.numel() * local.element_size()
        elif name.rsplit(".", 1)[-1] in ("weight_nf4", "weight_absmax"):  # a ShardableLinear4bit
            kinds["linear_4bit"] += local.numel() * local.element_size()
        elif p.requires_grad or "lora" in name:
            kinds["lora"] += local.numel() * local.element_size()
        else:
            kinds["other"] += local.numel() * local.element_size()
    return kinds
