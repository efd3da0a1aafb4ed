"""Peak memory and time of the loss step alone (output head + cross-entropy, forward and backward): the full
(tokens, vocab) logits against moe-qlora's chunked path (moe_qlora/train/losses.py), each in its own process.

    python scripts/bench_loss.py [--seq 4096 --vocab 151936 --hidden 2048 --chunk 256 --dtype bfloat16]

Defaults are Qwen3-30B-A3B's head (vocab 151,936, hidden 2048) at seq 4096, the issue's setting. Peak is the
process's VmHWM minus its RSS once the inputs exist: what the loss step adds. Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def worker(kind: str, args) -> dict:
    from moe_qlora.train.losses import ChunkedTokenLogProbs

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    hidden = torch.randn(args.seq, args.hidden, dtype=dtype).requires_grad_(True)
    weight = (torch.randn(args.vocab, args.hidden) * 0.02).to(dtype)
    targets = torch.randint(0, args.vocab, (args.seq,))
    with open("/proc/self/clear_refs", "w") as f:  # restart VmHWM from here
        f.write("5")
    base = _rss_mib("VmRSS")
    t = time.perf_counter()
    if kind == "full":
        logits = F.linear(hidden, weight).float()
        loss = F.cross_entropy(logits, targets, reduction="sum")
    else:
        loss = -ChunkedTokenLogProbs.apply(hidden, weight, None, targets, 1.0, args.chunk).sum()
    loss.backward()
    seconds = time.perf_counter() - t
    return {
        "kind": kind,
        "loss": round(float(loss) / args.seq, 5),
        "seconds": round(seconds, 2),
        "peak_mib": round(_rss_mib("VmHWM") - base, 1),
        "grad_norm": round(float(hidden.grad.float().norm()), 5),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)  # train.loss_chunk_tokens
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--worker", choices=["full", "chunked"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return
    results = []
    for kind in ("full", "chunked"):
        options = [f"--{k}={getattr(args, k)}" for k in ("seq", "vocab", "hidden", "chunk", "dtype")]
        cmd = [sys.executable, __file__, "--worker", kind, *options]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ}, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    print(f"loss step, seq {args.seq}, vocab {args.vocab:,}, hidden {args.hidden}, {args.dtype}, chunk {args.chunk}")
    print(f"{'':10} {'peak MiB':>10} {'s':>8} {'loss':>10} {'|grad h|':>10}")
    for r in results:
        print(f"{r['kind']:10} {r['peak_mib']:>10,.1f} {r['seconds']:>8.2f} {r['loss']:>10.5f} {r['grad_norm']:>10.5f}")
    print(
        json.dumps(
            {
                "seq": args.seq,
                "vocab": args.vocab,
                "hidden": args.hidden,
                "dtype": args.dtype,
                "chunk": args.chunk,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
