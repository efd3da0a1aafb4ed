"""Expert offload on the device: the same training run with every MoE layer's experts offloaded and without.

python scripts/bench_offload.py                       # GPU: the demo model and a real-width one, 8 steps each
python scripts/bench_offload.py --device cpu --steps 3 --models demo   # the script itself, on a CPU

Each run is `moe-qlora train` on configs/demo.yaml's data in a process of its own (fresh allocator statistics),
with model.expert_offload none (twice: a GPU's own nondeterminism shows as the two differing) or all. Printed
per model and setting: tokens/s (mean over the steps after the
first two), peak torch.cuda.max_memory_reserved against `moe-qlora plan`'s total for the same config, and whether
the losses and the adapter are bitwise those of the run without offload.
Models: demo = builtin:tiny-mixtral (2 layers, hidden 64); wide = a Mixtral of real expert width (hidden 2048,
expert intermediate 768 as Qwen3-30B-A3B's, 32 experts, top-4, 4 layers), random weights built on first use.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WIDE = {
    "hidden_size": 2048,
    "intermediate_size": 768,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
}


def model_path(name: str) -> str:
    if name == "demo":
        return "builtin:tiny-mixtral"
    from moe_qlora.model.model_path import ensure_tiny

    return str(ensure_tiny("mixtral", **WIDE))


def overrides(args, model: str, offload: str, out: Path) -> list[str]:
    sets = {
        "model.name_or_path": model,
        "model.expert_offload": offload,
        "model.device": args.device,
        "train.max_steps": args.steps,
        "train.warmup_steps": 1,
        "output.dir": str(out),
        "model.offload_resident_layers": args.resident,
    }
    return [item for k, v in sets.items() for item in ("--set", f"{k}={v}")]


def worker(argv: list[str]) -> None:
    """Run `moe-qlora train argv` here, then print the process's peak device memory as one JSON line."""
    import torch

    from moe_qlora.cli.app import app

    try:
        app(["train", "--config", str(ROOT / "configs" / "demo.yaml"), *argv], standalone_mode=False)
    finally:
        cuda = torch.cuda.is_available()
        peaks = {
            "peak_reserved": torch.cuda.max_memory_reserved() if cuda else None,
            "peak_allocated": torch.cuda.max_memory_allocated() if cuda else None,
        }
        print("BENCH " + json.dumps(peaks), flush=True)


def planned_bytes(args, model: str, offload: str, out: Path) -> int:
    from moe_qlora.config.load import load_config
    from moe_qlora.model.model_path import resolve_model_path
    from moe_qlora.model.plan import plan_run

    sets = overrides(args, model, offload, out)[1::2]
    cfg = load_config(ROOT / "configs" / "demo.yaml", sets)
    path = resolve_model_path(model)
    return plan_run(cfg, name_or_path=path, device="cuda" if args.device == "cuda" else "cpu").total


def run_one(args, name: str, offload: str, out: Path) -> dict:
    model = model_path(name)
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", *overrides(args, model, offload, out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{name} offload={offload} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    peaks = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("BENCH "))[6:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    timed = steps[2:] or steps
    return {
        "model": name,
        "offload": offload,
        "losses": [r["loss"] for r in steps],
        "tokens_per_s": sum(r["tokens"] for r in timed) / sum(r["step_time_s"] for r in timed),
        "plan_bytes": planned_bytes(args, model, offload, out),
        **peaks,
        "adapter": (out / "adapter" / "adapter_model.safetensors").read_bytes(),
        "offload_line": next((line for line in proc.stdout.splitlines() if "expert offload" in line), ""),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--models", nargs="*", choices=["demo", "wide"], default=["demo", "wide"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--resident", type=int, default=2, help="model.offload_resident_layers")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-offload")
    ap.add_argument("--timeout", type=int, default=500)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = []
    for name in args.models:
        base = None
        # the run without offload twice: on a GPU, kernels with atomics (attention's backward) can make two
        # identical runs differ, so the second says what "bitwise" can mean on this device
        for label, offload in (("none", "none"), ("none again", "none"), ("all", "all")):
            r = run_one(args, name, offload, args.out / f"{name}-{label.replace(' ', '-')}")
            r["offload"] = label
            base = base or dict(r)
            r["bitwise_losses"] = r["losses"] == base["losses"]
            r["bitwise_adapter"] = r.pop("adapter") == base["adapter"]
            results.append(r)
            print("RESULT " + json.dumps({k: v for k, v in r.items() if k != "losses"}), flush=True)
    print(f"{'model':6} {'offload':10} {'tok/s':>10} {'peak reserved':>14} {'plan':>10} {'peak/plan':>9}  bitwise")
    for r in results:
        reserved = r["peak_reserved"]
        ratio = f"{reserved / r['plan_bytes']:.2f}" if reserved else "-"
        shown = f"{reserved / 2**20:,.0f} MiB" if reserved else "-"
        print(
            f"{r['model']:6} {r['offload']:10} {r['tokens_per_s']:>10,.0f} {shown:>14} "
            f"{r['plan_bytes'] / 2**20:>6,.0f} MiB {ratio:>9}  losses {r['bitwise_losses']}, "
            f"adapter {r['bitwise_adapter']}  {r['offload_line'].strip()[:90]}"
        )
    print(json.dumps(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
    else:
        main()
