"""The MoE experts layer over frozen NF4 experts with per-expert LoRA: forward and its backward.

Forward (MUL_MAT_ID): for the rows s routed to expert e,
    h_s = x_s W1_e^T + b1_e + c (x_s A1_e^T) B1_e^T     gate_up, (S_e, 2I)
    a_s = gate(h_s)                                      (S_e, I), the model's own gating (e.g. silu(g) * u)
    y_s = a_s W2_e^T + b2_e + c (a_s A2_e^T) B2_e^T     down, (S_e, H)
    out[t] = sum over the K slots of t of  w_s * y_s
Backward: the input gradient through the transposed frozen experts (dx_s = dh_s W1_e + ...), the LoRA
gradients as per-expert scattered outer products (OUT_PROD_ID: dB_e = c * sum_s dy_s (x) p_s), and the
routing-weight gradient dw_s = <y_s, dout_t>, obtained without keeping y (see backward).
This file is the torch reference the GPU kernels match (a loop over experts); grouped_layer.py runs the
same math as whole-batch grouped operations.

Shape letters: T tokens, K experts per token, S = T*K routed rows, E experts, H hidden,
I expert intermediate, r LoRA rank, c = alpha / r. W is stored (E, out, in), or (E, in, out) when
`transposed` (GPT-OSS); the math above is the same either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_qlora.moe.mxfp4 import MXFP4Stack
from moe_qlora.moe.nf4 import NF4Stack
from moe_qlora.moe.routing import RoutedTokens


@dataclass(frozen=True)
class FrozenExperts:
    """The frozen half of an experts layer: what the autograd function never differentiates.

    gate_up: NF4 or MXFP4 (E, 2I, H), or (E, H, 2I) if transposed; (E, I, H) / (E, H, I) for non-gated experts
    (up_proj). down: (E, H, I) or (E, I, H). MXFP4 stacks are never transposed (mxfp4.py).
    gate_up_bias: (E, 2I) (or (E, I)) or None.  down_bias: (E, H) or None.
    gate: (n, 2I) -> (n, I), the model's own gating of the gate_up output (any differentiable function);
    for non-gated experts (n, I) -> (n, I), the module's activation.
    gate_is_silu_mul: gate is transformers' default silu(h[:, :I]) * h[:, I:], which the Triton gate_up
    kernel can apply in its epilogue.
    """

    gate_up: NF4Stack | MXFP4Stack
    down: NF4Stack | MXFP4Stack
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

    def weight(self, stack: NF4Stack | MXFP4Stack, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e of a stack as (in, out), the right operand of x @ W: one expert dequantized at a time."""
        w = stack.decode(e, e + 1, dtype)[0]
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


