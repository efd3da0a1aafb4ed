"""The MoE layer installed as transformers' experts implementation, and the kernels each experts module runs.

transformers v5 MoE blocks route tokens themselves and call `experts(hidden, top_k_index, top_k_weights)`;
the experts class dispatches on `config._experts_implementation`. We register "moe_qlora" there: the
block's routing stays exactly the model's own, and only the expert computation is ours.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface, _default_apply_gate

from moe_qlora.moe.expert_dispatch import exchange_with_expert_ranks
from moe_qlora.moe.expert_lora import ExpertLoRA
from moe_qlora.moe.expert_stacks import (
    experts_modules,
    holds_mxfp4,
    is_experts_module,
    quantized_stack,
    stack_names,
)
from moe_qlora.moe.grouped_layer import moe_lora_experts_grouped
from moe_qlora.moe.kernel_names import KERNELS
from moe_qlora.moe.kernel_rule import call_path
from moe_qlora.moe.layer_state import FUSED_BELOW_ROWS, layer_state, read_state
from moe_qlora.moe.nf4 import NF4Stack
from moe_qlora.moe.reference_layer import DeferredWeightGrads, FrozenExperts, MoEPlan, moe_lora_experts
from moe_qlora.moe.routing import route
from moe_qlora.moe.self_check import KernelSelfCheck, with_injected_fault
from moe_qlora.moe.token_chunks import chunk_module_tokens, over_token_chunks, token_wise_mlps

EXPERTS_IMPLEMENTATION = "moe_qlora"


def _frozen_experts(module: nn.Module) -> FrozenExperts:
    first, down = stack_names(module)
    has_bias = getattr(module, "has_bias", False)
    return FrozenExperts(
        gate_up=quantized_stack(module, first),
        down=quantized_stack(module, down),
        gate=module._apply_gate if module.has_gate else module.act_fn,
        transposed=getattr(module, "is_transposed", False) and not holds_mxfp4(module),  # MXFP4: (E, out, in)
        gate_up_bias=getattr(module, f"{first}_bias") if has_bias else None,
        down_bias=module.down_proj_bias if has_bias else None,
        gate_is_silu_mul=_cached_gates_with_silu_mul(module),
    )


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
    """The registered experts implementation. hidden_states: (T, H), top_k_*: (T, K) -> (T, H); the tokens a
    chunk at a time when set_token_chunks asked for it (token_chunks.py); under expert parallelism the routed rows
    exchanged with the ranks holding their experts first (expert_dispatch.py), the chunks then over the rows this
    rank received, so every rank makes the same collectives whatever its tokens."""
    state = read_state(self)
    if state.expert_shard is not None:
        out, routing = exchange_with_expert_ranks(
            partial(experts_in_chunks, self), state.expert_shard, hidden_states, top_k_index, top_k_weights
        )
        lora: ExpertLoRA | None = getattr(self, "moe_lora", None)
        if lora is not None and lora.active and self.training:
            lora.routed_rows += routing.counts  # the rows this rank routed, to every expert, as without ranks
        return out
    return experts_in_chunks(self, hidden_states, top_k_index, top_k_weights)


def experts_in_chunks(self, hidden_states, top_k_index, top_k_weights):
    """experts_call on the rows given, `chunk_tokens` of them at a time when set."""
    chunk = read_state(self).chunk_tokens
    if not chunk:
        return experts_call(self, hidden_states, top_k_index, top_k_weights)
    return over_token_chunks(partial(experts_call, self), chunk, hidden_states, top_k_index, top_k_weights)


def experts_call(self, hidden_states, top_k_index, top_k_weights):
    """One call of the MoE layer on the tokens given: routing metadata, kernels chosen for its rows, LoRA."""
    state = read_state(self)
    if state.offload is not None:
        offloader, layer = state.offload
        offloader.enter(layer)  # here, outside the autograd Function, grad mode says forward or generation
    frozen = _frozen_experts(self)
    lora: ExpertLoRA | None = getattr(self, "moe_lora", None)
    if lora is not None and not lora.active:
        lora = None
    split = state.expert_shard is not None  # LoRA's tensors are this rank's rows of DTensors: gradients by autograd
    deferred = state.deferred_grads if lora is not None and not split else None
    plan = MoEPlan(
        frozen,
        route(top_k_index, frozen.gate_up.num_experts),
        lora.scale if lora is not None else 0.0,
        deferred=deferred,
        lora_params=lora.factors() if deferred is not None else None,
    )
    if lora is not None and self.training and not split:  # split: counted over every expert before the exchange
        lora.routed_rows += plan.routing.counts
    factors = lora.factors() if lora is not None else None
    rows = hidden_states.shape[0] * top_k_index.shape[1]
    kernels = call_path(state.kernels, rows, frozen.gate_up.num_experts, state.fused_below_rows)
    if state.generating:
        kernels = generation_path(kernels, frozen, hidden_states.dtype)
    budget = state.dequant_budget

    def run(path, x, weights, lora_factors, call_plan):
        return run_moe_path(path, x, weights, lora_factors, call_plan, budget)

    checker: KernelSelfCheck | None = state.self_check
    if checker is not None and kernels != "torch" and not torch.compiler.is_compiling():
        kernels = checker.path_for(kernels, hidden_states, top_k_index, top_k_weights, factors, plan, run)
    return run(kernels, hidden_states, top_k_weights, factors, plan)


# CPU generation: an experts layer whose decoded gate_up stack fits in this many bytes runs the grouped formulation
# (each stack decoded whole by one call, then torch._grouped_mm): at decode steps every expert is hit and the
# per-expert loop's Python cost per expert is what a small layer's step costs. A larger stack runs the per-expert
# reference, which decodes each expert into a cache-sized buffer (scripts/bench_rollout.py, docs/benchmarks.md:
# builtin:tiny-mixtral's 0.5 MiB stacks 1.7x faster grouped; the qwen3 preset's 128 MiB ones 3x slower).
GROUPED_GENERATION_BYTES = 8 * 2**20


def generation_path(kernels: str, frozen: FrozenExperts, dtype: torch.dtype) -> str:
    """The path of a layer call during generation: the CPU reference's grouped formulation for small NF4 stacks
    (GROUPED_GENERATION_BYTES); any other choice as is (on CUDA, auto and triton already take the fused kernel
    at decode shapes). Both compute the same function in the same dtype (tests/moe/test_generation_path.py)."""
    if kernels != "torch" or not isinstance(frozen.gate_up, NF4Stack):
        return kernels
    experts, rows, cols = frozen.gate_up.shape
    return "grouped_mm" if experts * rows * cols * dtype.itemsize <= GROUPED_GENERATION_BYTES else kernels


@contextmanager
def generation_kernels(model) -> Iterator[None]:
    """Within the block `model`'s experts layers run the path generation_path picks for their calls (a GRPO
    rollout, `moe-qlora generate`); the training forward and every scoring pass keep the configured one."""
    states = [layer_state(module) for _, module in experts_modules(model)]
    for state in states:
        state.generating = True
    try:
        yield
    finally:
        for state in states:
            state.generating = False


def run_moe_path(path: str, x, weights, lora, plan: MoEPlan, dequant_budget: int | None) -> torch.Tensor:
    """The MoE layer through `path` (torch: the per-expert reference; triton, grouped_mm, torch-grouped: the
    grouped layer), with MOE_QLORA_INJECT_KERNEL_FAULT's fault for it, if any (self_check)."""
    if path == "torch":
        return with_injected_fault(path, lambda: moe_lora_experts(x, weights, lora, plan))
    return with_injected_fault(path, lambda: moe_lora_experts_grouped(x, weights, lora, plan, path, dequant_budget))


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


def set_token_chunks(model, chunk: int) -> tuple[int, int]:
    """Run every experts module, shared expert and dense MLP of `model` over `chunk` tokens at a time while
    gradients are recorded (token_chunks.py; 0: the whole micro-batch again). Returns (experts modules, other
    MLPs) set."""
    experts = experts_modules(model)
    for _, module in experts:
        layer_state(module).chunk_tokens = chunk
    mlps = token_wise_mlps(model, is_experts_module)
    for _, module in mlps:
        chunk_module_tokens(module, chunk)
    return len(experts), len(mlps)


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
