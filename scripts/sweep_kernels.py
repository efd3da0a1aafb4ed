"""Every Triton kernel config and grid order of one MoE layer step timed in one call, a JSONL row each: the data
that tunes tiles.MATMUL_CONFIGS and tiles.group_m offline from one GPU session.

    python scripts/sweep_kernels.py --out "$OUT/sweep.jsonl"           # GPU: Qwen3-30B-A3B and Mixtral-8x7B
    python scripts/sweep_kernels.py --tiny --out sweep.jsonl           # CPU smoke run: interpreter, tiny shapes
    python scripts/sweep_kernels.py --tokens 4096 16384 --out ...      # a short session: the figures' token counts

For each shape, token count and launch of the layer step (kernels.aot.layer_launch_calls: LoRA A, gate_up with its
silu epilogue, down, both input gradients, the LoRA outer product), each candidate of the GPU's config list pinned
in turn (tiles.pinned_config; the config the kernel was really launched with is recorded, so a candidate that does
not serve a launch shows as the default it fell back to, and repeats are dropped), at three grid orders: the groups
tiles.group_m chooses ("auto"), one row tile a group ("1") and one group of all ("0", the order before issue 67).
Each row: the median time of --repeats calls after a warm-up call (CUDA events on a GPU; the interpreter's wall
time on a CPU, which says nothing of speed), TFLOP/s, and the config. Rows are appended as they are measured, and
what --budget-s leaves out is listed in a last row {"not_measured": [...]}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moe_qlora.moe.kernels import tiles, triton_kernels  # noqa: E402
from moe_qlora.moe.kernels.aot import layer_launch_calls  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}  # hidden, inter, E, top-k
TOKENS = [512, 2048, 4096, 16384]
GROUPS = {"auto": None, "1": 1, "0": 0}
TINY = dict(shapes={"tiny": (64, 32, 8, 2)}, tokens=[32], configs=2)


class LaunchedConfig:
    """Wraps the matmul kernel: records the blocks, warps and stages each launch really ran with, and runs it."""

    def __init__(self, real):
        self.real, self.seen = real, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "SWAP_AB", "SPLIT_K")
            self.seen.append({k: kwargs.get(k) for k in keys})
            return self.real[grid](*args, **kwargs)

        return launch


def time_call(call, repeats: int, device: str) -> float:
    """The median seconds of `repeats` calls after one warm-up call (which compiles)."""
    call()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def launch_flops(name: str, hidden: int, inter: int, rows: int, rank: int) -> int:
    """The multiply-adds (x2) of one of the layer's launches over `rows` routed rows."""
    k_n = {
        "lora_a_dense": (hidden, rank),
        "gate_up_nf4_nested_silu_mul": (hidden, 2 * inter),
        "down_nf4_nested": (inter, hidden),
        "down_input_grad_nf4_nested": (hidden, inter),
        "gate_up_input_grad_nf4_nested": (2 * inter, hidden),
        "outer_product": (hidden, rank),
    }[name]
    return 2 * rows * k_n[0] * k_n[1]


def sweep(args, plan: dict, out) -> list[str]:
    """Times every (shape, tokens, launch, config, grid order); returns what the deadline left out."""
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    arch = tiles.target_arch(torch.device(device)) if device == "cuda" else 90
    deadline = time.monotonic() + args.budget_s
    left_out, seen_rows = [], set()
    candidates = tiles.MATMUL_CONFIGS[arch][: plan.get("configs")]
    for shape, (hidden, inter, experts, top_k) in plan["shapes"].items():
        for tokens in plan["tokens"]:
            calls = layer_launch_calls(
                hidden=hidden, inter=inter, experts=experts, top_k=top_k, tokens=tokens, rank=args.rank, device=device
            )
            for name, call in calls:
                for config in candidates if name != "outer_product" else [None]:
                    for group_name, group in GROUPS.items():
                        if time.monotonic() > deadline:
                            left_out.append(f"{shape}/{tokens}/{name}/{config}/{group_name}")
                            continue
                        row = measure(call, config, group, arch, args.repeats, device)
                        key = (shape, tokens, name, json.dumps(row["launched"], sort_keys=True), group_name)
                        if key in seen_rows:  # a candidate that does not serve the launch: the default again
                            continue
                        seen_rows.add(key)
                        flops = launch_flops(name, hidden, inter, tokens * top_k, args.rank)
                        row |= {"shape": shape, "tokens": tokens, "launch": name, "group": group_name, "arch": arch}
                        row["tflops"] = round(flops / row["seconds"] / 1e12, 2)
                        out.write(json.dumps(row) + "\n")
                        out.flush()
    return left_out


def measure(call, config, group, arch: int, repeats: int, device: str) -> dict:
    recorder = LaunchedConfig(triton_kernels._grouped_matmul_kernel)
    with (
        tiles.pinned_config(arch, config),
        mock.patch.object(tiles, "GROUP_M", group),
        mock.patch.object(triton_kernels, "_grouped_matmul_kernel", recorder),
    ):
        seconds = time_call(call, repeats, device)
    return {"seconds": seconds, "ms": round(seconds * 1e3, 4), "launched": recorder.seen[:1] or None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSONL file the rows are appended to")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=300, help="what is not reached by then is listed, not timed")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: Triton's interpreter, tiny shapes")
    ap.add_argument("--tokens", type=int, nargs="+", default=TOKENS, help="token counts, swept in this order")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES), help="shapes, in this order")
    args = ap.parse_args()
    shapes = {name: SHAPES[name] for name in args.shapes}
    plan = TINY if args.tiny else dict(shapes=shapes, tokens=args.tokens)
    with open(args.out, "a") as out:
        left_out = sweep(args, plan, out)
        out.write(json.dumps({"not_measured": left_out}) + "\n")
    print(f"{args.out}: {len(left_out)} variants not measured")


if __name__ == "__main__":
    main()
