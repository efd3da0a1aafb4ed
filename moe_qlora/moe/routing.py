"""Dispatch metadata: the (token, slot) pairs chosen by the router, sorted by expert, built on the device.

The router picks K experts per token; flattening gives S = T*K pairs. Sorting them by expert makes
each expert's rows contiguous, so an expert is one dense matmul over rows offsets[e]:offsets[e+1].
Everything here stays on the router's device with no host sync (counts by scatter_add_, not bincount, whose
output size depends on the data), so a layer can run inside a CUDA graph or a torch.compile graph. Only the
per-expert torch reference asks for host offsets (`host_offsets`, one sync).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutedTokens:
    """Pairs sorted by expert, all (S,) / (E,) device tensors.

    order:    (S,) int64, flat pair index (token * K + slot) of each sorted row.
    token:    (S,) int64, token of each sorted row (order // K).
    expert:   (S,) int64, expert of each sorted row (non-decreasing).
    inverse:  (S,) int64, sorted row of each flat pair: inverse[order[s]] = s. Gathering the rows back in
              (token, slot) order lets the combine sum a token's K rows with no atomics (deterministic).
    counts:   (E,) int64, rows per expert (sums to S).
    offsets_device: (E+1,) int64, row range of expert e is offsets[e]:offsets[e+1].
    top_k:    K.
    """

    order: torch.Tensor
    token: torch.Tensor
    expert: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    offsets_device: torch.Tensor
    top_k: int

    @property
    def num_rows(self) -> int:
        return self.order.shape[0]

    @property
    def num_experts(self) -> int:
        return self.counts.shape[0]

    @functools.cached_property
    def offsets(self) -> list[int]:
        """Host copy of the offsets, for the per-expert reference paths: one device sync, made once."""
        return self.offsets_device.tolist()

    def active_experts(self) -> list[int]:
        """Experts that received at least one row; the others cost nothing (host offsets: one sync)."""
        offsets = self.offsets
        return [e for e in range(len(offsets) - 1) if offsets[e + 1] > offsets[e]]

    def combine(self, rows: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """(S, H) sorted rows -> (T, H): out[t] = sum over slots k of weights[t, k] * rows[inverse[t*K + k]].

        A gather and a fixed-order sum over K instead of index_add_ (atomics on CUDA): two identical steps give
        bit-identical results on every device. weights: (T, K) or None (a plain sum)."""
        per_slot = rows.index_select(0, self.inverse).view(-1, self.top_k, rows.shape[-1])  # (T, K, H)
        if weights is None:
            return per_slot.sum(1)
        return torch.bmm(weights.to(rows.dtype).unsqueeze(1), per_slot).squeeze(1)


def route(top_k_index: torch.Tensor, num_experts: int) -> RoutedTokens:
    """Sort the router's choices by expert. top_k_index: (T, K) int. No host sync.

    Out-of-range expert ids fail through torch._assert_async: at once on the CPU, as a device-side assert on
    CUDA (asynchronously, but before any result is used), never as a silently wrong routing."""
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1).long()
    in_range = ((flat >= 0) & (flat < num_experts)).all()
    torch._assert_async(in_range, f"router chose expert ids outside [0, {num_experts})")
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat.clamp(0, num_experts - 1), torch.ones_like(flat))
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    # Stable sort keeps tokens in their original order inside each expert: deterministic accumulation.
    expert, order = torch.sort(flat, stable=True)
    inverse = torch.empty_like(order).index_copy_(0, order, torch.arange(order.shape[0], device=order.device))
    return RoutedTokens(
        order=order, token=order // k, expert=expert, inverse=inverse, counts=counts, offsets_device=offsets, top_k=k
    )
