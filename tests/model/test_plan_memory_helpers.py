"""train.mlp_chunk_tokens and train.offload_activations: what `plan` counts for them, what their auto resolves to,
and a run that trains with them."""

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
from moe_qlora.model.plan import AUTO_MLP_CHUNKS, auto_settings, plan_run

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
            "train": {"micro_batch_size": 1, "optimizer": "adamw_8bit", "offload_activations": False},
        }
    )
    return cfg, meta_model(str(QWEN3))


def with_chunk(cfg, chunk):
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"mlp_chunk_tokens": chunk})})


def plan_with(cfg, model, chunk, **args):
    cfg = with_chunk(cfg, chunk)
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
    assert any(
        f"auto: train.mlp_chunk_tokens {AUTO_MLP_CHUNKS[1]}, train.offload_activations false" in n for n in auto.notes
    )
    roomy = whole.total / 2**30 + 1
    assert plan_with(cfg, model, "auto", device="cuda", gpu_gib=roomy).mlp_chunk_tokens == 0
    assert plan_with(cfg, model, "auto", device="cpu", gpu_gib=between).mlp_chunk_tokens == 0


def test_offloaded_layer_inputs_are_planned_on_the_host():
    """Qwen3-30B-A3B, 48 checkpointed layers, 8192 tokens of bf16 hidden states each: all but two of them leave
    the GPU's activations; all 48 are the host memory the plan notes."""
    whole, offloaded = planned_bytes(), planned_bytes("train.offload_activations=true")
    layer_input = 8192 * 2048 * 2
    assert whole["activations_estimate"] - offloaded["activations_estimate"] == (48 - 2) * layer_input
    args = [
        "plan",
        "--model",
        str(QWEN3),
        "--json",
        "--set",
        "data.max_seq_len=8192",
        "--set",
        "train.micro_batch_size=1",
    ]
    notes = json.loads(CliRunner().invoke(app, [*args, "--set", "train.offload_activations=true"]).stdout)["notes"]
    assert any(f"({48 * layer_input / 2**30:,.2f} GiB of host memory" in n for n in notes)


@pytest.mark.parametrize("gpu_gib", [30, 40, 55, 90])  # nothing fits; offload + 16k; 2k chunks; fits as is
def test_auto_takes_the_first_setting_that_fits_in_its_order(long_qwen3, gpu_gib):
    """Both autos at 131,072 tokens: the oracle plans each (chunk, offload) pair of auto_settings' order as explicit
    settings and takes the first that fits without expert offload (none fitting: the first, neither)."""
    cfg, model = long_qwen3
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"offload_activations": "auto"})})
    auto = plan_with(cfg, model, "auto", device="cuda", gpu_gib=gpu_gib)
    settings = auto_settings(with_chunk(cfg, "auto"), "cuda")
    expected = settings[0]
    for chunk, offload in settings:
        explicit = plan_with(
            cfg.model_copy(update={"train": cfg.train.model_copy(update={"offload_activations": offload})}),
            model,
            chunk,
            device="cuda",
            gpu_gib=gpu_gib,
        )
        if explicit.fits and explicit.offload is None:
            expected = (chunk, offload)
            break
    assert (auto.mlp_chunk_tokens, auto.offload_activations) == expected


def test_offload_without_checkpointing_is_refused():
    with pytest.raises(ConfigError, match="offload_activations .* needs train.gradient_checkpointing"):
        validate_config(
            {
                "model": {"name_or_path": "x"},
                "data": {"train_files": ["a"]},
                "train": {"offload_activations": True, "gradient_checkpointing": False},
            }
        )


def test_a_negative_chunk_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="mlp_chunk_tokens"):
        validate_config(
            {"model": {"name_or_path": "x"}, "data": {"train_files": ["a"]}, "train": {"mlp_chunk_tokens": -1}}
        )


def run_sft(out, **train):
    from moe_qlora.train.sft import train as sft

    cfg = tiny_run_config(out, max_steps=3, micro_batch_size=4, lr=5e-3, **train)
    text = io.StringIO()
    return sft(cfg, Console(file=text, width=200)).losses, text.getvalue()


def test_runs_with_chunks_or_offload_say_so_and_train_as_one_without(tmp_path):
    """builtin:tiny-mixtral, 3 steps of 4 rows of up to 48 tokens. In chunks of 16: the same losses within fp32
    reordering (rel 1e-5: three optimizer steps compound the 4e-6 of one gradient). The layer inputs offloaded
    (on the CPU: host to host, the tiny inputs under the 1 MiB floor stay): bitwise the same."""
    whole, _ = run_sft(tmp_path / "whole", mlp_chunk_tokens=0, offload_activations=False)
    chunked, said = run_sft(tmp_path / "chunked", mlp_chunk_tokens=16, offload_activations=False)
    assert "MLP chunks: 2 MoE layers and 0 other MLPs work on 16 tokens at a time" in said
    assert len(chunked) == len(whole) == 3
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(chunked, whole, strict=True))
    offloaded, said = run_sft(tmp_path / "offloaded", mlp_chunk_tokens=0, offload_activations=True)
    assert "the 2 checkpointed layers' inputs wait for the backward in host memory" in said
    assert offloaded == whole


def test_an_offload_the_hosts_memory_cannot_take_is_refused_before_loading(monkeypatch):
    """On a GPU (its calls stood in for: this machine has none) whose host has 1 GiB free, Qwen3-30B-A3B's 48
    layer inputs of 131,072 bf16 tokens (24 GiB planned on the host) are refused, naming the key and both sizes."""
    from types import SimpleNamespace

    import torch

    from moe_qlora.model import budget, placement
    from moe_qlora.model.distributed import SINGLE

    monkeypatch.setattr(placement, "device_of", lambda ranks: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(budget, "this_gpu_capability", lambda: (9, 0))
    monkeypatch.setattr(placement, "available_host_bytes", lambda: 2**30)
    cfg = validate_config(
        {
            "model": {"name_or_path": str(QWEN3)},
            "data": {"train_files": ["unused.jsonl"], "max_seq_len": 131072},
            "train": {"micro_batch_size": 1, "offload_activations": True},
        }
    )
    with pytest.raises(ConfigError, match=r"offload_activations: .* need 24.00 GiB of host memory; .* 1.00 GiB"):
        placement.memory_helpers_chosen(cfg, SINGLE, str(QWEN3), Console(quiet=True), parallel="ddp")


def test_plan_longest_says_what_the_autos_take_at_its_length(long_qwen3):
    """At 262,144 tokens on 80 GiB both autos are taken (MoE chunks of 16,384, the largest candidate, and the
    offload), and the note names both, the offload with its host memory, 48 layers x 262,144 tokens x 2048 x 2
    bytes = 48 GiB; at 2,048 tokens neither is taken: no note."""
    from moe_qlora.cli.plan_plot import autos_taken

    cfg, model = long_qwen3
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"offload_activations": "auto"})})
    note = autos_taken(cfg, 262144, str(QWEN3), "cuda", model, 80, capability=(9, 0))
    assert note == (
        "at this length the MoE rows 16,384 tokens at a time (train.mlp_chunk_tokens) and the layer inputs in 48.00 GiB"
        " of host memory (train.offload_activations)"
    )
    assert autos_taken(cfg, 2048, str(QWEN3), "cuda", model, 80, capability=(9, 0)) is None
