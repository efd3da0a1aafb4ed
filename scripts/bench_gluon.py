"""The Gluon NF4 kernels (moe/kernels/gluon_nf4.py, sm_90; gluon_nf4_sm80.py, which an sm_90 GPU runs too) on one GPU
beside the two paths `auto` takes today for the same launches, Y = X @ W_e^T + c P L_e over routed rows sorted by
expert (LoRA rank 16, bf16; gate_up with silu(gate) * up fused): the fused Triton kernel
(kernels/ops.grouped_matmul) and bitsandbytes' dequantization + torch._grouped_mm (kernels/grouped_mm.py, the
dequantization timed with it and apart). Each result is first checked against grouped_mm's (the same dequantized
weights; the bound is two bf16 roundings of the output plus 1e-3 of sum |x||w| for summation order), so a run that
times a wrong kernel says so. Prints a table and the JSON, rewritten after each row.

    python scripts/bench_gluon.py --out "$OUT/gluon.json"      # a GPU: Qwen3-30B-A3B and Mixtral-8x7B
    TRITON_INTERPRET=1 python scripts/bench_gluon.py --tiny --out gluon.json   # CPU smoke run, no Gluon row
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moe_qlora.common.fileio import atomic_write_text  # noqa: E402
from moe_qlora.moe.kernels.grouped_mm import gmm_rows  # noqa: E402
from moe_qlora.moe.kernels.ops import (  # noqa: E402
    GroupedWeight,
    LowRank,
    grouped_matmul,
    grouped_matmul_silu_mul,
    silu_mul,
)
from moe_qlora.moe.nf4 import NF4Stack, quantize_stack  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}  # hidden, inter, E, top-k
TOKENS = [4096, 16384]
TINY = dict(shapes={"tiny": (128, 64, 4, 2)}, tokens=[32])


def routed_rows(tokens: int, experts: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """Rows per expert of `tokens` tokens routed uniformly at random to top_k distinct experts each: (E,)."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices
    return torch.bincount(picks.flatten(), minlength=experts)


def time_ms(call, repeats: int) -> float:
    """The median milliseconds of `repeats` calls after a warm-up call (CUDA events; on a CPU the wall clock)."""
    call()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            call()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def contenders(x, stack: NF4Stack, counts: torch.Tensor, with_gluon: bool, lora, glu: bool, gather=None):
    """{name: call} of the launch each path makes: Y (S, N) = X (S, K) @ W_e^T + c P L_e for each expert's rows
    (lora: ops.LowRank or None; gather: sorted row s is token gather[s] of x), and with glu silu(gate) * up of it
    too; each call returns Y, with glu (Y, act)."""
    offsets = [0] + torch.cumsum(counts, 0).tolist()
    ends = torch.tensor(offsets[1:], dtype=torch.int32, device=x.device)
    weight = GroupedWeight.quantized(stack, transpose=True)
    decoded = stack.decode(0, stack.shape[0], torch.bfloat16)
    factors = lora.weight.data.bfloat16() if lora is not None else None

    def grouped_mm_path(weights):
        rows = x if gather is None else x.index_select(0, gather)
        y = gmm_rows(rows, weights.transpose(1, 2), ends)
        if lora is not None:
            y = y + lora.scale * gmm_rows(lora.p, factors, ends)
        return (y, silu_mul(y.float()).to(y.dtype)) if glu else y

    calls = {}
    if with_gluon:
        from moe_qlora.moe.kernels.gluon_nf4 import nf4_swapped_matmul, nf4_swapped_matmul_silu_mul, tiles_of_offsets

        tiles = tiles_of_offsets(offsets, 64, x.device)
        major, _ = torch.cuda.get_device_capability()
        for arch, label in ((90, "gluon wgmma (sm_90 kernel)"), (80, "gluon mma_v2 (sm_80 kernel)")):
            if arch == 90 and major != 9:
                continue
            if glu:
                calls[label] = lambda a=arch: nf4_swapped_matmul_silu_mul(
                    x, stack, tiles, arch=a, lora=lora, gather=gather
                )
            else:
                calls[label] = lambda a=arch: nf4_swapped_matmul(x, stack, tiles, arch=a, lora=lora)
    if glu:
        calls["triton fused (auto on sm_80/89)"] = lambda: grouped_matmul_silu_mul(
            x, weight, offsets, lora=lora, gather=gather
        )
    else:
        calls["triton fused (auto on sm_80/89)"] = lambda: grouped_matmul(x, weight, offsets, lora=lora)
    calls["dequantize + grouped_mm (auto on sm_90)"] = lambda: grouped_mm_path(stack.decode(0, stack.shape[0], x.dtype))
    calls["grouped_mm alone (weights decoded)"] = lambda: grouped_mm_path(decoded)
    return calls


