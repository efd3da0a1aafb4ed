"""The MoE experts layer over frozen NF4 experts with per-expert LoRA: forward and its backward.

Forward (MUL_MAT_ID): for the rows s routed to expert e,
    h_s = x_s W1_e^T + b1_e + c (x_s A1_e^T) B1_e^T     gate_up, (S_e, 2I)
    a_s = gate(h_s)                                      (S_e, I), the model's own gating (e.g. silu(g) * u)
    y_s = a_s W2_e^T + b2_e + c (a_s A2_e^T) B2_e^T     down, (S_e, H)
    out[t] = sum over the K slots of t of  w_s * y_s
Backward: the input gradient through the transposed frozen experts (dx_s = dh_s W1_e + ...), the LoRA
gradients as per-expert scattered outer products (OUT_PROD_ID: dB_e = c * sum_s dy_s (x) p_s), and the
routing-weight gradient dw_s = <y_s, dout_t>, obtained without keeping y (see backward).
This file is the torch reference the GPU kernels match.

Shape letters: T tokens, K experts per token, S = T*K routed rows, E experts, H hidden,
I expert intermediate, r LoRA rank, c = alpha / r. W is stored (E, out, in), or (E, in, out) when
`transposed` (GPT-OSS); the math above is the same either way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_qlora.moe.nf4 import NF4Stack, dequantize_expert
from moe_qlora.moe.routing import RoutedTokens


@dataclass(frozen=True)
class FrozenExperts:
    """The frozen half of an experts layer: what the autograd function never differentiates.

    gate_up: NF4 (E, 2I, H) or (E, H, 2I) if transposed; (E, I, H) / (E, H, I) for non-gated experts (up_proj).
    down: NF4 (E, H, I) or (E, I, H).  gate_up_bias: (E, 2I) (or (E, I)) or None.  down_bias: (E, H) or None.
    gate: (n, 2I) -> (n, I), the model's own gating of the gate_up output (any differentiable function);
    for non-gated experts (n, I) -> (n, I), the module's activation.
    gate_is_silu_mul: gate is transformers' default silu(h[:, :I]) * h[:, I:], which the Triton gate_up
    kernel can apply in its epilogue.
    """

    gate_up: NF4Stack
    down: NF4Stack
    gate: Callable[[torch.Tensor], torch.Tensor]
    transposed: bool = False
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    gate_is_silu_mul: bool = False

    @property
    def intermediate(self) -> int:
        return self.down.shape[1] if self.transposed else self.down.shape[2]

    @property
    def up_width(self) -> int:
        """Columns of the first projection: 2I when gated (gate_up), I when not (up)."""
        return self.gate_up.shape[2] if self.transposed else self.gate_up.shape[1]

    def weight(self, stack: NF4Stack, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e of a stack as (in, out), the right operand of x @ W: one expert dequantized at a time."""
        w = dequantize_expert(stack, e, dtype)
        return w if self.transposed else w.t()

    def bias(self, bias: torch.Tensor | None, e: int, dtype: torch.dtype) -> torch.Tensor | None:
        return None if bias is None else bias[e].to(dtype)


class DeferredWeightGrads:
    """A store for the LoRA weight-gradient GEMMs (OUT_PROD_ID) of the grouped backward: pushed there instead
    of run, and run by flush(), which adds them to the parameters' .grad. The input gradient, which the rest
    of the backward waits on, is not delayed; the weight gradients nothing waits on can be scheduled later
    (e.g. batched at the end of a micro-batch, or overlapped with communication)."""

    def __init__(self):
        self._pending: list[tuple[tuple[torch.Tensor, ...], Callable[[], list]]] = []

    def push(self, params: tuple[torch.Tensor, ...], compute: Callable[[], list]) -> None:
        self._pending.append((params, compute))

    def __len__(self) -> int:
        return len(self._pending)

    def flush(self) -> None:
        """Run every pending computation, in push order, accumulating into .grad as autograd would."""
        pending, self._pending = self._pending, []
        for params, compute in pending:
            for p, grad in zip(params, compute(), strict=True):
                grad = grad.to(p.dtype)
                p.grad = grad if p.grad is None else p.grad.add_(grad)


