"""scripts/layer_traffic.py: one grouped MoE layer step at Qwen3-30B-A3B's real shape, counted on fake tensors (the
routing plan, the registered op's forward and backward on the grouped_mm path, bf16, nested NF4 scales, expert LoRA,
the default decode budget). Issue 58 asks for zero host reads and a few dozen launches per layer step: nothing is
read back, the launches do not grow with the tokens, and each row step (the gate, its backward, the combine) is one
operation where it used to be a chain of them. Controls: a decode budget that falls back to chunks of experts is
caught reading back; the torch chain of the gate's backward counts as many launches as it has operations."""

import sys
from pathlib import Path

import pytest
from torch._subclasses.fake_tensor import DataDependentOutputException

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import layer_traffic  # noqa: E402

# 77 measured at 4096 and 16384 tokens (from 153 and 173 before the row steps were fused): routing 13, decode 8
# (four stacks' codes and nested scales), 16 grouped GEMMs, 4 row steps, the rest small casts and gathers.
MOST_LAUNCHES = 80


@pytest.mark.parametrize("tokens", [4096, 16384])
def test_a_layer_step_at_a_real_shape_reads_nothing_back_in_a_few_dozen_launches(tokens):
    traffic = layer_traffic.layer_step_traffic("qwen3-30b-a3b", tokens)
    assert traffic.total_launches() <= MOST_LAUNCHES
    row_steps = {name: n for name, n in traffic.launches.items() if name.startswith("moe_qlora::")}
    assert row_steps == {"moe_qlora::silu_mul": 1, "moe_qlora::silu_mul_backward": 1, "moe_qlora::combine": 2}
    assert traffic.launches["aten::_grouped_mm"] == 16  # 4 frozen projections, 8 LoRA products, 4 weight gradients
    kinds = traffic.by_kind()
    assert kinds["decode"][0] == 8  # each stack's codes and nested scales, forward and backward


def test_the_counting_catches_a_host_read_and_counts_each_torch_operation(monkeypatch):
    from moe_qlora.moe.kernels import grouped_mm, rows

    # a 256 MiB budget with no window possible: chunks of experts, their row ranges read on the host
    monkeypatch.setattr(grouped_mm, "window_columns", lambda weight, itemsize, budget: None)
    with pytest.raises(DataDependentOutputException):
        layer_traffic.layer_step_traffic("qwen3-30b-a3b", 512, budget_mb=256)
    monkeypatch.undo()
    layer_traffic.layer_step_traffic("qwen3-30b-a3b", 512, budget_mb=256)  # in windows: nothing read back
    fused = layer_traffic.layer_step_traffic("qwen3-30b-a3b", 512)
    # the gate's backward as its torch chain (the reference called directly, not through the op): many launches
    monkeypatch.setattr(
        rows, "silu_mul_backward", lambda h, u, low, scale, w, t: rows.silu_mul_backward_reference(h, u, low, scale, w)
    )
    chained = layer_traffic.layer_step_traffic("qwen3-30b-a3b", 512)
    assert chained.total_launches() >= fused.total_launches() + 8


def test_a_checkpointed_step_decodes_each_stack_in_its_two_forwards_only():
    """Under activation checkpointing a layer runs forward, recomputed forward, backward: the recompute hands the
    stacks it decoded whole to the backward (4 decodes of codes, not 6). Control: stacks over the decode budget,
    decoded in windows, are not handed over and the backward decodes its own."""
    kept = layer_traffic.layer_step_traffic("qwen3-30b-a3b", 4096, checkpointed=True)
    assert kept.launches["bitsandbytes::dequantize_4bit"] == 4
    # 256 MiB: the forward decodes gate_up in 3 windows and down in 2, the backward down in 2 and gate_up in 4; each
    # of the three passes decodes its own
    windowed = layer_traffic.layer_step_traffic("qwen3-30b-a3b", 4096, checkpointed=True, budget_mb=256)
    once = layer_traffic.layer_step_traffic("qwen3-30b-a3b", 4096, budget_mb=256)
    decodes = "bitsandbytes::dequantize_4bit"
    assert (once.launches[decodes], windowed.launches[decodes]) == (5 + 6, 5 + 5 + 6)


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_the_triton_grid_order_reads_each_activation_tile_about_once(shape):
    """Issue 67, item 3: under the L2 model (layer_traffic.l2_reads), the Triton path's launches at 4096 and 16384
    tokens read each activation tile (a matmul's rows, an outer product's operands) from HBM at most twice, and all
    their operands in at most twice the bytes of each tile read once. Control: the order before (the row tiles
    fastest, group size 0) reads an activation tile once per N block: 32 times at Qwen3-30B-A3B, 224 at Mixtral."""
    for tokens in (4096, 16384):
        summary = layer_traffic.grid_summary(layer_traffic.triton_grid_reads(shape, tokens))
        assert summary["most_activation_reads"] <= 2
        assert summary["bytes_read"] <= 2 * summary["bytes_once"]
    before = layer_traffic.grid_summary(layer_traffic.triton_grid_reads(shape, 4096, group_m=0))
    assert before["most_activation_reads"] == {"qwen3-30b-a3b": 32, "mixtral-8x7b": 224}[shape]


def test_the_l2_model_reads_a_tile_again_only_once_it_is_evicted():
    """A tile is read once while it stays among the L2's most recent bytes, again after others pushed it out."""
    hot = [("x", 0, 10), ("w", 0, 10), ("x", 0, 10), ("w", 1, 10), ("x", 0, 10)]
    assert layer_traffic.l2_reads(hot, l2_bytes=20)["x"].most_reads == 1
    cold = [("x", 0, 10), ("w", 0, 10), ("w", 1, 10), ("x", 0, 10)]
    reads = layer_traffic.l2_reads(cold, l2_bytes=20)
    assert reads["x"].most_reads == 2 and reads["x"].bytes_read == 20 and reads["w"].bytes_once == 20
