"""The MoE experts layer over frozen NF4 experts with per-expert LoRA: forward and its backward.

Forward (MUL_MAT_ID): for the rows s routed to expert e,
    h_s = x_s W1_e^T + c (x_s A1_e^T) B1_e^T            gate_up, (S_e, 2I)
    a_s = act(gate(h_s)) * up(h_s)                       (S_e, I)
    y_s = a_s W2_e^T + c (a_s A2_e^T) B2_e^T            down, (S_e, H)
    out[t] = sum over the K slots of t of  w_s * y_s
Backward: the input gradient through the transposed frozen experts (dx_s = dh_s W1_e + ...), the LoRA
gradients as per-expert scattered outer products (OUT_PROD_ID: dB_e = c * sum_s dy_s (x) p_s), and the
routing-weight gradient dw_s = <y_s, dout_t>. This file is the torch reference the GPU kernels match.

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
    with torch.enable_grad():
        g = gate.detach().requires_grad_(True)
        act_g = act(g)
        (dgate,) = torch.autograd.grad(act_g, g, da * up)
    return torch.cat([dgate, da * act_g.detach()], dim=-1)


def _lora_grads(dy, x_in, p, lora_a, lora_b, scale):
    """Gradients of y = x W^T + c p B^T with p = x A^T, for one expert's rows.

    dy: (n, out), x_in: (n, in), p: (n, r). Returns dA (r, in), dB (out, r), dp (n, r).
    dB = c dy^T p and dA = (c dy B)^T x: the per-expert outer-product sums (OUT_PROD_ID).
    """
    dp = (dy @ lora_b).mul_(scale)
    return dp.t() @ x_in, (dy.t() @ p).mul_(scale), dp


class MoELoRAFunction(torch.autograd.Function):
    """Differentiable in x, the routing weights and the four LoRA stacks; the NF4 experts are frozen."""

    @staticmethod
    def forward(ctx, x, routing_weights, gate_up_a, gate_up_b, down_a, down_b, plan: MoEPlan):
        """x: (T, H); routing_weights: (T, K); gate_up_a (E, r, H), gate_up_b (E, 2I, r),
        down_a (E, r, I), down_b (E, H, r), or all four None. Returns (T, H)."""
        ex, rt, dtype = plan.experts, plan.routing, x.dtype
        inter = ex.intermediate
        lora = _cast_lora((gate_up_a, gate_up_b, down_a, down_b), dtype)
        x_sorted = x[rt.token]  # (S, H)
        h = x.new_empty(rt.num_rows, 2 * inter)
        y = x.new_empty(rt.num_rows, x.shape[1])
        rank = 0 if lora[0] is None else lora[0].shape[1]
        p_gate_up = x.new_empty(rt.num_rows, rank)
        p_down = x.new_empty(rt.num_rows, rank)
        for e in rt.active_experts():
            rows = slice(rt.offsets[e], rt.offsets[e + 1])
            a1, b1, a2, b2 = _expert_lora(lora, e)
            h[rows], p1 = _lora_linear(x_sorted[rows], dequantize_expert(ex.gate_up, e, dtype), a1, b1, plan.lora_scale)
            act_out = _gated(ex.act, h[rows], inter)
            y[rows], p2 = _lora_linear(act_out, dequantize_expert(ex.down, e, dtype), a2, b2, plan.lora_scale)
            if p1 is not None:
                p_gate_up[rows], p_down[rows] = p1, p2
        w_sorted = routing_weights.reshape(-1)[rt.order].to(dtype)  # (S,)
        out = torch.zeros_like(x).index_add_(0, rt.token, y * w_sorted[:, None])
        ctx.plan = plan
        ctx.save_for_backward(x, routing_weights, h, y, p_gate_up, p_down, gate_up_a, gate_up_b, down_a, down_b)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, routing_weights, h, y, p_gate_up, p_down, *lora_params = ctx.saved_tensors
        plan: MoEPlan = ctx.plan
        ex, rt, dtype = plan.experts, plan.routing, x.dtype
        inter, scale = ex.intermediate, plan.lora_scale
        lora = _cast_lora(lora_params, dtype)
        has_lora = lora[0] is not None

        grad_sorted = grad_out.to(dtype)[rt.token]  # (S, H), dout of each row's token
        w_sorted = routing_weights.reshape(-1)[rt.order].to(dtype)
        # out = sum_s w_s y_s, so dL/dw_s = <y_s, dout_t>; y_s was kept from the forward.
        grad_weights = torch.zeros(rt.num_rows, dtype=torch.float32, device=x.device)
        grad_weights[rt.order] = (y * grad_sorted).sum(-1, dtype=torch.float32)
        grad_y = grad_sorted * w_sorted[:, None]

        x_sorted = x[rt.token]
        grad_x_sorted = torch.zeros_like(x_sorted)
        lora_grads = [torch.zeros_like(p, dtype=torch.float32) if has_lora else None for p in lora_params]
        for e in rt.active_experts():
            rows = slice(rt.offsets[e], rt.offsets[e + 1])
            a1, b1, a2, b2 = _expert_lora(lora, e)
            act_out = _gated(ex.act, h[rows], inter)
            # Input gradient through the transposed frozen down projection: da = dy W2 (+ LoRA path).
            grad_act = grad_y[rows] @ dequantize_expert(ex.down, e, dtype)
            if has_lora:
                da2, db2, dp2 = _lora_grads(grad_y[rows], act_out, p_down[rows], a2, b2, scale)
                grad_act.addmm_(dp2, a2)
                lora_grads[2][e], lora_grads[3][e] = da2, db2
            grad_h = _gated_backward(ex.act, h[rows], grad_act, inter)
            grad_x_sorted[rows] = grad_h @ dequantize_expert(ex.gate_up, e, dtype)
            if has_lora:
                da1, db1, dp1 = _lora_grads(grad_h, x_sorted[rows], p_gate_up[rows], a1, b1, scale)
                grad_x_sorted[rows].addmm_(dp1, a1)
                lora_grads[0][e], lora_grads[1][e] = da1, db1
        # A token's K rows each send a gradient back to it: scatter-add over the sorted rows.
        grad_x = torch.zeros_like(x).index_add_(0, rt.token, grad_x_sorted)
        lora_grads = [g.to(p.dtype) if g is not None else None for g, p in zip(lora_grads, lora_params)]
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
