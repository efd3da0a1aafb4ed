"""Expert parallelism's exchange: each rank holds a contiguous range of a layer's experts, routes its own tokens with
the model's router, sends every routed (token, slot) row to the rank holding its expert, runs the rows it received
through its own experts, and gets the results back, which it weights and sums per token as one process does.

Two all_to_all_single calls carry the rows (torch.distributed's functional collective with autograd, which sends
their gradients back the other way), one more the expert id of each row and one the row counts (the split sizes:
a host read, one per layer call). Rows sorted by expert are sorted by destination rank too, since each rank's
experts are one range.
Every rank must call the exchange for every layer call, with or without tokens: the collectives pair up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from moe_qlora.moe.routing import RoutedTokens, route

LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ExpertShard:
    """Which experts each rank holds: rank r holds bounds[r]:bounds[r+1] of bounds[-1] experts (torch.chunk's split,
    as model.distributed.shard_rows gives it); `rank`, this one; `group`, the process group (None: the default)."""

    bounds: tuple[int, ...]
    rank: int
    group: Any = None
    on_device: dict = field(default_factory=dict, compare=False, repr=False)  # bounds as a tensor, by device

    def bounds_on(self, device: torch.device) -> torch.Tensor:
        """(W + 1,) int64 `bounds` on `device`, copied there once (not a host-to-device copy every layer call)."""
        if device not in self.on_device:
            self.on_device[device] = torch.tensor(self.bounds, device=device)
        return self.on_device[device]

    @property
    def num_experts(self) -> int:
        return self.bounds[-1]

    @property
    def first(self) -> int:
        return self.bounds[self.rank]

    @property
    def local_experts(self) -> int:
        return self.bounds[self.rank + 1] - self.first

    @property
    def world(self) -> int:
        return len(self.bounds) - 1


def exchange_with_expert_ranks(
    local: LocalExperts, shard: ExpertShard, hidden: torch.Tensor, top_k_index: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, RoutedTokens]:
    """The MoE layer over the ranks. hidden: (T, H), top_k_index / weights: (T, K) in global expert ids ->
    ((T, H), this rank's routing over all experts). `local(rows (R, H), local ids (R, 1), ones (R, 1))` computes
    this rank's experts on the rows it received, one expert a row, unweighted."""
    routing = route(top_k_index, shard.num_experts)
    send = rows_per_rank(routing, shard)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=shard.group)
    send_sizes, recv_sizes = torch.stack([send, recv]).tolist()  # one host read
    rows = hidden.index_select(0, routing.token)  # (S, H), sorted by expert, so by destination rank
    expert_ids = received_expert_ids(routing.expert, recv_sizes, send_sizes, shard)
    received = exchange_rows(rows, recv_sizes, send_sizes, shard)
    ones = torch.ones(expert_ids.shape[0], 1, dtype=weights.dtype, device=weights.device)
    computed = local(received, (expert_ids - shard.first).unsqueeze(1), ones)
    if torch.is_grad_enabled() and not computed.requires_grad and computed.grad_fn is None:
        computed.requires_grad_()  # a rank holding no trainable expert still joins the backward's exchange
    returned = exchange_rows(computed, send_sizes, recv_sizes, shard)
    return routing.combine(returned, weights), routing


def rows_per_rank(routing: RoutedTokens, shard: ExpertShard) -> torch.Tensor:
    """(W,) int64: how many of this rank's sorted rows go to each rank (the rows of its experts' range)."""
    at = routing.offsets_device.index_select(0, shard.bounds_on(routing.offsets_device.device))
    return at[1:] - at[:-1]


def received_expert_ids(
    experts: torch.Tensor, recv_sizes: list[int], send_sizes: list[int], shard: ExpertShard
) -> torch.Tensor:
    """(R,) int64 global expert id of each row this rank receives, in the order the rows arrive."""
    out = experts.new_empty(sum(recv_sizes))
    dist.all_to_all_single(out, experts.contiguous(), recv_sizes, send_sizes, group=shard.group)
    return out


def exchange_rows(rows: torch.Tensor, recv_sizes: list[int], send_sizes: list[int], shard: ExpertShard):
    """rows (sum(send_sizes), H) sent in rank order -> (sum(recv_sizes), H) received, differentiably (the
    gradient goes back through the reverse exchange)."""
    group = shard.group if shard.group is not None else dist.group.WORLD
    return wait_tensor(all_to_all_single_autograd(rows.contiguous(), recv_sizes, send_sizes, group))
