"""The MoE paths checked on the user's own device, with a fallback: the first GPU run must never compute wrong.

The Triton kernels and torch._grouped_mm are proven on a CPU (Triton's interpreter, compiles ahead of time), but a
user's GPU, driver and Triton build can still fail them: a compile error, a launch out of resources, or wrong
numbers. At the first call of a non-reference path per (path, expert stack shapes, dtype, rows class), that call's
own inputs go through the path (forward and input gradient, at the call's full size, so the tile class the rows
pick is the one checked) and through the per-expert torch reference in fp32 on its first PROBE_TOKENS tokens. A
difference beyond TOLERANCE, or an exception, marks the key failed: the call and every later one with that key
run the next path (FALLBACK: triton -> grouped_mm -> torch), and the run logs one warning naming the path, the
shapes and the error or the difference.

Cost: one more forward + backward of the layer per key (every layer of a model shares its shapes, so a run has a
handful: one per rows class its batches reach) and the reference on PROBE_TOKENS tokens; nothing afterwards.
`model.kernel_self_check: false` turns it off. MOE_QLORA_INJECT_KERNEL_FAULT=<path>:wrong|raise (comma-separated;
read once, common/injection.py, and set in-process by its `injected`) perturbs that path's output or makes it
raise: the CPU tests' stand-in for a broken GPU kernel.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
from collections.abc import Callable

import torch

from moe_qlora.common.injection import KERNEL_FAULT_ENV, injected_faults
from moe_qlora.moe.kernels.tiles import rows_class
from moe_qlora.moe.reference_layer import MoEPlan, moe_lora_experts
from moe_qlora.moe.routing import route

log = logging.getLogger(__name__)

FALLBACK = {"triton": "grouped_mm", "grouped_mm": "torch", "torch-grouped": "torch"}
PROBE_TOKENS = 8
# max |path - reference| / max |reference|, output and input gradient each, the reference in fp32. A 16-bit path
# rounds its inputs, weights, h and activation (2**-8 relative for bf16 each, compounding through two
# projections and the gate): measured below 1.5e-2 on random layers. fp32 paths differ from the reference in
# summation order only (~1e-6). A wrong kernel (gate and up swapped, a routing weight dropped, experts rolled) is
# off by O(1).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}
FAULT_ENV = KERNEL_FAULT_ENV

RunPath = Callable[[str, torch.Tensor, torch.Tensor, tuple | None, MoEPlan], torch.Tensor]


class InjectedKernelFault(RuntimeError):
    """Raised by a path named `<path>:raise` in MOE_QLORA_INJECT_KERNEL_FAULT."""


def injected_fault(path: str) -> str | None:
    """'wrong', 'raise', 'device' or None: the fault MOE_QLORA_INJECT_KERNEL_FAULT (or common.injection.injected)
    injects into `path`, from the record parsed once, not the environment: this runs for every MoE call."""
    return injected_faults().kernel_fault(path)


def with_injected_fault(path: str, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """compute(), unless a fault is injected into `path`: then it raises, or its output is off by half its
    value (differentiably, so the input gradient is wrong too)."""
    fault = injected_fault(path)
    if fault == "raise":
        raise InjectedKernelFault(f"fault injected into the {path} MoE path ({FAULT_ENV})")
    out = compute()
    return out * 1.5 if fault == "wrong" else out


class KernelSelfCheck:
    """The verdicts of one run: {(path, gate_up shape, down shape, dtype, rows class): None if it matched the
    reference, else why not}. One object is shared by every experts module of a model (set_moe_kernels)."""

    def __init__(self):
        self.verdicts: dict[tuple, str | None] = {}
        self.warned: set[tuple] = set()  # (path, shapes, dtype) already reported

    def path_for(self, path: str, x, top_k_index, top_k_weights, lora, plan: MoEPlan, run: RunPath) -> str:
        """The path this call runs: `path` if it passed (or passes now) its check for this call's key, else the
        first of its fallbacks that does; the torch reference is never checked."""
        while path != "torch":
            key = self.key(path, x, top_k_index, plan)
            if key not in self.verdicts:
                self.verdicts[key] = probe(path, x, top_k_index, top_k_weights, lora, plan, run)
                if self.verdicts[key] is not None and key[:4] not in self.warned:  # once, not per rows class
                    self.warned.add(key[:4])
                    log.warning(
                        "MoE self-check: %s failed on experts %s / %s, %s, %s rows per expert: %s; "
                        "this layer shape runs %s instead (model.kernel_self_check)",
                        path,
                        tuple(plan.experts.gate_up.shape),
                        tuple(plan.experts.down.shape),
                        str(x.dtype).removeprefix("torch."),
                        key[-1],
                        self.verdicts[key],
                        FALLBACK[path],
                    )
            if self.verdicts[key] is None:
                return path
            path = FALLBACK[path]
        return path

    @staticmethod
    def key(path: str, x, top_k_index, plan: MoEPlan) -> tuple:
        experts = plan.experts
        rows = rows_class(top_k_index.numel(), experts.gate_up.num_experts)
        # grad mode last but one: a rows class first seen without gradients (GRPO's rollouts) is probed again,
        # backward included, when gradients flow
        return path, tuple(experts.gate_up.shape), tuple(experts.down.shape), x.dtype, needs_grads(), rows

    @property
    def failed(self) -> dict[tuple, str]:
        return {key: why for key, why in self.verdicts.items() if why is not None}


def probe(path: str, x, top_k_index, top_k_weights, lora, plan: MoEPlan, run: RunPath) -> str | None:
    """None if `path` matches the fp32 reference on this call's first PROBE_TOKENS tokens, else the exception or
    the relative difference. Compared: the output and, where autograd runs, every gradient the layer gives: the
    input's, the routing weights' and the expert LoRA factors' (the outer-product kernel's). Out of memory is not
    a kernel fault: it propagates; a device-side fault cannot be fallen back from: DeviceFaultError.

    Run on a thread of its own: autograd's thread-local state (grad mode, and the saved-tensor hooks that
    non-reentrant activation checkpointing installs around the forward, which the probe's own graph must not
    reach: the recompute would then find fewer tensors saved than the forward) starts clean there."""
    grads = needs_grads()
    stream = torch.cuda.current_stream(x.device) if x.device.type == "cuda" else None
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="moe-self-check") as pool:
        return pool.submit(_probe, path, x, top_k_index, top_k_weights, lora, plan, run, grads, stream).result()


def needs_grads() -> bool:
    """Whether this call's backward will run, so the probe must check it (not under no_grad or inference_mode:
    GRPO's rollouts)."""
    return torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


