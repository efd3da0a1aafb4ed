"""split_experts' refusals, before any rank is left with a split it cannot compute."""

import os
import subprocess
import sys

import pytest
import torch

from moe_qlora.model.distributed import Ranks, shard_rows
from moe_qlora.model.expert_parallel import check_every_rank_holds_experts
from moe_qlora.moe.expert_stacks import UnsupportedExpertsError


@pytest.mark.parametrize(
    ("experts", "world"), [(8, 2), (8, 3), (8, 4), (7, 4), (8, 8), (256, 8), (8, 5), (8, 6), (3, 4)]
)
def test_a_world_that_leaves_a_rank_without_an_expert_is_refused_naming_the_split(experts, world):
    """The refusal agrees with the split itself (torch.chunk's, shard_rows): refused exactly when some rank's
    range is empty, and it says how many."""
    empty = sum(len(shard_rows(experts, Ranks(rank=r, world=world))) == 0 for r in range(world))
    if empty == 0:
        check_every_rank_holds_experts("layers.0.mlp.experts", experts, world)
        return
    with pytest.raises(UnsupportedExpertsError, match=f"{experts} experts over {world} ranks leave {empty} rank"):
        check_every_rank_holds_experts("layers.0.mlp.experts", experts, world)


SINGLE_RANK_SCRIPT = r"""
import sys, torch, torch.distributed as dist
from moe_qlora.config.sections import LoraSection
from moe_qlora.data.examples import Example, collate
from moe_qlora.model.adapters import attach_adapters
from moe_qlora.model.distributed import Ranks, full_tensor
from moe_qlora.model.expert_parallel import split_experts
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.moe.experts import set_moe_kernels
from moe_qlora.train.sft import accumulate_gradients

cuda = torch.cuda.is_available()
device, kernels = ("cuda", "triton") if cuda else ("cpu", "torch")
path, port, out = sys.argv[1], sys.argv[2], sys.argv[3]
dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
ranks = Ranks(rank=0, world=1)
lora = LoraSection(rank=4, target_modules=["o_proj"])


def gradients(split):
    # As build_policy places an ep run: loaded on the host for this rank's experts, split, then moved.
    opts = LoadOptions(path, device="cpu" if split else device, expert_shard=ranks if split else None)
    model = attach_adapters(load_model(opts), lora, seed=0, device=opts.device)
    set_moe_kernels(model, kernels)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    if split:
        split_experts(model, ranks)
        model.to(device)
    ids = torch.randint(3, 250, (4, 17), generator=g).tolist()
    batch = {k: v.to(device) for k, v in collate([Example(x, x, "r") for x in ids], 0).items()}
    loss, n, _ = accumulate_gradients(model, [batch], ranks=ranks)
    return loss, {k: full_tensor(p.grad).float().cpu() for k, p in model.named_parameters() if p.requires_grad}


whole, split = gradients(False), gradients(True)
torch.save({"whole": whole, "split": split, "device": device}, out)
dist.destroy_process_group()
from moe_qlora.common.process_exit import exit_without_finalizing

exit_without_finalizing(0)  # gloo's worker threads outlive the group (common/process_exit.py)
"""


def run_single_rank(tmp_path, model_dir) -> dict:
    from helpers.crash import free_port

    script = tmp_path / "single_rank.py"
    script.write_text(SINGLE_RANK_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(script), str(model_dir), str(free_port()), str(tmp_path / "out.pt")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp_path / "out.pt")


def assert_split_is_whole(result, rel: float) -> None:
    (loss_a, a), (loss_b, b) = result["whole"], result["split"]
    assert abs(loss_a - loss_b) <= rel * abs(loss_a) and a.keys() == b.keys()
    experts = [k for k in a if "moe_lora" in k]
    assert experts and all(float(a[k].abs().max()) > 0 for k in experts)
    for k in a:
        assert float((a[k] - b[k]).abs().max()) <= rel * float(a[k].abs().max()) + 1e-12, k


def test_ep_on_one_rank_is_the_model_without_it(tmp_path, tiny_mixtral_dir):
    """The ep code path on a single rank (its exchange an all_to_all with itself, its LoRA a DTensor, the model
    loaded on the host and moved as build_policy does): the gradients of the same model without it. CPU: gloo and
    the torch reference, fp32, within 1e-6 of each tensor's scale."""
    assert_split_is_whole(run_single_rank(tmp_path, tiny_mixtral_dir), 1e-6)


@pytest.mark.gpu
def test_ep_on_one_gpu_is_the_model_without_it(tmp_path, tiny_mixtral_dir):
    """The same on a GPU: NCCL's all_to_all, DTensor on a CUDA mesh, bitsandbytes' 4-bit linears moved by
    model.to, the Triton kernels on the received rows, bf16. Within 3e-2 of each tensor's scale: the routed rows
    come back in bf16 with their LoRA term added and are weighted by a bf16 matmul, where the layer without ep
    weights them in its fp32 epilogue (a few bf16 ulps)."""
    result = run_single_rank(tmp_path, tiny_mixtral_dir)
    assert result["device"] == "cuda"
    assert_split_is_whole(result, 3e-2)
