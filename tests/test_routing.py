"""Routing metadata on its own: sorted rows, counts, offsets."""

import pytest
import torch

from moe_qlora.routing import route


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


def test_route_rejects_out_of_range_expert_ids():
    with pytest.raises(ValueError, match="outside"):
        route(torch.tensor([[0, 9]]), 8)
