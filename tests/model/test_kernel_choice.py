"""model.kernels: auto. Which backend runs is decided on the host from shapes and the GPU alone (no sync):
per layer call, the fused NF4 kernel below model.fused_below_rows rows per expert and grouped_mm at or above,
where torch._grouped_mm has its CUTLASS kernel (sm_90 / sm_100, bf16); on other GPUs and dtypes its fallback
loops over experts after a device-to-host copy of the offsets, so auto keeps the fused kernel there."""

import pytest
import torch

from moe_qlora.model.kernel_choice import describe_kernels, resolve_kernels
from moe_qlora.moe import experts
from moe_qlora.moe.experts import auto_kernels, set_moe_kernels
from moe_qlora.moe.kernels.grouped_mm import has_fused_path

BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize(
    "capability,dtype,runs",
    [
        ((9, 0), BF16, "auto"),  # H100 / H200: CUTLASS grouped GEMM
        ((10, 0), BF16, "auto"),  # B200
        ((9, 0), FP32, "triton"),  # fp32 takes the fallback loop even on Hopper
        ((8, 0), BF16, "triton"),  # A100
        ((8, 9), BF16, "triton"),  # RTX 4090, the 24 GB card
        ((12, 0), BF16, "triton"),  # consumer Blackwell
    ],
)
def test_auto_on_cuda_uses_grouped_mm_only_where_it_has_a_fused_kernel(capability, dtype, runs):
    assert has_fused_path(capability, dtype) == (runs == "auto")
    assert resolve_kernels("auto", "cuda", dtype, capability) == runs
    assert resolve_kernels("grouped_mm", "cuda", dtype, capability) == "grouped_mm"  # asked for: kept


def test_auto_on_the_cpu_is_the_torch_reference():
    assert resolve_kernels("auto", "cpu", FP32) == "torch"


def test_the_run_says_what_runs_and_why():
    assert describe_kernels("auto", 64, "auto").startswith("auto per layer call: triton below 64 rows per expert")
    assert "no fused kernel for this GPU and dtype" in describe_kernels("triton", 64, "auto")
    assert describe_kernels("triton", 64, "triton") == "triton"


def test_each_call_picks_by_mean_rows_per_expert():
    assert auto_kernels(64 * 8 - 1, 8, 64) == "triton"
    assert auto_kernels(64 * 8, 8, 64) == "grouped_mm"
    assert auto_kernels(10**6, 8, 0) == "grouped_mm"  # fused_below_rows 0: never the fused kernel


def test_an_auto_layer_dispatches_each_call_to_its_choice(tiny_mixtral_dir, monkeypatch):
    """Few tokens (decode) go to triton, many to grouped_mm, through the same experts module."""
    from moe_qlora.model.loading import LoadOptions, load_model

    model = load_model(LoadOptions(str(tiny_mixtral_dir)))
    set_moe_kernels(model, "auto", fused_below_rows=4)
    seen = []

    def record(x, weights, lora, plan, kernels, budget):
        seen.append(kernels)
        return torch.zeros_like(x)

    monkeypatch.setattr(experts, "moe_lora_experts_grouped", record)
    model(torch.randint(3, 200, (1, 3)))  # 3 tokens x top-2 = 6 rows over 8 experts: < 4 per expert
    model(torch.randint(3, 200, (1, 40)))  # 80 rows: 10 per expert
    assert seen == ["triton"] * 2 + ["grouped_mm"] * 2  # 2 MoE layers per call
