"""Tiny training runs as the tests configure them, and what a run wrote: one builder instead of one per module."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from moe_qlora.config.load import validate_config
from moe_qlora.config.sections import RunConfig

ROOT = Path(__file__).resolve().parents[2]
DEMO_SFT = ROOT / "data" / "demo_sft.jsonl"


def tiny_run_config(out: Path, *, lora: dict | None = None, data: dict | None = None, **train) -> RunConfig:
    """SFT of builtin:tiny-mixtral on the demo rows (max_seq_len 48), rank-4 LoRA, writing to `out`; each
    section's keys given here are merged over those defaults."""
    return validate_config(
        {
            "model": {"name_or_path": "builtin:tiny-mixtral"},
            "lora": {"rank": 4, **(lora or {})},
            "data": {"train_files": [str(DEMO_SFT)], "max_seq_len": 48, **(data or {})},
            "train": train,
            "output": {"dir": str(out)},
        }
    )


def checkpoint_tensors(out: Path, step: int) -> tuple[dict, dict]:
    """(trainable tensors, optimizer state) of `out`'s checkpoint of `step`."""
    folder = out / "checkpoints" / f"step-{step:08d}"
    return load_file(str(folder / "trainable.safetensors")), load_file(str(folder / "optimizer.safetensors"))


def offline_config(tmp_path: Path, epochs: int) -> RunConfig:
    """Offline GRPO of builtin:tiny-mixtral on the demo's scored completions, 4 prompts a step, into tmp_path."""
    return validate_config(
        {
            "model": {"name_or_path": "builtin:tiny-mixtral"},
            "lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]},
            "data": {"train_files": [str(ROOT / "data" / "demo_grpo.jsonl")], "max_seq_len": 32},
            "train": {"epochs": epochs, "micro_batch_size": 8, "lr": 5e-3, "seed": 0},
            "grpo": {"offline_file": str(ROOT / "data" / "demo_grpo_offline.jsonl"), "prompts_per_step": 4},
            "output": {"dir": str(tmp_path / "offline")},
        }
    )