@dataclass(frozen=True)
class MoEPlan:
    """Everything non-differentiable one call needs: frozen weights, the routing, the LoRA scale, and where
    the grouped backward defers its LoRA weight gradients (None: computed at once)."""

    experts: FrozenExperts
    routing: RoutedTokens
    lora_scale: float
    deferred: DeferredWeightGrads | None = None
    lora_params: tuple[torch.Tensor, ...] | None = None  # the parameters the deferred gradients belong to


def _lora_linear(x, weight_io, bias, lora_a, lora_b, scale):
    """x W + b + c (x A^T) B^T, also returning p = x A^T (None without LoRA). x: (n, in), W: (in, out)."""
    y = x @ weight_io
    if bias is not None:
        y += bias
    if lora_a is None:
        return y, None
    p = x @ lora_a.t()  # (n, r)
    return y.addmm_(p, lora_b.t(), alpha=scale), p


def _silu_mul_with_vjp(h):
    """a = silu(g) * u for h = [g, u], and its vjp in closed form: d g = da u silu'(g), d u = da silu(g), with
    silu'(g) = s (1 + g (1 - s)), s = sigmoid(g), the formula torch's silu backward uses. Saves building
    and walking an autograd graph per expert, which dominates the reference's backward for small experts."""
    gate, up = h.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    silu = gate * sig

    def vjp(da):
        return torch.cat([da * up * sig * (1 + gate * (1 - sig)), da * silu], dim=-1)

    return silu * up, vjp


def _gate_with_vjp(gate, h, *, silu_mul=False):
    """a = gate(h) and a function mapping d a to d h: autograd on the model's own gate, evaluated once
    (in closed form for transformers' default silu(gate) * up)."""
    if silu_mul:
        return _silu_mul_with_vjp(h)
    with torch.enable_grad():
        hh = h.detach().requires_grad_(True)
        a = gate(hh)

    def vjp(da):
        (grad_h,) = torch.autograd.grad(a, hh, da)
        return grad_h

    return a.detach(), vjp


# Rows per chunk of routing_weight_dot: its fp32 copies of two (S, I) operands stay near 64 MiB each.
_DOT_CHUNK_ELEMENTS = 1 << 24


