"""The MoE experts layer of reference_layer.py as whole-batch grouped operations: one launch per projection instead
of a loop over experts. The GPU path, run with the Triton kernels (or dequantize + torch._grouped_mm), or with
their torch references as a CPU check.

Registered with torch.library (moe_qlora::grouped_experts and its backward) so that torch.compile(fullgraph=True)
traces a whole MoE block without a graph break. Shape letters as in reference_layer.py.
"""

from __future__ import annotations

import torch

from moe_qlora.common.device_runtime import host_flag, read_host_flag
from moe_qlora.moe.grouped_ops import (
    GroupedOps,
    grouped_ops,
    matmul_apart,
    offsets_for,
    row_steps_by_triton,
    rows_of_tokens,
)
from moe_qlora.moe.nf4 import NF4Stack
from moe_qlora.moe.reference_layer import FrozenExperts, MoEPlan, gate_with_vjp, routing_weight_dot
from moe_qlora.moe.routing import RoutedTokens


def grouped_forward(x, routing_weights, lora, plan: MoEPlan, ops: GroupedOps, *, keep_h: bool):
    """The grouped layer's forward: h = MUL_MAT_ID(x, W1) (+ LoRA), a = gate(h), y = MUL_MAT_ID(a, W2)
    (+ LoRA), out = sum_k w y. lora: (A1, B1, A2, B2) or four None. Returns (out (T, H), h (S, 2I) or None
    when not keep_h and the gate is fused, p1 and p2 (S, r) or None): what the backward needs."""
    from moe_qlora.moe.kernels import rows
    from moe_qlora.moe.kernels.ops import GroupedWeight as GW
    from moe_qlora.moe.kernels.ops import LowRank

    gate_up_a, gate_up_b, down_a, down_b = lora
    ex, rt, c = plan.experts, plan.routing, plan.lora_scale
    off, token, has_lora = offsets_for(ops, rt), rt.token, gate_up_a is not None
    by_triton = row_steps_by_triton(ops, x)
    xs, gather = rows_of_tokens(ops, x, token)
    # Stored (E, out, in): x W^T reads W transposed; GPT-OSS stores (E, in, out) and reads it as is.
    w1 = GW.quantized(ex.gate_up, transpose=not ex.transposed, key="gate_up")
    p1 = p2 = lora1 = lora2 = None
    if has_lora:  # x A1^T: (S, r); the up-projection c p1 B1^T is fused into the gate_up matmul
        p1 = ops.matmul(xs, GW.dense(gate_up_a, transpose=True), off, gather=gather)
        lora1 = LowRank(p1, GW.dense(gate_up_b, transpose=True), c)
    if ex.gate_is_silu_mul and ops.matmul_parts is not None:  # the gate's row step adds the LoRA term, keeps h
        y1, low1, scale1 = matmul_apart(ops, xs, w1, off, gather=gather, bias=ex.gate_up_bias, lora=lora1)
        a = rows.silu_mul(y1, low1, scale1, keep_h, by_triton)
        h = y1 if keep_h else None
    elif ex.gate_is_silu_mul:  # silu(gate) * up in the matmul's epilogue; h (S, 2I) kept for the backward
        h, a = ops.matmul_silu_mul(xs, w1, off, gather=gather, bias=ex.gate_up_bias, lora=lora1, keep_h=keep_h)
    else:
        h = ops.matmul(xs, w1, off, gather=gather, bias=ex.gate_up_bias, lora=lora1)  # (S, 2I)
        a = ex.gate(h)
    if has_lora:
        p2 = ops.matmul(a, GW.dense(down_a, transpose=True), off)
        lora2 = LowRank(p2, GW.dense(down_b, transpose=True), c)
    w2 = GW.quantized(ex.down, transpose=not ex.transposed, key="down")
    y, low2, scale2 = matmul_apart(ops, a, w2, off, bias=ex.down_bias, lora=lora2)  # (S, H)
    # sum over each token's K rows (and the LoRA term left apart): a gather, no atomics
    out = rows.combine(y, low2, scale2, rt.inverse, routing_weights, rt.top_k, by_triton)
    return out, h, p1, p2


