"""Where one MoE layer's forward + backward spends its GPU time: torch.profiler's kernels, largest first.

python scripts/profile_moe.py --shape qwen3-30b-a3b --tokens 4096 --kernels grouped_mm triton

The layer is bench_moe.py's (NF4 with nested scales, rank-8 LoRA with non-zero B, the default decode buffer),
without the self-check. Per path: the wall time of a step, the GPU time summed over kernels, the kernels that
take the most of it, and how many kernel launches and host-device synchronizations one step makes.
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_moe import SHAPES, experts_module, ours, set_kernels

CUDA_SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync")


def profile_path(layer, kernels_arg, x, idx, weights, seed, top):
    set_kernels(layer, kernels_arg, self_check=False)
    for _ in range(3):  # compile, autotune, allocator
        layer(x.clone().requires_grad_(True), idx, weights).backward(seed)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        layer(x.clone().requires_grad_(True), idx, weights).backward(seed)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sorted(
        (e for e in events if e.device_time_total > 0 and e.device_type.name == "CUDA"),
        key=lambda e: -e.device_time_total,
    )
    gpu_us = sum(e.device_time_total for e in kernels)
    syncs = {e.key: e.count for e in events if e.key in CUDA_SYNC_EVENTS}
    rows = [
        {
            "kernel": e.key[:90],
            "calls": e.count,
            "us": round(e.device_time_total, 1),
            "share": round(e.device_time_total / gpu_us, 3),
        }
        for e in kernels[:top]
    ]
    return {
        "path": kernels_arg,
        "gpu_us": round(gpu_us, 1),
        "launches": sum(e.count for e in kernels),
        "syncs": syncs,
        "top": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--kernels", nargs="*", default=["grouped_mm", "triton"])
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json")
    args = ap.parse_args()
    hidden, inter, experts, top_k = SHAPES[args.shape]
    # as bench_moe builds it: random fp32 stacks quantized to NF4 on the GPU, fed bf16 tokens
    layer = ours(*experts_module(hidden, inter, experts, top_k, torch.float32, device="cuda"), "torch", 8)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = torch.rand(args.tokens, experts, device="cuda", generator=g).topk(top_k, dim=-1).indices
    weights = torch.rand(args.tokens, top_k, device="cuda", generator=g).softmax(-1)
    seed = torch.randn(args.tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    results = {}
    for kernels in args.kernels:
        r = results[kernels] = profile_path(layer, kernels, x, idx, weights, seed, args.top)
        print(
            f"== {args.shape} x {args.tokens} tokens, {kernels}: GPU {r['gpu_us'] / 1e3:.2f} ms in "
            f"{r['launches']} launches; host syncs {r['syncs']}"
        )
        for row in r["top"]:
            print(f"  {row['us'] / 1e3:8.3f} ms {row['share']:6.1%} x{row['calls']:<5} {row['kernel']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