def routing_weight_dot(act: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(S,) fp32 <act_s, u_s> with fp32 products: the routing-weight gradient's dot product. In bf16,
    (act * u).sum(-1, dtype=float32) rounds every product to bf16 before summing (a median relative error of
    1.7e-3 on random rows, against 7e-8 here). act, u: (S, I). Chunked over rows so the fp32 copies stay small
    (static shapes: no host sync)."""
    rows = max(1, _DOT_CHUNK_ELEMENTS // max(act.shape[-1], 1))
    if act.shape[0] <= rows:
        return (act.float() * u.float()).sum(-1)
    return torch.cat([(a.float() * b.float()).sum(-1) for a, b in zip(act.split(rows), u.split(rows), strict=True)])


class MoELoRAFunction(torch.autograd.Function):
    """Differentiable in x, the routing weights and the four LoRA stacks; the NF4 experts are frozen.

    Rows are gathered and scattered one expert at a time, so no (S, H) copy of the tokens exists at once;
    the forward keeps h (S, 2I) and the LoRA projections (S, r) for the backward, nothing of size (S, H).
    """

    @staticmethod
    def forward(ctx, x, routing_weights, gate_up_a, gate_up_b, down_a, down_b, plan: MoEPlan):
        """x: (T, H); routing_weights: (T, K); gate_up_a (E, r, H), gate_up_b (E, 2I, r),
        down_a (E, r, I), down_b (E, H, r), or all four None. Returns (T, H)."""
        ex, rt, dtype, scale = plan.experts, plan.routing, x.dtype, plan.lora_scale
        lora = _cast_lora((gate_up_a, gate_up_b, down_a, down_b), dtype)
        rank = 0 if lora[0] is None else lora[0].shape[1]
        h = x.new_empty(rt.num_rows, ex.up_width)
        p_gate_up, p_down = x.new_empty(rt.num_rows, rank), x.new_empty(rt.num_rows, rank)
        w_sorted = routing_weights.reshape(-1).index_select(0, rt.order).to(dtype)  # (S,)
        out = torch.zeros_like(x)
        for e in rt.active_experts():
            rows = slice(rt.offsets[e], rt.offsets[e + 1])
            tokens = rt.token[rows]
            a1, b1, a2, b2 = _expert_lora(lora, e)
            w1, bias1 = ex.weight(ex.gate_up, e, dtype), ex.bias(ex.gate_up_bias, e, dtype)
            h[rows], p1 = _lora_linear(x.index_select(0, tokens), w1, bias1, a1, b1, scale)
            w2, bias2 = ex.weight(ex.down, e, dtype), ex.bias(ex.down_bias, e, dtype)
            y, p2 = _lora_linear(ex.gate(h[rows]), w2, bias2, a2, b2, scale)
            if p1 is not None:
                p_gate_up[rows], p_down[rows] = p1, p2
            out.index_add_(0, tokens, y.mul_(w_sorted[rows, None]))
        ctx.plan = plan
        ctx.save_for_backward(x, routing_weights, h, p_gate_up, p_down, gate_up_a, gate_up_b, down_a, down_b)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, routing_weights, h, p_gate_up, p_down, *lora_params = ctx.saved_tensors
        plan: MoEPlan = ctx.plan
        ex, rt, dtype, scale = plan.experts, plan.routing, x.dtype, plan.lora_scale
        lora = _cast_lora(lora_params, dtype)
        has_lora = lora[0] is not None
        grad_out = grad_out.to(dtype)
        w_sorted = routing_weights.reshape(-1).index_select(0, rt.order).to(dtype)
        grad_w_sorted = torch.zeros(rt.num_rows, dtype=torch.float32, device=x.device)
        grad_x = torch.zeros_like(x)
        lora_grads = [torch.zeros_like(p, dtype=torch.float32) if has_lora else None for p in lora_params]
        for e in rt.active_experts():
            rows = slice(rt.offsets[e], rt.offsets[e + 1])
            tokens, w = rt.token[rows], w_sorted[rows, None]
            a1, b1, a2, b2 = _expert_lora(lora, e)
            g = grad_out.index_select(0, tokens)  # (S_e, H): dout of each row's token, before the weight
            act_out, gate_vjp = _gate_with_vjp(ex.gate, h[rows], silu_mul=ex.gate_is_silu_mul)
            # y = J a + b2 with J linear (a W2 + c (a A2^T) B2^T); the row's output is w * y. Its input
            # gradient is w * J^T g, and the routing-weight gradient is <y, g> = <J a, g> + <b2, g>
            # = <a, J^T g> + <b2, g>: u = J^T g gives both, exactly, without keeping y or dividing by w.
            u = g @ ex.weight(ex.down, e, dtype).t()  # (S_e, I)
            if has_lora:
                q2 = (g @ b2).mul_(scale)  # c g B2: (S_e, r)
                u.addmm_(q2, a2)
                # dy = w g: dA2 = (w c g B2)^T a and dB2 = c (w g)^T p2, rescaling only (S_e, r) factors.
                lora_grads[2][e] = (q2 * w).t() @ act_out
                lora_grads[3][e] = (g.t() @ (p_down[rows] * w)).mul_(scale)
            dot = routing_weight_dot(act_out, u)
            if ex.down_bias is not None:
                dot += g.float() @ ex.down_bias[e].float()
            grad_w_sorted[rows] = dot
            grad_h = gate_vjp(u.mul_(w))
            # Input gradient through the transposed frozen gate_up projection (+ its LoRA path).
            grad_x_rows = grad_h @ ex.weight(ex.gate_up, e, dtype).t()
            if has_lora:
                dp1 = (grad_h @ b1).mul_(scale)  # (S_e, r)
                grad_x_rows.addmm_(dp1, a1)
                lora_grads[0][e] = dp1.t() @ x.index_select(0, tokens)
                lora_grads[1][e] = (grad_h.t() @ p_gate_up[rows]).mul_(scale)
            # A token's K rows each send a gradient back to it.
            grad_x.index_add_(0, tokens, grad_x_rows)
        grad_weights = torch.zeros_like(grad_w_sorted).index_copy_(0, rt.order, grad_w_sorted)
        lora_grads = [g.to(p.dtype) if g is not None else None for g, p in zip(lora_grads, lora_params, strict=True)]
        return (grad_x, grad_weights.view_as(routing_weights).to(routing_weights.dtype), *lora_grads, None)


def _cast_lora(params, dtype):
    return tuple(None if p is None else p.to(dtype) for p in params)


def _expert_lora(lora, e):
    return tuple(None if p is None else p[e] for p in lora)


def moe_lora_experts(
    x: torch.Tensor,
    routing_weights: torch.Tensor,
    lora: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    plan: MoEPlan,
) -> torch.Tensor:
    """Functional entry: x (T, H), routing_weights (T, K), lora = (A1, B1, A2, B2) or None -> (T, H)."""
    lora = lora if lora is not None else (None, None, None, None)
    return MoELoRAFunction.apply(x, routing_weights, *lora, plan)


# ------------------------------------------------------------------------------------------------------
# The same layer as whole-batch grouped operations (one launch per projection instead of a loop over
# experts): the GPU path, run with the Triton kernels, or with their torch references as a CPU check.


@dataclass(frozen=True)
class GroupedOps:
    """grouped_matmul, grouped_matmul_silu_mul and grouped_outer_product with kernels.ops' contracts: the
    Triton kernels, the dequantize + torch._grouped_mm backend, or the per-expert torch references.
    host_offsets: the ops take the offsets as a host list (the references loop over experts in Python);
    otherwise as the (E+1,) device tensor, so the layer never waits on the host."""

    matmul: Callable
    matmul_silu_mul: Callable
    outer: Callable
    host_offsets: bool = False
    fused_gather: bool = False  # the matmuls read rows through `gather` at no extra cost (_rows_of_tokens)


def grouped_ops(kind: str, dequant_budget: int | None = None) -> GroupedOps:
    """The ops of backend `kind`; dequant_budget: grouped_mm's decoded-stack limit in bytes (None: none)."""
    from moe_qlora.moe.kernels import ops

    if kind == "triton":
        return GroupedOps(ops.grouped_matmul, ops.grouped_matmul_silu_mul, ops.grouped_outer_product,
                          fused_gather=True)  # fmt: skip
    if kind == "grouped_mm":
        from moe_qlora.moe.kernels import grouped_mm as gmm

        return GroupedOps(functools.partial(gmm.grouped_matmul, budget=dequant_budget),
                          functools.partial(gmm.grouped_matmul_silu_mul, budget=dequant_budget),
                          gmm.grouped_outer_product)  # fmt: skip
    return GroupedOps(
        ops.grouped_matmul_reference,
        ops.grouped_matmul_silu_mul_reference,
        ops.grouped_outer_product_reference,
        host_offsets=True,
    )


def _offsets_for(ops: GroupedOps, rt: RoutedTokens):
    return rt.offsets if ops.host_offsets else rt.offsets_device


def _rows_of_tokens(ops: GroupedOps, t: torch.Tensor, token: torch.Tensor):
    """(rows, gather) to pass to the ops for a (T, ·) per-token operand read by several grouped matmuls: the
    Triton kernels gather inside the matmul (t, token); the others get the (S, ·) rows gathered once here
    instead of once per matmul (rows, None)."""
    return (t, token) if ops.fused_gather else (t.index_select(0, token), None)


def grouped_forward(x, routing_weights, lora, plan: MoEPlan, ops: GroupedOps, *, keep_h: bool):
    """The grouped layer's forward: h = MUL_MAT_ID(x, W1) (+ LoRA), a = gate(h), y = MUL_MAT_ID(a, W2)
    (+ LoRA), out = sum_k w y. lora: (A1, B1, A2, B2) or four None. Returns (out (T, H), h (S, 2I) or None
    when not keep_h and the gate is fused, p1 and p2 (S, r) or None): what the backward needs."""
    from moe_qlora.moe.kernels.ops import GroupedWeight as GW
    from moe_qlora.moe.kernels.ops import LowRank

    gate_up_a, gate_up_b, down_a, down_b = lora
    ex, rt, c = plan.experts, plan.routing, plan.lora_scale
    off, token, has_lora = _offsets_for(ops, rt), rt.token, gate_up_a is not None
    xs, gather = _rows_of_tokens(ops, x, token)
    # Stored (E, out, in): x W^T reads W transposed; GPT-OSS stores (E, in, out) and reads it as is.
    w1 = GW.quantized(ex.gate_up, transpose=not ex.transposed)
    p1 = p2 = lora1 = lora2 = None
    if has_lora:  # x A1^T: (S, r); the up-projection c p1 B1^T is fused into the gate_up matmul
        p1 = ops.matmul(xs, GW.dense(gate_up_a, transpose=True), off, gather=gather)
        lora1 = LowRank(p1, GW.dense(gate_up_b, transpose=True), c)
    if ex.gate_is_silu_mul:  # silu(gate) * up in the matmul's epilogue; h (S, 2I) kept for the backward
        h, a = ops.matmul_silu_mul(xs, w1, off, gather=gather, bias=ex.gate_up_bias, lora=lora1, keep_h=keep_h)
    else:
        h = ops.matmul(xs, w1, off, gather=gather, bias=ex.gate_up_bias, lora=lora1)  # (S, 2I)
        a = ex.gate(h)
    if has_lora:
        p2 = ops.matmul(a, GW.dense(down_a, transpose=True), off)
        lora2 = LowRank(p2, GW.dense(down_b, transpose=True), c)
    w2 = GW.quantized(ex.down, transpose=not ex.transposed)
    y = ops.matmul(a, w2, off, bias=ex.down_bias, lora=lora2)  # (S, H)
    out = rt.combine(y, routing_weights)  # sum over each token's K rows: a gather, no atomics
    return out, h, p1, p2


def grouped_backward(grad_out, x, routing_weights, h, p1, p2, lora, plan: MoEPlan, ops: GroupedOps):
    """Gradients of grouped_forward: (grad x, grad routing weights, dA1, dB1, dA2, dB2), the last four None
    without LoRA or when deferred to plan.deferred. The input gradient goes through the same grouped matmul
    over the transposed NF4 experts, the LoRA gradients by OUT_PROD_ID, and the routing-weight gradient is
    <a, J^T g> + <b2, g> (exact, no division by w; see MoELoRAFunction)."""
    from moe_qlora.moe.kernels.ops import GroupedWeight as GW
    from moe_qlora.moe.kernels.ops import LowRank

    a1, b1, a2, b2 = lora
    ex, rt, c = plan.experts, plan.routing, plan.lora_scale
    off, token, has_lora = _offsets_for(ops, rt), rt.token, a1 is not None
    g = grad_out.to(x.dtype)
    gs, gather = _rows_of_tokens(ops, g, token)
    w = routing_weights.reshape(-1).index_select(0, rt.order).to(x.dtype)[:, None]  # (S, 1)
    act, gate_vjp = _gate_with_vjp(ex.gate, h, silu_mul=ex.gate_is_silu_mul)
    # The LoRA weight gradients (OUT_PROD_ID), run now or pushed to plan.deferred; `later` holds their
    # operands, filled as the backward produces them.
    later = {}
    # u = J^T g = g W2 + (c g B2) A2: the down projection's input gradient before the routing weight,
    # (S, I), with the LoRA path fused into the transposed-experts matmul.
    lora2 = None
    if has_lora:
        q2 = c * ops.matmul(gs, GW.dense(b2, transpose=False), off, gather=gather)  # c g B2: (S, r)
        lora2 = LowRank(q2, GW.dense(a2, transpose=False))
        later.update(q2w=q2 * w, act=act, g=g, p2w=p2 * w)
    u = ops.matmul(gs, GW.quantized(ex.down, transpose=ex.transposed), off, gather=gather, lora=lora2)
    dot = routing_weight_dot(act, u)
    if ex.down_bias is not None:
        g_rows = gs if gather is None else g.index_select(0, token)
        dot += (g_rows.float() * ex.down_bias.float().index_select(0, rt.expert)).sum(-1)
    grad_h = gate_vjp(u * w)
    lora1 = None
    if has_lora:
        dp1 = c * ops.matmul(grad_h, GW.dense(b1, transpose=False), off)  # (S, r)
        lora1 = LowRank(dp1, GW.dense(a1, transpose=False))
        later.update(x=x, dp1=dp1, grad_h=grad_h, p1=p1)
    grad_rows = ops.matmul(grad_h, GW.quantized(ex.gate_up, transpose=ex.transposed), off, lora=lora1)  # (S, H)
    grad_x = rt.combine(grad_rows.to(x.dtype))  # a token's K rows each send a gradient back to it
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
    off, token = _offsets_for(ops, rt), rt.token
    # dA1[e] = sum_s dp1_s (x) x_s; the gathered operand (x) must come first, so transpose after.
    d_a1 = ops.outer(t["x"], t["dp1"], off, gather=token).transpose(1, 2)
    d_b1 = c * ops.outer(t["grad_h"], t["p1"], off)  # dB1[e] = c sum_s dh_s (x) p1_s
    d_a2 = ops.outer(t["q2w"], t["act"], off)  # dA2[e] = sum_s (w c g B2)_s (x) a_s
    d_b2 = c * ops.outer(t["g"], t["p2w"], off, gather=token)  # dB2[e] = c sum_s g_s (x) (w p2)_s
    return [d_a1, d_b1, d_a2, d_b2]


def moe_lora_experts_grouped(x, routing_weights, lora, plan: MoEPlan, kernels: str,
                             dequant_budget: int | None = None) -> torch.Tensor:  # fmt: skip
    """moe_lora_experts through grouped operations (`kernels`: triton, grouped_mm or torch-grouped;
    dequant_budget: grouped_mm's decoded-stack limit in bytes, None for none).

    transformers' default gate (silu(gate) * up) goes through the registered op moe_qlora::grouped_experts,
    which torch.compile traces as one node; other gates, and deferred LoRA gradients, through the Function."""
    lora = lora if lora is not None else (None, None, None, None)
    if plan.experts.gate_is_silu_mul and plan.deferred is None:
        keep_h = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, routing_weights, *lora))
        out, _, _, _ = grouped_experts_op(*op_inputs(x, routing_weights, lora, plan, kernels, dequant_budget, keep_h))
        return out
    return MoELoRAGroupedFunction.apply(x, routing_weights, *lora, plan, grouped_ops(kernels, dequant_budget))


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


