"""One grouped MoE layer step (forward + backward) at a real model's shape, counted on the CPU without computing it:
the operations a GPU would launch, the bytes each reads and writes, and whether any reads a value back to the host.

    python scripts/layer_traffic.py                                  # Qwen3-30B-A3B and Mixtral-8x7B, 512..16k tokens
    python scripts/layer_traffic.py --shape qwen3-30b-a3b --tokens 4096 --ops   # every operation, largest first

The layer runs its real code (the routing plan, the registered op's forward and backward, the grouped_mm path in
bf16 with nested NF4 scales, expert LoRA rank 8 and the default decode budget) on fake tensors: shapes and dtypes,
no values, so a 16k-token Mixtral layer is counted in a second and any host read (.tolist(), .item(), a shape that
depends on values) raises. Each operation that is not a view or an allocation is one launch; its bytes are its
inputs' and outputs' (an upper bound on its HBM traffic: an index_select counts its whole source). Their sum over
the H100's bandwidth (3.35 TB/s) is what the layer's memory traffic costs at best, set beside the roofline
bench_moe.py prints (the bytes the layer must read and the FLOPs it must do). Not counted: what a kernel does inside
(a GEMM's re-reads of its operands from L2), and the Triton path, whose kernels do not run on fake tensors.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_moe import H100_BYTES_PER_S, SHAPES, roofline  # noqa: E402

# Operations that launch nothing: views of a tensor, allocations (their memory is not traffic), metadata.
NO_LAUNCH = {
    "view",
    "_unsafe_view",
    "reshape",
    "t",
    "transpose",
    "permute",
    "expand",
    "slice",
    "select",
    "as_strided",
    "unsqueeze",
    "squeeze",
    "alias",
    "detach",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "empty",
    "empty_like",
    "new_empty",
    "empty_strided",
    "new_empty_strided",
    "lift_fresh",
    "_to_copy_meta",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "is_same_size",
    "_has_compatible_shallow_copy_type",
}
# A launch's kind, by the first name fragment it holds (the table's rows).
KINDS = [
    ("decode", ("dequantize", "bitsandbytes")),
    ("row steps (fused)", ("moe_qlora::",)),
    ("grouped GEMM", ("_grouped_mm",)),
    ("gather / scatter", ("index", "gather", "scatter", "take", "searchsorted", "sort", "argsort")),
    ("copy / cast / pad", ("copy", "_to_copy", "clone", "constant_pad", "cat", "stack", "contiguous")),
    ("reduction", ("sum", "mean", "cumsum", "amax", "max")),
]


def kind_of(name: str) -> str:
    return next((kind for kind, keys in KINDS if any(k in name for k in keys)), "elementwise / other")


@dataclass
class Traffic:
    """Launches and bytes by operation name."""

    launches: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def total_launches(self) -> int:
        return sum(self.launches.values())

    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def by_kind(self) -> dict[str, tuple[int, int]]:
        kinds: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for name, n in self.launches.items():
            kinds[kind_of(name)][0] += n
            kinds[kind_of(name)][1] += self.bytes[name]
        return {k: tuple(v) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1][1])}


def _tensor_bytes(values) -> int:
    flat, _ = torch.utils._pytree.tree_flatten(values)
    return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))


class CountingMode(TorchDispatchMode):
    """Counts every launching operation dispatched inside it, with its inputs' and outputs' bytes."""

    def __init__(self, where: bool = False):
        super().__init__()
        self.traffic, self.where = Traffic(), where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        # bitsandbytes' kernels and this package's row steps (kernels/rows.py: one Triton kernel each on a GPU)
        own = func.namespace in ("bitsandbytes", "moe_qlora")
        launches = own or (func.namespace == "aten" and name.rstrip("_") not in NO_LAUNCH)
        if launches:
            key = f"{func.namespace}::{name}" + (f" at {_caller()}" if self.where else "")
            self.traffic.launches[key] += 1
            self.traffic.bytes[key] += _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
        return out


def _caller() -> str:
    """The innermost line of this package that led to the operation (file:line)."""
    import traceback

    frames = [f for f in traceback.extract_stack() if "/moe_qlora/" in f.filename]
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"


def fake_stack(mode: FakeTensorMode, shape: tuple[int, int, int]):
    """An NF4 stack of `shape` with nested scales (model.expert_double_quant, the default), as fake tensors."""
    from moe_qlora.moe.nf4 import BLOCKSIZE, NESTED_BLOCKSIZE, NF4Stack

    numel = shape[0] * shape[1] * shape[2]
    blocks = numel // BLOCKSIZE
    with mode:
        packed = torch.empty(numel // 2, dtype=torch.uint8)
        absmax = torch.empty(blocks, dtype=torch.uint8)
        absmax2 = torch.empty(-(-blocks // NESTED_BLOCKSIZE), dtype=torch.float32)
        code2 = torch.empty(256, dtype=torch.float32)
    return NF4Stack(packed, absmax, (absmax2, code2, 0.0), shape)


def layer_step_traffic(
    shape: str,
    tokens: int,
    *,
    rank: int = 8,
    kernels: str = "grouped_mm",
    where: bool = False,
    budget_mb: float | None = None,
    checkpointed: bool = False,
) -> Traffic:
    """The traffic of one forward + backward of the registered op at `shape` (bench_moe.SHAPES) and `tokens`,
    with model.dequant_buffer_mb `budget_mb` (None: its default). checkpointed: a training step's share under
    activation checkpointing, forward, recomputed forward and backward, the recompute handing its decoded stacks to
    the backward as the layer does when they decode whole. Raises if any operation reads a value back to the
    host."""
    from moe_qlora.config.sections import ModelSection
    from moe_qlora.moe.grouped_layer import (
        KEPT_STACKS,
        NO_STACKS,
        grouped_experts_backward_op,
        grouped_experts_op,
        op_inputs,
    )
    from moe_qlora.moe.kernels.grouped_mm import dequant_budget_bytes
    from moe_qlora.moe.kernels.ops import silu_mul
    from moe_qlora.moe.reference_layer import FrozenExperts, MoEPlan
    from moe_qlora.moe.routing import route

    hidden, inter, experts, top_k = SHAPES[shape]
    default_budget_mb = ModelSection.model_fields["dequant_buffer_mb"].default
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    frozen = FrozenExperts(
        gate_up=fake_stack(mode, (experts, 2 * inter, hidden)),
        down=fake_stack(mode, (experts, hidden, inter)),
        gate=silu_mul,
        gate_is_silu_mul=True,
    )
    g = torch.Generator().manual_seed(0)
    top_k_index = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices
    budget = dequant_budget_bytes(budget_mb if budget_mb is not None else default_budget_mb)
    with mode:
        x = torch.empty(tokens, hidden, dtype=torch.bfloat16)
        weights = torch.empty(tokens, top_k, dtype=torch.bfloat16)
        lora = [
            torch.empty(experts, rank, hidden, dtype=torch.bfloat16),
            torch.empty(experts, 2 * inter, rank, dtype=torch.bfloat16),
            torch.empty(experts, rank, inter, dtype=torch.bfloat16),
            torch.empty(experts, hidden, rank, dtype=torch.bfloat16),
        ]
    counting = CountingMode(where)
    with mode, counting:  # the routing plan counted too: the experts module builds it at every call
        plan = MoEPlan(frozen, route(mode.from_tensor(top_k_index), experts), 2.0)
        args = op_inputs(x, weights, lora, plan, kernels, budget, True)
        if checkpointed:
            whole = all(math.prod(s.shape) * 2 <= (budget or math.inf) for s in (frozen.gate_up, frozen.down))
            stacks = KEPT_STACKS if kernels == "grouped_mm" and whole else NO_STACKS
            grouped_experts_op._init_fn(*args)  # the first forward, whose saved tensors checkpointing drops
            plan = MoEPlan(frozen, route(mode.from_tensor(top_k_index), experts), 2.0)
            args = op_inputs(x, weights, lora, plan, kernels, budget, True, decoded_stacks=stacks)
        out, h, p1, p2, *stacks = grouped_experts_op._init_fn(*args)
        _, weights_, lora_, frozen_, floats, ints, kernels_, _ = args
        grouped_experts_backward_op._init_fn(
            torch.empty_like(out), x, weights_, [h, p1, p2, *stacks], lora_, frozen_, floats, ints, kernels_
        )
    return counting.traffic


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), action="append", help="default: both")
    ap.add_argument("--tokens", type=int, nargs="*", default=[512, 4096, 16384])
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--ops", action="store_true", help="also every operation and where it runs, by bytes")
    ap.add_argument(
        "--checkpointed", action="store_true", help="a checkpointed training step: forward, recompute, backward"
    )
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    results = []
    for shape in args.shape or list(SHAPES):
        hidden, inter, experts, top_k = SHAPES[shape]
        for tokens in args.tokens:
            traffic = layer_step_traffic(shape, tokens, rank=args.rank, where=args.ops, checkpointed=args.checkpointed)
            per_expert = 3 * hidden * inter * (0.5 + 1 / 64 + 4 / (64 * 256))
            must_read, flops, ideal = roofline(tokens, hidden, inter, top_k, args.rank, experts, per_expert, 2)
            moved = traffic.total_bytes()
            results.append(
                {
                    "shape": shape,
                    "tokens": tokens,
                    "launches": traffic.total_launches(),
                    "bytes_moved": moved,
                    "bytes_must_read": must_read,
                    "h100_traffic_ms": round(moved / H100_BYTES_PER_S * 1e3, 3),
                    "h100_ideal_ms": round(ideal * 1e3, 3),
                    "by_kind": {k: {"launches": n, "bytes": b} for k, (n, b) in traffic.by_kind().items()},
                }
            )
            r = results[-1]
            print(
                f"{shape} x {tokens} tokens: {r['launches']} launches, {moved / 2**30:.2f} GiB moved "
                f"({r['h100_traffic_ms']} ms at 3.35 TB/s; the layer's ideal {r['h100_ideal_ms']} ms); no host read"
            )
            for kind, (n, b) in traffic.by_kind().items():
                print(f"    {kind:20s} {n:4d} launches {b / 2**30:8.2f} GiB")
            if args.ops:
                for name in sorted(traffic.bytes, key=lambda k: -traffic.bytes[k]):
                    print(f"      {name:45s} x{traffic.launches[name]:3d} {traffic.bytes[name] / 2**20:10.1f} MiB")
    print(json.dumps(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
