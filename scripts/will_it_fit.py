"""The "Will it fit?" table of docs/memory.md: `moe-qlora plan` on CUDA for the shipped model configs, at several
sequence lengths, with the memory knobs that matter, against common GPU sizes.

    python scripts/will_it_fit.py                 # markdown table + JSON
    python scripts/will_it_fit.py --seqs 2048 4096 --json fit.json

Settings: batch 1, LoRA rank 16 on every expert and the attention projections (the automatic targets),
gradient checkpointing, bf16 compute, NF4 with double quantization, chunked loss, kernels: auto (all
defaults; auto holds grouped_mm's decode buffer, at most model.dequant_buffer_mb, where it picks it). A GPU
"fits" when the plan is at most its memory less 0.5 GiB of headroom (allocator fragmentation; the CUDA
context is already a row of the plan).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = ["qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"]
# Columns: train settings, and model settings beside the defaults. kernels: triton decodes NF4 inside the
# matmul, so it has no grouped_mm decode buffer (model.dequant_buffer_mb) to hold.
OPTIMIZERS = {
    "adamw": ({"optimizer": "adamw"}, {}),
    "adamw_8bit": ({"optimizer": "adamw_8bit"}, {}),
    "adamw_8bit, kernels: triton": ({"optimizer": "adamw_8bit"}, {"kernels": "triton"}),
    "adamw_8bit, in backward": ({"optimizer": "adamw_8bit", "optimizer_in_backward": True}, {}),
    # every MoE layer's experts in pinned host memory, two layers on the GPU at a time (moe/offload.py)
    "adamw_8bit, in backward, expert_offload: all": (
        {"optimizer": "adamw_8bit", "optimizer_in_backward": True},
        {"expert_offload": "all"},
    ),
}
# NVIDIA's "GB" on a card is GiB (an RTX 3060 12GB has 12,288 MiB)
GPUS_GIB = {
    "6 GB": 6,
    "8 GB": 8,
    "10 GB": 10,
    "12 GB": 12,
    "16 GB": 16,
    "24 GB": 24,
    "40 GB": 40,
    "48 GB": 48,
    "80 GB": 80,
}
HEADROOM_GIB = 0.5


def plans(seqs: list[int]) -> list[dict]:
    from moe_qlora.config.load import validate_config
    from moe_qlora.model.budget import meta_model
    from moe_qlora.model.plan import plan_run

    rows = []
    for name in MODELS:
        path = str(ROOT / "configs" / "models" / name)
        model = meta_model(path)
        for seq in seqs:
            row = {"model": name, "seq": seq}
            for label, (train, model_keys) in OPTIMIZERS.items():
                cfg = validate_config(
                    {
                        "model": {"name_or_path": path, **model_keys},
                        "lora": {"rank": 16, "alpha": 32},  # the automatic targets: attention projections
                        "data": {"train_files": ["(not read by plan)"], "max_seq_len": seq},
                        "train": {"micro_batch_size": 1, **train},
                    }
                )
                row[label] = round(plan_run(cfg, name_or_path=path, device="cuda", model=model).total / 2**30, 2)
            rows.append(row)
    return rows


def smallest_gpu(gib: float) -> str:
    return next((name for name, size in GPUS_GIB.items() if gib <= size - HEADROOM_GIB), "> 80 GB")


def markdown(rows: list[dict]) -> str:
    head = ["model", "seq", *[f"{k} (GiB)" for k in OPTIMIZERS], "smallest GPU"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        best = min(r[k] for k in OPTIMIZERS)
        cells = [r["model"], str(r["seq"]), *[f"{r[k]:.1f}" for k in OPTIMIZERS], smallest_gpu(best)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = plans(args.seqs)
    print(markdown(rows))
    payload = {"device": "cuda", "rank": 16, "micro_batch_size": 1, "results": rows}
    print(json.dumps(payload))
    if args.json:
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