def op_inputs(x, routing_weights, lora, plan: MoEPlan, kernels: str, dequant_budget: int | None, keep_h: bool):
    """grouped_experts_op's arguments for one call: (x, routing_weights, lora (4, None-able), frozen tensors
    (routing 6, gate_up 4, down 4, biases 2), floats (2 nested offsets, LoRA scale), ints (both stack
    shapes, blocksize, transposed, the decode budget or 0), kernels, keep_h)."""
    ex, rt = plan.experts, plan.routing
    frozen = [*(getattr(rt, f) for f in _ROUTING_FIELDS), *_stack_tensors(ex.gate_up), *_stack_tensors(ex.down),
              ex.gate_up_bias, ex.down_bias]  # fmt: skip
    offsets = [s.nested[2] if s.nested is not None else 0.0 for s in (ex.gate_up, ex.down)]
    ints = [*ex.gate_up.shape, *ex.down.shape, ex.gate_up.blocksize, int(ex.transposed), dequant_budget or 0]
    return x, routing_weights, list(lora), frozen, [*offsets, float(plan.lora_scale)], ints, kernels, keep_h


def _plan_from(frozen, floats, ints, top_k: int) -> MoEPlan:
    """The MoEPlan op_inputs flattened (default gate, no deferred gradients)."""
    from moe_qlora.moe.kernels.ops import silu_mul

    order, token, expert, inverse, counts, offsets = frozen[:6]
    blocksize, transposed = ints[6], bool(ints[7])

    def stack(tensors, offset, shape):
        packed, absmax, absmax2, code2 = tensors
        return NF4Stack(packed, absmax, (absmax2, code2, offset) if absmax2 is not None else None, tuple(shape),
                        blocksize)  # fmt: skip

    frozen_experts = FrozenExperts(
        gate_up=stack(frozen[6:10], floats[0], ints[0:3]), down=stack(frozen[10:14], floats[1], ints[3:6]),
        gate=silu_mul, transposed=transposed, gate_up_bias=frozen[14], down_bias=frozen[15], gate_is_silu_mul=True,
    )  # fmt: skip
    rt = RoutedTokens(order=order, token=token, expert=expert, inverse=inverse, counts=counts,
                      offsets_device=offsets, top_k=top_k)  # fmt: skip
    return MoEPlan(frozen_experts, rt, floats[2])


