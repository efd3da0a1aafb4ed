"""model.kernels: auto. Which backend runs is decided on the host from shapes and the GPU alone (no sync):
per layer call, the fused NF4 kernel below model.fused_below_rows rows per expert and grouped_mm at or above,
where torch._grouped_mm has its CUTLASS kernel (sm_90 / sm_100, bf16); on other GPUs and dtypes its fallback
loops over experts after a device-to-host copy of the offsets, so auto keeps the fused kernel there."""

import pytest
import torch

from moe_qlora.config.load import validate_config
from moe_qlora.model import kernel_choice
from moe_qlora.model.budget import dequant_buffer_bytes, meta_model, planned_kernels
from moe_qlora.model.kernel_choice import describe_kernels, resolve_kernels
from moe_qlora.moe import experts
from moe_qlora.moe.experts import set_moe_kernels
from moe_qlora.moe.kernel_rule import auto_kernels
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


def test_triton_asked_on_the_cpu_says_what_runs_here_not_what_to_install(override_kernel_settings, monkeypatch):
    """Installing triton does not make it run on a CPU: the advice is model.kernels: auto, whether or not triton is
    installed; on CUDA without triton, the [gpu] extra."""
    from moe_qlora.config.sections import ConfigError

    override_kernel_settings(interpreted=False)  # as a user's run, not the tests' interpreter
    for installed in (True, False):
        monkeypatch.setattr(kernel_choice, "triton_installed", lambda installed=installed: installed)
        with pytest.raises(
            ConfigError, match=r"runs on an NVIDIA GPU, and this run is on the cpu: set model.kernels: auto"
        ):
            resolve_kernels("triton", "cpu", FP32)
    with pytest.raises(ConfigError, match=r"triton is not installed: pip install -e '\.\[gpu\]' \(it needs CUDA\)"):
        resolve_kernels("triton", "cuda", BF16, (9, 0))


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


# (device, compute dtype, GPU, tokens of one micro-batch) on the tiny Mixtral (8 experts, top-2) with
# fused_below_rows 4: auto turns from triton to grouped_mm at 16 tokens (32 rows, 4 per expert).
AGREEMENT_CASES = [
    ("cuda", "bfloat16", (9, 0), 40),  # H100, many rows: grouped_mm
    ("cuda", "bfloat16", (9, 0), 8),  # H100, few rows (2 per expert): triton
    ("cuda", "bfloat16", (9, 0), 16),  # H100, exactly fused_below_rows per expert: grouped_mm
    ("cuda", "bfloat16", (10, 0), 40),  # B200: grouped_mm
    ("cuda", "bfloat16", (8, 0), 40),  # A100: no fused grouped_mm, triton at any size
    ("cuda", "bfloat16", (8, 9), 40),  # RTX 4090: the same
    ("cuda", "float32", (9, 0), 40),  # fp32 on Hopper: triton
    ("cpu", "float32", (9, 0), 40),  # the CPU: the torch reference, whatever GPU was named
]


@pytest.fixture(scope="module")
def tiny_model(tiny_mixtral_dir):
    from moe_qlora.model.loading import LoadOptions, load_model

    return load_model(LoadOptions(str(tiny_mixtral_dir)))


def layer_path(model, case, monkeypatch) -> str:
    """The path the layer runs for `case`: model.kernels: auto resolved as the build resolves it, then one
    forward of the case's tokens through the experts modules (the path recorded, not run)."""
    device, dtype, capability, tokens = case
    set_moe_kernels(model, resolve_kernels("auto", device, getattr(torch, dtype), capability), fused_below_rows=4)
    seen = set()

    def record(path, x, weights, lora, plan, budget):
        seen.add(path)
        return torch.zeros_like(x)

    monkeypatch.setattr(experts, "run_moe_path", record)
    model(torch.randint(3, 200, (1, tokens)))
    (path,) = seen  # both MoE layers took one path
    return path


def case_config(path, case):
    """The run config of `case` for the tiny model at `path`: its compute dtype, one sequence of its tokens."""
    _, dtype, _, tokens = case
    return validate_config(
        {
            "model": {"name_or_path": str(path), "compute_dtype": dtype, "fused_below_rows": 4},
            "lora": {"rank": 4},
            "data": {"train_files": ["unused.jsonl"], "max_seq_len": tokens},
            "train": {"micro_batch_size": 1},
        }
    )


@pytest.mark.parametrize("case", AGREEMENT_CASES, ids=lambda c: f"{c[0]}-{c[1]}-sm{c[2][0]}{c[2][1]}-{c[3]}tok")
def test_the_plan_counts_the_path_the_layer_takes(case, tiny_model, tiny_mixtral_dir, monkeypatch):
    """The plan reads auto's rule (moe/kernel_rule.py) for the GPU it is told, as the layer does, and counts
    grouped_mm's decode buffer exactly where the layer runs grouped_mm."""
    monkeypatch.setattr(kernel_choice, "triton_installed", lambda: True)  # a GPU install, as the plan assumes
    device, _, capability, _ = case
    layer = layer_path(tiny_model, case, monkeypatch)
    cfg, meta = case_config(tiny_mixtral_dir, case), meta_model(str(tiny_mixtral_dir))
    assert planned_kernels(meta, cfg, device=device, capability=capability) == layer
    assert (dequant_buffer_bytes(meta, cfg, device=device, capability=capability) > 0) == (layer == "grouped_mm")


def test_the_plans_old_bf16_rule_would_disagree_with_the_layer(tiny_model, monkeypatch):
    """Control: the budget's rule before kernel_rule.py (bf16 on CUDA at or above fused_below_rows means
    grouped_mm, blind to the GPU) counts a decode buffer on the A100 and the RTX 4090, where the layer runs
    triton: the comparison above would see it."""
    monkeypatch.setattr(kernel_choice, "triton_installed", lambda: True)

    def bf16_means_grouped_mm(case):
        device, dtype, _, tokens = case
        return device == "cuda" and dtype == "bfloat16" and tokens * 2 >= 4 * 8

    wrong = [
        c
        for c in AGREEMENT_CASES
        if bf16_means_grouped_mm(c) != (layer_path(tiny_model, c, monkeypatch) == "grouped_mm")
    ]
    assert [c[2] for c in wrong] == [(8, 0), (8, 9)]
