"""The planner proved by measurement: peak memory of real training steps beside `moe-qlora plan`'s figure.

    python scripts/bench_memory.py                      # Qwen3-30B-A3B layers, 2 of them, seq 2048, r16
    python scripts/bench_memory.py --layers 4 --seqs 2048 4096 --json out.json
    python scripts/bench_memory.py --device cuda --gpu-gib 80 --seqs 32768 131072 --configs "long: MLP chunks of 8192"

The model has Qwen3-30B-A3B's real layer sizes (hidden 2048, 128 experts of 768, top-8, vocab 151,936, untied
head) but only `--layers` decoder layers, random bf16 weights generated once into the moe-qlora cache. Each
configuration trains two steps through `moe_qlora.train.sft.train` (batch 1, LoRA r16 on the experts and
q/k/v/o, gradient checkpointing) in its own subprocess on the CPU. The peak resident memory (VmHWM) is reset
once the model is loaded, so what is measured is the training peak with the weights resident, which is what
the planner models; the planner's figure is `plan_run` for the same config on the CPU (fp32 compute). With
`--device cuda` the measure is torch's peak reserved memory from the first step on (bf16), and the plan is made
for a GPU of `--gpu-gib` (the process held to it with set_per_process_memory_fraction): the long-context check
of the `long` stage of scripts/gpu_check.sh.
Prints a table and JSON: {"results": [{"seq", "measured_peak_mib", "planned_mib", ...}, ...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (label, train overrides): the defaults, then what each memory knob changes.
CONFIGURATIONS = {
    "adamw, full logits": {"optimizer": "adamw", "loss_chunk_tokens": 0},
    "adamw, chunked loss": {"optimizer": "adamw"},
    "adamw_8bit, chunked loss": {"optimizer": "adamw_8bit"},
    "adamw_8bit in backward, chunked loss": {"optimizer": "adamw_8bit", "optimizer_in_backward": True},
    "adamw_8bit, chunked loss, MLP chunks of 1024": {"optimizer": "adamw_8bit", "mlp_chunk_tokens": 1024},
    # long context, as configs/recipes/qwen3-30b-a3b-long.yaml trains (the layer inputs kept, then on the host)
    "long: MLP chunks of 8192": {"optimizer": "adamw_8bit", "mlp_chunk_tokens": 8192, "offload_activations": False},
    "long: MLP chunks of 8192, inputs on the host": {
        "optimizer": "adamw_8bit",
        "mlp_chunk_tokens": 8192,
        "offload_activations": True,
    },
}


def ensure_model(layers: int) -> Path:
    """Qwen3-30B-A3B's config cut to `layers` layers, random bf16 weights (seed 0), saved once."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moe_qlora.model.model_path import cache_dir
    from moe_qlora.model.tiny import build_byte_tokenizer

    path = cache_dir() / f"bench-memory-qwen3-30b-a3b-{layers}l"
    if (path / "config.json").exists():
        return path
    config = AutoConfig.from_pretrained(ROOT / "configs" / "models" / "qwen3-30b-a3b")
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=path.name + "."))
    model.save_pretrained(tmp)
    build_byte_tokenizer().save_pretrained(tmp)
    os.replace(tmp, path)
    return path


# What every configuration runs with: model.kernels (--kernels: auto is the per-expert torch reference on the CPU,
# whose backward works an expert at a time; grouped_mm the grouped formulation a GPU runs, with its row tensors);
# the device (--device: cuda measures torch's peak reserved memory, not the process's RSS); on CUDA the memory the
# process may use (--gpu-gib: an 80 GB card emulated on an H200 with set_per_process_memory_fraction), which the
# plan is made for too.
RUN = {"kernels": "auto", "device": "cpu", "gpu_gib": 0.0}