def _ops_from(kernels: str, ints) -> GroupedOps:
    return grouped_ops(kernels, ints[8] or None)


@torch.library.custom_op("moe_qlora::grouped_experts", mutates_args=())
def grouped_experts_op(
    x: torch.Tensor, routing_weights: torch.Tensor, lora: list[torch.Tensor | None], frozen: list[torch.Tensor | None],
    floats: list[float], ints: list[int], kernels: str, keep_h: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out (T, H), h (S, 2I) or (0, 2I), p1 (S, r), p2 (S, r)); r = 0 without LoRA."""
    plan = _plan_from(frozen, floats, ints, routing_weights.shape[1])
    out, h, p1, p2 = grouped_forward(x, routing_weights, tuple(lora), plan, _ops_from(kernels, ints), keep_h=keep_h)
    h = h if h is not None else x.new_empty(0, plan.experts.up_width)
    no_rank = x.new_empty(routing_weights.numel(), 0)
    outputs = (out, h, p1 if p1 is not None else no_rank, p2 if p2 is not None else no_rank.clone())
    return tuple(_as_faked(t) for t in outputs)


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
    return (x.new_empty(x.shape), x.new_empty(rows if keep_h else 0, width), x.new_empty(rows, rank),
            x.new_empty(rows, rank))  # fmt: skip


@torch.library.custom_op("moe_qlora::grouped_experts_backward", mutates_args=())
def grouped_experts_backward_op(
    grad_out: torch.Tensor, x: torch.Tensor, routing_weights: torch.Tensor, saved: list[torch.Tensor],
    lora: list[torch.Tensor | None], frozen: list[torch.Tensor | None], floats: list[float], ints: list[int],
    kernels: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(grad x, grad routing weights, dA1, dB1, dA2, dB2) from the forward's saved (h, p1, p2); the last four
    (0,) without LoRA."""
    plan = _plan_from(frozen, floats, ints, routing_weights.shape[1])
    h, p1, p2 = saved
    has_lora = lora[0] is not None
    grads = grouped_backward(grad_out, x, routing_weights, h, p1 if has_lora else None, p2 if has_lora else None,
                             tuple(lora), plan, _ops_from(kernels, ints))  # fmt: skip
    return tuple(_as_faked(g) if g is not None else x.new_empty(0) for g in grads)


