"""`moe-qlora plan`: will it fit? Bytes by kind for a configured run, from config.json alone.

The model is built on the meta device (no weights, no memory) and every parameter is classified with the
rules the loader applies: NF4 expert stacks, bitsandbytes 4-bit linears, what stays in the compute dtype,
then LoRA (fp32), its gradients (all, or one layer's when stepped in the backward) and the optimizer state
(fp32 or 8-bit moments). Activation memory is an estimate (see below).

Several GPUs (`gpus`, `parallel`): under ddp every GPU holds all of that; under fsdp (FSDP2, as
distributed.shard_model wraps the model) the experts, the compute-dtype weights, LoRA, its gradients and the
optimizer state are split by dim 0 across the GPUs, the 4-bit linears by output row, and the unsharded
parameters of the layers being computed are added. Communication per optimizer step is counted for both.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AutoConfig
from transformers.quantizers.quantizers_utils import should_convert_module

from .config import RunConfig, resolve_compute_dtype
from .experts import (
    adopt_dense_input_experts,
    adopt_split_gate_up_experts,
    expert_dims,
    is_experts_module,
    quantized_stack_names,
)
from .families import matches_target, resolve_targets
from .kernels.grouped_mm import dequant_budget_bytes, experts_per_chunk
from .kernels.ops import autotune_requested
from .loading import linears_not_quantized
from .model_classes import text_model_from_config
from .nf4 import BLOCKSIZE, NESTED_BLOCKSIZE

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
LORA_BYTES = 4  # LoRA master weights and their gradients are fp32
# What the process holds before any model: the CUDA context and cuBLAS workspaces on a GPU; on the CPU the
# libraries themselves (torch, transformers, peft, bitsandbytes: 475 MiB measured after importing them).
RUNTIME_BYTES = {"cuda": 600 * 2**20, "cpu": 480 * 2**20}
DEFAULT_GPU_GIB = 80.0
# Bandwidth one GPU's collectives get, bytes/s each direction: NVLink 4 on an H100 SXM (900 GB/s both ways),
# and a PCIe 4.0 x16 slot (32 GB/s raw, ~25 GB/s achieved).
LINKS = {"NVLink 4": 450e9, "PCIe 4 x16": 25e9}
PARALLEL_MODES = ("auto", "ddp", "fsdp")


def four_bit_bytes(numel: int, *, double_quant: bool) -> int:
    """Codes (two a byte) plus block scales: fp32 per 64 values, or a byte each plus an fp32 per 256 blocks."""
    blocks = numel // BLOCKSIZE
    scales = blocks + 4 * math.ceil(blocks / NESTED_BLOCKSIZE) if double_quant else 4 * blocks
    return numel // 2 + scales


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

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    @property
    def fits(self) -> bool:
        """The per-GPU total within one GPU's memory (gpu_bytes)."""
        return self.total <= self.gpu_bytes


def meta_model(name_or_path: str, trust_remote_code: bool = False) -> nn.Module:
    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
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


def weight_bytes(model: nn.Module, cfg: RunConfig, *, device: str) -> dict[str, int]:
    """Bytes of the loaded weights by kind (classified_weights)."""
    compute = DTYPE_BYTES[resolve_compute_dtype(cfg.model.compute_dtype, device)]
    double_quant = {"experts_nf4": cfg.model.expert_double_quant, "linear_4bit": cfg.model.linear_double_quant}
    kinds = {"experts_nf4": 0, "linear_4bit": 0, "other": 0}
    for _, kind, p in classified_weights(model, device=device):
        n = p.numel()
        kinds[kind] += n * compute if kind == "other" else four_bit_bytes(n, double_quant=double_quant[kind])
    return kinds


def lora_tensor_shapes(model: nn.Module, cfg: RunConfig, targets: list[str]) -> list[tuple[str, tuple[int, ...]]]:
    """(module name, shape) of every LoRA tensor: per-expert factor stacks (experts on dim 0, see
    experts.ExpertLoRA), PEFT's lora_A (r, in) and lora_B (out, r) on targeted linears and on routers."""
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


