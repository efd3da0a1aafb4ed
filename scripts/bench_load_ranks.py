"""Host memory per rank while loading for ddp, fsdp and ep (issue 70, item 1), on gloo ranks of this machine, for
Mixtral, Qwen3-MoE and DeepSeek-V3 checkpoints of random weights, bf16 or DeepSeek's FP8 release layout.

    python scripts/bench_load_ranks.py                          # 3 families, bf16, 2 and 4 ranks
    python scripts/bench_load_ranks.py --family deepseek_v3 --format fp8 --ranks 2 4
    python scripts/bench_load_ranks.py --json out.json
    python scripts/bench_load_ranks.py --family mixtral --layouts ddp ep  # some layouts (one process always)

Each rank builds the run's model as the trainer does (`build.build_policy`: loading, LoRA, then fsdp's shards or
ep's experts), in bf16, in its own process; its peak RSS (VmHWM) above the ~500 MiB that the imports take is
measured through loading and placing. Rows per family:
  - one process: the whole model (the figure the others are compared with, divided by N);
  - ddp: each rank a replica, streamed tensor by tensor (its share is the whole model);
  - fsdp, whole: every rank quantizing the whole model before sharding, as all did before (the control);
  - fsdp and ep: each rank reading and quantizing only the experts it keeps.
The bound of the issue is a rank's share of the 4-bit model (what it keeps), plus one decoder layer's tensors as
stored (bf16, or fp8 decoded to bf16) and the largest tensor read; "within" says whether the peak is under it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

COMMON = dict(vocab_size=8000, hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128)
COMMON.update(max_position_embeddings=4096)
FAMILIES = {  # ~100 MiB of bf16 experts a MoE layer, 8 MoE layers, a small vocabulary: checkpoints of ~1 GiB,
    # nearly all experts, as the real ones are (95% and more)
    "mixtral": dict(num_hidden_layers=8, intermediate_size=1024, num_local_experts=16, num_experts_per_tok=2),
    "qwen3_moe": dict(num_hidden_layers=8, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512)
    | dict(intermediate_size=2048),
    "deepseek_v3": dict(num_hidden_layers=9, first_k_dense_replace=1, intermediate_size=2048)
    | dict(n_routed_experts=32, moe_intermediate_size=512, n_shared_experts=1, num_experts_per_tok=4)
    | dict(n_group=4, topk_group=2, q_lora_rank=384, kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64)
    | dict(v_head_dim=64),
}
SHARD_BYTES = 256 * 2**20
LAYOUTS = ("ddp", "fsdp, whole", "fsdp", "ep")


def family_config(family: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **COMMON, **FAMILIES[family])


def generate(family: str, path: Path) -> Path:
    """Random bf16 weights (seed 0) for every parameter of `family`'s model, in ~256 MiB shards plus an index."""
    from bench_load import generate as generate_checkpoint

    return generate_checkpoint(path, family_config(family), SHARD_BYTES)


def stored_sizes(path: Path) -> dict:
    """The bound's parts from the checkpoint's headers: the largest decoder layer's and the largest tensor's
    bytes, counting fp8 weights at bf16's 2 bytes (they are decoded to bf16 as read)."""
    from safetensors import safe_open

    layers, largest = {}, 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as handle:
            for key in handle.keys():
                shape = handle.get_slice(key).get_shape()
                size = 2 * int(torch.tensor(shape).prod()) if shape else 2
                largest = max(largest, size)
                if ".layers." in key:
                    layer = key.split(".layers.")[1].split(".")[0]
                    layers[layer] = layers.get(layer, 0) + size
    return {"layer_mib": max(layers.values()) / 2**20, "tensor_mib": largest / 2**20}


