"""train.mlp_chunk_tokens: what `plan` counts for it, what auto resolves to, and a run that trains with it."""

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from moe_qlora.cli.app import app
from moe_qlora.config.base import ConfigError
from moe_qlora.config.load import validate_config
from moe_qlora.model.budget import meta_model
from moe_qlora.model.plan import AUTO_MLP_CHUNKS, plan_run

from helpers.runs import tiny_run_config

ROOT = Path(__file__).resolve().parents[2]
QWEN3 = ROOT / "configs/models/qwen3-30b-a3b"


def planned_bytes(*settings: str) -> dict[str, int]:
    args = ["plan", "--model", str(QWEN3), "--json"]
    for s in ["data.max_seq_len=8192", "train.micro_batch_size=1", "lora.rank=16", *settings]:
        args += ["--set", s]
    return json.loads(CliRunner().invoke(app, args).stdout)["bytes"]


def test_a_chunk_plans_a_chunks_rows():
    """Qwen3-30B-A3B, 8192 tokens in chunks of 2048, bf16, grouped_mm: the backward's rows (3 H + 2I + I per row,
    budget.moe_backward_bytes) are a chunk's; the recomputed layer keeps a chunk's MoE rows (K (2I + 2r) per token)
    and each chunk's input (H per token) instead of the micro-batch's rows."""
    whole, chunked = planned_bytes(), planned_bytes("train.mlp_chunk_tokens=2048")
    per_row = 3 * 2048 + 2 * 768 + 768
    assert whole["moe_backward"] == 8192 * 8 * per_row * 2
    assert chunked["moe_backward"] == 2048 * 8 * per_row * 2
    moe_rows_saved = (8192 - 2048) * 8 * (2 * 768 + 2 * 16) * 2
    assert whole["activations_estimate"] - chunked["activations_estimate"] == moe_rows_saved - 8192 * 2048 * 2
    assert planned_bytes("train.mlp_chunk_tokens=8192") == whole  # a chunk as long as the micro-batch: no chunks


@pytest.fixture(scope="module")
def long_qwen3():
    cfg = validate_config(
        {
            "model": {"name_or_path": str(QWEN3)},
            "lora": {"rank": 16},
            "data": {"train_files": ["unused.jsonl"], "max_seq_len": 131072},
            "train": {"micro_batch_size": 1, "optimizer": "adamw_8bit"},
        }
    )
    return cfg, meta_model(str(QWEN3))


def plan_with(cfg, model, chunk, **args):
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"mlp_chunk_tokens": chunk})})
    return plan_run(cfg, name_or_path=str(QWEN3), model=model, capability=(9, 0), **args)  # one GPU kind for all


def test_auto_takes_the_largest_chunk_that_fits(long_qwen3):
    """The oracle: each candidate planned as an explicit setting; auto must take the first (largest) that fits a
    GPU sized between the plans of the two largest, none where the run fits whole, none on the CPU."""
    cfg, model = long_qwen3
    whole = plan_with(cfg, model, 0, device="cuda", gpu_gib=80)
    first, second = (plan_with(cfg, model, c, device="cuda", gpu_gib=80).total / 2**30 for c in AUTO_MLP_CHUNKS[:2])
    assert second < first < whole.total / 2**30
    between = (first + second) / 2
    auto = plan_with(cfg, model, "auto", device="cuda", gpu_gib=between)
    assert auto.mlp_chunk_tokens == AUTO_MLP_CHUNKS[1] and auto.fits and auto.offload is None
    assert any(f"auto -> {AUTO_MLP_CHUNKS[1]}" in note for note in auto.notes)
    roomy = whole.total / 2**30 + 1
    assert plan_with(cfg, model, "auto", device="cuda", gpu_gib=roomy).mlp_chunk_tokens == 0
    assert plan_with(cfg, model, "auto", device="cpu", gpu_gib=between).mlp_chunk_tokens == 0


def test_a_negative_chunk_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="mlp_chunk_tokens"):
        validate_config(
            {"model": {"name_or_path": "x"}, "data": {"train_files": ["a"]}, "train": {"mlp_chunk_tokens": -1}}
        )


def test_a_run_with_chunks_says_so_and_trains_as_one_without(tmp_path):
    """builtin:tiny-mixtral, 3 steps of 4 rows of up to 48 tokens in chunks of 16: the same losses as unchunked
    within fp32 reordering (rel 1e-5: three optimizer steps compound the 4e-6 of one gradient)."""
    from moe_qlora.train.sft import train

    def run(name, chunk):
        cfg = tiny_run_config(tmp_path / name, max_steps=3, micro_batch_size=4, lr=5e-3, mlp_chunk_tokens=chunk)
        text = io.StringIO()
        result = train(cfg, Console(file=text, width=200))
        return result.losses, text.getvalue()

    (whole, _), (chunked, said) = run("whole", 0), run("chunked", 16)
    assert "MLP chunks: 2 MoE layers and 0 other MLPs work on 16 tokens at a time" in said
    assert len(chunked) == len(whole) == 3
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(chunked, whole, strict=True))
