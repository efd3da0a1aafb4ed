"""Peak host memory and time of merging an expert LoRA adapter into bf16 weights, side by side:

- `moe-qlora merge`: the 4-bit model in memory, merged tensors streamed into 400 MiB shards;
- what a user would do otherwise: transformers loads the bf16 checkpoint, PEFT loads the adapter
  (target_parameters on the fused experts), `merge_and_unload()`, `save_pretrained()`.

    python scripts/bench_merge.py                # uses (or writes once) bench_load.py's ~2.7 GB checkpoint
    python scripts/bench_merge.py --json out.json

Each runs in its own subprocess; peak RSS is its VmHWM, including what importing torch, transformers, PEFT
and bitsandbytes costs (`baseline`). The adapter (rank 16 on every expert and on q/k/v/o, random B) is made
once beside the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

SHARD = "400MB"


def make_adapter(base: Path) -> Path:
    """Rank-16 LoRA on every expert and on q/k/v/o of the 4-bit model, B random (a trained-looking update)."""
    from moe_qlora.config.sections import LoraSection
    from moe_qlora.export.adapter import save_adapter
    from moe_qlora.model.adapters import attach_adapters
    from moe_qlora.model.loading import LoadOptions, load_model

    out = base.parent / (base.name + "-adapter")
    if (out / "adapter_model.safetensors").exists():
        return out
    lora = LoraSection(rank=16, alpha=32.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = attach_adapters(load_model(LoadOptions(str(base), compute_dtype=torch.bfloat16)), lora, seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and ("lora_B" in name or name.endswith("_b")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    return save_adapter(model, out, cfg=lora, base_model_name_or_path=str(base))


def worker(name: str, adapter: str, out: str) -> dict:
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import bitsandbytes  # noqa: F401 (imported before the baseline reading, as both need it)
    import peft
    import transformers

    from moe_qlora.common.memory import peak_rss_mib

    baseline = peak_rss_mib()
    t = time.perf_counter()
    if name == "moe-qlora merge":
        from rich.console import Console

        from moe_qlora.cli.adapter import parse_size
        from moe_qlora.inference.merge import merge_adapter

        merge_adapter(adapter, out, dtype="bfloat16", max_shard_bytes=parse_size(SHARD), console=Console(quiet=True))
    else:
        base = json.loads((Path(adapter) / "adapter_config.json").read_text())["base_model_name_or_path"]
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
        model.save_pretrained(out, max_shard_size=SHARD)
    seconds = time.perf_counter() - t
    files = list(Path(out).glob("*.safetensors"))
    return {
        "merger": name,
        "seconds": round(seconds, 1),
        "baseline_mib": round(baseline, 1),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "written_mib": round(sum(f.stat().st_size for f in files) / 2**20, 1),
        "shards": len(files),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default=None, help="bench_load.py's checkpoint (default: the moe-qlora cache)")
    ap.add_argument("--only", nargs="*", default=["moe-qlora merge", "transformers+PEFT merge_and_unload"])
    ap.add_argument("--json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--adapter", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.adapter, args.out)))
        return
    from bench_load import generate

    from moe_qlora.model.model_path import cache_dir

    base = generate(Path(args.path) if args.path else cache_dir() / "bench-load-qwen3")
    adapter = make_adapter(base)
    ckpt_mib = sum(f.stat().st_size for f in base.glob("*.safetensors")) / 2**20
    results = []
    for name in args.only:
        out = base.parent / "bench-merge-out"
        shutil.rmtree(out, ignore_errors=True)
        command = [sys.executable, __file__, "--worker", name, "--adapter", str(adapter), "--out", str(out)]
        proc = subprocess.run(command, capture_output=True, text=True)
        results.append(
            json.loads(proc.stdout.strip().splitlines()[-1])
            if proc.returncode == 0
            else {"merger": name, "error": proc.stderr.strip().splitlines()[-1]}
        )
        shutil.rmtree(out, ignore_errors=True)

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"merge into a {ckpt_mib:,.0f} MiB bf16 Qwen3-MoE checkpoint (rank-16 experts + attention)")
    columns = ("merger", "peak RSS MiB", "peak - baseline", "written MiB", "shards", "s")
    for col in columns:
        table.add_column(col, justify="right")
    for r in results:
        if "error" in r:
            table.add_row(r["merger"], "error: " + r["error"][:80], *[""] * (len(columns) - 2))
            continue
        table.add_row(
            r["merger"],
            f"{r['peak_rss_mib']:,.0f}",
            f"{r['peak_rss_mib'] - r['baseline_mib']:,.0f}",
            f"{r['written_mib']:,.0f}",
            str(r["shards"]),
            f"{r['seconds']:.1f}",
        )
    Console(width=150).print(table)
    payload = {"checkpoint_mib": round(ckpt_mib, 1), "shard": SHARD, "results": results}
    print(json.dumps(payload))
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