def run_config(model: Path, seq: int, train: dict, out: Path) -> dict:
    """The RunConfig dict of one measured configuration."""
    data = out / "data.jsonl"
    data.write_text(json.dumps({"text": "".join(chr(97 + i % 26) for i in range(seq + 64))}) + "\n")
    return {
        "model": {
            "name_or_path": str(model),
            "compute_dtype": "auto",
            "kernels": RUN["kernels"],
            "device": RUN["device"],
        },
        "lora": {"rank": 16, "alpha": 32, "experts": True, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "data": {"train_files": [str(data)], "format": "text", "max_seq_len": seq},
        "train": {
            "micro_batch_size": 1,
            "epochs": 2,
            "max_steps": 2,
            "lr": 1e-4,
            "warmup_steps": 0,
            "gradient_checkpointing": True,
            **train,
        },
        "output": {"dir": str(out / "run")},
    }


def commit() -> str:
    """The commit measured (a figure names its device and commit); 'unknown' outside a git checkout."""
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return os.environ.get("MOE_QLORA_COMMIT") or (proc.stdout.strip() if proc.returncode == 0 else "unknown")


def reset_peak_rss() -> None:
    """VmHWM back to the current RSS (Linux: write 5 to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def worker(model: str, seq: int, label: str) -> dict:
    """Runs in the subprocess: two training steps, the peak measured from the first one on. On CUDA with the
    allocator `moe-qlora train` sets (expandable segments; torch's default fragments at long context)."""
    from moe_qlora.common.cuda_allocator import choose_cuda_allocator
    from moe_qlora.config.load import validate_config

    if RUN["device"] == "cuda":
        choose_cuda_allocator()  # before CUDA allocates

    with tempfile.TemporaryDirectory(prefix="bench-memory-") as out:
        return measure_two_steps(validate_config(run_config(Path(model), seq, CONFIGURATIONS[label], Path(out))))


def measure_two_steps(cfg) -> dict:
    """Trains `cfg` for its steps; the peak memory from the first step on, the RSS after loading, and the
    last step's time. The run's folder is the caller's to remove (a checkpoint is ~250 MiB)."""
    from rich.console import Console

    from moe_qlora.common.memory import peak_rss_mib, release_freed_memory
    from moe_qlora.train import sft as trainer

    real_step, peaks, loaded = trainer.train_step, [], {}
    cuda = RUN["device"] == "cuda"
    if cuda and RUN["gpu_gib"]:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, RUN["gpu_gib"] * 2**30 / total))

    def peak_mib() -> float:
        return torch.cuda.max_memory_reserved() / 2**20 if cuda else peak_rss_mib()

    def measured_step(*args, **kwargs):
        if not peaks:
            release_freed_memory()
            if cuda:
                torch.cuda.synchronize()
                loaded["rss"] = torch.cuda.memory_reserved() / 2**20
            else:
                reset_peak_rss()
                loaded["rss"] = peak_rss_mib()
        t0 = time.perf_counter()
        record = real_step(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        peaks.append((peak_mib(), time.perf_counter() - t0))
        return record

    trainer.train_step = measured_step
    trainer.train(cfg, Console(quiet=True))
    figures = {
        "measured_peak_mib": round(max(p for p, _ in peaks), 1),
        "rss_after_load_mib": round(loaded["rss"], 1),
        "step_s": round(peaks[-1][1], 1),
    }
    if cuda:  # what the tensors held at their peak, beside what the allocator reserved for them
        figures |= {
            "allocated_peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1),
            "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or "default",
        }
    return figures


def planned(model: Path, seq: int, label: str) -> tuple[int, dict]:
    from moe_qlora.config.load import validate_config
    from moe_qlora.model.plan import plan_run

    with tempfile.TemporaryDirectory() as tmp:
        cfg = validate_config(run_config(model, seq, CONFIGURATIONS[label], Path(tmp)))
        gpu = {"gpu_gib": RUN["gpu_gib"]} if RUN["device"] == "cuda" and RUN["gpu_gib"] else {}
        plan = plan_run(cfg, name_or_path=str(model), device=RUN["device"], **gpu)
    rows = {k: round(v / 2**20, 1) for k, v in plan.bytes.items()}
    if plan.phases_apart:  # the rows then sum to the total (plan's own table shows it so)
        rows["not_at_once"] = -round(plan.phases_apart / 2**20, 1)
    return plan.total, rows


def measure(model: Path, seq: int, label: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", str(model), "--seqs", str(seq), "--label", label]
    cmd += ["--kernels", RUN["kernels"], "--device", RUN["device"], "--gpu-gib", str(RUN["gpu_gib"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        raise SystemExit(f"{label} at seq {seq} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument(
        "--model",
        help="measure this model instead (a folder or builtin:tiny-<family>, e.g. builtin:tiny-gpt-oss: a family "
        "whose attention is eager on the CPU, against builtin:tiny-qwen3-moe, which runs SDPA)",
    )
    ap.add_argument("--seqs", type=int, nargs="+", default=[2048])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGURATIONS), choices=list(CONFIGURATIONS))
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: peak reserved GPU memory")
    ap.add_argument("--gpu-gib", type=float, default=0.0, help="cuda: the memory the run may use (0: the GPU's)")
    ap.add_argument(
        "--kernels",
        default="auto",
        help="model.kernels of every configuration (e.g. grouped_mm: the grouped formulation, on the CPU too)",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--label", help=argparse.SUPPRESS)
    args = ap.parse_args()
    RUN.update(kernels=args.kernels, device=args.device, gpu_gib=args.gpu_gib)
    if args.worker:
        print(json.dumps(worker(args.worker, args.seqs[0], args.label)))
        return
    if args.model:
        from moe_qlora.model.model_path import resolve_model_path

        model = Path(resolve_model_path(args.model))
    else:
        model = ensure_model(args.layers)
    name = args.model or f"Qwen3-30B-A3B layers x{args.layers}"
    results = []
    for seq in args.seqs:
        for label in args.configs:
            total, rows = planned(model, seq, label)
            row = {
                "config": label,
                "layers": args.layers,
                "seq": seq,
                **measure(model, seq, label),
                "planned_mib": round(total / 2**20, 1),
                "plan_rows_mib": rows,
            }
            row["ratio"] = round(row["measured_peak_mib"] / row["planned_mib"], 3)
            results.append(row)
            if args.json:  # rewritten after each row: a run stopped by a timeout keeps what it measured
                from moe_qlora.common.fileio import atomic_write_text

                atomic_write_text(args.json, json.dumps(payload(args, name, results), indent=2) + "\n")
            print(
                f"{label:<38} seq {seq:>5}: measured {row['measured_peak_mib']:>9,.0f} MiB, planned "
                f"{row['planned_mib']:>9,.0f} MiB, ratio {row['ratio']:.3f}, step {row['step_s']} s",
                flush=True,
            )
    from rich.console import Console
    from rich.table import Table

    where = (
        f"CUDA bf16, peak reserved{f' within {args.gpu_gib:g} GiB' if args.gpu_gib else ''}"
        if args.device == "cuda"
        else "CPU fp32, peak RSS"
    )
    table = Table(title=f"Peak memory of a training step: {name}, r16, batch 1, {where}")
    for col in ("configuration", "seq", "measured MiB", "planned MiB", "measured / planned"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for r in results:
        table.add_row(
            r["config"],
            str(r["seq"]),
            f"{r['measured_peak_mib']:,.0f}",
            f"{r['planned_mib']:,.0f}",
            f"{r['ratio']:.3f}",
        )
    Console().print(table)
    print(json.dumps(payload(args, name, results)))


def payload(args, name: str, results: list[dict]) -> dict:
    """The JSON the run prints and writes: what was measured, where, at which commit."""
    return {
        "model": name,
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "gpu_gib": args.gpu_gib,
        "commit": commit(),
        "kernels": args.kernels,
        "threads": torch.get_num_threads(),
        "results": results,
    }


if __name__ == "__main__":
    main()