def grouped_backward(grad_out, x, routing_weights, h, p1, p2, lora, plan: MoEPlan, ops: GroupedOps):
    """Gradients of grouped_forward: (grad x, grad routing weights, dA1, dB1, dA2, dB2), the last four None
    without LoRA or when deferred to plan.deferred. The input gradient goes through the same grouped matmul
    over the transposed NF4 experts, the LoRA gradients by OUT_PROD_ID, and the routing-weight gradient is
    <a, J^T g> + <b2, g> (exact, no division by w; see MoELoRAFunction)."""
    from moe_qlora.moe.kernels import rows
    from moe_qlora.moe.kernels.ops import GroupedWeight as GW
    from moe_qlora.moe.kernels.ops import LowRank

    a1, b1, a2, b2 = lora
    ex, rt, c = plan.experts, plan.routing, plan.lora_scale
    off, token, has_lora = offsets_for(ops, rt), rt.token, a1 is not None
    by_triton = row_steps_by_triton(ops, x)
    g = grad_out.to(x.dtype)
    gs, gather = rows_of_tokens(ops, g, token)
    w = routing_weights.reshape(-1).index_select(0, rt.order).to(x.dtype)[:, None]  # (S, 1)
    # The LoRA weight gradients (OUT_PROD_ID), run now or pushed to plan.deferred; `later` holds their
    # operands, filled as the backward produces them.
    later = {}
    # u = J^T g = g W2 + (c g B2) A2: the down projection's input gradient before the routing weight,
    # (S, I), with the LoRA path fused into the transposed-experts matmul (or added by the gate's row step).
    lora2 = None
    if has_lora:
        q2 = c * ops.matmul(gs, GW.dense(b2, transpose=False), off, gather=gather)  # c g B2: (S, r)
        lora2 = LowRank(q2, GW.dense(a2, transpose=False))
        later.update(q2w=q2 * w, g=gs, g_gather=gather, p2w=p2 * w)  # g's rows as gathered for u
    w_down = GW.quantized(ex.down, transpose=ex.transposed, key="down")
    u, low_u, scale_u = matmul_apart(ops, gs, w_down, off, gather=gather, lora=lora2)
    if ex.gate_is_silu_mul:  # act, <act, u> and the gate's vjp at u w in one row step
        grad_h, act, dot = rows.silu_mul_backward(h, u, low_u, scale_u, w.view(-1), by_triton)
    else:
        u = u if low_u is None else u.add_(low_u, alpha=scale_u)
        act, gate_vjp = gate_with_vjp(ex.gate, h)
        dot = routing_weight_dot(act, u)
        grad_h = gate_vjp(u * w)
    del u, low_u  # the backward's peak comes with the next projection: (S, H) rows twice
    later["act"] = act
    if ex.down_bias is not None:
        g_rows = gs if gather is None else g.index_select(0, token)
        dot += (g_rows.float() * ex.down_bias.float().index_select(0, rt.expert)).sum(-1)
    lora1 = None
    if has_lora:
        dp1 = c * ops.matmul(grad_h, GW.dense(b1, transpose=False), off)  # (S, r)
        lora1 = LowRank(dp1, GW.dense(a1, transpose=False))
        later.update(x=x, dp1=dp1, grad_h=grad_h, p1=p1)
    w_up = GW.quantized(ex.gate_up, transpose=ex.transposed, key="gate_up")
    grad_rows, low_x, scale_x = matmul_apart(ops, grad_h, w_up, off, lora=lora1)  # (S, H)
    # a token's K rows each send a gradient back to it
    grad_x = rows.combine(grad_rows.to(x.dtype), low_x, scale_x, rt.inverse, None, rt.top_k, by_triton)
    grad_w = dot.index_select(0, rt.inverse).view_as(routing_weights)  # sorted rows back to (T, K)
    grads = [None] * 4
    if has_lora:

        def lora_weight_grads():
            return _lora_weight_grads(ops, later, rt, c)

        if plan.deferred is not None:
            plan.deferred.push(plan.lora_params, lora_weight_grads)
        else:
            grads = [gr.to(p.dtype) for gr, p in zip(lora_weight_grads(), lora, strict=True)]
    return grad_x, grad_w.to(routing_weights.dtype), *grads


