"""Issue 58's GPU measurements in one run, one JSON: the MoE layer against transformers grouped_mm + PEFT and its
roofline, the training step against transformers + bitsandbytes + PEFT (and Unsloth, experts4bit-qlora where they
import), and each step's peak reserved memory against `moe-qlora plan`.

    python scripts/perf.py --json "$OUT/perf.json"          # GPU: within --budget-s (420 s) on an H100
    python scripts/perf.py --tiny --json perf.json          # CPU: the tests' smoke run, shapes shrunk

Order, most needed first: the layer at LoRA rank 8 (Qwen3-30B-A3B's and Mixtral-8x7B's shapes, 512 to 16k tokens),
the training step (eight Qwen3-30B-A3B layers at full width with its 151,936-token vocabulary, at 4k, 8k and 16k
tokens, each contender loaded once), the layer at rank 16, then the Triton kernels with the 24 GB cards' config list
(sm_80 / sm_89) beside this GPU's own at the two largest token counts, then auto's step replayed as CUDA graphs
beside auto. The budget holds for the whole run: the training part's checkpoint (generated on the GPU the first
time) and plans are built first (`prepare_s`), and the parts share what is left; each training contender hands over
every length as it is measured, so one stopped at its share's end keeps the lengths it finished. Whatever the budget
leaves out is listed as not measured. The JSON is rewritten after each part, so a stage stopped by its timeout keeps
what it measured:

    {"device": "NVIDIA H100 80GB HBM3", "commit": "<sha>", "layer": [{"shape": "qwen3-30b-a3b", "tokens": 4096,
     "rank": 8, "contender": "moe-qlora auto", "gpu_ms": 9.9, "x_roofline": 15.6, ...}, ...],
     "train": [{"preset": "qwen3-30b-a3b-8l", "layers": 8, "vocab": 151936, "seq": 4096, "contender": "moe-qlora",
     "tokens_per_s": 85762, "peak_reserved_mib": 3262, "plan_mib": 2747, ...}, ...], "not_measured": [...]}

Layer contenders: moe-qlora auto / grouped_mm / triton, transformers grouped_mm + PEFT, and auto replayed as CUDA
graphs, last (bench_moe.py, each checked against its fp32 reference; `graphed_over_auto` in the summary: what the
host's launches cost a step). Train contenders: moe-qlora, transformers+bnb+peft, unsloth, experts4bit-qlora
(bench_train.py, each in its own process). x_roofline divides by the H100's ideal (3.35 TB/s, 990 TFLOP/s bf16), as
bench_moe.py prints it; ideal_ms is that ideal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_moe  # noqa: E402
import bench_train  # noqa: E402
from bench_presets import PRESETS  # noqa: E402

LAYER_CONTENDERS = ["moe-qlora auto", "moe-qlora grouped_mm", "moe-qlora triton", "transformers grouped_mm + PEFT"]
# issue 67's item 4: auto's step captured and replayed as CUDA graphs, beside auto timed again: what the host's
# launches cost. The last part, so that a capture that fails cannot cost the other figures.
GRAPHED = "moe-qlora auto, CUDA graph"
GRAPH_CONTENDERS = ["moe-qlora auto", GRAPHED]
# issue 58's item 4: the Triton kernels with the 24 GB cards' config list (sm_80 / sm_89) on this GPU, beside the own
SMALL_GPU_CONTENDERS = ["moe-qlora triton, sm_80 configs", "moe-qlora triton"]
PEFT_LAYER = "transformers grouped_mm + PEFT"
TRAIN_CONTENDERS = ["moe-qlora", "transformers+bnb+peft", "experts4bit-qlora", "unsloth"]
PEFT_TRAIN = "transformers+bnb+peft"
# the train part's time, shared by weight: ours and what users run instead first, then the other two
TRAIN_WEIGHTS = {"moe-qlora": 3, PEFT_TRAIN: 3}


# What a full run measures (GPU) and what the tests' smoke run does (CPU, --tiny): layer shapes and token counts, the
# training preset and its sequence lengths, and how much smaller the layer shapes are built.
FULL = dict(
    shapes=["qwen3-30b-a3b", "mixtral-8x7b"],
    tokens=[512, 2048, 4096, 16384],
    ranks=[8, 16],
    shrink=1,
    preset="qwen3-30b-a3b-8l",
    seqs=[4096, 8192, 16384],
    steps=2,
    # a training contender given less than train_min_s is not started (loading the 8-layer preset alone takes
    # about that); ours and what users run instead are given train_floor_s at least, when that much is left
    # (below it the weighted share cuts off the 16k length first)
    train_min_s=30,
    train_floor_s=90,
)
TINY = dict(
    shapes=["qwen3-30b-a3b"],
    tokens=[32],
    ranks=[8],
    shrink=32,
    preset="tiny-qwen3",
    seqs=[64, 128],
    steps=1,
    train_min_s=5,
    train_floor_s=10,
)


def commit() -> str:
    """The commit measured: MOE_QLORA_COMMIT (a GPU machine gets a copy of the tree without .git), else git's."""
    if sha := os.environ.get("MOE_QLORA_COMMIT"):
        return sha
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def layer_record(row: dict) -> dict:
    """bench_moe's row in the JSON's terms: GPU milliseconds (None on a CPU), x_roofline of the best time
    measured, the path the contender took, and whether it matched its fp32 reference; or why not measured."""
    record = {k: row[k] for k in ("shape", "tokens", "rank", "contender")}
    if "skipped" in row:
        return record | {"not_measured": row["skipped"]}
    gpu = row["gpu_seconds"]
    return record | {
        "gpu_ms": round(gpu * 1e3, 3) if gpu is not None else None,
        "wall_ms": round(row["seconds"] * 1e3, 3),
        "gpu_ms_all": [round(t * 1e3, 3) for t in row["gpu_seconds_all"]],
        "x_roofline": round(row["x_over_ideal"], 2),
        "ideal_ms": round(row["h100_ideal_s"] * 1e3, 4),
        "path": row["path"],
        "max_relative_error": row["max_relative_error"],
        "correct": row["correct"],
        "self_check_fallbacks": row["self_check_fallbacks"],
        "step_peak_mib": round(row["step_peak_mib"], 1),
        "stored_mib": round(row["stored_mib"], 1),
    }


