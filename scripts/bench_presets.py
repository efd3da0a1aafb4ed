"""The model shapes the training benchmarks run (bench_train.py, step_roofline.py): each preset's architecture and
sizes, and the transformers config it builds. Kept apart so that the two scripts import it, not each other."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

PRESETS = {
    # Issue 2: Mixtral architecture, 4 layers, 32 experts, top-4, hidden 1024, expert intermediate 512.
    "mixtral": dict(arch="mixtral", hidden=1024, layers=4, experts=32, top_k=4, inter=512, vocab=4096),
    # The brief's CPU bar: a Qwen3-MoE-like model of the same size.
    "qwen3": dict(arch="qwen3_moe", hidden=1024, layers=4, experts=32, top_k=4, inter=512, vocab=4096),
    # GPU: two layers of Qwen3-30B-A3B at full width (128 experts, top-8, expert intermediate 768, 32 heads of 128)
    "qwen3-30b-a3b": dict(
        arch="qwen3_moe",
        hidden=2048,
        layers=2,
        experts=128,
        top_k=8,
        inter=768,
        vocab=32000,
        heads=32,
        kv_heads=4,
        head_dim=128,
    ),
}
# GPU rollouts (issue 59): four layers of Qwen3-30B-A3B at full width, with its vocabulary (the head is a decode
# step's largest single matmul)
PRESETS["qwen3-30b-a3b-4l"] = {**PRESETS["qwen3-30b-a3b"], "layers": 4, "vocab": 151936}
# GPU training speed (issue 58): eight layers of Qwen3-30B-A3B at full width with its vocabulary, so the MoE layers'
# share of a step is the real model's (6 of its 48 layers' worth of experts per 1 head, against 2 per 1 above), and
# positions up to 16k tokens
PRESETS["qwen3-30b-a3b-8l"] = {**PRESETS["qwen3-30b-a3b-4l"], "layers": 8, "max_positions": 32768}


# The tests' smoke run of scripts/perf.py on the CPU: the qwen3 architecture at a few seconds a step.
PRESETS["tiny-qwen3"] = dict(arch="qwen3_moe", hidden=64, layers=2, experts=8, top_k=2, inter=32, vocab=512)


def build_config(p):
    common = dict(
        vocab_size=p["vocab"],
        hidden_size=p["hidden"],
        num_hidden_layers=p["layers"],
        num_attention_heads=p.get("heads", 16),
        num_key_value_heads=p.get("kv_heads", 4),
        max_position_embeddings=p.get("max_positions", 4096),
        num_experts_per_tok=p["top_k"],
    )
    if p["arch"] == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(num_local_experts=p["experts"], intermediate_size=p["inter"], **common)
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        num_experts=p["experts"],
        moe_intermediate_size=p["inter"],
        intermediate_size=4 * p["inter"],
        head_dim=p.get("head_dim", 64),
        norm_topk_prob=True,
        decoder_sparse_step=1,
        **common,
    )


def ensure_checkpoint(preset: str, device: str = "cpu") -> Path:
    """The benchmark model, generated once (bf16 safetensors, seed 0) into the moe-qlora cache; its random weights
    drawn on `device` (a GPU draws the 8-layer preset's 5.6B in seconds, a CPU core in minutes)."""
    from moe_qlora.model.model_path import cache_dir
    from moe_qlora.model.tiny import build_byte_tokenizer

    path = cache_dir() / f"bench-{preset}"
    if (path / "config.json").exists():
        return path
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(build_config(PRESETS[preset]), dtype=torch.bfloat16)
    # written beside and renamed into place: a run stopped mid-write (a GPU stage's timeout) leaves no checkpoint
    # that looks whole
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    build_byte_tokenizer().save_pretrained(partial)
    partial.rename(path)
    return path