@grouped_experts_backward_op.register_fake
def _grouped_experts_backward_fake(grad_out, x, routing_weights, saved, lora, frozen, floats, ints, kernels):
    return (x.new_empty(x.shape), routing_weights.new_empty(routing_weights.shape),
            *(p.new_empty(p.shape) if p is not None else x.new_empty(0) for p in lora))  # fmt: skip


def _setup_context(ctx, inputs, output):
    x, routing_weights, lora, frozen, floats, ints, kernels, _ = inputs
    _, h, p1, p2 = output
    ctx.floats, ctx.ints, ctx.kernels, ctx.num_frozen = floats, ints, kernels, len(frozen)
    ctx.save_for_backward(x, routing_weights, h, p1, p2, *lora, *frozen)


def _grouped_experts_backward(ctx, grad_out, _grad_h, _grad_p1, _grad_p2):
    x, routing_weights, h, p1, p2, *rest = ctx.saved_tensors
    lora, frozen = rest[:4], rest[4:]
    grads = grouped_experts_backward_op(grad_out, x, routing_weights, [h, p1, p2], lora, frozen, ctx.floats,
                                        ctx.ints, ctx.kernels)  # fmt: skip
    lora_grads = [g if p is not None else None for g, p in zip(grads[2:], lora, strict=True)]
    return grads[0], grads[1], lora_grads, None, None, None, None, None


grouped_experts_op.register_autograd(_grouped_experts_backward, setup_context=_setup_context)