def train_record(result: dict, preset: str, plans: dict[int, int]) -> dict:
    """bench_train's result in the JSON's terms, with `moe-qlora plan`'s total for its sequence length."""
    p = PRESETS[preset]
    record = {"preset": preset, "layers": p["layers"], "vocab": p["vocab"], "seq": result.get("seq")}
    record["contender"] = result["contender"]
    if "error" in result:
        return record | {"not_measured": result["error"]}
    plan = plans.get(result["seq"])
    reserved = result.get("peak_reserved_mib")
    return record | {
        "tokens_per_s": result["tokens_per_s"],
        "step_s": result["step_s"],
        "peak_reserved_mib": reserved,
        "peak_allocated_mib": result.get("peak_allocated_mib"),
        "plan_mib": round(plan / 2**20, 1) if plan else None,
        "reserved_over_plan": round(reserved * 2**20 / plan, 3) if plan and reserved else None,
        "load_s": result["load_s"],
        "first_loss": result["first_loss"],
    }


def layer_summary(layer: list[dict]) -> list[dict]:
    """Per (shape, tokens, rank): auto and the best of our paths against PEFT, auto against our best, and the
    issue's targets (2x PEFT; within 3x of the roofline from 4k tokens; auto within 5% of our best)."""
    cases: dict[tuple, dict[str, dict]] = {}
    for r in layer:
        if r.get("gpu_ms") or r.get("wall_ms"):
            cases.setdefault((r["shape"], r["tokens"], r["rank"]), {})[r["contender"]] = r
    rows = []
    for (shape, tokens, rank), by_name in cases.items():

        def ms(r):
            return r["gpu_ms"] if r["gpu_ms"] is not None else r["wall_ms"]

        ours = {n: ms(r) for n, r in by_name.items() if n.startswith("moe-qlora") and n != GRAPHED}
        peft, auto = by_name.get(PEFT_LAYER), ours.get("moe-qlora auto")
        best = min(ours.values()) if ours else None
        row = {"shape": shape, "tokens": tokens, "rank": rank, "auto_ms": auto, "best_ours_ms": best}
        if peft is not None and auto is not None:
            row["auto_x_peft"] = round(ms(peft) / auto, 3)
            row["meets_2x_peft"] = ms(peft) / auto >= 2
        if auto is not None and GRAPHED in by_name:  # < 1: the graphs save the host's share of the step
            row["graphed_over_auto"] = round(ms(by_name[GRAPHED]) / auto, 3)
        if auto is not None and best:
            row["auto_over_best"] = round(auto / best, 3)
            row["meets_auto_within_5pct"] = auto <= 1.05 * best
            x_roofline = by_name["moe-qlora auto"]["x_roofline"]
            row["auto_x_roofline"] = x_roofline
            if tokens >= 4096:
                row["meets_3x_roofline"] = x_roofline <= 3
        rows.append(row)
    return rows


