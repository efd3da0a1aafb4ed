"""Dispatch metadata: the (token, slot) pairs chosen by the router, sorted by expert.

The router picks K experts per token; flattening gives S = T*K pairs. Sorting them by expert makes
each expert's rows contiguous, so an expert is one dense matmul over rows offsets[e]:offsets[e+1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutedTokens:
    """Pairs sorted by expert.

    order:   (S,) int64, flat pair index (token * K + slot) of each sorted row.
    token:   (S,) int64, token of each sorted row (order // K).
    counts:  (E,) int64, rows per expert (sums to S).
    offsets: list of E+1 ints, row range of expert e is offsets[e]:offsets[e+1] (host copy: one sync).
    """

    order: torch.Tensor
    token: torch.Tensor
    counts: torch.Tensor
    offsets: list[int]

    @property
    def num_rows(self) -> int:
        return self.offsets[-1]

    def active_experts(self) -> list[int]:
        """Experts that received at least one row; the others cost nothing."""
        return [e for e in range(len(self.offsets) - 1) if self.offsets[e + 1] > self.offsets[e]]


def route(top_k_index: torch.Tensor, num_experts: int) -> RoutedTokens:
    """Sort the router's choices by expert. top_k_index: (T, K) int."""
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1).long()
    counts = torch.bincount(flat, minlength=num_experts)  # negative ids raise here
    offsets = [0] + torch.cumsum(counts, 0).tolist()  # the one host sync of the layer
    if len(offsets) != num_experts + 1:  # bincount grew past num_experts: an id >= num_experts
        raise ValueError(f"router chose expert ids outside [0, {num_experts}): {len(offsets) - 1} bins")
    # Stable sort keeps tokens in their original order inside each expert: deterministic accumulation.
    order = torch.sort(flat, stable=True).indices
    return RoutedTokens(order=order, token=order // k, counts=counts, offsets=offsets)
