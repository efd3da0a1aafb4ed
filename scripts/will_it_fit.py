"""The "Will it fit?" table of docs/memory.md: `moe-qlora plan` on CUDA for the shipped model configs, at several
sequence lengths, with the memory knobs that matter, against common GPU sizes.

    python scripts/will_it_fit.py                 # markdown table + JSON
    python scripts/will_it_fit.py --seqs 2048 4096 --json fit.json

Settings: batch 1, LoRA rank 16 on every expert and the attention projections (the automatic targets),
gradient checkpointing, bf16 compute, NF4 with double quantization, chunked loss, kernels: auto (all
defaults). The columns plan for a GPU below 80 GB (an Ada or Ampere card, where auto runs the Triton kernels: no
decoded stack), the last for an 80 GB H100 (auto runs grouped_mm at these lengths and holds its decoded stack
and rows: `moe-qlora plan --gpu-gb` chooses the same way). A GPU "fits" when the plan is at most its memory less
0.5 GiB of headroom (allocator fragmentation; the CUDA context is already a row of the plan).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = ["qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"]
# Columns: train settings, and model settings beside the defaults; the GPU each is planned for (below).
OPTIMIZERS = {
    "adamw": ({"optimizer": "adamw"}, {}),
    "adamw_8bit": ({"optimizer": "adamw_8bit"}, {}),
    "adamw_8bit, in backward": ({"optimizer": "adamw_8bit", "optimizer_in_backward": True}, {}),
    # every MoE layer's experts in pinned host memory, two layers on the GPU at a time (moe/offload.py)
    "adamw_8bit, in backward, expert_offload: all": (
        {"optimizer": "adamw_8bit", "optimizer_in_backward": True},
        {"expert_offload": "all"},
    ),
    "adamw_8bit, 80 GB H100": ({"optimizer": "adamw_8bit"}, {}),
}
H100_COLUMN = "adamw_8bit, 80 GB H100"
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
    from moe_qlora.model.budget import DEFAULT_GPU_CAPABILITY, SMALLER_GPU_CAPABILITY, meta_model
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
                gpu = DEFAULT_GPU_CAPABILITY if label == H100_COLUMN else SMALLER_GPU_CAPABILITY
                plan = plan_run(cfg, name_or_path=path, device="cuda", model=model, capability=gpu)
                row[label] = round(plan.total / 2**30, 2)
            rows.append(row)
    return rows


def smallest_gpu(row: dict) -> str:
    """The smallest GPU the row's best plan for its class fits: below 80 GB the smaller cards' columns, at 80 the
    H100's."""
    smaller = min(v for k, v in row.items() if k in OPTIMIZERS and k != H100_COLUMN)
    for name, size in GPUS_GIB.items():
        if (smaller if size < 80 else row[H100_COLUMN]) <= size - HEADROOM_GIB:
            return name
    return "> 80 GB"


def markdown(rows: list[dict]) -> str:
    head = ["model", "seq", *[f"{k} (GiB)" for k in OPTIMIZERS], "smallest GPU"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], str(r["seq"]), *[f"{r[k]:.1f}" for k in OPTIMIZERS], smallest_gpu(r)]
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