def rank_worker(layout: str, path: str) -> dict:
    """One process (RANK etc. set by `launch`, or none for "one process"): the run's model built for `layout`;
    the peak RSS of loading and placing, and what the rank keeps."""
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import bitsandbytes  # noqa: F401 (imported before the baseline reading)
    import peft  # noqa: F401
    import transformers  # noqa: F401
    from rich.console import Console

    from moe_qlora.common.memory import peak_rss_mib
    from moe_qlora.config.sections import LoraSection, ModelSection
    from moe_qlora.model.build import Placement, build_policy
    from moe_qlora.model.distributed import SINGLE, join, leave, local_shard, shard_model
    from moe_qlora.model.loading import LoadOptions, load_model

    ranks = SINGLE if layout == "one process" else join(1800)
    baseline, t = peak_rss_mib(), time.perf_counter()
    if layout == "fsdp, whole":  # the control: the whole model quantized on every rank, then sharded
        nested = ModelSection.model_fields["expert_double_quant"].default  # as the run's layouts load
        model = load_model(LoadOptions(path, compute_dtype=torch.bfloat16, expert_double_quant=nested))
        ranks = shard_model(model, ranks)
    else:
        placement = Placement(sharded=layout == "fsdp", experts_split=layout == "ep")
        model_cfg = ModelSection(name_or_path=path, compute_dtype="bfloat16", device="cpu")
        model, _, ranks = build_policy(
            model_cfg, LoraSection(), path, Console(quiet=True), placement=placement, ranks=ranks
        )
    seconds = time.perf_counter() - t
    kept = sum(local_shard(p).numel() * p.element_size() for p in model.parameters())
    if ranks.world > 1:
        leave(ranks)
    return {
        "layout": layout,
        "rank": ranks.rank,
        "world": ranks.world,
        "seconds": round(seconds, 1),
        "peak_mib": round(peak_rss_mib() - baseline, 1),
        "kept_mib": round(kept / 2**20, 1),
    }


def launch(layout: str, path: Path, world: int) -> list[dict]:
    """`world` gloo ranks of this machine building the model for `layout`; each rank's row."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
        if world == 1:
            env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        command = [sys.executable, __file__, "--worker", layout, "--path", str(path)]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    rows = []
    for proc in procs:
        out, err = proc.communicate(timeout=3600)
        last = (err.strip().splitlines() or ["(nothing on stderr)"])[-1]
        rows.append(json.loads(out.strip().splitlines()[-1]) if proc.returncode == 0 else {"error": last})
    return rows


def family_rows(family: str, fmt: str, worlds: list[int], layouts=LAYOUTS) -> tuple[list[dict], dict]:
    """Every layout over every world size for one family; the bound's parts added to each row."""
    from bench_load import generate_fp8

    from moe_qlora.model.model_path import cache_dir

    path = generate(family, cache_dir() / f"bench-load-ranks-{family}")
    if fmt == "fp8":
        path = generate_fp8(path, path.with_name(path.name + "-fp8"))
    sizes = stored_sizes(path)
    [one] = launch("one process", path, 1)
    rows = [{**one, "family": family}]
    for world in worlds:
        for layout in layouts:
            for row in launch(layout, path, world):
                row.update(family=family, layout=row.get("layout", layout), world=world)
                if "error" not in row:
                    row["one_over_n_mib"] = round(one["peak_mib"] / world, 1)
                    row["bound_mib"] = round(row["kept_mib"] + sizes["layer_mib"] + sizes["tensor_mib"], 1)
                rows.append(row)
    return rows, sizes


def print_table(rows: list[dict], fmt: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Host memory per rank while loading and placing ({fmt}; peak RSS above the imports)")
    columns = ("family", "layout", "N", "rank", "peak MiB", "one process / N", "kept MiB", "bound MiB", "within")
    for col in (*columns, "s"):
        table.add_column(col, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(r["family"], r["layout"], str(r["world"]), "error: " + r["error"][:90])
            continue
        bound = r.get("bound_mib")
        table.add_row(
            r["family"],
            r["layout"],
            str(r["world"]),
            str(r["rank"]),
            f"{r['peak_mib']:,.0f}",
            f"{r['one_over_n_mib']:,.0f}" if "one_over_n_mib" in r else "",
            f"{r['kept_mib']:,.0f}",
            f"{bound:,.0f}" if bound else "",
            ("yes" if r["peak_mib"] <= bound else "no") if bound else "",
            f"{r['seconds']:.1f}",
        )
    Console(width=160).print(table)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", nargs="*", choices=sorted(FAMILIES), default=sorted(FAMILIES))
    ap.add_argument("--format", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument("--ranks", nargs="*", type=int, default=[2, 4], help="world sizes")
    ap.add_argument("--layouts", nargs="*", choices=LAYOUTS, default=list(LAYOUTS), help="beside one process")
    ap.add_argument("--json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(rank_worker(args.worker, args.path)))
        from moe_qlora.common.process_exit import exit_without_finalizing

        exit_without_finalizing(0)  # a gloo rank: common/process_exit.py
        return
    rows, bounds = [], {}
    for family in args.family:
        family_result, bounds[family] = family_rows(family, args.format, args.ranks, args.layouts)
        rows += family_result
    print_table(rows, args.format)
    payload = {"format": args.format, "families": {f: FAMILIES[f] for f in args.family}, "bound_parts": bounds}
    payload |= {"commit": os.popen(f"git -C {ROOT} rev-parse --short HEAD").read().strip(), "results": rows}
    print(json.dumps(payload))
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
