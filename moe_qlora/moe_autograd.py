"""The MoE experts layer over frozen NF4 experts with per-expert LoRA: forward and its backward.

Forward (MUL_MAT_ID): for the rows s routed to expert e,
    h_s = x_s W1_e^T + c (x_s A1_e^T) B1_e^T            gate_up, (S_e, 2I)
    a_s = act(gate(h_s)) * up(h_s)                       (S_e, I)
    y_s = a_s W2_e^T + c (a_s A2_e^T) B2_e^T            down, (S_e, H)
    out[t] = sum over the K slots of t of  w_s * y_s
Backward: the input gradient through the transposed frozen experts (dx_s = dh_s W1_e + ...), the LoRA
gradients as per-expert scattered outer products (OUT_PROD_ID: dB_e = c * sum_s dy_s (x) p_s), and the
routing-weight gradient dw_s = <y_s, dout_t>, obtained as <a_s, J^T dout_t> (see backward).
This file is the torch reference the GPU kernels match.

Shape letters: T tokens, K experts per token, S = T*K routed rows, E experts, H hidden,
I expert intermediate, r LoRA rank, c = alpha / r.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .nf4 import NF4Stack, dequantize_expert
from .routing import RoutedTokens


@dataclass(frozen=True)
class FrozenExperts:
    """The quantized half of an experts layer: what the autograd function never differentiates.

    gate_up: NF4 (E, 2I, H), gate rows first then up rows.  down: NF4 (E, H, I).
    act: elementwise activation applied to the gate half.
    """

    gate_up: NF4Stack
    down: NF4Stack
    act: Callable[[torch.Tensor], torch.Tensor]

    @property
    def intermediate(self) -> int:
        return self.down.shape[2]


@dataclass(frozen=True)
class MoEPlan:
    """Everything non-differentiable one call needs: frozen weights, the routing, the LoRA scale."""

    experts: FrozenExperts
    routing: RoutedTokens
    lora_scale: float


def _lora_linear(x, weight, lora_a, lora_b, scale):
    """x W^T + c (x A^T) B^T, also returning p = x A^T (None without LoRA). x: (n, in), W: (out, in)."""
    y = x @ weight.t()
    if lora_a is None:
        return y, None
    p = x @ lora_a.t()  # (n, r)
    return y.addmm_(p, lora_b.t(), alpha=scale), p


def _gated(act, h, intermediate):
    """act(gate) * up for h: (n, 2I) in concatenated [gate | up] layout."""
    return act(h[:, :intermediate]) * h[:, intermediate:]


def _gated_backward(act, h, da, intermediate):
    """d h from d a where a = act(gate) * up; the activation's derivative comes from autograd, exact."""
    gate, up = h[:, :intermediate], h[:, intermediate:]
    grad_h = torch.empty_like(h)
    with torch.enable_grad():
        g = gate.detach().requires_grad_(True)
        act_g = act(g)
        (grad_h[:, :intermediate],) = torch.autograd.grad(act_g, g, da * up)
    torch.mul(da, act_g.detach(), out=grad_h[:, intermediate:])
    return grad_h


class MoELoRAFunction(torch.autograd.Function):
    """Differentiable in x, the routing weights and the four LoRA stacks; the NF4 experts are frozen.

    Rows are gathered and scattered one expert at a time, so no (S, H) copy of the tokens exists at once;
    the forward keeps h (S, 2I) and the LoRA projections (S, r) for the backward, nothing of size (S, H).
    """

    @staticmethod
    def forward(ctx, x, routing_weights, gate_up_a, gate_up_b, down_a, down_b, plan: MoEPlan):
        """x: (T, H); routing_weights: (T, K); gate_up_a (E, r, H), gate_up_b (E, 2I, r),
        down_a (E, r, I), down_b (E, H, r), or all four None. Returns (T, H)."""
        ex, rt, dtype = plan.experts, plan.routing, x.dtype
        lora = _cast_lora((gate_up_a, gate_up_b, down_a, down_b), dtype)
        rank = 0 if lora[0] is None else lora[0].shape[1]
        h = x.new_empty(rt.num_rows, 2 * ex.intermediate)
        p_gate_up, p_down = x.new_empty(rt.num_rows, rank), x.new_empty(rt.num_rows, rank)
        w_sorted = routing_weights.reshape(-1).index_select(0, rt.order).to(dtype)  # (S,)
        out = torch.zeros_like(x)
        for e in rt.active_experts():
            rows = slice(rt.offsets[e], rt.offsets[e + 1])
            tokens = rt.token[rows]
            a1, b1, a2, b2 = _expert_lora(lora, e)
            h[rows], p1 = _lora_linear(x.index_select(0, tokens), dequantize_expert(ex.gate_up, e, dtype), a1, b1,
                                       plan.lora_scale)  # fmt: skip
            act_out = _gated(ex.act, h[rows], ex.intermediate)
            y, p2 = _lora_linear(act_out, dequantize_expert(ex.down, e, dtype), a2, b2, plan.lora_scale)
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
            act_out = _gated(ex.act, h[rows], ex.intermediate)
            # y = J a with J linear (a W2^T + c (a A2^T) B2^T): the row's output is w * y. Its input
            # gradient is w * J^T g, and the routing-weight gradient <y, g> = <J a, g> = <a, J^T g>, so
            # u = J^T g gives both, exactly, without keeping y from the forward or dividing by w.
            u = g @ dequantize_expert(ex.down, e, dtype)  # (S_e, I)
            if has_lora:
                q2 = (g @ b2).mul_(scale)  # c g B2: (S_e, r)
                u.addmm_(q2, a2)
                # dy = w g: dA2 = (w c g B2)^T a and dB2 = c (w g)^T p2, rescaling only (S_e, r) factors.
                lora_grads[2][e] = (q2 * w).t() @ act_out
                lora_grads[3][e] = (g.t() @ (p_down[rows] * w)).mul_(scale)
            grad_w_sorted[rows] = (act_out * u).sum(-1, dtype=torch.float32)
            grad_h = _gated_backward(ex.act, h[rows], u.mul_(w), ex.intermediate)
            # Input gradient through the transposed frozen gate_up projection (+ its LoRA path).
            grad_x_rows = grad_h @ dequantize_expert(ex.gate_up, e, dtype)
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
