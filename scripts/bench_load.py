"""Peak host memory while loading a sharded bf16 (or FP8) MoE checkpoint in 4-bit, against its stored and
quantized sizes.

    python scripts/bench_load.py                 # generates ~2.7 GB of bf16 shards once, then measures
    python scripts/bench_load.py --format fp8    # the same weights published as DeepSeek-V3 publishes: per-expert
                                                 # keys, fp8 e4m3 with 128 x 128 block scales (moe-qlora only:
                                                 # transformers + bnb cannot quantize an FP8 checkpoint to NF4)
    python scripts/bench_load.py --json out.json
    python scripts/bench_load.py --ranks 2       # FSDP on gloo: each rank's peak RSS loading and sharding, each rank
                                                 # quantizing only the experts it keeps, against the whole-model load
                                                 # every rank did before (issue 70, item 1)

The checkpoint (Qwen3-MoE architecture, random weights, seed 0) is written shard by shard, never whole in
memory. Each loader runs in its own subprocess; peak RSS is its VmHWM and includes the ~450 MiB that
importing torch, transformers, PEFT and bitsandbytes costs (reported as `baseline`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPE = dict(
    vocab_size=32000,
    hidden_size=2048,
    num_hidden_layers=6,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=48,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    intermediate_size=4096,
    max_position_embeddings=4096,
)
SHARD_BYTES = 400 * 2**20


def generate(path: Path, config=None, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write random bf16 weights (seed 0) for every parameter of the meta model of `config` (SHAPE's Qwen3-MoE by
    default) into ~`shard_bytes` shards plus an index."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from moe_qlora.model.tiny import build_byte_tokenizer

    if (path / "model.safetensors.index.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    config = config or Qwen3MoeConfig(**SHAPE)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(0)
    shard, size, weight_map, n = {}, 0, {}, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size, n = {}, 0, n + 1

    for key, p in model.state_dict().items():
        shard[key] = (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16)
        size += shard[key].numel() * 2
        if size >= shard_bytes:
            flush()
    flush()
    total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    config.save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return path


FP8_BLOCK = 128


def to_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 e4m3 weight, its (ceil(rows/128), ceil(cols/128)) fp32 scale grid), each block's absmax at 448."""
    rows, cols = w.shape
    grid_rows, grid_cols = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = torch.zeros(grid_rows * FP8_BLOCK, grid_cols * FP8_BLOCK)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(grid_rows, FP8_BLOCK, grid_cols, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def per_expert_fp8(key: str, stack: torch.Tensor) -> dict[str, torch.Tensor]:
    """A fused expert stack as the hub's per-expert FP8 keys (gate_up (E, 2I, H) -> gate_proj and up_proj)."""
    prefix, name = key.rsplit(".", 1)
    parts = {"gate_proj": 0, "up_proj": 1} if name == "gate_up_proj" else {"down_proj": None}
    out = {}
    for e in range(stack.shape[0]):
        for proj, half in parts.items():
            w = stack[e] if half is None else stack[e].chunk(2, dim=0)[half]
            q, scale = to_fp8(w)
            out[f"{prefix}.{e}.{proj}.weight"], out[f"{prefix}.{e}.{proj}.weight_scale_inv"] = q, scale
    return out


def generate_fp8(source: Path, path: Path) -> Path:
    """The bf16 checkpoint `source` shard by shard as an FP8 release: projections and per-expert weights in fp8
    with block scales; router, norms, embeddings and head in bf16."""
    from safetensors.torch import load_file, save_file

    if (path / "model.safetensors.index.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard in sorted(source.glob("*.safetensors")):
        out = {}
        for key, t in load_file(str(shard)).items():
            if t.dim() == 3:
                out.update(per_expert_fp8(key, t))
            elif key.endswith("_proj.weight"):
                out[key], out[key + "_scale_inv"] = to_fp8(t)
            else:
                out[key] = t
        save_file(out, str(path / shard.name), metadata={"format": "pt"})
        weight_map.update({k: shard.name for k in out})
        del out
    total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for f in source.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            (path / f.name).write_bytes(f.read_bytes())
    return path


def run_default_double_quant() -> bool:
    """model.expert_double_quant as a run has it by default (LoadOptions' own default is off): the loads measured
    here are a run's."""
    from moe_qlora.config.sections import ModelSection

    return ModelSection.model_fields["expert_double_quant"].default


def worker(name: str, path: str) -> dict:
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import bitsandbytes  # noqa: F401 (imported before the baseline reading, as both loaders need it)
    import peft  # noqa: F401
    import transformers

    from moe_qlora.common.memory import peak_rss_mib
    from moe_qlora.model.loaded_model import parameter_bytes_by_kind
    from moe_qlora.model.loading import LoadOptions, load_model

    nested = run_default_double_quant()
    baseline = peak_rss_mib()
    t = time.perf_counter()
    if name == "moe-qlora":
        model = load_model(LoadOptions(path, compute_dtype=torch.bfloat16, expert_double_quant=nested))
    else:  # the same choice of nested scales as moe-qlora's
        quant = transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=nested,
        )
        model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.bfloat16)
    seconds = time.perf_counter() - t
    peak_load = peak_rss_mib()
    with torch.no_grad():  # what the first training step does: every weight page becomes resident
        for p in model.parameters():
            p.data.reshape(-1)[::512].float().sum()
    kinds = parameter_bytes_by_kind(model)
    dense_experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if p.dim() == 3)
    return {
        "loader": name,
        "seconds": round(seconds, 1),
        "baseline_mib": round(baseline, 1),
        "peak_rss_mib": round(peak_load, 1),
        "rss_after_touch_mib": round(peak_rss_mib(), 1),
        "model_mib": round(sum(kinds.values()) / 2**20, 1),
        "dense_expert_mib": round(dense_experts / 2**20, 1),
    }


