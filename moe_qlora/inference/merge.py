"""`moe-qlora merge`: a full Hugging Face checkpoint with the adapter folded into 16/32-bit weights.

Each weight is the one the adapter was trained against: NF4-dequantized for the 4-bit experts and linears, as
stored for the rest, plus its LoRA update (scale * B_e A_e per expert, scale * B A per linear) in fp32, then cast
to the output dtype. Nothing is merged into 4-bit weights: re-quantizing W + BA would round most of the update
away. The 4-bit model is the only whole model in memory; merged tensors stream into safetensors shards of at
most `max_shard_bytes`, each written and freed before the next, and are renamed back to the checkpoint layout
the base came in (transformers' reverse weight conversion, as save_pretrained does).

Every LoRA module of the adapter file must show up as a merged delta of the same norm (read independently of
the model by export.norms.check_norms), or the merge fails: a silently dropped expert delta cannot ship.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console

from moe_qlora.common.fileio import atomic_dir, save_safetensors
from moe_qlora.export.adapter import plain_key
from moe_qlora.export.norms import check_norms
from moe_qlora.inference.generate import load_for_generation
from moe_qlora.moe.expert_stacks import (
    decoded_expert,
    expert_dims,
    experts_modules,
    holds_mxfp4,
    quantized_stack,
    stack_names,
)
from moe_qlora.moe.layer_state import read_state
from moe_qlora.moe.mxfp4 import BLOCKS_SUFFIX as MXFP4_BLOCKS
from moe_qlora.moe.mxfp4 import SCALES_SUFFIX as MXFP4_SCALES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Tokenizer and generation files copied from the base beside the merged weights.
COPIED = ("*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py")
NOT_COPIED = {"config.json", "model.safetensors.index.json", "adapter_config.json"}
# fp32 B A summed in float64 (ours) against float64 factors (check_norms): measured under 1e-6 relative on
# 2048 x 2048 weights; a dropped expert is off by 1.0, a dropped rank of r=16 by ~0.1.
NORM_RTOL = 1e-5


class MergeError(RuntimeError):
    """The merge would not reproduce the adapter (exit code 2)."""


@dataclass
class MergeReport:
    out: Path
    shards: int = 0
    tensors: int = 0
    bytes: int = 0
    # {checkpoint key of the model: ||delta|| per expert (3D stacks) or one value (linears)}
    delta_norms: dict[str, list[float]] = field(default_factory=dict)


def linear_deltas(model) -> dict[str, torch.Tensor]:
    """{plain weight key: scale * B A} of every PEFT LoRA layer (linears, and parameters such as the router)."""
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or "default" not in module.lora_A:
            continue
        if getattr(module, "use_dora", {}).get("default"):
            raise MergeError(f"{plain_key(name)}: DoRA adapters are not merged by moe-qlora")
        a = module.lora_A["default"].weight.detach().float()
        b = module.lora_B["default"].weight.detach().float()
        delta = (b @ a) * module.scaling["default"]
        if getattr(module, "fan_in_fan_out", False):
            delta = delta.T
        param = getattr(module, "parameter_name", "weight")
        deltas[f"{plain_key(name).replace('.base_layer', '')}.{param}"] = delta.cpu()
    return deltas


def expert_delta(module, stack: str, e: int) -> torch.Tensor:
    """scale * B_e A_e of expert e of one stack, fp32 in the stack's storage layout: (out, in), or (in, out)
    for transposed experts (GPT-OSS); zeros for experts without LoRA (an MXFP4 stack decoded as it is)."""
    lora = getattr(module, "moe_lora", None)
    if lora is None:
        _, hidden, inter = expert_dims(module)
        out = (2 if module.has_gate else 1) * inter if stack != "down_proj" else hidden
        inp = hidden if stack != "down_proj" else inter
        return torch.zeros((inp, out) if getattr(module, "is_transposed", False) else (out, inp))
    a, b = (lora.gate_up_a, lora.gate_up_b) if stack != "down_proj" else (lora.down_a, lora.down_b)
    delta = (b[e].detach().float() @ a[e].detach().float()) * lora.scale
    return (delta.T if getattr(module, "is_transposed", False) else delta).cpu()


def merged_stack(module, key: str, stack: str, dtype: torch.dtype, report: MergeReport) -> torch.Tensor:
    """W_e + scale * B_e A_e for every expert of a stack, (E, d1, d2) in `dtype`, built one expert at a time
    (an fp32 copy of a whole stack is several times the 4-bit model); records each expert's ||delta||. An MXFP4
    stack's base is the published one, decoded exactly."""
    shape, base_expert = stored_experts(module, stack)
    out = torch.empty(shape, dtype=dtype)
    for e in range(out.shape[0]):
        delta = expert_delta(module, stack, e)
        out[e] = base_expert(e).cpu() + delta
        if getattr(module, "moe_lora", None) is None:
            continue  # an MXFP4 stack without LoRA: decoded only, no delta to check
        for part, part_delta in split_fused_gate_up(module, key, delta.unsqueeze(0), dim=1):
            report.delta_norms.setdefault(part, []).extend(frobenius_norms(part_delta))
    return out


