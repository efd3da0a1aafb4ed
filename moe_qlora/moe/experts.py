"""Per-expert LoRA on quantized experts, plugged into transformers' experts interface.

transformers v5 MoE blocks route tokens themselves and call `experts(hidden, top_k_index, top_k_weights)`;
the experts class dispatches on `config._experts_implementation`. We register "moe_qlora" there: the
block's routing stays exactly the model's own, and only the expert computation is ours.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import bitsandbytes as bnb
import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface, _default_apply_gate

from moe_qlora.moe.grouped_layer import moe_lora_experts_grouped
from moe_qlora.moe.kernel_names import KERNELS
from moe_qlora.moe.layer_state import FUSED_BELOW_ROWS, layer_state, read_state
from moe_qlora.moe.mxfp4 import (
    BLOCKS_SUFFIX,
    SCALES_SUFFIX,
    MXFP4Stack,
    check_encodable,
    published_shapes,
    stack_shape_of,
)
from moe_qlora.moe.nf4 import NF4Stack
from moe_qlora.moe.offload import OffloadedStack
from moe_qlora.moe.reference_layer import DeferredWeightGrads, FrozenExperts, MoEPlan, moe_lora_experts
from moe_qlora.moe.routing import route
from moe_qlora.moe.self_check import KernelSelfCheck, with_injected_fault

EXPERTS_IMPLEMENTATION = "moe_qlora"
# Expert stacks: the first projection (gate_up_proj when gated, up_proj when not) and down_proj.
EXPERT_PARAMS = ("gate_up_proj", "up_proj", "down_proj")


class UnsupportedExpertsError(ValueError):
    """An experts module whose layout or math the MoE layer cannot compute exactly."""


class ExpertLoRA(nn.Module):
    """LoRA factors for every expert of one layer (fp32 master weights).

    gate_up_a: (E, r, H)  gate_up_b: (E, 2I, r), or (E, I, r) for non-gated experts (up_proj)
    down_a: (E, r, I)  down_b: (E, H, r)
    Expert e's update is scale * B_e A_e with scale = alpha / r; B starts at zero so training starts at the base model.
    """

    def __init__(
        self,
        *,
        num_experts: int,
        hidden: int,
        intermediate: int,
        rank: int,
        alpha: float,
        gated: bool = True,
        device=None,
        generator=None,
    ):
        super().__init__()
        shapes = {
            "gate_up_a": (num_experts, rank, hidden),
            "gate_up_b": (num_experts, (2 if gated else 1) * intermediate, rank),
            "down_a": (num_experts, rank, intermediate),
            "down_b": (num_experts, hidden, rank),
        }
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=torch.float32, device=device)))
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        self.active = True  # False: the experts compute the frozen base alone (GRPO's reference policy)
        # Rows routed to each expert while training (router load), read and reset by the trainer.
        self.register_buffer("routed_rows", torch.zeros(num_experts, dtype=torch.long, device=device), persistent=False)
        self.reset_parameters(generator)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        # Same distribution PEFT gives lora_A (kaiming-uniform, a=sqrt(5), fan_in = in features), per expert.
        for a in (self.gate_up_a, self.down_a):
            bound = 1.0 / math.sqrt(a.shape[-1])
            nn.init.uniform_(a, -bound, bound, generator=generator)
        nn.init.zeros_(self.gate_up_b)
        nn.init.zeros_(self.down_b)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.gate_up_a, self.gate_up_b, self.down_a, self.down_b)

    def extra_repr(self) -> str:
        return f"experts={self.gate_up_a.shape[0]}, rank={self.rank}, alpha={self.alpha}"


def stack_names(module: nn.Module) -> tuple[str, str]:
    """The experts module's two stacks: ('gate_up_proj', 'down_proj'), or ('up_proj', 'down_proj') when the
    experts are not gated (up -> activation -> down, e.g. Nemotron-H's squared ReLU)."""
    return ("gate_up_proj" if getattr(module, "has_gate", True) else "up_proj", "down_proj")


def is_experts_module(module: nn.Module) -> bool:
    """True for a class on transformers' experts interface (its decorator sets has_gate) with its 3D stacks."""
    if not hasattr(module, "has_gate"):
        return False
    shardable = read_state(module).shardable_shapes is not None
    return shardable or all(hasattr(module, n) or hasattr(module, n + BLOCKS_SUFFIX) for n in stack_names(module))


def holds_mxfp4(module: nn.Module) -> bool:
    """Whether an experts module keeps its stacks in MXFP4 (`<stack>_blocks` and `<stack>_scales`)."""
    return hasattr(module, stack_names(module)[0] + BLOCKS_SUFFIX)


def module_expert(module: nn.Module, name: str, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Expert e of a quantized stack decoded to the layout of the module's own parameter: (out, in), or (in, out)
    when the module is transposed and the stack is MXFP4 (kept as published, (out, in))."""
    w = module_stack(module, name).decode(e, e + 1, dtype)[0]
    return w.T if getattr(module, "is_transposed", False) and holds_mxfp4(module) else w


def decoded_module_stack(module: nn.Module, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An MXFP4 stack decoded (exactly) to the layout of the module's own parameter: (E, out, in), or (E, in, out)
    when the module is transposed (gpt-oss): what transformers' dequantization of the checkpoint holds."""
    w = module_stack(module, name).decode(0, expert_dims(module)[0], dtype)
    return w.transpose(1, 2).contiguous() if getattr(module, "is_transposed", False) else w


def expect_mxfp4_stacks(model: nn.Module) -> int:
    """Before loading a checkpoint published in MXFP4: every experts module's stacks become the uint8
    `<stack>_blocks` (E, out, in/32, 16) and `<stack>_scales` (E, out, in/32) parameters the checkpoint holds (on
    the meta device, as transformers builds models before loading), so they are read as stored, never decoded.
    Returns how many stacks."""
    count = 0
    for name, module in experts_modules(model):
        for stack in stack_names(module):
            stored = module._parameters.pop(stack)
            shape = stack_shape_of(tuple(stored.shape), getattr(module, "is_transposed", False))
            check_encodable(shape, f"{name}.{stack}")
            for suffix, part in zip((BLOCKS_SUFFIX, SCALES_SUFFIX), published_shapes(shape), strict=True):
                empty = torch.empty(part, dtype=torch.uint8, device="meta")
                module.register_parameter(stack + suffix, nn.Parameter(empty, requires_grad=False))
            count += 1
        module._is_hf_initialized = True  # its model's _init_weights would reach for the stacks no longer there
    return count


def check_supported_layout(module: nn.Module, name: str = "experts") -> None:
    """Refuse an experts module the MoE layer would compute wrongly, naming what is unsupported.

    Supported: gate_up_proj / down_proj stacks, stored (E, out, in) or transposed (E, in, out), with or
    without biases, and any gating the module defines in `_apply_gate` (it is called as is, and
    differentiated by autograd), e.g. GPT-OSS's interleaved, clamped SwiGLU; or non-gated up_proj / down_proj
    stacks with the module's own activation `act_fn` between them.
    """
    problems = []
    if getattr(module, "has_post_expert_norm", False):
        problems.append("a norm after each expert (has_post_expert_norm=True)")
    if problems:
        raise UnsupportedExpertsError(
            f"{name} ({type(module).__name__}) has " + ", ".join(problems) + "; moe-qlora computes experts "
            "as down(gate(gate_up(x))) with optional biases. Refusing rather than training on a wrong forward."
        )


def expert_dims(module: nn.Module) -> tuple[int, int, int]:
    """(experts, hidden, intermediate) of an experts module, from its first stack (quantized or not)."""
    if "gate_proj" in module._parameters and read_state(module).split_gate_up:  # not fused yet
        e, inter, hidden = module.gate_proj.shape
        return e, hidden, inter
    if holds_mxfp4(module):
        e, width, hidden = module_stack(module, stack_names(module)[0]).shape  # (E, out, in)
        return e, hidden, width // 2 if module.has_gate else width
    stack = getattr(module, stack_names(module)[0])
    e, d1, d2 = stack.quant_state.shape if isinstance(stack, bnb.nn.Params4bit) else stack.shape
    hidden, width = (d1, d2) if getattr(module, "is_transposed", False) else (d2, d1)
    return e, hidden, width // 2 if module.has_gate else width


def _frozen_experts(module: nn.Module) -> FrozenExperts:
    first, down = stack_names(module)
    has_bias = getattr(module, "has_bias", False)
    return FrozenExperts(
        gate_up=module_stack(module, first),
        down=module_stack(module, down),
        gate=module._apply_gate if module.has_gate else module.act_fn,
        transposed=getattr(module, "is_transposed", False) and not holds_mxfp4(module),  # MXFP4: (E, out, in)
        gate_up_bias=getattr(module, f"{first}_bias") if has_bias else None,
        down_bias=module.down_proj_bias if has_bias else None,
        gate_is_silu_mul=_cached_gates_with_silu_mul(module),
    )


def module_stack(module: nn.Module, name: str) -> NF4Stack | MXFP4Stack:
    """The quantized stack `name` of an experts module: its MXFP4 blocks and scales as published; or NF4, its
    bitsandbytes Params4bit, or, once made shardable, the plain parameters `{name}_nf4` and `{name}_absmax`
    (whatever FSDP has gathered into them for this call)."""
    if hasattr(module, name + BLOCKS_SUFFIX):
        return MXFP4Stack.from_published(getattr(module, name + BLOCKS_SUFFIX), getattr(module, name + SCALES_SUFFIX))
    state = read_state(module)
    if state.offload is not None:  # its stacks in host memory: a handle that fetches them when read
        offloader, layer = state.offload
        return OffloadedStack(offloader, layer, name)
    shapes = state.shardable_shapes
    if shapes is not None:
        packed, absmax = getattr(module, f"{name}_nf4"), getattr(module, f"{name}_absmax")
        return NF4Stack(packed.view(-1), absmax.view(-1), None, shapes[name])
    param = getattr(module, name)
    if not isinstance(param, bnb.nn.Params4bit):
        raise UnsupportedExpertsError(
            f"{type(module).__name__}.{name} is not NF4-quantized; "
            "load the model with moe_qlora.model.loading.load_model"
        )
    return NF4Stack.from_param(param)


def make_stacks_shardable(model: nn.Module) -> int:
    """Replace every NF4 expert stack (a Params4bit, whose block scales live in its quant_state where FSDP cannot
    see them) by two frozen parameters with the experts on dim 0, so FSDP2 shards them by expert:
    `{name}_nf4` (E, O*I/2) uint8 codes and `{name}_absmax` (E, O*I/64) fp32 scales, nested scales decoded
    (the same fp32 values the kernels decode on the fly, so results do not change). Returns how many stacks."""
    converted = 0
    for module in model.modules():
        if not is_experts_module(module) or read_state(module).shardable_shapes is not None or holds_mxfp4(module):
            continue  # MXFP4 blocks and scales are plain parameters with the experts on dim 0 already
        shapes, nested = {}, False
        for name in stack_names(module):
            stack = NF4Stack.from_param(getattr(module, name))
            nested |= stack.nested is not None
            e = stack.num_experts
            packed = stack.experts_codes(0, e).reshape(e, -1).clone()
            absmax = stack.experts_absmax(0, e).reshape(e, -1).float().clone()
            del module._parameters[name]
            module.register_parameter(f"{name}_nf4", nn.Parameter(packed, requires_grad=False))
            module.register_parameter(f"{name}_absmax", nn.Parameter(absmax, requires_grad=False))
            shapes[name] = stack.shape
            converted += 1
        state = layer_state(module)
        state.shardable_shapes, state.nested_scales = shapes, nested
    return converted


def _cached_gates_with_silu_mul(module: nn.Module) -> bool:
    """_gates_with_silu_mul, read from the flag set_moe_kernels stores (method identity is not something
    torch.compile can trace), computed here for a module never set."""
    flag = read_state(module).gate_is_silu_mul
    return _gates_with_silu_mul(module) if flag is None else flag


def _gates_with_silu_mul(module: nn.Module) -> bool:
    """True when the module gates with transformers' default silu(gate) * up over the two halves of gate_up
    (Mixtral, Qwen-MoE, DeepSeek, OLMoE, ...), which the kernels fuse; any other gate runs as the module's own."""
    own_gate = getattr(getattr(module, "_apply_gate", None), "__func__", None)
    silu = isinstance(getattr(module, "act_fn", None), SiLUActivation | nn.SiLU)
    return module.has_gate and own_gate is _default_apply_gate and silu


def moe_qlora_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The registered experts implementation. hidden_states: (T, H), top_k_*: (T, K) -> (T, H)."""
    state = read_state(self)
    if state.offload is not None:
        offloader, layer = state.offload
        offloader.enter(layer)  # here, outside the autograd Function, grad mode says forward or generation
    frozen = _frozen_experts(self)
    lora: ExpertLoRA | None = getattr(self, "moe_lora", None)
    if lora is not None and not lora.active:
        lora = None
    deferred = state.deferred_grads if lora is not None else None
    plan = MoEPlan(
        frozen,
        route(top_k_index, frozen.gate_up.num_experts),
        lora.scale if lora is not None else 0.0,
        deferred=deferred,
        lora_params=lora.factors() if deferred is not None else None,
    )
    if lora is not None and self.training:
        lora.routed_rows += plan.routing.counts
    factors = lora.factors() if lora is not None else None
    kernels = state.kernels
    if kernels == "auto":
        kernels = auto_kernels(
            hidden_states.shape[0] * top_k_index.shape[1], frozen.gate_up.num_experts, state.fused_below_rows
        )
    budget = state.dequant_budget

    def run(path, x, weights, lora_factors, call_plan):
        return run_moe_path(path, x, weights, lora_factors, call_plan, budget)

    checker: KernelSelfCheck | None = state.self_check
    if checker is not None and kernels != "torch" and not torch.compiler.is_compiling():
        kernels = checker.path_for(kernels, hidden_states, top_k_index, top_k_weights, factors, plan, run)
    return run(kernels, hidden_states, top_k_weights, factors, plan)


def run_moe_path(path: str, x, weights, lora, plan: MoEPlan, dequant_budget: int | None) -> torch.Tensor:
    """The MoE layer through `path` (torch: the per-expert reference; triton, grouped_mm, torch-grouped: the
    grouped layer), with MOE_QLORA_INJECT_KERNEL_FAULT's fault for it, if any (self_check)."""
    if path == "torch":
        return with_injected_fault(path, lambda: moe_lora_experts(x, weights, lora, plan))
    return with_injected_fault(path, lambda: moe_lora_experts_grouped(x, weights, lora, plan, path, dequant_budget))


def auto_kernels(num_rows: int, num_experts: int, fused_below_rows: int) -> str:
    """The backend of one call under `kernels: auto`, from the mean rows per expert (S / E: known from the
    shapes, so choosing needs no host sync)."""
    return "triton" if num_rows < fused_below_rows * num_experts else "grouped_mm"


def set_moe_kernels(
    model,
    kernels: str,
    *,
    fused_below_rows: int = FUSED_BELOW_ROWS,
    dequant_buffer_mb: float | None = None,
    self_check: bool = False,
) -> int:
    """Run every experts module of `model` with `kernels`; returns how many modules were set.
    dequant_buffer_mb bounds grouped_mm's decoded stack (decoded a chunk of experts at a time above it);
    self_check: check each non-reference path against the torch reference at its first call per layer shape,
    dtype and rows class, falling back where it fails (self_check.KernelSelfCheck, one for the whole model). Off
    by default here, so a test of a path tests that path; a run turns it on (model.kernel_self_check)."""
    if kernels not in KERNELS:
        raise ValueError(f"unknown MoE kernels {kernels!r}; expected one of {KERNELS}")
    from moe_qlora.moe.kernels.grouped_mm import dequant_budget_bytes

    modules = experts_modules(model)
    checker = KernelSelfCheck() if self_check else None
    for _, module in modules:
        state = layer_state(module)
        state.kernels, state.fused_below_rows = kernels, fused_below_rows
        state.dequant_budget = dequant_budget_bytes(dequant_buffer_mb)
        state.gate_is_silu_mul = _gates_with_silu_mul(module)
        state.self_check = checker
    return len(modules)


def kernel_self_check(model) -> KernelSelfCheck | None:
    """The self-check set_moe_kernels gave `model`'s experts (None when off)."""
    checks = (read_state(m).self_check for _, m in experts_modules(model))
    return next((check for check in checks if check), None)


@contextmanager
def deferred_lora_gradients(model) -> Iterator[DeferredWeightGrads]:
    """Within the block, the grouped backward (kernels triton / torch-grouped) pushes the expert LoRA weight
    gradients to the yielded store instead of computing them; `store.flush()` adds them to .grad, with the
    same values direct computation gives. The per-expert torch reference computes them at once as before."""
    store = DeferredWeightGrads()
    modules = experts_modules(model)
    for _, module in modules:
        layer_state(module).deferred_grads = store
    try:
        yield store
    finally:
        for _, module in modules:
            layer_state(module).deferred_grads = None


def register_experts_implementation() -> None:
    """Make "moe_qlora" a valid `experts_implementation` (idempotent; the mapping is transformers' global one)."""
    if EXPERTS_IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(EXPERTS_IMPLEMENTATION, moe_qlora_experts_forward)


def apply_moe_qlora_experts(model) -> str:
    """Route every experts module of `model` through moe-qlora; returns the previous implementation."""
    register_experts_implementation()
    previous = model.config._experts_implementation
    model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    return previous


def revert_moe_qlora_experts(model, previous: str) -> None:
    """Undo `apply_moe_qlora_experts`."""
    model.set_experts_implementation(previous)


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if is_experts_module(m)]


def compute_device(model: nn.Module) -> torch.device:
    """Where `model` computes: its input embeddings' device. Not its experts' stacks' device, which is the host
    for offloaded layers (model.expert_offload) while their LoRA, routing and gradients live on the GPU."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None:
        return embeddings.weight.device
    return next(model.parameters()).device  # a bare experts module (benchmarks, tests): where its stacks are


def attach_expert_lora(
    model: nn.Module, *, rank: int, alpha: float, seed: int, device: torch.device | str | None = None
) -> list[str]:
    """Add an ExpertLoRA to every experts module (checked for a supported layout first), on `device` (default:
    where the model computes, compute_device). Returns their names."""
    device = torch.device(device) if device is not None else compute_device(model)
    names = []
    generator = torch.Generator().manual_seed(seed)
    for name, module in experts_modules(model):
        check_supported_layout(module, name)
        e, hidden, inter = expert_dims(module)
        lora = ExpertLoRA(
            num_experts=e,
            hidden=hidden,
            intermediate=inter,
            rank=rank,
            alpha=alpha,
            gated=module.has_gate,
            generator=generator,
        )
        module.moe_lora = lora.to(device)
        names.append(name)
    return names
