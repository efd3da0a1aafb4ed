"""Per-expert weights of a published checkpoint read as the model's fused expert stacks, under the names
transformers' own checkpoint conversion gives them, filled one expert at a time (FusedExpertsTensor); FP4 experts'
bytes gathered into MXFP4 stacks; what the loader quantizes an expert at a time (ExpertReader).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from moe_qlora.model.published_tensors import FP4_GROUP, Fp4RowTensor, Fp8BlockTensor, ModelLoadError
from moe_qlora.moe.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX


class FusedExpertsTensor:
    """Per-expert FP8 weights read as the fused (E, sum of rows, cols) bf16 stack the model holds, one expert at a
    time into one buffer: transformers' own merge (MergeModulelist, then Concatenate for gate and up) keeps each
    expert's decoded tensor, their stack and the concatenation alive together, about twice a layer's experts in
    bf16 (measured: 523 MiB over the load's bound with bench_load.py --format fp8)."""

    def __init__(self, name: str, parts: list[list]):
        self.name, self.parts = name, parts  # parts[source][expert]: the tensors concatenated along rows

    def get_dtype(self) -> str:
        return "BF16"

    def get_shape(self) -> list[int]:
        rows = sum(part[0].get_shape()[0] for part in self.parts)
        return [len(self.parts[0]), rows, self.parts[0][0].get_shape()[1]]

    def __getitem__(self, index):
        if index is not Ellipsis:
            raise ValueError(f"{self.name}: read whole ([...]), not [{index!r}]")
        out = torch.empty(self.get_shape(), dtype=torch.bfloat16)
        for e in range(out.shape[0]):
            out[e] = self.expert(e)
        return out

    def expert(self, e: int) -> torch.Tensor:
        """Expert e alone: (sum of rows, cols) bf16."""
        return torch.cat([part[e][...] for part in self.parts])


class Fp4StackBytes:
    """The stored bytes of a fused FP4 stack as MXFP4's `<stack>_blocks` (E, out, G, 16) or `<stack>_scales`
    (E, out, G): each expert's sources' rows concatenated (gate before up), nothing decoded. An FP4 row of
    (cols / 2) bytes is its G groups of 16 bytes, low nibble first as in MXFP4, so the bytes are already MXFP4's."""

    def __init__(self, fused: FusedExpertsTensor, part: str):
        self.fused, self.part = fused, part  # part: "weight" (the codes) or "scale" (the e8m0 exponents)

    def get_dtype(self) -> str:
        return "U8"

    def get_shape(self) -> list[int]:
        experts, rows, cols = self.fused.get_shape()
        groups = cols // FP4_GROUP
        return [experts, rows, groups, FP4_GROUP // 2] if self.part == "weight" else [experts, rows, groups]

    def __getitem__(self, index):
        if index is not Ellipsis:
            suffix = BLOCKS_SUFFIX if self.part == "weight" else SCALES_SUFFIX
            raise ValueError(f"{self.fused.name}{suffix}: read whole ([...]), not [{index!r}]")
        out = torch.empty(self.get_shape(), dtype=torch.uint8)
        for e in range(out.shape[0]):
            rows = [getattr(part[e], self.part)[...].contiguous().view(torch.uint8) for part in self.fused.parts]
            out[e] = torch.cat(rows).view(out.shape[1:])
        return out


def fp4_stacks_kept(state: dict, folder: Path) -> dict:
    """`state` with every fused stack of FP4 experts as MXFP4 `<stack>_blocks` and `<stack>_scales` of the stored
    bytes (model.expert_format mxfp4); an FP4 weight left out of a stack, or scales that are not e8m0 bytes,
    cannot be kept so: ModelLoadError."""
    out = {}
    for name, tensor in state.items():
        parts = tensor.parts if isinstance(tensor, FusedExpertsTensor) else [[tensor]]
        if not any(isinstance(p, Fp4RowTensor) for part in parts for p in part):
            out[name] = tensor
            continue
        if not isinstance(tensor, FusedExpertsTensor) or any(type(p) is not Fp4RowTensor for q in parts for p in q):
            raise ModelLoadError(
                f"{folder}: {name}: an FP4 weight outside a stack of FP4 experts cannot be kept as MXFP4: use "
                "model.expert_format nf4"
            )
        scales = {p.scale.get_dtype() for part in parts for p in part}
        if not scales <= {"U8", "F8_E8M0"}:
            raise ModelLoadError(
                f"{folder}: {name}: FP4 scales stored as {sorted(scales)}, not e8m0: kept as MXFP4 only with e8m0 "
                "scales; use model.expert_format nf4"
            )
        out[name + BLOCKS_SUFFIX] = Fp4StackBytes(tensor, "weight")
        out[name + SCALES_SUFFIX] = Fp4StackBytes(tensor, "scale")
    return out


class ExpertReader:
    """A FusedExpertsTensor as nf4.quantize_stack reads a stack: `shape`, and `[e]` expert e decoded alone."""

    def __init__(self, fused: FusedExpertsTensor):
        self.fused, self.shape = fused, tuple(fused.get_shape())

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.fused.expert(e)


def stacks_read_by_expert(state: dict, model_type: str | None) -> dict[str, FusedExpertsTensor]:
    """The fused FP8/FP4 stacks moe-qlora quantizes itself, an expert at a time as each is decoded, instead of
    handing transformers the stack, under the name transformers' renames give them (DeepSeek-V4's ffn -> mlp,
    MiniMax-M2's block_sparse_moe -> mlp; the base model's prefix, where the checkpoint has none, is added where
    the model is at hand: loading.stack_of). Each tensor's own `name` is its key in `state`."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, apply_renamings

    renamings = [r for r in get_checkpoint_conversion_mapping(model_type) or [] if isinstance(r, WeightRenaming)]
    fused = {apply_renamings(k, renamings): v for k, v in state.items() if isinstance(v, FusedExpertsTensor)}
    # a module's stacks all or none: one left to transformers would be the module's only stack while it loads,
    # and a module without its stacks is no experts module to the quantizer (its other stack left in bf16)
    stacks = {k.rsplit(".", 1)[1] for k in fused}
    modules = {k.rsplit(".", 1)[0] for k in fused}
    whole = {m for m in modules if all(f"{m}.{stack}" in fused for stack in stacks)}
    return {k: v for k, v in fused.items() if k.rsplit(".", 1)[0] in whole}


def fused_expert_stacks(state: dict, model_type: str | None) -> dict:
    """Per-expert FP8 (or FP4) weights grouped into FusedExpertsTensor stacks under the names transformers'
    checkpoint conversion for `model_type` gives them (a converter that stacks experts, MergeModulelist(0), and
    concatenates its sources along rows, Concatenate(1): gate and up into gate_up_proj); transformers' renames
    (DeepSeek-V4's ffn -> mlp) then apply to the stack's name. Only complete groups (every source for experts
    0..E-1, all quantized) are fused; anything else is left to transformers."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    for converter in get_checkpoint_conversion_mapping(model_type) or []:
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(converter, "operations", [])]
        stacks = ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])
        if isinstance(converter, WeightConverter) and stacks and len(converter.target_patterns) == 1:
            state = fuse_converter_sources(state, list(converter.source_patterns), converter.target_patterns[0])
    return state


