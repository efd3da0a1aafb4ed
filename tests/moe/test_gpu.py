"""On a CUDA GPU only (marker `gpu`; skipped with a reason on other machines, see conftest).

What the CPU cannot check: the compiled kernels at real layer shapes in bf16, on tensor cores, which
Triton's interpreter never runs, and a training run that picks the Triton kernels by itself
(model.kernels: auto) against the same run on the torch reference. On a GPU machine the interpreter
tests of test_kernels*.py also run, compiled, on the GPU (fixture `dev`).
"""

import json
from pathlib import Path

import pytest
import torch
import yaml
from test_kernels import lora_term, nf4_stack, offsets_of, rounding_bound
from typer.testing import CliRunner

from moe_qlora.cli.app import app
from moe_qlora.moe.kernels.ops import (
    GroupedWeight,
    grouped_matmul,
    grouped_matmul_reference,
    grouped_matmul_silu_mul,
    grouped_matmul_silu_mul_reference,
    grouped_outer_product,
    grouped_outer_product_reference,
)
from moe_qlora.moe.nf4 import dequantize_stack

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def routed_rows(tokens, experts, top_k, seed=0):
    """Random top-k routing as sorted rows: (offsets, token of each row), some experts far busier."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g) * torch.linspace(0.2, 1.0, experts)
    idx = scores.topk(top_k, dim=-1).indices.reshape(-1)
    order = idx.argsort(stable=True)
    counts = torch.bincount(idx, minlength=experts).tolist()
    return offsets_of(counts), (order // top_k).cuda()


def test_gate_up_with_silu_mul_epilogue_at_qwen3_30b_shape_bf16():
    # Qwen3-30B-A3B layer: 128 experts, hidden 2048, expert intermediate 768, top-8; 1024 tokens.
    offsets, token = routed_rows(1024, 128, 8)
    stack = nf4_stack(128, 2 * 768, 2048, device="cuda")
    weight = GroupedWeight.quantized(stack, transpose=True)
    x = (0.5 * torch.randn(1024, 2048, generator=torch.Generator().manual_seed(1))).cuda().bfloat16()
    lora = lora_term(offsets, 16, 2 * 768, scale=2.0, dtype=torch.bfloat16, device="cuda")
    h_ref, act_ref = grouped_matmul_silu_mul_reference(x, weight, offsets, gather=token, lora=lora)
    h, act = grouped_matmul_silu_mul(x, weight, offsets, gather=token, lora=lora)
    # bf16 bound as in test_kernels; fp32 accumulation over K = 2048 in another order stays inside it.
    bound = rounding_bound(x, stack, offsets, h_ref, transpose=True, rel=2**-7, gather=token, lora=lora)
    assert ((h.float() - h_ref.float()).abs() <= bound).all()
    gate, up = h_ref.float().chunk(2, dim=-1)
    dgate, dup = bound.chunk(2, dim=-1)
    # silu(g')u' - silu(g)u = (silu(g') - silu(g))(u + du) + silu(g) du with |silu'| <= 1.1: the cross term
    # 1.1 dgate dup counts where gate and up both cancel to near zero (missing here, it failed on an H100)
    act_bound = 1.1 * (up.abs() + dup) * dgate + gate.abs() * dup + 2**-6 * act_ref.float().abs() + 1e-5
    assert ((act.float() - act_ref.float()).abs() <= act_bound).all()


@pytest.mark.parametrize("tokens", [1, 24], ids=["one_token_decode", "grpo_sampling_batch"])
def test_swapped_tiles_for_few_rows_at_qwen3_30b_shape_bf16(tokens):
    """Few rows per expert (at most SWAP_AB_MAX_ROWS on average): the packed kernels' transposed 16-row tiles,
    compiled and autotuned on the GPU, forward gate_up (fused silu x up) and the down input gradient, against
    the references within the same bf16 bounds."""
    from moe_qlora.moe.kernels import tiles

    offsets, token = routed_rows(tokens, 128, 8, seed=5)
    assert offsets[-1] <= tiles.SWAP_AB_MAX_ROWS * 128
    up_stack = nf4_stack(128, 2 * 768, 2048, device="cuda", seed=6)
    up = GroupedWeight.quantized(up_stack, transpose=True)
    x = (0.5 * torch.randn(tokens, 2048, generator=torch.Generator().manual_seed(7))).cuda().bfloat16()
    lora = lora_term(offsets, 16, 2 * 768, scale=2.0, dtype=torch.bfloat16, device="cuda")
    h_ref, _ = grouped_matmul_silu_mul_reference(x, up, offsets, gather=token, lora=lora)
    h, _ = grouped_matmul_silu_mul(x, up, offsets, gather=token, lora=lora)
    bound = rounding_bound(x, up_stack, offsets, h_ref, transpose=True, rel=2**-7, gather=token, lora=lora)
    assert ((h.float() - h_ref.float()).abs() <= bound).all()
    down_stack = nf4_stack(128, 2048, 768, device="cuda", seed=8)
    down = GroupedWeight.quantized(down_stack, transpose=False)  # g (S, 2048) -> (S, 768)
    g = torch.randn(offsets[-1], 2048, generator=torch.Generator().manual_seed(9)).cuda().bfloat16()
    expected = grouped_matmul_reference(g, down, offsets)
    got = grouped_matmul(g, down, offsets)
    bound = rounding_bound(g, down_stack, offsets, expected, transpose=False, rel=2**-7)
    assert ((got.float() - expected.float()).abs() <= bound).all()


def test_input_gradient_through_transposed_down_at_mixtral_shape_bf16():
    # Mixtral-8x7B down projection (8, 4096, 14336) read transposed: g W2 + (c g B2) A2, 2048 rows.
    offsets, token = routed_rows(1024, 8, 2, seed=2)
    stack = nf4_stack(8, 4096, 14336, device="cuda", seed=3)
    weight = GroupedWeight.quantized(stack, transpose=False)  # W_e[k=out, n=in]: g (S, 4096) -> (S, 14336)
    g = torch.randn(1024, 4096, generator=torch.Generator().manual_seed(4)).cuda().bfloat16()
    lora = lora_term(offsets, 16, 14336, scale=1.0, dtype=torch.bfloat16, device="cuda")
    expected = grouped_matmul_reference(g, weight, offsets, gather=token, lora=lora)
    got = grouped_matmul(g, weight, offsets, gather=token, lora=lora)
    bound = rounding_bound(g, stack, offsets, expected, transpose=False, rel=2**-7, gather=token, lora=lora)
    assert ((got.float() - expected.float()).abs() <= bound).all()


def test_lora_gradient_outer_products_bf16():
    # dB1 = sum_s dh_s (x) p_s at Qwen3 shapes: 8192 rows into 128 experts, (1536, 16) per expert.
    offsets, token = routed_rows(1024, 128, 8, seed=5)
    gen = torch.Generator().manual_seed(6)
    a = torch.randn(1024, 2048, generator=gen).cuda().bfloat16()
    b = torch.randn(offsets[-1], 16, generator=gen).cuda().bfloat16()
    expected = grouped_outer_product_reference(a, b, offsets, gather=token)
    got = grouped_outer_product(a, b, offsets, gather=token)
    # bf16 x bf16 products are exact in fp32 on both sides; only the order of up to ~200 fp32 additions differs.
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)


def train_losses(tmp_path, kernels, steps=6):
    """Loss per step of the demo config on CUDA in fp32 with the given model.kernels (auto runs triton in fp32 on
    every GPU: torch._grouped_mm has no fused fp32 kernel)."""
    cfg = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    cfg["model"].update(device="cuda", kernels=kernels, compute_dtype="float32")
    cfg["data"]["train_files"] = [str((ROOT / "configs" / f).resolve()) for f in cfg["data"]["train_files"]]
    cfg["train"].update(max_steps=steps, warmup_steps=2)
    cfg["output"]["dir"] = str(tmp_path / kernels)
    path = tmp_path / f"{kernels}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["train", "--config", str(path)])
    assert result.exit_code == 0, result.output
    assert "MoE kernels: " + ("triton" if kernels == "auto" else "torch") in result.output
    metrics = [json.loads(line) for line in (tmp_path / kernels / "metrics.jsonl").read_text().splitlines()]
    return [m["loss"] for m in metrics if "loss" in m]


def test_training_on_triton_kernels_follows_the_torch_reference(tmp_path):
    triton_losses = train_losses(tmp_path, "auto")
    torch_losses = train_losses(tmp_path, "torch")
    assert len(triton_losses) == len(torch_losses) == 6
    # fp32 with IEEE products: the two paths differ by summation order only (~1e-6 relative per layer);
    # over 6 AdamW steps at lr 5e-3 that stays far below 1e-3 of the loss.
    torch.testing.assert_close(torch.tensor(triton_losses), torch.tensor(torch_losses), rtol=1e-3, atol=1e-4)
    assert triton_losses[-1] < triton_losses[0]


@pytest.mark.parametrize("kernels", ["grouped_mm", "triton"])
def test_a_layer_step_replays_as_cuda_graphs_bit_for_bit_for_any_routing(tiny_mixtral_dir, kernels):
    """Issue 67, item 4: the MoE layer's forward and backward captured as CUDA graphs after warming up (autotuning
    done), then replayed with another batch and another routing of the same token count: output, input gradient
    and every LoRA gradient equal eager's on the same inputs bit for bit (the same kernels in the same order; the
    tile maps and grids depend on shapes alone, tests/moe/test_host_syncs.py). The replay on a second routing is
    the control that a graph frozen on the first one's row counts would fail. In bf16, what training runs: torch's
    fp32 `_grouped_mm` is a fallback that copies the offsets to the host (seen on an H200, torch 2.11: capture
    refused), and `auto` never takes grouped_mm in fp32."""
    from moe_qlora.moe.experts import set_moe_kernels

    from helpers.oracle import quantized_with_lora

    model = quantized_with_lora(tiny_mixtral_dir, "cuda", expert_double_quant=True, compute_dtype=torch.bfloat16)
    set_moe_kernels(model, kernels)
    module = model.model.layers[0].mlp.experts
    factors = module.moe_lora.factors()

    def batch(seed, skewed):
        """64 tokens routed top-2 over 8 experts; skewed: every token to experts 0 and 1, six experts empty."""
        g = torch.Generator().manual_seed(seed)
        scores = torch.rand(64, 8, generator=g) + (torch.arange(8) < 2) * float(skewed)
        weights, idx = scores.softmax(-1).topk(2, dim=-1)
        x = torch.randn(64, 64, generator=g)
        return x.cuda().bfloat16().requires_grad_(True), idx.cuda(), weights.cuda().bfloat16()

    def eager(x, idx, weights):
        for p in factors:
            p.grad = None
        x = x.detach().clone().requires_grad_(True)
        out = module(x, idx, weights)
        out.backward(torch.ones_like(out))
        return [out.detach(), x.grad, *[p.grad.clone() for p in factors]]

    graphed = torch.cuda.make_graphed_callables(module, batch(1, False), num_warmup_iters=3)
    for seed, skewed in ((2, False), (3, True)):
        x, idx, weights = batch(seed, skewed)
        for p in factors:
            p.grad = None
        out = graphed(x, idx, weights)
        out.backward(torch.ones_like(out))
        replayed = [out.detach(), x.grad, *[p.grad.clone() for p in factors]]
        for got, want in zip(replayed, eager(x, idx, weights), strict=True):
            assert torch.equal(got, want)


def _gluon_case(experts, n, k, rank, seed=0, device="cuda"):
    """An NF4 stack (E, n, k) with nested scales on the GPU, uneven rows per expert (every ninth none, tiles of 64
    partial), bf16 rows, their tiles, and a LoRA term of `rank` (P bf16, L fp32) with its ops reference."""
    from moe_qlora.moe.kernels import gluon_nf4
    from moe_qlora.moe.kernels.ops import LowRank

    torch.manual_seed(seed)
    stack = nf4_stack(experts, n, k, double_quant=True, device=device, seed=seed)
    counts = torch.randint(0, 150, (experts,))
    counts[::9] = 0
    offsets = [0] + torch.cumsum(counts, 0).tolist()
    first = offsets[-1]
    tiles = gluon_nf4.tiles_of_offsets(offsets, 64, device)
    x = torch.randn(first, k, device=device).bfloat16()
    lora = None
    if rank:
        p = (0.1 * torch.randn(first, rank, device=device)).bfloat16()
        lora = LowRank(p, GroupedWeight.dense(0.1 * torch.randn(experts, rank, n, device=device), transpose=False), 2.0)
    return stack, tiles, x, lora, offsets


def _reference_and_bound(x, stack, offsets, lora):
    """The fp32 product with bitsandbytes' dequantization rounded to bf16 (what the kernels decode, bit for bit:
    tests/moe/test_gluon_nf4.py) and the LoRA term in fp32, and the bound of a kernel that rounds L to bf16 and its
    output once: 2^-8 |y| + K 2^-24 sum |x||w| (fp32 summation in any order) + 2^-8 c |P||L|."""
    from moe_qlora.moe.kernels.ops import LowRank

    decoded = dequantize_stack(stack, torch.bfloat16).view(stack.shape).float()
    weight = GroupedWeight.dense(decoded, transpose=True)
    lora32 = LowRank(lora.p.float(), lora.weight, lora.scale) if lora is not None else None
    ref = grouped_matmul_reference(x.float(), weight, offsets, lora=lora32)
    magnitude = grouped_matmul_reference(x.float().abs(), GroupedWeight.dense(decoded.abs(), transpose=True), offsets)
    bound = 2**-8 * ref.abs() + x.shape[1] * 2**-24 * magnitude
    if lora is not None:
        abs_lora = LowRank(lora.p.float().abs(), GroupedWeight.dense(lora.weight.data.abs(), transpose=False), 1.0)
        bound += 2**-8 * lora.scale * grouped_matmul_reference(x.float() * 0, weight, offsets, lora=abs_lora)
    return ref, bound


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("rank", [0, 8, 16])
def test_the_gluon_nf4_kernels_equal_the_dequantized_product(arch, rank):
    """moe/kernels/gluon_nf4.py (sm_90: wgmma) and gluon_nf4_sm80.py (mma_v2, which an sm_90 GPU runs too) against
    ops.grouped_matmul_reference in fp32 with bitsandbytes' own dequantization, at Qwen3-30B-A3B's down shape, 128
    experts of uneven rows, with a LoRA term of rank 8 and 16 (its MMA's K 16) and without. The decoded weights
    are bitsandbytes' bit for bit and the MMA sums exact bf16 products in fp32: the bound (_reference_and_bound)
    is the output's rounding, the summation order, and L rounded to bf16. Control: the rolled experts miss."""
    from moe_qlora.moe.kernels.gluon_nf4 import nf4_swapped_matmul

    major, minor = torch.cuda.get_device_capability()
    if 10 * major + minor < arch or major > 9:
        pytest.skip(f"the sm_{arch} kernel needs sm_{arch} to sm_90; this GPU is sm_{major}{minor}")
    stack, tiles, x, lora, offsets = _gluon_case(128, 2048, 768, rank)
    ref, bound = _reference_and_bound(x, stack, offsets, lora)
    out = nf4_swapped_matmul(x, stack, tiles, arch=arch, lora=lora).float()
    assert ((out - ref).abs() <= bound).all()
    rolled_offsets = [0, *offsets[2:], offsets[-1]]  # each expert's rows given to the expert before it
    rolled, _ = _reference_and_bound(x, stack, rolled_offsets, lora)
    assert not ((out - rolled).abs() <= bound).all()


@pytest.mark.parametrize("arch", [90, 80])
def test_the_gluon_nf4_kernels_fuse_silu_gate_times_up(arch):
    """The gate_up launch with silu(gate) * up in the epilogue, at Qwen3-30B-A3B's gate_up shape with a rank-16
    LoRA term, each sorted row reading its token by index (gather), as the layer's gate_up launch does: h within
    _reference_and_bound of ops.grouped_matmul_reference, and act within one bf16 rounding
    (2^-7 of |act| + 1e-6, the exp's approximation) of silu(gate) * up computed by torch from the kernel's own h;
    without keep_h the same act. Control: act from h's halves swapped misses."""
    from moe_qlora.moe.kernels.gluon_nf4 import nf4_swapped_matmul_silu_mul
    from moe_qlora.moe.kernels.ops import silu_mul

    major, minor = torch.cuda.get_device_capability()
    if 10 * major + minor < arch or major > 9:
        pytest.skip(f"the sm_{arch} kernel needs sm_{arch} to sm_90; this GPU is sm_{major}{minor}")
    stack, tiles, x, lora, offsets = _gluon_case(128, 1536, 2048, 16, seed=1)
    tokens = torch.randn(x.shape[0] // 4 + 1, 2048, device="cuda").bfloat16()
    gather = torch.randint(0, tokens.shape[0], (x.shape[0],), device="cuda", dtype=torch.int32)
    ref, bound = _reference_and_bound(tokens[gather.long()], stack, offsets, lora)
    h, act = nf4_swapped_matmul_silu_mul(tokens, stack, tiles, arch=arch, lora=lora, gather=gather)
    assert ((h.float() - ref).abs() <= bound).all()
    expected = silu_mul(h.float())
    assert ((act.float() - expected).abs() <= 2**-7 * expected.abs() + 1e-6).all()
    _, act_alone = nf4_swapped_matmul_silu_mul(tokens, stack, tiles, arch=arch, lora=lora, keep_h=False, gather=gather)
    assert torch.equal(act_alone, act)
    swapped = silu_mul(torch.cat(h.float().chunk(2, dim=-1)[::-1], dim=-1))
    assert not ((act.float() - swapped).abs() <= 2**-7 * swapped.abs() + 1e-6).all()


def test_ops_launches_take_the_gluon_kernels_when_asked(monkeypatch):
    """With tiles.KernelSettings.gluon (MOE_QLORA_GLUON=1), ops.grouped_matmul_silu_mul (the gate_up launch: tokens
    by index, a rank-16 LoRA, offsets on the device as the layer has them) runs the Gluon kernel, whose h is within
    _reference_and_bound of the reference; without it the same call does not reach it."""
    from moe_qlora.moe.kernels import gluon_nf4, tiles
    from moe_qlora.moe.kernels.ops import grouped_matmul_silu_mul

    major, _ = torch.cuda.get_device_capability()
    if not 8 <= major <= 9:
        pytest.skip("the Gluon kernels run on sm_80 to sm_90")
    stack, _, x, lora, offsets = _gluon_case(128, 1536, 2048, 16, seed=2)
    tokens = torch.randn(x.shape[0] // 4 + 1, 2048, device="cuda").bfloat16()
    gather = torch.randint(0, tokens.shape[0], (x.shape[0],), device="cuda")
    ref, bound = _reference_and_bound(tokens[gather], stack, offsets, lora)
    served = []
    real = gluon_nf4.forward
    monkeypatch.setattr(gluon_nf4, "forward", lambda *a, **k: served.append(1) or real(*a, **k))
    weight = GroupedWeight.quantized(stack, transpose=True)
    on_device = torch.tensor(offsets, device="cuda")
    with tiles.kernel_settings_overridden(gluon=True):
        h, act = grouped_matmul_silu_mul(tokens, weight, on_device, gather=gather, lora=lora)
    assert served == [1] and ((h.float() - ref).abs() <= bound).all()
    grouped_matmul_silu_mul(tokens, weight, on_device, gather=gather, lora=lora)
    assert served == [1]
