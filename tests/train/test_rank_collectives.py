"""What a sharded run's ranks do together, on 2 gloo ranks in one launch: the update (clip and optimizer step),
where out of memory on one rank while it measures its gradients' norm, or in the optimizer step, leaves every
rank at the same meeting point and the next update still sums the norm over both ranks right (the ranks'
collectives stay paired); and the gathers for the adapter and the checkpoint, whose whole tensors rank 0 alone
keeps."""

import subprocess

import pytest

from helpers.crash import script_on_ranks

SCRIPT = r"""
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from moe_qlora.common.injection import injected
from moe_qlora.model.distributed import Ranks
from moe_qlora.train.faults import StepAbandoned
from moe_qlora.train.optim import ClippedAdamW
from moe_qlora.train.position import StepPosition
from moe_qlora.train.update import apply_update

def say(line):
    os.write(1, (line + "\n").encode())  # one write: the ranks share the pipe, and print writes the newline apart


dist.init_process_group("gloo", timeout=timedelta(seconds=20))
rank = dist.get_rank()
ranks = Ranks(rank=rank, world=2, sharded=True)
mesh = init_device_mesh("cpu", (2,))
g = torch.Generator().manual_seed(0)
whole = torch.randn(6, 4, generator=g)  # the sharded parameter's gradient, whole
plain = torch.randn(5, generator=g)  # a replicated parameter's (summed already, as sum_gradients leaves it)
sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)]))
replicated = torch.nn.Parameter(torch.zeros(5))
optimizer = ClippedAdamW([sharded, replicated], lr=1e-2, betas=(0.9, 0.999), foreach=False)
cfg = type("Train", (), {"max_grad_norm": 1.0})
expected = float(torch.cat([whole.flatten(), plain]).norm())

for step, phase in enumerate(("gradient norm", "optimizer", ""), start=1):
    sharded.grad = distribute_tensor(whole.clone(), mesh, [Shard(0)])
    replicated.grad = plain.clone()
    position = StepPosition()
    position.start(step)
    fault = f"{step}:{phase}" if phase and rank == 1 else ""
    try:
        with injected(oom=fault):
            norm, skipped = apply_update(ranks, optimizer, 1.0, cfg, position)
        said = f"stepped {norm:.6f} {skipped}"
    except StepAbandoned as exc:
        said = f"abandoned {type(exc.error).__name__}"
    say(f"rank {rank} | {phase or 'none'} | {said} | {expected:.6f}")
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from moe_qlora.model.distributed import local_shard, whole_trainable
from moe_qlora.train.checkpoint import checkpoint_tensors

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
full = {n: p.detach().clone() for n, p in net.named_parameters()}
fully_shard(net, mesh=mesh)
adamw = torch.optim.AdamW(net.parameters())
net(torch.ones(2, 4)).sum().backward()
adamw.step()
with whole_trainable(net, ranks):
    inside = [
        (isinstance(p, DTensor), p.device.type, tuple(local_shard(p).shape) == tuple(full[n].shape))
        for n, p in net.named_parameters()
    ]
after = all(isinstance(p, DTensor) for p in net.parameters())
state = checkpoint_tensors(net, adamw, keep=rank == 0)
kinds = sorted({f"{'shard' if d else 'whole'}:{dev}:{'full shape' if same else 'part'}" for d, dev, same in inside})
counts = f"{len(state['trainable'])} {len(state['optimizer'])}"
say(f"rank {rank} | gathered | {','.join(kinds)} {after} | {counts}")
dist.barrier()
dist.destroy_process_group()
from moe_qlora.common.process_exit import exit_without_finalizing

exit_without_finalizing(0)  # gloo's worker threads outlive the group (common/process_exit.py)
"""


@pytest.fixture(scope="module")
def update_launch(tmp_path_factory) -> subprocess.CompletedProcess:
    """The script on 2 gloo ranks, launched once for the module's tests."""
    script = tmp_path_factory.mktemp("ranks") / "ranks.py"
    script.write_text(SCRIPT)
    proc = script_on_ranks(script, 2)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc


def test_a_rank_out_of_memory_in_the_update_meets_the_other_and_the_next_norm_is_whole(update_launch):
    """Rank 1 runs out of memory measuring its shard's norm (step 1), then in the optimizer step (step 2): both
    ranks leave each step abandoned (rank 1 with its error, rank 0 without), neither waits out the 20 s collective
    timeout; step 3's norm is the whole gradient's on both (fp32 sums of 29 elements: 1e-5). Control, run by hand
    on the code before the fix (the norm's all_reduce inside the update's one stretch) with the out of memory
    raised inside the norm: rank 0's norm all_reduce met rank 1's failure flag, and rank 1 died waiting 20 s in a
    later collective rank 0 never joined (the launch exits 1)."""
    said = {}
    for line in update_launch.stdout.splitlines():
        if line.count(" | ") == 3 and " | gathered | " not in line:
            who, phase, what, expected = line.split(" | ")
            said[who, phase] = what, float(expected)
    for phase in ("gradient norm", "optimizer"):
        assert said["rank 0", phase][0] == "abandoned NoneType", said
        assert said["rank 1", phase][0] == "abandoned OutOfMemoryError", said
    for who in ("rank 0", "rank 1"):
        what, expected = said.pop((who, "none"))
        kind, norm, skipped = what.split()
        assert kind == "stepped" and skipped == "False"
        assert abs(float(norm) - expected) <= 1e-5 * expected, (who, norm, expected)


def test_the_adapter_and_checkpoint_gathers_keep_whole_tensors_on_rank_0_alone(update_launch):
    """An FSDP2-sharded 2-layer net after one AdamW step: inside whole_trainable rank 0's parameters are whole and
    rank 1's are still its shards; both are shards again after. (That rank 0's go to the host is not shown here:
    on gloo every tensor is on the CPU already.) checkpoint_tensors gives rank 0 the
    4 tensors and 12 optimizer entries (step and both moments of each), rank 1 nothing. Control: before the
    change every rank held every whole tensor (on its device) and the whole state."""
    gathered = {}
    for line in update_launch.stdout.splitlines():
        if " | gathered | " in line:
            who, _, inside, counts = line.split(" | ")
            gathered[who] = inside, counts
    assert gathered["rank 0"] == ("whole:cpu:full shape True", "4 12"), gathered
    assert gathered["rank 1"] == ("shard:cpu:part True", "0 0"), gathered