def rank_worker(name: str, path: str) -> dict:
    """One gloo rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT set by rank_runs): load for FSDP, its experts alone
    ("sliced") or the whole model as every rank did before ("whole"), then shard; its peak RSS through both."""
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401

    from moe_qlora.common.memory import peak_rss_mib
    from moe_qlora.model.distributed import join, leave, local_shard, shard_model
    from moe_qlora.model.loading import LoadOptions, load_model

    ranks = join(600)
    baseline = peak_rss_mib()
    t = time.perf_counter()
    shard = ranks if name == "sliced" else None
    nested = run_default_double_quant()
    model = load_model(LoadOptions(path, compute_dtype=torch.bfloat16, expert_shard=shard, expert_double_quant=nested))
    peak_load = peak_rss_mib()
    shard_model(model, ranks)
    seconds = time.perf_counter() - t
    kept = sum(local_shard(p).numel() * p.element_size() for p in model.parameters())
    leave(ranks)
    return {
        "loader": f"fsdp, {name}",
        "rank": ranks.rank,
        "world": ranks.world,
        "seconds": round(seconds, 1),
        "baseline_mib": round(baseline, 1),
        "peak_rss_load_mib": round(peak_load, 1),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "kept_mib": round(kept / 2**20, 1),
    }


def rank_runs(path: Path, world: int) -> list[dict]:
    """Both loaders over `world` gloo ranks on this machine, one after the other; every rank's row."""
    import os
    import socket

    rows = []
    for name in ("whole", "sliced"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
            command = [sys.executable, __file__, "--worker", name, "--path", str(path), "--ranks", str(world)]
            procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for proc in procs:
            out, err = proc.communicate(timeout=1800)
            if proc.returncode:
                rows.append({"loader": f"fsdp, {name}", "error": err.strip().splitlines()[-1]})
            else:
                rows.append(json.loads(out.strip().splitlines()[-1]))
    return rows


def print_rank_runs(path: Path, world: int, args) -> None:
    rows = rank_runs(path, world)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"FSDP over {world} gloo ranks: host memory per rank, loading then sharding")
    columns = ("loader", "rank", "peak RSS MiB", "peak - baseline", "of which loading", "kept MiB", "s")
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(r["loader"], "error: " + r["error"][:80], *[""] * (len(columns) - 2))
            continue
        table.add_row(
            r["loader"],
            str(r["rank"]),
            f"{r['peak_rss_mib']:,.0f}",
            f"{r['peak_rss_mib'] - r['baseline_mib']:,.0f}",
            f"{r['peak_rss_load_mib'] - r['baseline_mib']:,.0f}",
            f"{r['kept_mib']:,.0f}",
            f"{r['seconds']:.1f}",
        )
    Console(width=150).print(table)
    payload = {"world": world, "format": args.format, "shape": SHAPE, "results": rows}
    print(json.dumps(payload))
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default=None, help="where the generated checkpoint lives (default: the moe-qlora cache)")
    ap.add_argument("--only", nargs="*", default=None, help="loaders (default: both; fp8: moe-qlora)")
    ap.add_argument("--format", choices=["bf16", "fp8"], default="bf16", help="how the checkpoint is stored")
    ap.add_argument("--json")
    ap.add_argument("--ranks", type=int, default=0, help="FSDP over this many gloo ranks: sliced against whole loads")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(rank_worker(args.worker, args.path) if args.ranks else worker(args.worker, args.path)))
        from moe_qlora.common.process_exit import exit_without_finalizing

        exit_without_finalizing(0)  # a gloo rank: common/process_exit.py
        return
    from moe_qlora.model.model_path import cache_dir

    path = generate(Path(args.path) if args.path else cache_dir() / "bench-load-qwen3")
    if args.ranks:
        if args.format == "fp8":
            path = generate_fp8(path, path.with_name(path.name + "-fp8"))
        print_rank_runs(path, args.ranks, args)
        return
    if args.format == "fp8":
        path = generate_fp8(path, path.with_name(path.name + "-fp8"))
    loaders = args.only or (["moe-qlora"] if args.format == "fp8" else ["moe-qlora", "transformers+bnb"])
    shards = sorted(path.glob("*.safetensors"))
    ckpt_mib = sum(f.stat().st_size for f in shards) / 2**20
    shard_mib = max(f.stat().st_size for f in shards) / 2**20
    results = []
    for name in loaders:
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", name, "--path", str(path)], capture_output=True, text=True
        )
        results.append(
            json.loads(proc.stdout.strip().splitlines()[-1])
            if proc.returncode == 0
            else {"loader": name, "error": proc.stderr.strip().splitlines()[-1]}
        )

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(shards)} {args.format} shards, {ckpt_mib:,.0f} MiB (largest {shard_mib:,.0f} MiB)")
    columns = (
        "loader",
        "peak RSS MiB",
        "peak - baseline",
        "<= model + shard?",
        "RSS once weights touched",
        "model MiB",
        "of which dense experts",
        "load s",
    )
    for col in columns:
        table.add_column(col, justify="right")
    for r in results:
        if "error" in r:
            table.add_row(r["loader"], "error: " + r["error"][:80], *[""] * (len(columns) - 2))
            continue
        above = r["peak_rss_mib"] - r["baseline_mib"]
        r["within_model_plus_shard"] = above <= r["model_mib"] + shard_mib
        table.add_row(
            r["loader"],
            f"{r['peak_rss_mib']:,.0f}",
            f"{above:,.0f}",
            "yes" if r["within_model_plus_shard"] else "no",
            f"{r['rss_after_touch_mib']:,.0f}",
            f"{r['model_mib']:,.0f}",
            f"{r['dense_expert_mib']:,.0f}",
            f"{r['seconds']:.1f}",
        )
    Console(width=150).print(table)
    payload = {
        "format": args.format,
        "checkpoint_mib": round(ckpt_mib, 1),
        "largest_shard_mib": round(shard_mib, 1),
        "shape": SHAPE,
        "results": results,
    }
    print(json.dumps(payload))
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