class MoELoRAGroupedFunction(torch.autograd.Function):
    """MoELoRAFunction's math over all rows at once (grouped_forward / grouped_backward), for any gate; the
    registered op below (torch.compile-able) runs the same two functions for transformers' default gate."""

    @staticmethod
    def forward(ctx, x, routing_weights, gate_up_a, gate_up_b, down_a, down_b, plan: MoEPlan, ops: GroupedOps):
        lora = (gate_up_a, gate_up_b, down_a, down_b)
        out, h, p1, p2 = grouped_forward(x, routing_weights, lora, plan, ops, keep_h=any(ctx.needs_input_grad[:6]))
        ctx.plan, ctx.ops = plan, ops
        ctx.save_for_backward(x, routing_weights, h, p1, p2, *lora)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, routing_weights, h, p1, p2, *lora = ctx.saved_tensors
        grads = grouped_backward(grad_out, x, routing_weights, h, p1, p2, tuple(lora), ctx.plan, ctx.ops)
        return *grads, None, None


def _lora_weight_grads(ops: GroupedOps, t: dict, rt: RoutedTokens, c: float) -> list[torch.Tensor]:
    """dA1, dB1, dA2, dB2 (fp32) as per-expert outer products of the rows' operands `t`: OUT_PROD_ID."""
    off, token = offsets_for(ops, rt), rt.token
    # dA1[e] = sum_s dp1_s (x) x_s; the gathered operand (x) must come first, so transpose after.
    d_a1 = ops.outer(t["x"], t["dp1"], off, gather=token).transpose(1, 2)
    d_b1 = c * ops.outer(t["grad_h"], t["p1"], off)  # dB1[e] = c sum_s dh_s (x) p1_s
    d_a2 = ops.outer(t["q2w"], t["act"], off)  # dA2[e] = sum_s (w c g B2)_s (x) a_s
    d_b2 = c * ops.outer(t["g"], t["p2w"], off, gather=t["g_gather"])  # dB2[e] = c sum_s g_s (x) (w p2)_s
    return [d_a1, d_b1, d_a2, d_b2]


def moe_lora_experts_grouped(
    x, routing_weights, lora, plan: MoEPlan, kernels: str, dequant_budget: int | None = None
) -> torch.Tensor:
    """moe_lora_experts through grouped operations (`kernels`: triton, grouped_mm or torch-grouped;
    dequant_budget: grouped_mm's decoded-stack limit in bytes, None for none).

    transformers' default gate (silu(gate) * up) goes through the registered op moe_qlora::grouped_experts,
    which torch.compile traces as one node; other gates, deferred LoRA gradients and offloaded experts (whose op
    inputs would keep the device copies alive until the backward) through the Function."""
    lora = lora if lora is not None else (None, None, None, None)
    offloaded = getattr(plan.experts.gate_up, "offloaded", False)
    # the op's flattened plan carries NF4 stacks only; an MXFP4 one (gpt-oss, whose own gate never takes the op
    # anyway) runs through the Function
    nf4 = isinstance(plan.experts.gate_up, NF4Stack)
    if plan.experts.gate_is_silu_mul and plan.deferred is None and not offloaded and nf4:
        keep_h = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, routing_weights, *lora))
        stacks = NO_STACKS
        if keep_h and kernels == "grouped_mm" and _decodes_whole(plan, x.dtype, dequant_budget):
            stacks = KEPT_STACKS if _recomputing() else STACK_SHAPES
        args = op_inputs(x, routing_weights, lora, plan, kernels, dequant_budget, keep_h, decoded_stacks=stacks)
        return grouped_experts_op(*args)[0]
    return MoELoRAGroupedFunction.apply(x, routing_weights, *lora, plan, grouped_ops(kernels, dequant_budget))