class DeviceFaultError(RuntimeError):
    """A path faulted on the device (an illegal address, say): the CUDA context is lost, no fallback can run."""


GRADIENTS = (
    "input gradient",
    "routing-weight gradient",
    "gate_up_a gradient",
    "gate_up_b gradient",
    "down_a gradient",
    "down_b gradient",
)


def _probe(path, x, top_k_index, top_k_weights, lora, plan: MoEPlan, run: RunPath, grads: bool, stream):
    n = min(PROBE_TOKENS, x.shape[0])
    if n == 0:
        return None
    unsaved = dataclasses.replace(plan, deferred=None, lora_params=None)  # the probe's gradients go nowhere
    inputs = [x.detach(), top_k_weights.detach(), *(p.detach() for p in lora or ())]
    with (
        torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(),
        torch.enable_grad() if grads else torch.no_grad(),
    ):
        try:
            leaves = [t.requires_grad_(grads) for t in inputs]
            xs, ws, probe_lora = leaves[0], leaves[1], tuple(leaves[2:]) or None
            out = run(path, xs, ws, probe_lora, unsaved)
            seed = probe_seed(out, n)
            got = [out[:n]]
            if grads:  # the seed is zero past n tokens, so the LoRA gradients sum the first n tokens' rows alone
                got += [
                    g[:n] if i < 2 and g is not None else g
                    for i, g in enumerate(torch.autograd.grad(out, leaves, seed, allow_unused=True))
                ]
            synchronize(path, x)  # a device-side fault surfaces here, inside the try, not at a later call
        except (torch.OutOfMemoryError, DeviceFaultError):
            raise
        except Exception as exc:  # a compile error, a launch out of resources, an unsupported op: fall back
            if is_device_fault(exc):
                raise DeviceFaultError(device_fault_message(path, plan, x, exc)) from exc
            return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        expected = _reference(x[:n], top_k_index[:n], top_k_weights[:n], lora, plan, seed[:n], grads)
    tolerance = TOLERANCE.get(x.dtype, 5e-2)
    for name, g, e in zip(("output", *GRADIENTS), got, expected, strict=False):
        if g is None or e is None:
            if (g is None) != (e is None):
                return f"{name}: the path gives {'none' if g is None else 'one'}, the torch reference does not"
            continue
        difference = _relative_difference(g, e)
        if not difference <= tolerance:  # also NaN
            return (
                f"{name} differs from the torch reference by {difference:.3g} of its largest value "
                f"(tolerance {tolerance:g})"
            )
    return None


def probe_seed(out: torch.Tensor, n: int) -> torch.Tensor:
    """The output gradient the probe differentiates with: random on the first n tokens, zero past them."""
    g = torch.Generator(device=out.device).manual_seed(0)
    seed = torch.randn(out.shape, generator=g, device=out.device, dtype=out.dtype)
    seed[n:] = 0
    return seed


def synchronize(path: str, x: torch.Tensor) -> None:
    """Wait for the probe's kernels (on a GPU), so that an asynchronous fault raises here;
    MOE_QLORA_INJECT_KERNEL_FAULT=<path>:device raises what such a fault raises (torch.AcceleratorError)."""
    if injected_fault(path) == "device":
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered (injected)")
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)


def is_device_fault(exc: Exception) -> bool:
    return (
        isinstance(exc, torch.AcceleratorError)
        or "illegal memory access" in str(exc)
        or "device-side assert" in str(exc)
    )


def device_fault_message(path: str, plan: MoEPlan, x: torch.Tensor, exc: Exception) -> str:
    gate_up, down = tuple(plan.experts.gate_up.shape), tuple(plan.experts.down.shape)
    return (
        f"MoE self-check: the {path} path faulted on the device for experts {gate_up} / {down}, "
        f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')} tokens ({str(exc).splitlines()[0]}). The GPU "
        "context cannot be used after such a fault, so the run stops here; rerun with "
        "--set model.kernels=torch (the reference path), and please report the shapes above."
    )


def _reference(x, top_k_index, top_k_weights, lora, plan: MoEPlan, seed, grads: bool) -> list[torch.Tensor]:
    """[output, and with `grads` the input, routing-weight and LoRA factor gradients] of the per-expert torch
    reference in fp32 on these tokens."""
    sub_plan = MoEPlan(plan.experts, route(top_k_index, plan.experts.gate_up.num_experts), plan.lora_scale)
    leaves = [x.detach().float(), top_k_weights.detach().float(), *(p.detach().float() for p in lora or ())]
    leaves = [t.requires_grad_(grads) for t in leaves]
    out = moe_lora_experts(leaves[0], leaves[1], tuple(leaves[2:]) or None, sub_plan)  # biases cast per expert
    return [out, *torch.autograd.grad(out, leaves, seed.float(), allow_unused=True)] if grads else [out]


def _relative_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().clamp_min(1e-12)
    return ((got.float() - expected).abs().max() / scale).item()