def agreement(y: torch.Tensor, reference: torch.Tensor, magnitude: torch.Tensor) -> tuple[float, bool]:
    """(max |y - reference|, whether within two bf16 roundings of the output plus `rel` of sum |x||w| + c |P||L|):
    rel 1e-3 for the summation order (K 2^-24 is 8.5e-4 at K = 14,336) where every path rounds the weights alike;
    2^-7 under Triton's interpreter, which rounds the fused kernel's weights to bf16 towards zero (a whole ulp)."""
    rel = 2**-7 if os.environ.get("TRITON_INTERPRET") == "1" else 1e-3
    err = (y.float() - reference).abs()
    return float(err.max()), bool((err <= 2**-7 * reference.abs() + rel * magnitude).all())


def bench_shape(name, n, k, experts, top_k, tokens, repeats, device, with_gluon, rank, glu) -> list[dict]:
    counts = routed_rows(tokens, experts, top_k)
    rows_total = int(counts.sum())
    torch.manual_seed(0)
    stack = NF4Stack.from_param(quantize_stack(torch.randn(experts, n, k, device=device), double_quant=True))
    # gate_up reads each token by index (top_k sorted rows a token), down its own sorted rows
    x = torch.randn(tokens if glu else rows_total, k, device=device).bfloat16()
    gather = torch.randint(0, tokens, (rows_total,), device=device) if glu else None
    lora = None
    if rank:
        p = (0.1 * torch.randn(rows_total, rank, device=device)).bfloat16()
        l_factors = 0.1 * torch.randn(experts, rank, n, device=device)
        lora = LowRank(p, GroupedWeight.dense(l_factors, transpose=False), 2.0)
    flop = 2 * rows_total * n * (k + rank)
    weight_bytes = experts * n * k // 2 + experts * n * k // 64  # codes and nested scale codes, read once
    calls = contenders(x, stack, counts, with_gluon, lora, glu, gather)
    reference = calls["grouped_mm alone (weights decoded)"]()
    reference = (reference[0] if glu else reference).float()
    ends = torch.cumsum(counts, 0).to(device=device, dtype=torch.int32)
    rows = x if gather is None else x.index_select(0, gather)
    magnitude = gmm_rows(rows.abs(), stack.decode(0, experts, torch.bfloat16).abs().transpose(1, 2), ends).float()
    if lora is not None:
        magnitude += lora.scale * gmm_rows(lora.p.abs(), lora.weight.data.abs().bfloat16(), ends).float()
    out = []
    for contender, call in calls.items():
        row = dict(shape=name, n=n, k=k, tokens=tokens, rows=rows_total, rank=rank, glu=glu, contender=contender)
        result = call()
        row["max_abs_err"], row["agrees"] = agreement(result[0] if glu else result, reference, magnitude)
        if glu:  # act within one bf16 rounding of silu(gate) * up from the path's own h (exp's error: 1e-6)
            expected = silu_mul(result[0].float())
            row["act_agrees"] = bool(((result[1].float() - expected).abs() <= 2**-7 * expected.abs() + 1e-6).all())
            row["agrees"] = row["agrees"] and row["act_agrees"]
        row["ms"] = round(time_ms(call, repeats), 4)
        row["tflops"] = round(flop / row["ms"] / 1e9, 2)
        row["weight_gbs"] = round(weight_bytes / row["ms"] / 1e6, 1)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON file, rewritten after each row")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU: Triton's interpreter, no Gluon row)")
    ap.add_argument("--lora-rank", type=int, default=16, help="the LoRA term's rank (0: none)")
    args = ap.parse_args()
    plan = TINY if args.tiny else dict(shapes=SHAPES, tokens=TOKENS)
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
    runs_gluon = (8, 0) <= capability < (10, 0) and not args.tiny  # the tiny shapes are not whole K-steps
    result = dict(
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        commit=os.environ.get("MOE_QLORA_COMMIT", ""),
        rows=[],
        not_measured=[],
    )
    for name, (hidden, inter, experts, top_k) in plan["shapes"].items():
        for wname, (n, k) in {"down": (hidden, inter), "gate_up": (2 * inter, hidden)}.items():
            for tokens in plan["tokens"]:
                label = f"{name}/{wname}/{tokens}"
                if not runs_gluon:
                    result["not_measured"].append(f"{label} gluon: needs an sm_80 to sm_90 GPU and the real shapes")
                device = "cuda" if torch.cuda.is_available() else "cpu"
                for row in bench_shape(
                    name,
                    n,
                    k,
                    experts,
                    top_k,
                    tokens,
                    args.repeats,
                    device,
                    runs_gluon,
                    args.lora_rank,
                    wname == "gate_up",
                ):
                    row["weights"] = wname
                    result["rows"].append(row)
                    print(f"{label:<34}{row['contender']:<42}{row['ms']:>9.3f} ms{row['tflops']:>8.1f} TF/s"
                          f"  agrees={row['agrees']}")  # fmt: skip
                    atomic_write_text(Path(args.out), json.dumps(result, indent=1))
    atomic_write_text(Path(args.out), json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