def literal_pattern(pattern: str, wildcards: int) -> str | None:
    """A converter's pattern as the literal key text it stands for (transformers writes a dot either way, `.` or
    `\\.`), or None when it uses more of regex than that or has not `wildcards` `*`s: left to transformers."""
    text = pattern.replace(r"\.", ".")
    return text if re.fullmatch(r"[\w.*]+", text) and text.count("*") == wildcards else None


def fuse_converter_sources(state: dict, sources: list[str], target: str) -> dict:
    """`state` with each complete group of per-expert quantized keys matching `sources` (one `*` for the expert
    index) replaced by one FusedExpertsTensor named prefix + `target`."""
    literal = [literal_pattern(s, 1) for s in sources]
    target = literal_pattern(target, 0)
    if None in literal or target is None:
        return state
    matchers = [re.compile(r"^(.*?)" + r"(\d+)".join(map(re.escape, s.split("*"))) + "$") for s in literal]
    groups: dict[str, list[dict[int, str]]] = {}
    for key in state:
        for i, matcher in enumerate(matchers):
            if m := matcher.match(key):
                groups.setdefault(m.group(1), [{} for _ in sources])[i][int(m.group(2))] = key
    out = dict(state)
    for prefix, per_source in groups.items():
        experts = len(per_source[0])
        complete = all(sorted(keys) == list(range(experts)) for keys in per_source)
        decoded = (Fp8BlockTensor, Fp4RowTensor)
        if not complete or not all(isinstance(state[k], decoded) for keys in per_source for k in keys.values()):
            continue
        parts = [[state[keys[e]] for e in range(experts)] for keys in per_source]
        for keys in per_source:
            for k in keys.values():
                del out[k]
        out[prefix + target] = FusedExpertsTensor(prefix + target, parts)
    return out
