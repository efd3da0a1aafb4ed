"""Bytes by kind one process holds for a configured run, from config.json alone: the arithmetic `moe-qlora plan`
prints, that an out-of-memory message ranks knobs by, and that `parallel: auto` decides with.

The model is built on the meta device (no weights, no memory) and every parameter is classified with the
rules the loader applies: NF4 expert stacks, bitsandbytes 4-bit linears, what stays in the compute dtype,
then LoRA (fp32), its gradients (all, or one layer's when stepped in the backward) and the optimizer state
(fp32 or 8-bit moments). Activation memory is an estimate (see below). plan.py adds several GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers.quantizers.quantizers_utils import should_convert_module

from moe_qlora.config.sections import RunConfig, resolve_compute_dtype
from moe_qlora.model.activation_budget import (
    DTYPE_BYTES,
    activation_bytes,
    attention_bytes,
    host_activation_bytes,
    loss_bytes,
    mlp_row_tokens,
    recomputed_layer_bytes,
)
from moe_qlora.model.attention import choose_attention, position_limit_note
from moe_qlora.model.checkpoint_files import read_model_config
from moe_qlora.model.classes import text_model_from_config
from moe_qlora.model.families import matches_target
from moe_qlora.model.loading import linears_not_quantized
from moe_qlora.model.published import chosen_expert_format
from moe_qlora.moe.expert_stacks import expert_dims, is_experts_module
from moe_qlora.moe.kernel_rule import call_path, resolve_auto
from moe_qlora.moe.kernels.grouped_mm import decode_peak_bytes, dequant_budget_bytes, experts_per_chunk
from moe_qlora.moe.kernels.tiles import autotune_requested
from moe_qlora.moe.layouts import adopt_dense_input_experts, adopt_split_gate_up_experts, quantized_stack_names
from moe_qlora.moe.mxfp4 import BLOCKSIZE as MXFP4_BLOCKSIZE
from moe_qlora.moe.nf4 import BLOCKSIZE, NESTED_BLOCKSIZE

LORA_BYTES = 4  # LoRA master weights and their gradients are fp32
# What the process holds besides the model: the CUDA context and cuBLAS workspaces on a GPU; on the CPU the
# libraries (torch, transformers, peft, bitsandbytes, datasets) and what loading and tokenizing leave resident:
# 625 MiB measured in a training process once a tiny model is loaded and its rows tokenized (scripts/
# bench_memory.py --model builtin:tiny-qwen3-moe, rss_after_load; torch 2.13 CPU, transformers 5.24). The
# libraries' imports alone are 475 MiB; counting only those left every small CPU plan 1.3x under (issue 68).
RUNTIME_BYTES = {"cuda": 600 * 2**20, "cpu": 625 * 2**20}
DEFAULT_GPU_GIB = 80.0
DEFAULT_GPU_CAPABILITY = (9, 0)  # the GPU a plan is for unless told: an H100, whose 80 GiB is DEFAULT_GPU_GIB


SMALLER_GPU_CAPABILITY = (8, 9)  # below 80 GB: the 24 and 48 GB cards (Ada, Ampere), the A100 40GB (sm_80)


def capability_for_memory(gpu_gib: float) -> tuple[int, int]:
    """The GPU `plan --gpu-gb` plans for when told only its memory: from 80 GB an H100 (sm_90, whose bf16 grouped
    GEMMs are CUTLASS's, so `auto` decodes stacks for torch._grouped_mm); below, an Ada or Ampere card, where
    `auto` runs the Triton kernels (no decoded stack). An A100 80GB is planned as an H100: the larger plan. A MIG
    slice of an H100 runs grouped_mm on less: a run's own plan reads its GPU (this_gpu_capability)."""
    return DEFAULT_GPU_CAPABILITY if gpu_gib >= DEFAULT_GPU_GIB else SMALLER_GPU_CAPABILITY


def this_gpu_capability() -> tuple[int, int]:
    """The (major, minor) of this machine's GPU, for a plan made inside a run; DEFAULT_GPU_CAPABILITY without one."""
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else DEFAULT_GPU_CAPABILITY


def four_bit_bytes(numel: int, *, double_quant: bool) -> int:
    """Codes (two a byte) plus block scales: fp32 per 64 values, or a byte each plus an fp32 per 256 blocks."""
    blocks = numel // BLOCKSIZE
    scales = blocks + 4 * math.ceil(blocks / NESTED_BLOCKSIZE) if double_quant else 4 * blocks
    return numel // 2 + scales


# Rows held in a layer's backward alone, never at once with the loss's logits (Plan.phases_apart).
BACKWARD_ONLY_ROWS = ("dequant_buffer", "moe_backward")


@dataclass
class Plan:
    """Bytes one GPU holds, by kind, for a run on `gpus` GPUs in mode `parallel` (ddp or fsdp; one GPU is ddp's
    single rank), and the bytes each GPU sends per optimizer step."""

    model_type: str
    params: int
    bytes: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    gpus: int = 1
    parallel: str = "ddp"
    gpu_bytes: int = int(DEFAULT_GPU_GIB * 2**30)
    communication_bytes_per_step: int = 0
    offload: object = None  # offload_plan.OffloadPlan when model.expert_offload moves experts to the host
    mlp_chunk_tokens: int = 0  # train.mlp_chunk_tokens as planned (auto resolved by plan.plan_run); 0: none
    offload_activations: bool = False  # train.offload_activations as planned (auto resolved by plan.plan_run)
    host_activation_bytes: int = 0  # the page-locked host memory the offloaded layer inputs take
    recomputed_layer_bytes: int = 0  # of activations_estimate, the layer recomputed in the backward alone

    @property
    def phases_apart(self) -> int:
        """Bytes the rows count twice over: the loss's logits are freed before the layers' backward begins, so they
        never meet what that backward alone holds (the recomputed layer, the decoded stacks, the MoE rows); the
        peak holds the larger of the two. Against the peaks an H200 measured (docs/memory.md), the plan that summed
        them was 15% over at 4k tokens and 9% at 16k (the CUDA context counted); taking the larger, within 1%."""
        backward = self.recomputed_layer_bytes + sum(self.bytes.get(k, 0) for k in BACKWARD_ONLY_ROWS)
        return min(self.bytes.get("loss_logits", 0), backward)

    @property
    def total(self) -> int:
        return sum(self.bytes.values()) - self.phases_apart

    @property
    def fits(self) -> bool:
        """The per-GPU total within one GPU's memory (gpu_bytes)."""
        return self.total <= self.gpu_bytes


def meta_model(name_or_path: str, trust_remote_code: bool = False) -> nn.Module:
    config = read_model_config(name_or_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = text_model_from_config(config, trust_remote_code=trust_remote_code)
    adopt_dense_input_experts(model)
    adopt_split_gate_up_experts(model)
    return model


def classified_weights(model: nn.Module, *, device: str) -> Iterator[tuple[str, str, nn.Parameter]]:
    """(parameter name, kind, parameter) of every weight, classified as the quantizer does (see loading.py):
    experts_nf4 (expert stacks), linear_4bit (bitsandbytes linears) or other (kept in the compute dtype)."""
    skip = sorted(linears_not_quantized(model, on_cpu=device == "cpu"))
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if pname in quantized_stack_names(module):
                kind = "experts_nf4"
            elif isinstance(module, nn.Linear) and pname == "weight" and should_convert_module(name, skip):
                kind = "linear_4bit"
            else:
                kind = "other"
            yield f"{name}.{pname}" if name else pname, kind, p


def experts_in_mxfp4(model: nn.Module, cfg: RunConfig) -> bool:
    """Whether the run keeps its experts as the checkpoint's MXFP4 bytes (model.expert_format, resolved for the
    checkpoint's quantization_config as loading resolves it)."""
    return chosen_expert_format(model.config, cfg.model.expert_format, Path(cfg.model.name_or_path)) == "mxfp4"


def mxfp4_bytes(numel: int) -> int:
    """Bytes of `numel` MXFP4 weights: half a byte each and one exponent byte per 32 (4.25 bits a weight)."""
    return numel // 2 + numel // MXFP4_BLOCKSIZE


def weight_bytes(model: nn.Module, cfg: RunConfig, *, device: str) -> dict[str, int]:
    """Bytes of the loaded weights by kind (classified_weights); the experts in MXFP4 when the run keeps them so."""
    compute = DTYPE_BYTES[resolve_compute_dtype(cfg.model.compute_dtype, device)]
    double_quant = {"experts_nf4": cfg.model.expert_double_quant, "linear_4bit": cfg.model.linear_double_quant}
    kinds = {"experts_nf4": 0, "linear_4bit": 0, "other": 0}
    mxfp4 = experts_in_mxfp4(model, cfg)
    for _, kind, p in classified_weights(model, device=device):
        n = p.numel()
        if kind == "other":
            kinds[kind] += n * compute
        elif kind == "experts_nf4" and mxfp4:
            kinds["experts_mxfp4"] = kinds.get("experts_mxfp4", 0) + mxfp4_bytes(n)
        else:
            kinds[kind] += four_bit_bytes(n, double_quant=double_quant[kind])
    return kinds


def lora_tensor_shapes(model: nn.Module, cfg: RunConfig, targets: list[str]) -> list[tuple[str, tuple[int, ...]]]:
    """(module name, shape) of every LoRA tensor: per-expert factor stacks (experts on dim 0, see
    expert_lora.ExpertLoRA), PEFT's lora_A (r, in) and lora_B (out, r) on targeted linears and on routers."""
    r, shapes = cfg.lora.rank, []
    if cfg.lora.experts:
        for name, module in model.named_modules():
            if quantized_stack_names(module):  # split stacks too (unfused)
                e, hidden, inter = expert_dims(module)
                up = (2 if getattr(module, "has_gate", True) else 1) * inter
                shapes += [(name, s) for s in [(e, r, hidden), (e, up, r), (e, r, inter), (e, hidden, r)]]
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and any(matches_target(name, t) for t in targets):
            shapes += [(name, (r, module.in_features)), (name, (module.out_features, r))]
    if cfg.lora.router:
        for name, module in model.named_modules():
            if is_experts_module(module):
                block_name = name.rsplit(".", 1)[0]
                block = model.get_submodule(block_name)
                attr = "gate" if getattr(block, "gate", None) is not None else "router"
                router = getattr(block, attr, None)
                if router is not None and getattr(router, "weight", None) is not None:
                    out_features, in_features = router.weight.shape[:2]
                    shapes += [(f"{block_name}.{attr}", (r, in_features)), (f"{block_name}.{attr}", (out_features, r))]
    return shapes


def lora_tensor_sizes(model: nn.Module, cfg: RunConfig, targets: list[str]) -> list[int]:
    """Element counts of every LoRA tensor (lora_tensor_shapes)."""
    return [math.prod(shape) for _, shape in lora_tensor_shapes(model, cfg, targets)]


def optimizer_state_bytes(numel: int, optimizer: str) -> int:
    """One tensor's optimizer state. torch AdamW: two fp32 moments. bitsandbytes 8-bit: two uint8 code
    tensors and an fp32 scale per 256-element block for each; tensors under 4,096 elements (its
    min_8bit_size) keep two fp32 moments. bitsandbytes' two 256-entry code maps are shared by all tensors."""
    if optimizer == "adamw" or numel < 4096:
        return 8 * numel
    return 2 * numel + 2 * 4 * math.ceil(numel / 256)


def gradient_bytes(n_lora: int, model: nn.Module, cfg: RunConfig) -> int:
    """LoRA gradients alive at once: all of them, or with train.optimizer_in_backward about one decoder
    layer's (a layer's backward forms its LoRA gradients together; each is freed once its tensor is stepped)."""
    if cfg.train.optimizer_in_backward:
        return math.ceil(n_lora / model.config.num_hidden_layers) * LORA_BYTES
    return n_lora * LORA_BYTES


def planned_kernels(
    model: nn.Module, cfg: RunConfig, *, device: str, capability: tuple[int, int] = DEFAULT_GPU_CAPABILITY
) -> str:
    """The path the MoE layer's calls of a training micro-batch take, by the rule the layer reads
    (moe/kernel_rule.py): model.kernels resolved for `device`, the compute dtype and `capability`, then, under
    auto, chosen for the micro-batch's mean rows per expert. The plan cannot see the machine the run will have:
    `capability` is the GPU it plans for (an H100 unless told) and triton is taken as installed (a GPU install,
    `pip install -e '.[gpu]'`; without it auto runs grouped_mm at every size). The layer chooses per call: one
    with fewer rows (a short last batch, generation) can take triton where the plan says grouped_mm."""
    m = cfg.model
    dtype = getattr(torch, resolve_compute_dtype(m.compute_dtype, device))
    kernels = resolve_auto(device, dtype, capability, with_triton=True) if m.kernels == "auto" else m.kernels
    moe = [mod for mod in model.modules() if is_experts_module(mod)]
    experts = expert_dims(moe[0])[0] if moe else 1
    k = getattr(model.config, "num_experts_per_tok", 0) or 1
    return call_path(kernels, mlp_row_tokens(cfg) * k, experts, m.fused_below_rows)


def dequant_buffer_bytes(
    model: nn.Module, cfg: RunConfig, *, device: str, capability: tuple[int, int] = DEFAULT_GPU_CAPABILITY
) -> int:
    """grouped_mm's decode of an expert stack, alive during one projection (grouped_mm.decode_peak_bytes): the
    largest stack whole in the compute dtype, or above model.dequant_buffer_mb a window of its columns with what
    the window needs; MXFP4 stacks a chunk of experts at a time. With checkpointing, both stacks decoded whole
    are held from a layer's recompute to the end of its backward. Counted when the layer runs grouped_mm for a
    training micro-batch (planned_kernels: the GPU of `capability`)."""
    moe = [m for m in model.modules() if is_experts_module(m)]
    if not moe or planned_kernels(model, cfg, device=device, capability=capability) != "grouped_mm":
        return 0
    m = cfg.model
    experts, hidden, inter = expert_dims(moe[0])
    d = DTYPE_BYTES[resolve_compute_dtype(m.compute_dtype, device)]
    budget = dequant_budget_bytes(m.dequant_buffer_mb)
    gated = 2 if getattr(moe[0], "has_gate", True) else 1
    if experts_in_mxfp4(model, cfg):
        expert_bytes = gated * inter * hidden * d
        return experts_per_chunk(experts, expert_bytes, budget) * expert_bytes
    rows = mlp_row_tokens(cfg) * (getattr(model.config, "num_experts_per_tok", 0) or 1)
    stored = [(experts, gated * inter, hidden), (experts, hidden, inter)]  # gate_up, down as (E, out, in)
    if getattr(moe[0], "is_transposed", False):
        stored = [(e, cols, out) for e, out, cols in stored]
    forward = not getattr(moe[0], "is_transposed", False)  # the forward reads W^T of an (E, out, in) stack
    whole = [math.prod(shape) * d for shape in stored]
    if cfg.train.gradient_checkpointing and all(not budget or b <= budget for b in whole):
        # a recomputed layer hands both stacks, decoded whole, to its backward (grouped_layer: KEPT_STACKS)
        return sum(whole)
    return max(
        decode_peak_bytes(shape, transpose, BLOCKSIZE, d, budget, rows)
        for shape in stored
        for transpose in (forward, not forward)
    )


def moe_backward_bytes(
    model: nn.Module, cfg: RunConfig, *, device: str, capability: tuple[int, int] = DEFAULT_GPU_CAPABILITY
) -> int:
    """The grouped layer's backward at its peak, besides what its forward saved (activation_bytes: h and the LoRA
    projections) and the decoded stack (dequant_buffer_bytes): while it projects the gradient back through gate_up
    (grouped_layer.grouped_backward), its S = tokens x K rows of the gate's gradient (2I) and activation (I), the
    projected rows (H) and, on grouped_mm, the output gradient's gathered rows and the LoRA term kept apart for the
    combine (H each), in the compute dtype. One layer's (the one in its backward), when the layer runs a grouped
    path (planned_kernels); the per-expert reference works an expert at a time. A chunk's rows with MLP chunks."""
    moe = [m for m in model.modules() if is_experts_module(m)]
    kernels = planned_kernels(model, cfg, device=device, capability=capability) if moe else "torch"
    if kernels not in ("triton", "grouped_mm"):
        return 0
    _, hidden, inter = expert_dims(moe[0])
    gated = 2 if getattr(moe[0], "has_gate", True) else 1
    rows = mlp_row_tokens(cfg) * (getattr(model.config, "num_experts_per_tok", 0) or 1)
    hidden_rows = 1 if kernels == "triton" else 2 + int(cfg.lora.experts)
    d = DTYPE_BYTES[resolve_compute_dtype(cfg.model.compute_dtype, device)]
    return rows * (hidden_rows * hidden + gated * inter + inter) * d


AUTOTUNE_FLUSH_BYTES = 256 * 2**20  # triton.testing.do_bench clears the L2 with this buffer between timings


def autotune_bytes(
    model: nn.Module, cfg: RunConfig, *, device: str, capability: tuple[int, int] = DEFAULT_GPU_CAPABILITY
) -> int:
    """The buffer Triton's autotuner allocates while it times the fused kernel's configs (the first step of each
    shape class), at the peak of that step. Counted on CUDA when a training micro-batch's MoE calls take Triton
    (planned_kernels for the GPU of `capability`) and autotuning is on (MOE_QLORA_AUTOTUNE=0 turns it off).
    Where they take grouped_mm, Triton times only smaller calls (generation, a short batch), below the peak, and
    the allocator hands the freed buffer to the step's own tensors."""
    if device != "cuda" or not autotune_requested():
        return 0
    takes_triton = planned_kernels(model, cfg, device=device, capability=capability) == "triton"
    return AUTOTUNE_FLUSH_BYTES if takes_triton else 0


def one_device_plan(
    cfg: RunConfig,
    model: nn.Module,
    targets: list[str],
    *,
    device: str,
    capability: tuple[int, int] = DEFAULT_GPU_CAPABILITY,
) -> Plan:
    """Bytes by kind of the run `cfg` in one process on `device` (a GPU of `capability` on CUDA): what ddp puts
    on every GPU."""
    plan = Plan(model_type=model.config.model_type, params=sum(p.numel() for p in model.parameters()))
    plan.bytes.update(weight_bytes(model, cfg, device=device))
    sizes = lora_tensor_sizes(model, cfg, targets)
    n_lora = sum(sizes)
    plan.bytes.update(
        lora=n_lora * LORA_BYTES,
        gradients=gradient_bytes(n_lora, model, cfg),
        optimizer=sum(optimizer_state_bytes(n, cfg.train.optimizer) for n in sizes),
    )
    plan.bytes["activations_estimate"] = activation_bytes(model, cfg, device=device)
    plan.recomputed_layer_bytes = recomputed_layer_bytes(model, cfg, device=device)
    if host := host_activation_bytes(model, cfg, device=device):
        plan.offload_activations, plan.host_activation_bytes = True, host
        plan.notes.append(
            f"train.offload_activations: the checkpointed layers' inputs in page-locked host memory "
            f"({host / 2**30:,.2f} GiB of host memory, not counted above)"
        )
    attention = choose_attention(type(model), device)
    if scores := attention_bytes(model, cfg, device=device):
        plan.bytes["eager_attention"] = scores
    plan.notes.append(f"attention: {attention.describe()}")
    if note := position_limit_note(model.config, cfg.data.max_seq_len):
        plan.notes.append(note)
    plan.bytes["loss_logits"] = loss_bytes(model, cfg)
    plan.bytes["runtime"] = RUNTIME_BYTES["cuda" if device == "cuda" else "cpu"]
    if buffer := dequant_buffer_bytes(model, cfg, device=device, capability=capability):
        plan.bytes["dequant_buffer"] = buffer
    if rows := moe_backward_bytes(model, cfg, device=device, capability=capability):
        plan.bytes["moe_backward"] = rows
    if flush := autotune_bytes(model, cfg, device=device, capability=capability):
        plan.bytes["autotune_flush"] = flush
    if apart := plan.phases_apart:
        plan.notes.append(
            f"the loss's logits are freed before the layers' backward, whose recomputed layer, decoded stacks and "
            f"MoE rows they never meet: the total counts the larger of the two ({apart / 2**30:,.2f} GiB less than "
            "the rows' sum, the not_at_once row)"
        )
    if not any(is_experts_module(m) for m in model.modules()):
        plan.notes.append("no MoE experts in this model: it would train as plain QLoRA")
    plan.notes.append(f"targets: experts={cfg.lora.experts}, linears={targets}")
    t = cfg.train
    plan.notes.append(
        f"optimizer: {t.optimizer}"
        + (", stepped in the backward" if t.optimizer_in_backward else "")
        + (
            f"; loss through the head {t.loss_chunk_tokens} tokens at a time"
            if t.loss_chunk_tokens
            else "; full logits"
        )
    )
    if t.optimizer == "paged_adamw_8bit" and device == "cuda":
        plan.notes.append("paged_adamw_8bit: its state can page out to host memory under pressure (not counted)")
    return plan