def stored_experts(module, stack: str) -> tuple[tuple[int, ...], Callable[[int], torch.Tensor]]:
    """(the stack's shape as the module holds it, expert e -> its fp32 weight in that layout)."""
    import bitsandbytes as bnb

    from moe_qlora.moe.nf4 import NF4Stack, dequantize_expert

    if holds_mxfp4(module):
        transposed = getattr(module, "is_transposed", False)
        quantized = quantized_stack(module, stack)
        experts, out, inp = quantized.shape
        return (experts, inp, out) if transposed else quantized.shape, lambda e: decoded_expert(module, stack, e)
    param = getattr(module, stack)
    if isinstance(param, bnb.nn.Params4bit):
        nf4 = NF4Stack.from_param(param)
        return nf4.shape, lambda e: dequantize_expert(nf4, e)
    return tuple(param.shape), lambda e: param[e].detach().float()


def merged_tensors(model, dtype: torch.dtype, report: MergeReport) -> Iterator[tuple[str, torch.Tensor]]:
    """(plain key, merged weight in `dtype`) for every parameter and persistent buffer of the base model."""
    import bitsandbytes as bnb

    from moe_qlora.moe.nf4 import dequantize_param

    deltas = linear_deltas(model)
    stacks = {  # with expert LoRA, and every MXFP4 stack (decoded to the module's layout even without LoRA)
        f"{plain_key(name)}.{stack}": (module, stack)
        for name, module in experts_modules(model)
        if getattr(module, "moe_lora", None) is not None or holds_mxfp4(module)
        for stack in stack_names(module)
    }
    mxfp4_scales = {f"{key}{MXFP4_SCALES}" for key, (module, _) in stacks.items() if holds_mxfp4(module)}
    split_modules = {
        f"{plain_key(name)}.gate_up_proj": module
        for name, module in experts_modules(model)
        if read_state(module).split_gate_up
    }
    for name, p in model.named_parameters():
        if ".lora_" in name or ".moe_lora." in name or plain_key(name) in mxfp4_scales:
            continue  # an MXFP4 stack's scales are merged with its blocks
        key = plain_key(name).removesuffix(MXFP4_BLOCKS)
        if key in stacks:
            module, stack = stacks.pop(key)
            weight = merged_stack(module, key, stack, dtype, report)
        else:
            weight = dequantize_param(p) if isinstance(p, bnb.nn.Params4bit) else p.detach().float()
            weight = weight.cpu()
            if (delta := deltas.pop(key, None)) is not None:
                weight = weight + delta  # never in place: `weight` may be the model's own parameter
                report.delta_norms[key] = frobenius_norms(delta)
            weight = weight.to(dtype) if weight.is_floating_point() else weight
        yield from split_fused_gate_up(split_modules.get(key), key, weight, dim=1)
    yield from persistent_buffers(model)
    left = sorted(deltas) + sorted(stacks)
    if left:
        raise MergeError(f"LoRA with no base weight to merge into: {', '.join(left[:4])}")


def frobenius_norms(delta: torch.Tensor) -> list[float]:
    """||delta|| per expert of a 3D stack, or of a 2D weight, summed in float64 one expert at a time (an fp32
    sum over millions of elements drifts by ~1e-4 relative, as much as the check allows)."""
    experts = delta if delta.dim() == 3 else delta.unsqueeze(0)
    return [float(torch.linalg.vector_norm(e, dtype=torch.float64)) for e in experts]


def split_fused_gate_up(module, key: str, weight: torch.Tensor, *, dim: int) -> Iterator[tuple[str, torch.Tensor]]:
    """A shared-expert stack moe-qlora fused at load ([gate; up] along `dim`) back to the checkpoint's
    gate_proj and up_proj; anything else as it is."""
    if module is None or not read_state(module).split_gate_up or not key.endswith(".gate_up_proj"):
        yield key, weight
        return
    prefix = key.removesuffix(".gate_up_proj")
    gate, up = weight.chunk(2, dim=dim)
    yield f"{prefix}.gate_proj", gate.contiguous()
    yield f"{prefix}.up_proj", up.contiguous()


def persistent_buffers(model) -> Iterator[tuple[str, torch.Tensor]]:
    """Buffers a checkpoint holds (e.g. DeepSeek-V3's e_score_correction_bias), not rotary caches."""
    for name, module in model.named_modules():
        for buf_name, buf in module._buffers.items():
            if buf is None or buf_name in module._non_persistent_buffers_set or ".moe_lora" in f".{name}":
                continue
            yield plain_key(f"{name}.{buf_name}" if name else buf_name), buf.detach().cpu().clone()


