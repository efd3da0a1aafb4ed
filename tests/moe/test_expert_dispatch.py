"""Expert parallelism's exchange on 3 gloo ranks (8 experts split 3, 3, 2) against the same layer in one process:
the output and the gradients of the hidden states, the routing weights and each expert's weight, in the cases a
step meets: uneven loads, every row routed to one rank's experts (the others receive nothing), a rank with no
tokens at all. Controls: a wrong permutation of the received rows, a combine that gets nothing back."""

import torch

from helpers.crash import script_on_ranks

SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
import moe_qlora.moe.expert_dispatch as dispatch
from moe_qlora.moe.expert_dispatch import ExpertShard, exchange_with_expert_ranks

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
E, H, K = 8, 6, 2
bounds = (0, 3, 6, 8)
shard = ExpertShard(bounds, rank)
g = torch.Generator().manual_seed(0)
experts = torch.randn(E, H, H, generator=g, dtype=torch.float64)  # expert e: x -> tanh(x W_e)


def case(name):
    cases = {"uneven": (1, (5, 9, 2)), "one rank's experts": (2, (4, 4, 4)), "a rank without tokens": (3, (6, 0, 3))}
    seed, tokens = cases[name]
    g = torch.Generator().manual_seed(seed)
    hidden = [torch.randn(t, H, generator=g, dtype=torch.float64) for t in tokens]
    choices = 3 if name == "one rank's experts" else E  # 3: rank 0's experts alone, the others receive nothing
    index = [pick(g, choices, t) for t in tokens]
    weights = [torch.rand(t, K, generator=g, dtype=torch.float64) for t in tokens]
    return hidden, index, weights


def pick(g, choices, tokens):
    if not tokens:
        return torch.empty(0, K, dtype=torch.long)
    return torch.stack([torch.randperm(choices, generator=g)[:K] for _ in range(tokens)])


def one_process(hidden, index, weights, w):
    out = torch.zeros_like(hidden)
    for k in range(index.shape[1]):
        picked = w.index_select(0, index[:, k])
        out = out + weights[:, k : k + 1] * torch.tanh(torch.bmm(hidden.unsqueeze(1), picked).squeeze(1))
    return out


def check(name, broken):
    hidden, index, weights = case(name)
    w = experts.clone().requires_grad_()
    x, wt = hidden[rank].clone().requires_grad_(), weights[rank].clone().requires_grad_()
    mine = w[shard.first : shard.first + shard.local_experts]

    def local(rows, ids, ones):
        return ones * torch.tanh(torch.bmm(rows.unsqueeze(1), mine.index_select(0, ids[:, 0])).squeeze(1))

    out, _ = exchange_with_expert_ranks(local, shard, x, index[rank], wt)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    (out * probe).sum().backward()
    gw = w.grad.clone()
    dist.all_reduce(gw)  # each rank's expert weights got every rank's rows: summed, the whole gradient
    ref_w = experts.clone().requires_grad_()
    ref_loss = 0.0
    ref = []
    for r in range(world):
        xr, wr = hidden[r].clone().requires_grad_(), weights[r].clone().requires_grad_()
        o = one_process(xr, index[r], wr, ref_w)
        pr = torch.randn(o.shape, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
        (o * pr).sum().backward()
        ref.append((o.detach(), xr.grad, wr.grad))
    errs = [
        float((out - ref[rank][0]).abs().max()) if out.numel() else 0.0,
        float((x.grad - ref[rank][1]).abs().max()) if x.numel() else 0.0,
        float((wt.grad - ref[rank][2]).abs().max()) if wt.numel() else 0.0,
        float((gw - ref_w.grad).abs().max()),
    ]
    err = torch.tensor(max(errs), dtype=torch.float64)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"{broken or 'exact'} | {name} | {float(err):.3e}", flush=True)


original_ids, original_rows = dispatch.received_expert_ids, dispatch.exchange_rows
for broken in ("", "permutation", "combine"):
    if broken == "permutation":  # the received rows paired with their neighbours' expert ids
        dispatch.received_expert_ids = lambda *a: original_ids(*a).roll(1)
    if broken == "combine":  # the results never sent back: the rows that went out come back as computed nowhere
        calls = []

        def no_return(rows, recv, send, shard):
            calls.append(1)
            if len(calls) % 2 == 0:
                return torch.zeros(sum(recv), rows.shape[-1], dtype=rows.dtype) + 0 * rows.sum()
            return original_rows(rows, recv, send, shard)

        dispatch.received_expert_ids = original_ids
        dispatch.exchange_rows = no_return
    for name in ("uneven", "one rank's experts", "a rank without tokens"):
        check(name, broken)
dist.barrier()  # no rank tears the group down while a peer is still in a collective
dist.destroy_process_group()
from moe_qlora.common.process_exit import exit_without_finalizing

exit_without_finalizing(0)  # gloo's worker threads outlive the group (common/process_exit.py)
"""


def test_the_exchange_over_three_ranks_is_the_one_process_layer(tmp_path):
    """float64 throughout, so the bound is rounding alone (1e-12); each control's error is the size of the outputs
    (> 1e-2) in every case where any row crosses ranks."""
    script = tmp_path / "exchange.py"
    script.write_text(SCRIPT)
    proc = script_on_ranks(script, 3)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    results = {}
    for line in proc.stdout.splitlines():
        if line.count(" | ") == 2:
            kind, name, err = line.split(" | ")
            results[kind, name] = float(err)
    cases = ("uneven", "one rank's experts", "a rank without tokens")
    assert set(results) == {(k, c) for k in ("exact", "permutation", "combine") for c in cases}
    for name in cases:
        assert results["exact", name] <= 1e-12, name
        assert results["permutation", name] > 1e-2, name
        assert results["combine", name] > 1e-2, name
    assert torch.isfinite(torch.tensor(list(results.values()))).all()
