"""Routing metadata on its own: sorted rows, counts, offsets."""

import pytest
import torch

from moe_qlora.moe.routing import route


@pytest.mark.parametrize(
    "tokens,k,experts",
    [
        (7, 2, 8),  # ragged, some experts empty
        (1, 1, 4),  # a single row
        (5, 4, 4),  # top-k equals the number of experts
    ],
)
def test_route_sorts_rows_by_expert_and_counts_them(tokens, k, experts):
    g = torch.Generator().manual_seed(tokens)
    idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    rt = route(idx, experts)
    flat = idx.reshape(-1)
    assert int(rt.counts.sum()) == tokens * k == rt.num_rows
    assert sorted(rt.order.tolist()) == list(range(tokens * k))  # a permutation
    for e in range(experts):
        rows = rt.order[rt.offsets[e] : rt.offsets[e + 1]]
        assert torch.all(flat[rows] == e)
        assert rows.tolist() == sorted(rows.tolist())  # stable: token order kept inside an expert
    torch.testing.assert_close(rt.token, rt.order // k)
    assert rt.active_experts() == [e for e in range(experts) if int(rt.counts[e]) > 0]


@pytest.mark.parametrize("bad_id", [9, 8, -1])
def test_route_rejects_out_of_range_expert_ids(bad_id):
    # torch._assert_async: raised at once on the CPU (a device-side assert on CUDA), no host sync either way.
    with pytest.raises(RuntimeError, match=r"outside \[0, 8\)"):
        route(torch.tensor([[0, bad_id]]), 8)


def test_route_metadata_is_consistent_and_sync_free():
    """expert, inverse and the device offsets agree with the sort; combine sums each token's K rows."""
    g = torch.Generator().manual_seed(3)
    idx = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(9)])
    rt = route(idx, 6)
    assert torch.equal(rt.expert, idx.reshape(-1)[rt.order])
    assert torch.equal(rt.order[rt.inverse], torch.arange(18))
    assert rt.offsets_device.tolist() == [0, *torch.cumsum(rt.counts, 0).tolist()]
    rows = torch.randn(18, 5, generator=g)
    weights = torch.rand(9, 2, generator=g)
    expected = torch.zeros(9, 5).index_add_(0, rt.token, rows * weights.reshape(-1)[rt.order, None])
    torch.testing.assert_close(rt.combine(rows, weights), expected)
    # The routing compiles into one graph: nothing in it reads device values on the host.
    compiled = torch.compile(lambda i: route(i, 6).offsets_device, fullgraph=True, backend="eager")
    assert torch.equal(compiled(idx), rt.offsets_device)