def verify_against_adapter(adapter_dir: Path, report: MergeReport) -> int:
    """Every (module, expert) row of the adapter file's own norms has a merged delta of the same norm."""
    rows = check_norms(adapter_dir).rows
    for row in rows:
        key = row.module if row.module in report.delta_norms else f"{row.module}.weight"
        merged = report.delta_norms.get(key)
        if merged is None:
            raise MergeError(f"{adapter_dir}: the LoRA of {row.module} was not merged into any weight")
        got = merged[row.expert or 0]
        if not math.isclose(got, row.norm_delta, rel_tol=NORM_RTOL, abs_tol=1e-12):
            where = row.module + ("" if row.expert is None else f" expert {row.expert}")
            raise MergeError(f"{where}: merged ||delta|| {got:.6g} but the adapter's scale*B*A is {row.norm_delta:.6g}")
    return len(rows)


class ShardWriter:
    """Tensors into numbered safetensors shards of at most `max_bytes` each (a tensor never split)."""

    def __init__(self, folder: Path, max_bytes: int, revert):
        self.folder, self.max_bytes, self.revert = folder, max_bytes, revert
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[str, list[str]]] = []

    def add(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.max_bytes:
            self.flush()
        self.pending[key] = tensor
        self.size += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        tensors = {k: v.contiguous() for k, v in self.revert(self.pending).items()}
        name = f"part-{len(self.files):05d}.safetensors"
        save_safetensors(tensors, str(self.folder / name), metadata={"format": "pt"})
        self.files.append((name, list(tensors)))
        self.pending, self.size = {}, 0

    def finish(self) -> tuple[int, int]:
        """Rename to model-0000i-of-0000n, write the index; (shards, total bytes)."""
        self.flush()
        n, weight_map, total = len(self.files), {}, 0
        for i, (name, keys) in enumerate(self.files):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.folder / name).rename(self.folder / final)
            total += (self.folder / final).stat().st_size
            weight_map.update({k: final for k in keys})
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return n, total


def checkpoint_layout(model):
    """A function renaming a shard from the model's own (fused) layout to the one its checkpoints use."""
    from transformers.core_model_loading import revert_weight_conversion

    from moe_qlora.model.peft_roundtrip import clean_base_config, skeleton

    plain = skeleton(clean_base_config(model.config))
    return lambda state: revert_weight_conversion(plain, state)


def copy_base_files(base: Path, out: Path, dtype: torch.dtype) -> None:
    """config.json without quantization, in the merged dtype; tokenizer and generation files as they are."""
    config = json.loads((base / "config.json").read_text())
    config.pop("quantization_config", None)
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for pattern in COPIED:
        for f in base.glob(pattern):
            if f.name not in NOT_COPIED and f.is_file():
                shutil.copy2(f, out / f.name)


def merge_adapter(
    adapter_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "bfloat16",
    max_shard_bytes: int = 5 * 10**9,
    device: str = "cpu",
    console: Console | None = None,
) -> MergeReport:
    """Write the merged checkpoint to `out_dir` (atomically); the report holds each merged delta's norms."""
    console = console or Console(stderr=True)
    if dtype not in DTYPES:
        raise MergeError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    model, _ = load_for_generation(adapter_dir, console, device=device, kernels="torch", doing="merge")
    report = MergeReport(out=out_dir)
    with atomic_dir(out_dir) as tmp, torch.no_grad():
        writer = ShardWriter(tmp, max_shard_bytes, checkpoint_layout(model))
        for key, tensor in merged_tensors(model, DTYPES[dtype], report):
            writer.add(key, tensor)
            report.tensors += 1
        verify_against_adapter(adapter_dir, report)
        report.shards, report.bytes = writer.finish()
        copy_base_files(Path(model.name_or_path), tmp, DTYPES[dtype])
        keep_chat_template(adapter_dir, tmp)
    return report


def merged_tensors_of(adapter_dir: Path, dtype: torch.dtype, console: Console) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint key, tensor) of what `merge` writes for the adapter in `dtype`, one tensor at a time (verify
    compares a merged checkpoint with it without holding either whole)."""
    model, _ = load_for_generation(adapter_dir, console, device="cpu", kernels="torch", doing="verify")
    revert, report = checkpoint_layout(model), MergeReport(out=adapter_dir)
    with torch.no_grad():
        for key, tensor in merged_tensors(model, dtype, report):
            yield from revert({key: tensor}).items()


def keep_chat_template(adapter_dir: Path, out: Path) -> None:
    """The run's own chat template (model.chat_template, kept in the adapter folder) over the base's: transformers
    reads chat_template.jinja before a template in tokenizer_config.json."""
    from moe_qlora.model.build import CHAT_TEMPLATE_FILE

    if (adapter_dir / CHAT_TEMPLATE_FILE).is_file():
        shutil.copy2(adapter_dir / CHAT_TEMPLATE_FILE, out / CHAT_TEMPLATE_FILE)
