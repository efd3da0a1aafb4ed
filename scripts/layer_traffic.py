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

    python scripts/layer_traffic.py --grid                           # the Triton path's grid order, per launch

--grid counts the Triton path's launches instead (kernels.aot.capture_launches at the shape): each operand tile's
reads from HBM when the programs run in the order the kernel numbers them, through an L2 model (L2_BYTES, least
recently used out first), against each tile read once; --group-m forces a group size (0: the row tiles fastest,
the order before issue 67).
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
        # an operation on real host tensors only (the op's kept-stacks flag) is host work, not a device launch
        launches = launches and _any_fake((args, kwargs, out))
        if launches:
            key = f"{func.namespace}::{name}" + (f" at {_caller()}" if self.where else "")
            self.traffic.launches[key] += 1
            self.traffic.bytes[key] += _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
        return out


def _any_fake(values) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    flat, _ = torch.utils._pytree.tree_flatten(values)
    return any(isinstance(t, torch.Tensor) and is_fake(t) for t in flat)


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


# ------------------------------------------------------------------------------------------------------
# The Triton path's grid order: how often each operand tile of a grouped GEMM is read from HBM.
#
# A launch's programs start in the order of their linear index (tiles.grid_block maps it to the output block). The
# model: every program reads its operand tiles whole (an activation tile: a row tile's rows over the program's K; a
# weight tile: an expert's BLOCK_N columns, NF4 codes and block scales, over that K) through an L2 of L2_BYTES that
# keeps the tiles read most recently (LRU); a tile not in it is read from HBM. Programs resident at once run in
# parallel, not in their order, which a cache of the whole L2 does not see: a model of the order, not of the timing.

L2_BYTES = 50 * 2**20  # the H100's and H200's L2


@dataclass
class OperandReads:
    """One operand of one launch: its tiles' HBM reads through the L2 model."""

    tiles: int = 0
    most_reads: int = 0
    bytes_once: int = 0  # each tile read once
    bytes_read: int = 0  # what the model reads from HBM


def launch_grid(launch) -> tuple[int, ...]:
    """The launch's grid, a tuple: a grid given as a function of the meta-parameters called with them."""
    return tuple(launch.grid(launch.kwargs)) if callable(launch.grid) else tuple(launch.grid)


def _kernel_args(launch) -> dict:
    return dict(zip(launch.kernel.arg_names, launch.args, strict=False)) | launch.kwargs


def l2_reads(accesses, l2_bytes: int = L2_BYTES) -> dict[str, OperandReads]:
    """accesses: (operand, tile key, bytes) in program order. Each operand's tiles and their HBM reads through an
    LRU cache of l2_bytes."""
    from collections import OrderedDict

    cache: OrderedDict = OrderedDict()
    held, reads, sizes = 0, defaultdict(int), {}
    for operand, key, nbytes in accesses:
        key = (operand, key)
        sizes[key] = nbytes
        if key in cache:
            cache.move_to_end(key)
            continue
        reads[key] += 1
        cache[key] = nbytes
        held += nbytes
        while held > l2_bytes and len(cache) > 1:
            held -= cache.popitem(last=False)[1]
    out: dict[str, OperandReads] = {}
    for (operand, _), n in reads.items():
        r = out.setdefault(operand, OperandReads())
        r.tiles += 1
        r.most_reads = max(r.most_reads, n)
        r.bytes_once += sizes[(operand, _)]
        r.bytes_read += sizes[(operand, _)] * n
    return out