def activation_bytes(model: nn.Module, cfg: RunConfig, *, device: str) -> int:
    """An estimate of activation memory for one micro-batch (N = batch * seq tokens, d = compute bytes).

    Checkpointed layers keep their input (N H d); the others, and the one being recomputed, keep a layer's
    activations: ~12 N H d for attention, norms and residuals, N K (2I + 2r) d for the MoE rows (h and the
    LoRA projections) and 2 N E fp32 for the router. SDPA's memory-efficient kernels are assumed (no N x N
    attention matrix). The loss is its own row (loss_bytes).
    """
    c, t, lora = model.config, cfg.train, cfg.lora
    tokens = t.micro_batch_size * cfg.data.max_seq_len
    d, hidden = DTYPE_BYTES[resolve_compute_dtype(cfg.model.compute_dtype, device)], c.hidden_size
    layers = c.num_hidden_layers
    moe = [m for m in model.modules() if is_experts_module(m)]
    k = getattr(c, "num_experts_per_tok", 0) or 0
    experts, _, inter = expert_dims(moe[0]) if moe else (0, hidden, 0)
    per_layer = 12 * tokens * hidden * d + tokens * k * (2 * inter + 2 * lora.rank) * d + 2 * tokens * experts * 4
    checkpointed = math.ceil(layers / t.checkpoint_interval) if t.gradient_checkpointing else 0
    kept_full = layers - checkpointed + (1 if checkpointed else 0)
    return checkpointed * tokens * hidden * d + kept_full * per_layer


def loss_bytes(model: nn.Module, cfg: RunConfig) -> int:
    """Logits the loss holds at once. Chunked (train.loss_chunk_tokens, losses.py): one fp32 (chunk, vocab)
    buffer reused for logits, softmax and gradient, plus logsumexp's temporary: 2 x 4 bytes. Full logits:
    ~3 x (tokens, vocab) fp32 for the micro-batch (logits, log-softmax, gradient)."""
    tokens = cfg.train.micro_batch_size * cfg.data.max_seq_len
    chunk = cfg.train.loss_chunk_tokens
    vocab = model.config.get_text_config().vocab_size
    return 2 * 4 * min(tokens, chunk) * vocab if chunk else 3 * 4 * tokens * vocab


def gradient_bytes(n_lora: int, model: nn.Module, cfg: RunConfig) -> int:
    """LoRA gradients alive at once: all of them, or with train.optimizer_in_backward about one decoder
    layer's (a layer's backward forms its LoRA gradients together; each is freed once its tensor is stepped)."""
    if cfg.train.optimizer_in_backward:
        return math.ceil(n_lora / model.config.num_hidden_layers) * LORA_BYTES
    return n_lora * LORA_BYTES


def dequant_buffer_bytes(model: nn.Module, cfg: RunConfig, *, device: str) -> int:
    """grouped_mm's decoded expert stack, alive during one projection: the largest stack in the compute dtype,
    or model.dequant_buffer_mb when smaller (decoded a chunk of experts at a time). Counted when the run uses
    grouped_mm: kernels: grouped_mm, or auto on CUDA at or above model.fused_below_rows rows per expert."""
    moe = [m for m in model.modules() if is_experts_module(m)]
    if not moe:
        return 0
    m = cfg.model
    experts, hidden, inter = expert_dims(moe[0])
    k = getattr(model.config, "num_experts_per_tok", 0) or 1
    rows_per_expert = cfg.train.micro_batch_size * cfg.data.max_seq_len * k / experts
    dtype = resolve_compute_dtype(m.compute_dtype, device)
    # auto takes grouped_mm only where torch has its fused kernel: bf16 on sm_90/sm_100. The plan does not know
    # the GPU, so in bf16 it counts the buffer (an H100's case; on other GPUs auto runs triton and needs none).
    grouped = m.kernels == "grouped_mm" or (m.kernels == "auto" and device == "cuda" and dtype == "bfloat16"
                                            and rows_per_expert >= m.fused_below_rows)  # fmt: skip
    if not grouped:
        return 0
    d = DTYPE_BYTES[dtype]
    gated = 2 if getattr(moe[0], "has_gate", True) else 1
    expert_bytes = gated * inter * hidden * d
    return experts_per_chunk(experts, expert_bytes, dequant_budget_bytes(m.dequant_buffer_mb)) * expert_bytes


AUTOTUNE_FLUSH_BYTES = 256 * 2**20  # triton.testing.do_bench clears the L2 with this buffer between timings


def autotune_bytes(cfg: RunConfig, *, device: str) -> int:
    """The buffer Triton's autotuner allocates while it times the fused kernel's configs (first steps of each
    shape class), kept reserved by torch's caching allocator afterwards. Counted on CUDA when Triton kernels
    may run (kernels: triton or auto) and autotuning is on (MOE_QLORA_AUTOTUNE=0 turns it off)."""
    if device != "cuda" or cfg.model.kernels not in ("triton", "auto") or not autotune_requested():
        return 0
    return AUTOTUNE_FLUSH_BYTES