def train_summary(train: list[dict]) -> list[dict]:
    """Per sequence length: each contender's tokens/s and peak reserved over transformers + bnb + PEFT's, and
    moe-qlora's peak reserved over its plan (the targets: 2x the tokens/s at half the memory; within 10%)."""
    by_seq: dict[int, dict[str, dict]] = {}
    for r in train:
        if "tokens_per_s" in r:
            by_seq.setdefault(r["seq"], {})[r["contender"]] = r
    rows = []
    for seq, by_name in sorted(by_seq.items()):
        peft = by_name.get(PEFT_TRAIN)
        for name, r in by_name.items():
            row = {"seq": seq, "contender": name, "reserved_over_plan": r["reserved_over_plan"]}
            if peft is not None and name != PEFT_TRAIN:
                row["x_peft_tokens_per_s"] = round(r["tokens_per_s"] / peft["tokens_per_s"], 3)
                if r["peak_reserved_mib"] and peft["peak_reserved_mib"]:
                    row["x_peft_reserved"] = round(r["peak_reserved_mib"] / peft["peak_reserved_mib"], 3)
            rows.append(row)
    return rows


class PerfRun:
    """One run's figures, rewritten to `json_path` after every part.

    The budget holds for the whole run: prepare() first builds what the training part needs (its checkpoint,
    generated on the device the first time, and `plan`'s totals) and times it; the parts then share what is
    left by the fractions deadline() takes, so a cold start shortens every part a little, not the training
    part alone."""

    def __init__(self, args, plan: dict):
        self.args, self.plan = args, plan
        self.device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
        self.start = self.parts_start = time.monotonic()
        self.train_setup = None
        self.doc = {
            "device": device_name(self.device),
            "commit": commit(),
            "torch": torch.__version__,
            "triton": _version("triton"),
            "budget_s": args.budget_s,
            "layer": [],
            "train": [],
            "not_measured": [],
        }

    def prepare(self) -> None:
        """The training part's checkpoint and plans, before the parts' clock starts; the device memory it took
        handed back."""
        t0 = time.monotonic()
        preset, seqs = self.plan["preset"], self.plan["seqs"]
        args = SimpleNamespace(
            preset=preset,
            seqs=seqs,
            steps=self.plan["steps"],
            loss_chunk=1024,
            device=self.device,
            single_quant=False,
            roofline=False,
        )
        path = bench_train.ensure_checkpoint(preset, self.device)
        plans = {seq: bench_train.planned_bytes(path, args, seq) for seq in seqs}
        self.train_setup = (args, plans)
        release_device_memory(self.device)
        self.doc["prepare_s"] = round(time.monotonic() - t0, 1)
        self.parts_start = time.monotonic()
        self.save()

    def deadline(self, share: float) -> float:
        """When the parts' first `share` of the time left after prepare() ends."""
        left = max(0.0, self.args.budget_s - (self.parts_start - self.start))
        return self.parts_start + share * left

    def save(self) -> None:
        self.doc["elapsed_s"] = round(time.monotonic() - self.start, 1)
        self.doc["layer_summary"] = layer_summary(self.doc["layer"])
        self.doc["train_summary"] = train_summary(self.doc["train"])
        self.doc["not_measured"] = [
            {k: r[k] for k in r if k not in ("layers", "vocab")}
            for r in self.doc["layer"] + self.doc["train"]
            if "not_measured" in r
        ]
        if self.args.json:
            from moe_qlora.common.fileio import atomic_write_text

            atomic_write_text(self.args.json, json.dumps(self.doc, indent=1))

    def layers(self, rank: int, deadline: float, only=tuple(LAYER_CONTENDERS), tokens=None) -> None:
        """Every layer shape at `rank` for the contenders `only`, token counts past `deadline` not measured."""
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        for shape in self.plan["shapes"]:
            hidden, inter, experts, top_k = bench_moe.SHAPES[shape]
            shrink = self.plan["shrink"]
            dims = (hidden // shrink, inter // shrink, experts, top_k)
            rows, _ = bench_moe.bench_shape(
                shape,
                dims,
                tokens or self.plan["tokens"],
                device=self.device,
                dtype=dtype,
                rank=rank,
                repeats=self.args.repeats,
                only=list(only),
                deadline=deadline,
            )
            self.doc["layer"] += [layer_record(r) for r in rows]
            self.save()
        release_device_memory(self.device)

    def train(self, deadline: float) -> None:
        """Each training contender in a process of its own, loaded once for every sequence length, each length's
        figures kept as they come; one that cannot import or load, or runs out of its time, says why."""
        args, plans = self.train_setup
        preset = self.plan["preset"]
        release_device_memory(self.device)
        self.doc["parent_reserved_mib_during_train"] = reserved_mib(self.device)
        names = bench_train.contenders_for(self.device, TRAIN_CONTENDERS)
        for i, name in enumerate(names):
            weights = [TRAIN_WEIGHTS.get(n, 1) for n in names[i:]]
            share = train_share(deadline - time.monotonic(), weights, self.plan["train_floor_s"])
            if share < self.plan["train_min_s"]:
                results = [{"contender": name, "seq": seq, "error": "not measured: out of time"} for seq in args.seqs]
            else:
                results = bench_train.run_contender(name, args, timeout=share)
            self.doc["train"] += [train_record(r, preset, plans) for r in results]
            self.save()


def train_share(left_s: float, weights: list[float], floor_s: float) -> float:
    """The first of the contenders' time: its weighted share of `left_s`, raised to `floor_s` (or all that is
    left, if less) for a contender of weight above 1; what one leaves goes to the next."""
    share = left_s * weights[0] / sum(weights)
    if weights[0] > 1:
        share = max(share, min(floor_s, left_s))
    return share


def release_device_memory(device: str) -> None:
    """The parent's cached device memory handed back, so the training contenders' processes have the GPU to
    themselves (bar this process's CUDA context) and measure their own peaks."""
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def reserved_mib(device: str) -> float | None:
    return round(torch.cuda.memory_reserved() / 2**20, 1) if device == "cuda" else None


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return None


def print_tables(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    layer = Table(title=f"MoE layer, forward + backward: {doc['device']} at {doc['commit'][:10]}")
    for col in ("shape", "tokens", "rank", "auto ms", "best ours ms", "auto x PEFT", "auto / best", "x roofline"):
        layer.add_column(col, justify="right")
    for r in doc["layer_summary"]:
        cells = [r.get(k) for k in ("auto_ms", "best_ours_ms", "auto_x_peft", "auto_over_best", "auto_x_roofline")]
        layer.add_row(r["shape"], str(r["tokens"]), str(r["rank"]), *("-" if c is None else f"{c:g}" for c in cells))
    console.print(layer)
    train = Table(title="Training step")
    for col in ("seq", "contender", "tokens/s", "peak reserved MiB", "plan MiB", "reserved / plan", "or why not"):
        train.add_column(col, justify="right")
    for r in doc["train"]:
        cells = [r.get(k) for k in ("tokens_per_s", "peak_reserved_mib", "plan_mib", "reserved_over_plan")]
        train.add_row(
            str(r["seq"]), r["contender"], *("-" if c is None else f"{c:,}" for c in cells), r.get("not_measured", "")
        )
    console.print(train)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the figures here (rewritten after each part)")
    ap.add_argument("--budget-s", type=float, default=420, help="seconds for the whole run (the parts share it)")
    ap.add_argument("--repeats", type=int, default=3, help="timed layer steps after a warm-up (the best is kept)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: shrunk layer shapes, a tiny model")
    ap.add_argument("--only", choices=["layer", "train"], help="one part")
    args = ap.parse_args()
    run = PerfRun(args, TINY if args.tiny else FULL)
    if args.only != "layer":
        run.prepare()
    first, *later = run.plan["ranks"]
    if args.only != "train":
        run.layers(first, run.deadline(0.4))
    if args.only != "layer":
        run.train(run.deadline(0.85))
    if args.only != "train":
        for rank in later:
            run.layers(rank, run.deadline(0.9))
        run.layers(first, run.deadline(0.95), only=SMALL_GPU_CONTENDERS, tokens=run.plan["tokens"][-2:])
        run.layers(first, run.deadline(1.0), only=GRAPH_CONTENDERS)
    run.save()
    print_tables(run.doc)
    print(json.dumps({k: run.doc[k] for k in ("device", "commit", "layer_summary", "train_summary")}))
    wrong = [r for r in run.doc["layer"] if r.get("correct") is False]
    for r in wrong:
        print(f"FAIL  {r['contender']} at {r['shape']}, {r['tokens']} tokens, rank {r['rank']}: off its reference")
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