# What grouped_experts_op returns of the stacks grouped_mm decoded whole (ints[9]): nothing; tensors of their shapes
# that hold nothing (one zero, expanded); or the stacks, which the backward then reads instead of decoding them
# again. A checkpointed layer's first forward and its recompute must save tensors of the same shapes
# (torch.utils.checkpoint checks), so the first returns the shapes and the recompute the stacks. Which of the two
# the backward got is said by a host flag saved beside them, never read off the tensors: a saved-tensor hook
# that stores tensors densely (torch.autograd.graph.save_on_cpu, activation offload) turns the expanded zero into
# a stack of zeros that looks like a real one.
NO_STACKS, STACK_SHAPES, KEPT_STACKS = 0, 1, 2


def _recomputing() -> bool:
    """Whether this forward runs inside a backward: activation checkpointing's recompute, whose saved tensors the
    layer's own backward reads next (torch.utils.checkpoint, use_reentrant=False, recomputes in an unpack hook)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def _decodes_whole(plan: MoEPlan, dtype: torch.dtype, budget: int | None) -> bool:
    """Whether grouped_mm decodes both stacks whole (each within the budget) rather than in windows."""
    stacks = (plan.experts.gate_up, plan.experts.down)
    return not budget or all(s.num_experts * s.expert_numel * dtype.itemsize <= budget for s in stacks)


# ------------------------------------------------------------------------------------------------------
# torch.library registration: the grouped layer (default gate) as one op with a fake implementation and a
# registered backward, so torch.compile(fullgraph=True) traces a whole MoE block (router, routing metadata,
# this op) without a graph break. Its arguments are plain tensors and scalars, the MoEPlan flattened by
# op_inputs: the routing metadata, each NF4 stack's bytes and scales (nested: codes + per-256 scales +
# a float offset), optional biases; the LoRA factors; and the backend. The plan is rebuilt from them inside.

_ROUTING_FIELDS = ("order", "token", "expert", "inverse", "counts", "offsets_device")


def _stack_tensors(stack: NF4Stack) -> list[torch.Tensor | None]:
    absmax2, code2, _ = stack.nested if stack.nested is not None else (None, None, 0.0)
    return [stack.packed, stack.absmax, absmax2, code2]


def op_inputs(
    x,
    routing_weights,
    lora,
    plan: MoEPlan,
    kernels: str,
    dequant_budget: int | None,
    keep_h: bool,
    *,
    decoded_stacks: int = NO_STACKS,
):
    """grouped_experts_op's arguments for one call: (x, routing_weights, lora (4, None-able), frozen tensors
    (routing 6, gate_up 4, down 4, biases 2), floats (2 nested offsets, LoRA scale), ints (both stack
    shapes, blocksize, transposed, the decode budget or 0, decoded_stacks), kernels, keep_h). decoded_stacks:
    NO_STACKS, STACK_SHAPES or KEPT_STACKS (grouped_mm's stacks decoded whole, returned for the backward)."""
    ex, rt = plan.experts, plan.routing
    frozen = [
        *(getattr(rt, f) for f in _ROUTING_FIELDS),
        *_stack_tensors(ex.gate_up),
        *_stack_tensors(ex.down),
        ex.gate_up_bias,
        ex.down_bias,
    ]
    offsets = [s.nested[2] if s.nested is not None else 0.0 for s in (ex.gate_up, ex.down)]
    ints = [*ex.gate_up.shape, *ex.down.shape, ex.gate_up.blocksize, int(ex.transposed), dequant_budget or 0]
    ints.append(decoded_stacks)
    return x, routing_weights, list(lora), frozen, [*offsets, float(plan.lora_scale)], ints, kernels, keep_h


def _plan_from(frozen, floats, ints, top_k: int) -> MoEPlan:
    """The MoEPlan op_inputs flattened (default gate, no deferred gradients)."""
    from moe_qlora.moe.kernels.ops import silu_mul

    order, token, expert, inverse, counts, offsets = frozen[:6]
    blocksize, transposed = ints[6], bool(ints[7])

    def stack(tensors, offset, shape):
        packed, absmax, absmax2, code2 = tensors
        return NF4Stack(
            packed, absmax, (absmax2, code2, offset) if absmax2 is not None else None, tuple(shape), blocksize
        )

    frozen_experts = FrozenExperts(
        gate_up=stack(frozen[6:10], floats[0], ints[0:3]),
        down=stack(frozen[10:14], floats[1], ints[3:6]),
        gate=silu_mul,
        transposed=transposed,
        gate_up_bias=frozen[14],
        down_bias=frozen[15],
        gate_is_silu_mul=True,
    )
    rt = RoutedTokens(
        order=order, token=token, expert=expert, inverse=inverse, counts=counts, offsets_device=offsets, top_k=top_k
    )
    return MoEPlan(frozen_experts, rt, floats[2])


def _ops_from(kernels: str, ints, decoded: dict | None = None) -> GroupedOps:
    return grouped_ops(kernels, ints[8] or None, decoded)


@torch.library.custom_op("moe_qlora::grouped_experts", mutates_args=())
def grouped_experts_op(
    x: torch.Tensor,
    routing_weights: torch.Tensor,
    lora: list[torch.Tensor | None],
    frozen: list[torch.Tensor | None],
    floats: list[float],
    ints: list[int],
    kernels: str,
    keep_h: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (T, H), h (S, 2I) or (0, 2I), p1 (S, r), p2 (S, r), gate_up, down, kept ()); r = 0 without LoRA; the
    stacks as ints[9] asks (_decoded_stacks), and kept (a host bool) says whether they are the stacks."""
    plan = _plan_from(frozen, floats, ints, routing_weights.shape[1])
    decoded = {} if ints[9] == KEPT_STACKS else None
    ops = _ops_from(kernels, ints, decoded)
    out, h, p1, p2 = grouped_forward(x, routing_weights, tuple(lora), plan, ops, keep_h=keep_h)
    h = h if h is not None else x.new_empty(0, plan.experts.up_width)
    no_rank = x.new_empty(routing_weights.numel(), 0)
    outputs = (out, h, p1 if p1 is not None else no_rank, p2 if p2 is not None else no_rank.clone())
    return *(_as_faked(t) for t in outputs), *_decoded_stacks(x, ints, decoded), host_flag(decoded is not None)


def _decoded_stacks(x: torch.Tensor, ints, decoded: dict | None) -> list[torch.Tensor]:
    """The op's last two outputs: (0,) twice; one zero expanded to each stack's stored shape (no memory); or the
    stacks grouped_mm decoded, contiguous."""
    if ints[9] == NO_STACKS:
        return [x.new_empty(0), x.new_empty(0)]
    if ints[9] == STACK_SHAPES or decoded is None:
        return [x.new_zeros(()).expand(ints[0:3]), x.new_zeros(()).expand(ints[3:6])]
    return [decoded["gate_up"], decoded["down"]]


def _as_faked(t: torch.Tensor) -> torch.Tensor:
    """t with the contiguous strides the fake implementations promise: grouped_mm's 16-byte padding leaves
    column slices (p1, p2 at rank 4 in bf16) and OUT_PROD_ID's dA1 is a transposed view; a compiled graph
    (inductor) is generated from the fake strides and stops at their assertion when the real ones differ."""
    return t.contiguous()


@grouped_experts_op.register_fake
def _grouped_experts_fake(x, routing_weights, lora, frozen, floats, ints, kernels, keep_h):
    rows, transposed = routing_weights.numel(), bool(ints[7])
    width = ints[2] if transposed else ints[1]
    rank = lora[0].shape[1] if lora[0] is not None else 0
    kept = [x.new_empty(ints[0:3]), x.new_empty(ints[3:6])] if ints[9] == KEPT_STACKS else None
    return (
        x.new_empty(x.shape),
        x.new_empty(rows if keep_h else 0, width),
        x.new_empty(rows, rank),
        x.new_empty(rows, rank),
        *(kept or _decoded_stacks(x, ints, None)),
        torch.empty((), dtype=torch.bool, device="cpu"),
    )


@torch.library.custom_op("moe_qlora::grouped_experts_backward", mutates_args=())
def grouped_experts_backward_op(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    routing_weights: torch.Tensor,
    saved: list[torch.Tensor],
    lora: list[torch.Tensor | None],
    frozen: list[torch.Tensor | None],
    floats: list[float],
    ints: list[int],
    kernels: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad x, grad routing weights, dA1, dB1, dA2, dB2) from the forward's saved (h, p1, p2, the stacks it
    decoded whole or their placeholders, and its kept flag); the last four (0,) without LoRA."""
    plan = _plan_from(frozen, floats, ints, routing_weights.shape[1])
    h, p1, p2, gate_up, down, kept = saved
    # the flag, not ctx.ints: a checkpointed layer's backward node and its ints are its first forward's, while its
    # saved tensors (the flag among them) are the recompute's
    decoded = {"gate_up": gate_up, "down": down} if read_host_flag(kept) else None
    has_lora = lora[0] is not None
    grads = grouped_backward(
        grad_out,
        x,
        routing_weights,
        h,
        p1 if has_lora else None,
        p2 if has_lora else None,
        tuple(lora),
        plan,
        _ops_from(kernels, ints, decoded),
    )
    return tuple(_as_faked(g) if g is not None else x.new_empty(0) for g in grads)


@grouped_experts_backward_op.register_fake
def _grouped_experts_backward_fake(grad_out, x, routing_weights, saved, lora, frozen, floats, ints, kernels):
    return (
        x.new_empty(x.shape),
        routing_weights.new_empty(routing_weights.shape),
        *(p.new_empty(p.shape) if p is not None else x.new_empty(0) for p in lora),
    )


def _setup_context(ctx, inputs, output):
    x, routing_weights, lora, frozen, floats, ints, kernels, _ = inputs
    _, h, p1, p2, gate_up, down, kept = output
    # Returned only to be saved here: no gradient flows into them, and autograd would hand the backward a zero
    # gradient of each, materialized (2.4 GiB of fp32 zeros for Qwen3-30B-A3B's decoded stacks, a layer).
    ctx.mark_non_differentiable(h, p1, p2, gate_up, down, kept)
    ctx.set_materialize_grads(False)
    ctx.floats, ctx.ints, ctx.kernels, ctx.num_frozen = floats, ints, kernels, len(frozen)
    ctx.save_for_backward(x, routing_weights, h, p1, p2, gate_up, down, kept, *lora, *frozen)


def _grouped_experts_backward(ctx, grad_out, *_grad_saved):
    x, routing_weights, *saved = ctx.saved_tensors
    saved, lora, frozen = saved[:6], saved[6:10], saved[10:]
    grads = grouped_experts_backward_op(
        grad_out, x, routing_weights, saved, lora, frozen, ctx.floats, ctx.ints, ctx.kernels
    )
    lora_grads = [g if p is not None else None for g, p in zip(grads[2:], lora, strict=True)]
    return grads[0], grads[1], lora_grads, None, None, None, None, None


grouped_experts_op.register_autograd(_grouped_experts_backward, setup_context=_setup_context)