def matmul_accesses(launch):
    """The tile reads of one _grouped_matmul_kernel launch, program by program in the order they start (the grid
    (group, N blocks, groups), tiles.grid_block; split-K's splits taken as separate N blocks): its activation rows
    and its weight columns."""
    from moe_qlora.moe.kernels.tiles import grid_block

    a = _kernel_args(launch)
    tile_map = a["tiles_ptr"].tolist()
    n_blocks = -(-a["N"] // a["BLOCK_N"])
    group, blocks, _ = launch_grid(launch)
    splits = blocks // n_blocks if a["PHASE"] == 1 else 1
    k_split = -(-a["K"] // splits)
    x_item = a["x_ptr"].element_size()
    w_bytes = int(k_split * a["BLOCK_N"] * (2 if a["GLU"] else 1) * ((0.5 + 1 / 64) if a["W_NF4"] else x_item))
    if a["PHASE"] == 2:  # the sum of the partial sums reads no operand
        return
    for pid in range(len(tile_map) * blocks):
        tile, block = grid_block(pid, len(tile_map), blocks, group)
        (expert, start, end), (n_block, split) = tile_map[tile], divmod(block, splits)
        if start < end:  # a spare tile of the upper-bound grid returns at once
            # the tile map holds the expert's end: a tile's rows are at most BLOCK_M
            yield "activations", (tile, split), min(a["BLOCK_M"], end - start) * k_split * x_item
            yield "weights", (expert, n_block, split), w_bytes


def outer_product_accesses(launch):
    """The tile reads of one _grouped_outer_product_kernel launch (program (expert, out tile), expert fastest):
    A's tile is an expert's rows over BLOCK_M columns, B's over BLOCK_N columns."""
    a = _kernel_args(launch)
    offsets = a["offsets_ptr"].tolist()
    (experts, programs), n_tiles = launch_grid(launch), -(-a["N"] // a["BLOCK_N"])
    width = {"a": min(a["BLOCK_M"], a["M"]) * a["a_ptr"].element_size()}
    width["b"] = min(a["BLOCK_N"], a["N"]) * a["b_ptr"].element_size()
    for j in range(programs):
        for e in range(experts):
            rows = offsets[e + 1] - offsets[e]
            if rows:
                yield "a", (e, j // n_tiles), rows * width["a"]
                yield "b", (e, j % n_tiles), rows * width["b"]


def triton_grid_reads(shape: str, tokens: int, *, rank: int = 8, arch: int = 90, group_m: int | None = None):
    """Every Triton launch of one layer step (forward and backward, kernels.aot.capture_launches: `arch`'s default
    config, uniform routing, tiles.group_m's groups unless `group_m`) with its operands' HBM reads under the L2
    model."""
    from unittest import mock

    from moe_qlora.moe.kernels import tiles
    from moe_qlora.moe.kernels.aot import capture_launches

    hidden, inter, experts, top_k = SHAPES[shape]
    with mock.patch.object(tiles, "GROUP_M", group_m):
        launches = capture_launches(
            hidden=hidden, inter=inter, experts=experts, top_k=top_k, tokens=tokens, rank=rank, arch=arch
        )
    rows = []
    for launch in launches:
        matmul = "tiles_ptr" in launch.kernel.arg_names
        operands = l2_reads(matmul_accesses(launch) if matmul else outer_product_accesses(launch))
        rows.append(
            {"launch": launch.name, "grid": list(launch_grid(launch))} | {k: vars(r) for k, r in operands.items()}
        )
    return rows


def grid_summary(rows: list[dict]) -> dict:
    """A layer step's Triton launches: the most reads of any activation tile (the row operands: a matmul's X, an
    outer product's A and B) and the bytes read from HBM against each tile read once."""
    operands = [v for r in rows for v in r.values() if isinstance(v, dict)]
    activations = [r[k] for r in rows for k in ("activations", "a", "b") if k in r]
    return {
        "most_activation_reads": max(a["most_reads"] for a in activations),
        "bytes_read": sum(o["bytes_read"] for o in operands),
        "bytes_once": sum(o["bytes_once"] for o in operands),
    }


def print_grid_reads(args) -> None:
    results = []
    for shape in args.shape or list(SHAPES):
        for tokens in args.tokens:
            rows = triton_grid_reads(shape, tokens, rank=args.rank, group_m=args.group_m)
            results.append({"shape": shape, "tokens": tokens, "launches": rows} | grid_summary(rows))
            r = results[-1]
            print(
                f"{shape} x {tokens} tokens: {r['bytes_read'] / 2**30:.2f} GiB read from HBM by the Triton launches "
                f"(each tile once: {r['bytes_once'] / 2**30:.2f}); an activation tile read at most "
                f"{r['most_activation_reads']} times"
            )
            for launch in rows:
                reads = ", ".join(
                    f"{k} x{v['most_reads']} {v['bytes_read'] / 2**20:.0f}/{v['bytes_once'] / 2**20:.0f} MiB"
                    for k, v in launch.items()
                    if isinstance(v, dict)
                )
                print(f"    {launch['launch']:40s} grid {str(launch['grid']):14s} {reads}")
    print(json.dumps(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


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
    ap.add_argument("--grid", action="store_true", help="the Triton path's grid order: HBM reads of each operand tile")
    ap.add_argument("--group-m", type=int, help="--grid: every launch in groups of this many row tiles (0: none)")
    args = ap.parse_args()
    if args.grid:
        return print_grid_reads(args)
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
