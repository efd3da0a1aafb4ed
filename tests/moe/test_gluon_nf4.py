"""The Gluon NF4 kernels (moe/kernels/gluon_nf4.py, gluon_nf4_sm80.py) without a GPU: their decode's index math
against bitsandbytes' dequantization, and what their SASS shows at Qwen3-30B-A3B's and Mixtral-8x7B's weight shapes,
compiled as the JIT would for sm_80 and sm_90 (scripts/kernel_report.py --gluon, in a subprocess without
TRITON_INTERPRET). Their numerics on a GPU: tests/moe/test_gpu.py. Gluon has no interpreter, so nothing here runs a
kernel itself."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_kernels import nf4_stack

from moe_qlora.moe.kernels import gluon_decode, gluon_nf4
from moe_qlora.moe.nf4 import NF4_LEVELS, dequantize_expert_reference

ROOT = Path(__file__).resolve().parents[2]


def decode_as_the_kernel(stack, e, shift_of=gluon_decode.word_and_shift):
    """Expert e's (N, K) weights in bf16 decoded as the kernel's threads do: step by step of 128 columns, the code
    of column k read from the word and bit word_and_shift(k % 128) names, its level times the block's fp32
    scale rounded once to bf16."""
    _, n, k = stack.shape
    words = stack.packed.view(torch.int32).view(-1, n, k // 8)[e]  # (N, K / 8)
    levels = torch.tensor(NF4_LEVELS)
    scales = stack.expert_absmax(e).view(n, k // 64)
    out = torch.empty(n, k)
    for col in range(k):
        word, shift = shift_of(col % 128)
        code = (words[:, 16 * (col // 128) + word] >> shift) & 0xF
        out[:, col] = levels[code] * scales[:, col // 64]
    return out.to(torch.bfloat16)


def test_the_decode_reads_each_code_where_bitsandbytes_wrote_it():
    """Bit for bit bitsandbytes' dequantization rounded to bf16, for every column of two steps (fails if the
    nibbles of a byte are read low first, the control)."""
    stack = nf4_stack(3, 64, 256, double_quant=True)
    for e in range(3):
        expected = dequantize_expert_reference(stack, e).to(torch.bfloat16)
        assert torch.equal(decode_as_the_kernel(stack, e), expected)

    def low_first(k):
        word, shift = gluon_decode.word_and_shift(k)
        return word, shift ^ 4

    assert not torch.equal(decode_as_the_kernel(stack, 0, low_first), dequantize_expert_reference(stack, 0).bfloat16())


def test_the_launch_refuses_what_the_kernel_cannot_compute():
    stack = nf4_stack(2, 128, 192, double_quant=True)  # K = 192: not a whole number of 128-wide steps
    tiles = tuple(torch.zeros(1, dtype=torch.int32) for _ in range(3))
    x = torch.zeros(4, 192, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K % 128 == 0"):
        gluon_nf4.swapped_launch(x, stack, tiles, torch.zeros(4, 128, dtype=torch.bfloat16))
    plain = nf4_stack(2, 128, 256)
    with pytest.raises(ValueError, match="nested False"):
        gluon_nf4.swapped_launch(x.new_zeros(4, 256), plain, tiles, torch.zeros(4, 128, dtype=torch.bfloat16))


def report_rows(*flags):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOE_QLORA_TRITON_BLOCKS")}
    cmd = [sys.executable, "scripts/kernel_report.py", "--gluon", *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {(r["arch"], r["name"]): r for r in json.loads(proc.stdout.strip().splitlines()[-1])}


@pytest.fixture(scope="module")
def gluon_rows():
    """The forward launches with a LoRA term of rank 16 (down; gate_up with silu(gate) * up fused)."""
    return report_rows()


def test_the_sass_feeds_the_tensor_cores_from_registers_within_issue_67s_targets(gluon_rows):
    """Issue 67 item 2's targets for every launch (down, and gate_up with silu(gate) * up fused, of both models, with
    a rank-16 LoRA term, sm_80 and sm_90): A from registers (HMMA, or HGMMA with a register A), on sm_90 a wgmma
    left in flight across the decode of the next chunk, one barrier a K-step, no store of the decoded tile and no
    table read from shared memory, no spill, at most 240 registers, at most 5 non-MMA instructions per decoded
    weight (4.99 on sm_90, 4.8 on sm_80: a shift, a shfl, a multiply and half a pack, the rest addressing, scales
    and copies), and the LoRA term's MMAs covering K = 16 per block, not a padded K-step. Control: the sm_90
    kernel draining each wgmma is caught."""
    launches = {key: row for key, row in gluon_rows.items() if not key[1].endswith("_control")}
    assert {arch for arch, _ in launches} == {"80", "90"} and len(launches) == 8
    for (arch, name), row in launches.items():
        assert row["mma_a_from_registers"] is True, name
        assert row["wgmma_max_pending"] >= 1 if arch == "90" else row["wgmma_max_pending"] is None, name
        assert row["barriers_per_kstep"] <= 1, name
        assert row["decoded_tile_stores_per_kstep"] == 0 and row["table_loads_per_kstep"] == 0, name
        assert row["spills"] == 0 and row["regs"] <= 240, name
        assert row["instr_per_weight_element"] <= 5.0, name
        assert row["item2_misses"] == [], name
        assert row["rank"] == 16 and row["lora_k_per_block"] == 16, name
    drained = gluon_rows[("90", "qwen3-30b-a3b/gluon_down/drained_control")]
    assert drained["wgmma_max_pending"] == 0 and "wgmma drained every K-step" in drained["item2_misses"]


def test_the_lora_terms_mma_grows_with_the_rank_not_to_a_k_step():
    """lora_k_per_block reads the rank back from the sm_90 SASS: 16 at rank 8 (one MMA of K 16 a block, its zero
    half included), 64 at rank 40 (the next power of two: the kernel's ranges and layouts need one; rank 40 did not
    compile while it was rounded to 48)."""
    for rank, k in ((8, 16), (40, 64)):
        rows = report_rows("--arch", "90", "--shape", "qwen3-30b-a3b", "--rank", str(rank))
        assert {row["lora_k_per_block"] for key, row in rows.items() if not key[1].endswith("_control")} == {k}


def test_the_gluon_kernels_serve_only_what_they_compute():
    """serves: a forward over a nested-scale NF4 stack in bf16 on sm_80-90 with K and N whole steps, a dense LoRA of
    rank <= 64 and contiguous token indices; each way out of that is refused (the launch then stays with the Triton
    kernel)."""
    from moe_qlora.moe.kernels.ops import GroupedWeight, LowRank

    nested = nf4_stack(2, 128, 256, double_quant=True)
    weight = GroupedWeight.quantized(nested, transpose=True)
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    lora = LowRank(
        torch.zeros(4, 16, dtype=torch.bfloat16), GroupedWeight.dense(torch.zeros(2, 16, 128), transpose=False)
    )

    def serves(x=x, weight=weight, bias=None, lora=lora, glu=False, capability=(9, 0), gather=None):
        return gluon_nf4.serves(x, weight, gather=gather, bias=bias, lora=lora, glu=glu, capability=capability)

    assert serves() and serves(capability=(8, 0)) and serves(capability=(8, 9)) and serves(lora=None)
    assert serves(glu=True) and serves(gather=torch.arange(4))  # N / 2 = 64 gate rows; tokens by index
    wide_lora = LowRank(
        torch.zeros(4, 65, dtype=torch.bfloat16), GroupedWeight.dense(torch.zeros(2, 65, 128), transpose=False)
    )
    short_k = GroupedWeight.quantized(nf4_stack(2, 128, 192, double_quant=True), transpose=True)
    refused = {
        "Blackwell": serves(capability=(10, 0)),
        "Turing": serves(capability=(7, 5)),
        "fp32 rows": serves(x=x.float()),
        "no nested scales": serves(weight=GroupedWeight.quantized(nf4_stack(2, 128, 256), transpose=True)),
        "the transposed experts": serves(weight=GroupedWeight.quantized(nested, transpose=False)),
        "a bias": serves(bias=torch.zeros(2, 128)),
        "K not a whole step": serves(weight=short_k),
        "rank 65": serves(lora=wide_lora),
        "dense experts": serves(weight=GroupedWeight.dense(torch.zeros(2, 128, 256), transpose=True)),
        "a strided gather": serves(gather=torch.arange(8)[::2]),
    }  # fmt: skip
    assert not any(refused.values()), refused


def test_the_host_tiles_cover_each_experts_rows_in_tiles_of_64():
    expert, first, end = gluon_nf4.tiles_of_offsets([0, 130, 130, 194], 64, "cpu")
    assert (
        expert.tolist() == [0, 0, 0, 2] and first.tolist() == [0, 64, 128, 130] and end.tolist() == [64, 128, 130, 194]
    )


def test_moe_qlora_gluon_1_asks_for_the_gluon_kernels():
    from moe_qlora.moe.kernels.tiles import KernelSettings

    assert KernelSettings.from_environment({"MOE_QLORA_GLUON": "1"}).gluon
    assert (
        not KernelSettings.from_environment({}).gluon
        and not KernelSettings.from_environment({"MOE_QLORA_GLUON": "0"}).gluon
    )