def plan_run(
    cfg: RunConfig,
    *,
    name_or_path: str,
    device: str = "cuda",
    model: nn.Module | None = None,
    gpus: int = 1,
    parallel: str | None = None,
    gpu_gib: float = DEFAULT_GPU_GIB,
) -> Plan:
    """Bytes by kind one GPU holds for the run `cfg` on `gpus` devices of `gpu_gib` GiB each, and what each
    sends per optimizer step. `parallel`: auto, ddp or fsdp (default: cfg.train.parallel). `model`:
    meta_model(name_or_path), when already built (planning many configurations of one model)."""
    model = model if model is not None else meta_model(name_or_path, cfg.model.trust_remote_code)
    targets = resolve_targets(model, cfg.lora.target_modules)  # round-trips a probe adapter through PEFT: once
    plan = one_device_plan(cfg, model, targets, device=device)
    plan.gpus, plan.gpu_bytes = gpus, int(gpu_gib * 2**30)
    requested = parallel or cfg.train.parallel
    if requested not in PARALLEL_MODES:
        raise ValueError(f"parallel: {requested!r} is not one of {', '.join(PARALLEL_MODES)}")
    plan.parallel, why = choose_parallel(requested, plan, gpus=gpus, gpu_gib=gpu_gib)
    if plan.parallel == "fsdp":
        shard_plan(plan, sharded_tensors(model, cfg, targets, device=device), cfg, model, device=device)
    else:
        plan.communication_bytes_per_step = ddp_communication_bytes(plan.bytes["lora"], gpus)
    if gpus > 1 or plan.parallel == "fsdp":  # one GPU without sharding: the notes as they always were
        add_parallel_notes(plan, why, cfg, gpu_gib=gpu_gib)
    return plan


def one_device_plan(cfg: RunConfig, model: nn.Module, targets: list[str], *, device: str) -> Plan:
    """Bytes by kind of the run `cfg` in one process on `device`: what ddp puts on every GPU."""
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
    plan.bytes["loss_logits"] = loss_bytes(model, cfg)
    plan.bytes["runtime"] = RUNTIME_BYTES["cuda" if device == "cuda" else "cpu"]
    if buffer := dequant_buffer_bytes(model, cfg, device=device):
        plan.bytes["dequant_buffer"] = buffer
    if flush := autotune_bytes(cfg, device=device):
        plan.bytes["autotune_flush"] = flush
    if not any(is_experts_module(m) for m in model.modules()):
        plan.notes.append("no MoE experts in this model: it would train as plain QLoRA")
    plan.notes.append(f"targets: experts={cfg.lora.experts}, linears={targets}")
    t = cfg.train
    plan.notes.append(f"optimizer: {t.optimizer}" + (", stepped in the backward" if t.optimizer_in_backward else "")
                      + (f"; loss through the head {t.loss_chunk_tokens} tokens at a time" if t.loss_chunk_tokens
                         else "; full logits"))  # fmt: skip
    if t.optimizer == "paged_adamw_8bit" and device == "cuda":
        plan.notes.append("paged_adamw_8bit: its state can page out to host memory under pressure (not counted)")
    return plan


def choose_parallel(requested: str, plan: Plan, *, gpus: int, gpu_gib: float) -> tuple[str, str]:
    """(ddp or fsdp, why). auto, as the trainer decides it (session.sharding_chosen): ddp when the one-device
    plan fits one GPU of `gpu_gib` GiB, fsdp when it does not; on one GPU there is nothing to shard it over."""
    if requested != "auto":
        return requested, f"parallel: {requested}"
    if gpus == 1:
        return "ddp", "parallel auto: one GPU, one process"
    need = plan.total / 2**30
    if plan.fits:
        return "ddp", f"parallel auto -> ddp: the whole run ({need:,.2f} GiB) fits one {gpu_gib:g} GiB GPU"
    return "fsdp", f"parallel auto -> fsdp: the whole run ({need:,.2f} GiB) does not fit one {gpu_gib:g} GiB GPU"


def ddp_communication_bytes(lora_bytes: int, gpus: int) -> int:
    """Bytes one rank sends per optimizer step under ddp: one ring all-reduce of the fp32 LoRA gradients
    (distributed.sum_gradients), 2 (N-1)/N of the buffer (a reduce-scatter and an all-gather)."""
    return 2 * (gpus - 1) * lora_bytes // gpus


