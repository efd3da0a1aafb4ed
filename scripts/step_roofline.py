"""The training step's arithmetic against what this machine's matmuls can do at its shapes (bench_train.py --roofline).

    python scripts/step_roofline.py --preset qwen3 --seq 1024 --dtype bfloat16   # the limit alone, as a table

FLOPs of one step (batch 1, expert LoRA of rank r, gradient checkpointing on every layer, the chunked loss), per
decoder layer with T tokens, hidden H, E experts of intermediate I, top-K, attention of nh (nkv) heads of hd:
- linear work (attention projections, router, experts' gate_up and down): forward, its recompute and the input
  gradient, 3x the forward; the frozen weights get no gradient;
- attention's core (QK^T and PV, the full T x T square as the CPU's kernels compute it): forward, recompute and a
  backward of twice the forward, 4x;
- LoRA (A and B of gate_up and down, every routed row): forward, recompute, input and weight gradients, 4x;
- the output head through the chunked loss: forward, the logits recomputed in the backward, and dh, 3x.
The limit: each kind of product timed with torch.mm / torch.bmm at the step's shape and dtype in this process
(the experts' at the mean rows per expert), the step's FLOPs of that kind divided by its measured rate, summed.
Element-wise work (norms, activations, the optimizer, NF4 decoding) is not in the limit: the profile shows it.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def shapes(p: dict, seq: int) -> dict:
    heads, kv, hd = p.get("heads", 16), p.get("kv_heads", 4), p.get("head_dim", 64)
    if p["arch"] == "mixtral":
        hd = p["hidden"] // heads
    return {
        "T": seq,
        "H": p["hidden"],
        "E": p["experts"],
        "K": p["top_k"],
        "I": p["inter"],
        "nh": heads,
        "nkv": kv,
        "hd": hd,
        "V": p["vocab"],
        "L": p["layers"],
    }


def products(p: dict, seq: int, rank: int, chunk: int) -> list[dict]:
    """Every kind of matrix product in a step: its (m, k, n) (batch b for bmm), how many a step runs (forward,
    recompute and backward counted by the multiples in the module docstring) and its FLOPs."""
    s = shapes(p, seq)
    t, h, e, k, i, v = s["T"], s["H"], s["E"], s["K"], s["I"], s["V"]
    q_width, kv_width = s["nh"] * s["hd"], s["nkv"] * s["hd"]
    rows = max(1, round(t * k / e))  # mean rows per expert
    layers = s["L"]
    kinds = [
        ("attention q, o", (t, h, q_width), 2 * 3 * layers),
        ("attention k, v", (t, h, kv_width), 2 * 3 * layers),
        ("attention core", (s["nh"], t, s["hd"], t), 2 * 4 * layers),  # QK^T and PV: bmm (b, m, k, n)
        ("router", (t, h, e), 3 * layers),
        ("experts gate_up", (rows, h, 2 * i), e * 3 * layers),
        ("experts down", (rows, i, h), e * 3 * layers),
        ("expert LoRA A", (rows, h + i, rank), e * 4 * layers),  # A of gate_up (H -> r) and of down (I -> r)
        ("expert LoRA B", (rows, rank, 3 * i + h), e * 4 * layers),  # B of gate_up (r -> 2I) and down (r -> H)
        ("output head", (min(chunk or t, t), h, v), 3 * -(-t // (chunk or t))),
    ]
    out = []
    for name, shape, count in kinds:
        flops = 2 * shape[0] * shape[1] * shape[2] * (shape[3] if len(shape) == 4 else 1)
        out.append({"kind": name, "shape": shape, "count": count, "flops": flops * count})
    return out


def measured_rate(shape: tuple, dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of torch.mm (m, k) @ (k, n), or torch.bmm (b, m, k) @ (b, k, n), at `dtype`: the best of `repeats`
    after a warm-up, so the rate is the machine's at this shape, not a cold cache's."""
    g = torch.Generator().manual_seed(0)
    if len(shape) == 4:
        b, m, kk, n = shape
        a, w = torch.randn(b, m, kk, generator=g).to(dtype), torch.randn(b, kk, n, generator=g).to(dtype)
        op, flops = torch.bmm, 2 * b * m * kk * n
    else:
        m, kk, n = shape
        a, w = torch.randn(m, kk, generator=g).to(dtype), torch.randn(kk, n, generator=g).to(dtype)
        op, flops = torch.mm, 2 * m * kk * n
    inner = max(1, int(2e8 // max(flops, 1)))  # ~0.2 GFLOP a timing, so small shapes are not all overhead
    op(a, w)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            op(a, w)
        best = min(best, (time.perf_counter() - t0) / inner)
    return flops / best


def step_limit(p: dict, seq: int, dtype: torch.dtype, *, rank: int = 8, chunk: int = 1024) -> dict:
    """{products: [...with measured rate and seconds], flops, limit_s}: the step at torch.mm's measured rates."""
    rows = products(p, seq, rank, chunk)
    for r in rows:
        r["gflops_per_s"] = measured_rate(r["shape"], dtype) / 1e9
        r["seconds"] = r["flops"] / (r["gflops_per_s"] * 1e9)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "products": rows,
        "flops": sum(r["flops"] for r in rows),
        "limit_s": sum(r["seconds"] for r in rows),
    }


# What a profiled step's time is attributed to: the first rule whose pattern is in an op's name, by self time;
# matmuls are then split by where they run (matmul_part).
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "aten::matmul")
CATEGORIES = [
    ("NF4 decode", ("dequantize", "bitsandbytes", "nf4")),
    ("matmul", MATMUL),
    ("attention kernel", ("scaled_dot_product", "flash_attention")),
    ("gather / scatter", ("index_select", "index_add", "index_copy", "gather", "scatter", "index_put", "take")),
    ("softmax / loss", ("softmax", "logsumexp", "cross_entropy", "nll_loss")),
    ("copies and casts", ("aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous")),
]
# The scopes an experts layer's products run under: moe-qlora's autograd function (forward and backward), and
# transformers' grouped_mm experts (PEFT's contender).
EXPERT_SCOPES = ("MoELoRAFunction", "aten::_grouped_mm")