def gate_with_vjp(gate, h, *, silu_mul=False):
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
            n, m = tokens.numel(), matmul_rows(tokens.numel(), x)
            a1, b1, a2, b2 = _expert_lora(lora, e)
            w1, bias1 = ex.weight(ex.gate_up, e, dtype), ex.bias(ex.gate_up_bias, e, dtype)
            h_e, p1 = _lora_linear(gather_rows(x, tokens, m), w1, bias1, a1, b1, scale)
            h[rows] = h_e[:n]
            w2, bias2 = ex.weight(ex.down, e, dtype), ex.bias(ex.down_bias, e, dtype)
            y, p2 = _lora_linear(ex.gate(h_e), w2, bias2, a2, b2, scale)
            if p1 is not None:
                p_gate_up[rows], p_down[rows] = p1[:n], p2[:n]
            out.index_add_(0, tokens, y[:n].mul_(w_sorted[rows, None]))
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
            tokens = rt.token[rows]
            n, m = tokens.numel(), matmul_rows(tokens.numel(), x)
            w = pad_rows(w_sorted[rows, None], m)
            a1, b1, a2, b2 = _expert_lora(lora, e)
            # (S_e, H): dout of each row's token, before the weight. Its padding rows and w's are zero, so every
            # product below is zero there, and the sums over rows (the LoRA gradients) are exact.
            g = gather_rows(grad_out, tokens, m)
            act_out, gate_vjp = gate_with_vjp(ex.gate, pad_rows(h[rows], m), silu_mul=ex.gate_is_silu_mul)
            # y = J a + b2 with J linear (a W2 + c (a A2^T) B2^T); the row's output is w * y. Its input
            # gradient is w * J^T g, and the routing-weight gradient is <y, g> = <J a, g> + <b2, g>
            # = <a, J^T g> + <b2, g>: u = J^T g gives both, exactly, without keeping y or dividing by w.
            u = g @ ex.weight(ex.down, e, dtype).t()  # (S_e, I)
            if has_lora:
                q2 = (g @ b2).mul_(scale)  # c g B2: (S_e, r)
                u.addmm_(q2, a2)
                # dy = w g: dA2 = (w c g B2)^T a and dB2 = c (w g)^T p2, rescaling only (S_e, r) factors.
                lora_grads[2][e] = (q2 * w).t() @ act_out
                lora_grads[3][e] = (g.t() @ (pad_rows(p_down[rows], m) * w)).mul_(scale)
            dot = routing_weight_dot(act_out, u)
            if ex.down_bias is not None:
                dot += g.float() @ ex.down_bias[e].float()
            grad_w_sorted[rows] = dot[:n]
            grad_h = gate_vjp(u.mul_(w))
            if m > n:  # a gate whose derivative at 0 is not finite would put 0 * inf = nan in the padding rows
                grad_h[n:] = 0
            # Input gradient through the transposed frozen gate_up projection (+ its LoRA path).
            grad_x_rows = grad_h @ ex.weight(ex.gate_up, e, dtype).t()
            if has_lora:
                dp1 = (grad_h @ b1).mul_(scale)  # (S_e, r)
                grad_x_rows.addmm_(dp1, a1)
                lora_grads[0][e] = dp1.t() @ gather_rows(x, tokens, m)
                lora_grads[1][e] = (grad_h.t() @ pad_rows(p_gate_up[rows], m)).mul_(scale)
            # A token's K rows each send a gradient back to it.
            grad_x.index_add_(0, tokens, grad_x_rows[:n])
        grad_weights = torch.zeros_like(grad_w_sorted).index_copy_(0, rt.order, grad_w_sorted)
        lora_grads = [g.to(p.dtype) if g is not None else None for g, p in zip(lora_grads, lora_params, strict=True)]
        return (grad_x, grad_weights.view_as(routing_weights).to(routing_weights.dtype), *lora_grads, None)


def matmul_rows(n: int, x: torch.Tensor) -> int:
    """The rows an expert's n rows of x are computed in: n, except for bf16 / fp16 on the CPU, where they are
    padded to row_grid(n) with zero rows.

    oneDNN builds (JIT-compiles) a kernel for every matmul shape it has not seen. The rows an expert gets change
    from step to step as training moves the routing, so unpadded every step built hundreds of new kernels
    (bench_train's qwen3 preset: 2,251 builds at ~2.4 ms in 5 steps, and 800 MiB of RSS; fp32 runs on MKL's
    GEMM, which builds none). On the grid an expert's products take a few dozen shapes each, built once."""
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16):
        return n
    return row_grid(n)


def row_grid(n: int) -> int:
    """n rounded up to a multiple of max(16, 2^(floor(log2 n) - 3)): 8 steps per power of two from 128 rows on (at
    most 12.5% added), multiples of 16 below (at most 15 added)."""
    step = max(16, 1 << max(n.bit_length() - 4, 0))
    return -(-n // step) * step


def pad_rows(t: torch.Tensor, m: int) -> torch.Tensor:
    """t (n, ...) with zero rows appended up to m rows (t itself when n == m)."""
    if t.shape[0] == m:
        return t
    out = t.new_zeros(m, *t.shape[1:])
    out[: t.shape[0]] = t
    return out


def gather_rows(x: torch.Tensor, index: torch.Tensor, m: int) -> torch.Tensor:
    """x[index] (n, H) with zero rows appended up to m rows, gathered in place into the padded buffer."""
    if index.numel() == m:
        return x.index_select(0, index)
    out = x.new_zeros(m, x.shape[1])
    torch.index_select(x, 0, index, out=out[: index.numel()])
    return out


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