@dataclass(frozen=True)
class ShardedTensor:
    """A tensor FSDP2 shards on dim 0: `rows` rows of `row_numel` elements of `elem_bytes` bytes each, in the
    FSDP group `group` (a decoder layer's module name; "" for the root)."""

    group: str
    kind: str
    rows: int
    row_numel: int
    elem_bytes: int

    def shard_numel(self, gpus: int) -> int:
        """Elements one rank holds: FSDP2 pads dim 0 to a multiple of the ranks, so each has ceil(rows / N)."""
        return -(-self.rows // gpus) * self.row_numel

    def shard_bytes(self, gpus: int) -> int:
        return self.shard_numel(gpus) * self.elem_bytes


def decoder_layer_names(model: nn.Module) -> list[str]:
    """Module names of the decoder layers, one FSDP group each: the modules of the classes the model names in
    _no_split_modules, as distributed.shard_model wraps them."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    return [name for name, m in model.named_modules() if type(m).__name__ in classes]


def fsdp_group(name: str, layers: list[str]) -> str:
    """The FSDP group that manages parameter or module `name`: the innermost decoder layer holding it, else the
    root ("")."""
    holding = [layer for layer in layers if name == layer or name.startswith(layer + ".")]
    return max(holding, key=len, default="")


def rows_and_row_numel(shape: tuple[int, ...]) -> tuple[int, int]:
    """(dim 0, elements per dim-0 row) of a shape; a scalar is one row of one."""
    return (shape[0], math.prod(shape[1:])) if len(shape) else (1, 1)


def sharded_tensors(model: nn.Module, cfg: RunConfig, targets: list[str], *, device: str) -> list[ShardedTensor]:
    """Every tensor FSDP shards (distributed.shard_model). Each NF4 expert stack becomes two, experts on dim 0
    (experts.make_stacks_shardable): uint8 codes, half a byte a weight, and fp32 block scales, one per 64
    weights (nested scales decoded): 4.5 bits a weight whatever model.expert_double_quant says. So does each
    4-bit linear whose rows hold whole NF4 blocks, output rows on dim 0 (nf4.make_linears_shardable); the others
    are not here: they stay whole. Then the weights kept in the compute dtype and the fp32 LoRA tensors."""
    compute = DTYPE_BYTES[resolve_compute_dtype(cfg.model.compute_dtype, device)]
    layers = decoder_layer_names(model)
    tensors = []
    for name, kind, p in classified_weights(model, device=device):
        group = fsdp_group(name, layers)
        if kind == "experts_nf4":
            experts, per_expert = rows_and_row_numel(tuple(p.shape))
            tensors.append(ShardedTensor(group, kind, experts, per_expert // 2, 1))
            tensors.append(ShardedTensor(group, kind, experts, per_expert // BLOCKSIZE, 4))
        elif kind == "linear_4bit" and p.shape[1] % BLOCKSIZE == 0:
            tensors.append(ShardedTensor(group, kind, p.shape[0], p.shape[1] // 2, 1))
            tensors.append(ShardedTensor(group, kind, p.shape[0], p.shape[1] // BLOCKSIZE, 4))
        elif kind == "other":
            tensors.append(ShardedTensor(group, kind, *rows_and_row_numel(tuple(p.shape)), compute))
    for module_name, shape in lora_tensor_shapes(model, cfg, targets):
        tensors.append(ShardedTensor(fsdp_group(module_name, layers), "lora", *rows_and_row_numel(shape), LORA_BYTES))
    return tensors


def unsharded_group_bytes(tensors: list[ShardedTensor], gpus: int) -> dict[str, int]:
    """Bytes of each FSDP group's parameters when all-gathered: N padded shards of each of its tensors."""
    groups: dict[str, int] = {}
    for t in tensors:
        groups[t.group] = groups.get(t.group, 0) + gpus * t.shard_bytes(gpus)
    return groups


def fsdp_communication_bytes(tensors: list[ShardedTensor], gpus: int, grad_accum: int) -> int:
    """Bytes one rank sends per optimizer step under fsdp, ring collectives moving (N-1)/N of each whole buffer.
    Every micro-batch: each decoder layer's parameters are all-gathered twice (for its forward, and again for
    its backward: reshard_after_forward), the root's once (FSDP2 keeps the root unsharded from its forward to
    the end of the backward), and the fp32 LoRA gradients are reduce-scattered once."""
    per_micro_batch = 0
    for group, whole in unsharded_group_bytes(tensors, gpus).items():
        gathers = 2 if group else 1
        per_micro_batch += gathers * (gpus - 1) * whole // gpus
    lora_whole = sum(gpus * t.shard_bytes(gpus) for t in tensors if t.kind == "lora")
    per_micro_batch += (gpus - 1) * lora_whole // gpus
    return grad_accum * per_micro_batch


def shard_plan(plan: Plan, tensors: list[ShardedTensor], cfg: RunConfig, model: nn.Module, *, device: str) -> None:
    """Turn the one-device `plan` into one rank's bytes under fsdp over plan.gpus ranks. Sharded: experts,
    4-bit linears (by row), compute-dtype weights, LoRA, its gradients and optimizer state (one rank's shard of
    each tensor). Whole: 4-bit linears whose rows split NF4 blocks, activations, loss, runtime, the decode
    buffer, the autotuner's flush buffer. Added: all_gather_buffers, the unsharded
    parameters of the largest decoder layer twice (the one computing and the next, prefetched), and
    root_unsharded, the root's (embeddings, final norm, head), held from the forward to the end of the backward."""
    n = plan.gpus
    kinds = ("experts_nf4", "linear_4bit", "other")
    shard = {kind: sum(t.shard_bytes(n) for t in tensors if t.kind == kind) for kind in kinds}
    whole_linears = [p.numel() for _, kind, p in classified_weights(model, device=device)
                     if kind == "linear_4bit" and p.shape[1] % BLOCKSIZE]  # fmt: skip
    lora = [t for t in tensors if t.kind == "lora"]
    lora_numel = sum(t.shard_numel(n) for t in lora)
    groups = unsharded_group_bytes(tensors, n)
    layers = [whole for group, whole in groups.items() if group]
    plan.bytes.update(
        experts_nf4=shard["experts_nf4"],
        linear_4bit=shard["linear_4bit"]
        + sum(four_bit_bytes(k, double_quant=cfg.model.linear_double_quant) for k in whole_linears),
        other=shard["other"],
        lora=lora_numel * LORA_BYTES,
        gradients=gradient_bytes(lora_numel, model, cfg),
        optimizer=sum(optimizer_state_bytes(t.shard_numel(n), cfg.train.optimizer) for t in lora),
        all_gather_buffers=2 * max(layers, default=0),
        root_unsharded=groups.get("", 0),
    )
    plan.communication_bytes_per_step = fsdp_communication_bytes(tensors, n, cfg.train.grad_accum)


def add_parallel_notes(plan: Plan, why: str, cfg: RunConfig, *, gpu_gib: float) -> None:
    """What the mode holds on each GPU, whether it fits, and what its communication costs per step."""
    n, gb = plan.gpus, plan.communication_bytes_per_step / 1e9
    gpus = f"{n} GPU" + ("s" if n > 1 else "")
    plan.notes.append(why)
    if plan.parallel == "ddp":
        plan.notes.append(f"ddp over {gpus}: each holds all of the above; the fp32 LoRA gradients are all-reduced "
                          "once a step")  # fmt: skip
    else:
        plan.notes.append(f"fsdp over {gpus}, one FSDP group a decoder layer: 4-bit experts and linears (4.5 bits "
                          "a weight: fp32 scales, not double-quantized), compute-dtype weights, LoRA, gradients and "
                          "optimizer state sharded")  # fmt: skip
        plan.notes.append("all_gather_buffers: two decoder layers unsharded (one prefetched); root_unsharded: "
                          "embeddings, final norm and head, whole from the forward to the backward's end")  # fmt: skip
        if cfg.train.optimizer != "adamw":
            plan.notes.append(f"train refuses train.optimizer: {cfg.train.optimizer} under fsdp (bitsandbytes state "
                              "is not sharded): use adamw")  # fmt: skip
    verdict = "fits" if plan.fits else "does not fit"
    plan.notes.append(f"per GPU {plan.total / 2**30:,.2f} GiB: {verdict} in {gpu_gib:g} GiB")
    seconds = ", ".join(f"{plan.communication_bytes_per_step / rate:,.3f} s at {link} ({rate / 1e9:g} GB/s)"
                        for link, rate in LINKS.items())  # fmt: skip
    plan.notes.append(f"communication per optimizer step: {gb:,.2f} GB sent by each GPU; {seconds}")


def render_plan(plan: Plan, console) -> None:
    from rich.table import Table

    title = f"{plan.model_type}: {plan.params / 1e9:.2f}B parameters"
    if plan.gpus > 1 or plan.parallel == "fsdp":
        title += f", per GPU ({plan.parallel} over {plan.gpus} GPU{'s' if plan.gpus > 1 else ''})"
    table = Table(title=title)
    table.add_column("kind")
    table.add_column("MiB", justify="right")
    table.add_column("GiB", justify="right")
    for kind, n in [*plan.bytes.items(), ("total", plan.total)]:
        table.add_row(kind, f"{n / 2**20:,.1f}", f"{n / 2**30:,.2f}")
    console.print(table)
    for note in plan.notes:
        console.print(note, highlight=False)