def matmul_part(event, rank: int, vocab: int) -> str:
    """Where a matmul event belongs: "LoRA matmul" when an operand has the LoRA rank as one of its two last
    dimensions (A and B, their products, PEFT's B A), "expert matmul" under an experts layer's scope, "output head
    matmul" when the vocabulary is a dimension, else "attention / router matmul"."""
    dims = {d for shape in event.input_shapes if len(shape) >= 2 for d in shape[-2:]}
    if rank in dims:
        return "LoRA matmul"
    scope = event
    while scope is not None:
        if any(scope.name.startswith(s) for s in EXPERT_SCOPES):
            return "expert matmul"
        scope = scope.cpu_parent
    return "output head matmul" if vocab in dims else "attention / router matmul"


def categorized(events, *, rank: int, vocab: int) -> dict[str, float]:
    """Seconds of self CPU time per category over a profile's op events (profile.events(), recorded with shapes)."""
    out: dict[str, float] = {}
    for ev in events:
        category = next((c for c, pats in CATEGORIES if any(pat in ev.name for pat in pats)), "other element-wise")
        if category == "matmul":
            category = matmul_part(ev, rank, vocab)
        out[category] = out.get(category, 0.0) + ev.self_cpu_time_total / 1e6
    return out


def main() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_presets import PRESETS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--loss-chunk", type=int, default=1024)
    args = ap.parse_args()
    limit = step_limit(PRESETS[args.preset], args.seq, getattr(torch, args.dtype), chunk=args.loss_chunk)
    print(f"{'product':18} {'shape':>22} {'count':>6} {'GFLOP':>9} {'GFLOP/s':>9} {'s':>8}")
    for r in limit["products"]:
        print(
            f"{r['kind']:18} {str(r['shape']):>22} {r['count']:>6} {r['flops'] / 1e9:>9.2f} "
            f"{r['gflops_per_s']:>9.1f} {r['seconds']:>8.3f}"
        )
    print(
        f"step: {limit['flops'] / 1e9:.1f} GFLOP, limit {limit['limit_s']:.3f} s at torch.mm's rates "
        f"({limit['dtype']}, {limit['threads']} threads)"
    )
    print(json.dumps(limit))


if __name__ == "__main__":
    main()
