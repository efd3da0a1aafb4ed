"""Compile every Triton kernel variant ahead of time for NVIDIA targets, without a GPU.

python -m moe_qlora.moe.kernels.aot [--arch 80 --arch 90] [--json]

Each variant (weights dense / NF4 / NF4 with nested scales, with the fused LoRA term and the fused
silu(gate) * up epilogue, fp32 / bf16 inputs) is one of a layer's real launches at Qwen3-30B-A3B's shapes,
bound and specialized by Triton's own binder as the JIT does on a GPU (strides of 1 become constants, sizes
divisible by 16 carry the hint), then taken through the whole pipeline to a cubin for each architecture: code
the interpreter accepts but the compiler rejects is caught on a CPU machine, and the shared memory checked is
the kernel's that runs. Run without TRITON_INTERPRET (it replaces the jitted functions).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

# The variants compiled, each as one of a layer's real launches (capture_launches) at Qwen3-30B-A3B's shapes:
# name: (launch, expert weights: "nf4", "nf4_nested" or "mxfp4"). The NF4 kernels with and without nested
# (double-quantized) scales, gpt-oss's MXFP4 (e2m1 codes, e8m0 scales) in the forward and through the transposed
# experts, the dense LoRA A projection, the fused silu(gate) * up epilogue, and the outer product of the LoRA
# gradients. The row steps between the GEMMs (kernels/rows.py) are compiled too, as "rows/<name>".
VARIANTS = {
    "grouped_matmul/dense": ("lora_a_dense", "nf4_nested"),
    "grouped_matmul/nf4": ("down_nf4_nested", "nf4"),
    "grouped_matmul/nf4_nested": ("down_nf4_nested", "nf4_nested"),
    "grouped_matmul/nf4_nested_silu_mul": ("gate_up_nf4_nested_silu_mul", "nf4_nested"),
    "grouped_matmul/mxfp4": ("down_mxfp4", "mxfp4"),
    "grouped_matmul/mxfp4_input_grad": ("down_input_grad_mxfp4", "mxfp4"),
    "grouped_outer_product": ("outer_product", "nf4_nested"),
}
SHAPE = dict(hidden=2048, inter=768, experts=128, top_k=8, tokens=2048, rank=16)  # Qwen3-30B-A3B


def compile_all(archs: list[int]) -> list[dict]:
    """Every variant in fp32 and bf16 activations for each arch, specialized exactly as the JIT would."""
    from moe_qlora.moe.kernels.tiles import interpreted

    if interpreted():
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter replaces the kernels that would be compiled")
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    import torch

    results = []
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for arch in archs:
            launches = {
                weights: {
                    launch.name: launch for launch in capture_launches(**SHAPE, dtype=dtype, weights=weights, arch=arch)
                }
                for weights in ("nf4", "nf4_nested", "mxfp4")
            }
            named = [(name, launches[weights][launch]) for name, (launch, weights) in VARIANTS.items()]
            row_shape = {k: SHAPE[k] for k in ("hidden", "inter", "tokens", "top_k")}
            named += [(f"rows/{launch.name}", launch) for launch in capture_row_launches(**row_shape, dtype=dtype)]
            for name, launch in named:
                compiled = compile_as_jit(launch, arch)
                registers, spilled = resource_usage(compiled)
                results.append(
                    {
                        "variant": f"{name}/{dtype_name}/sm_{arch}",
                        "registers": registers,
                        "spilled_bytes": spilled,
                        "cubin_bytes": len(compiled.asm["cubin"]),
                        "tensor_core_mma": "mma" in compiled.asm["ptx"],
                        "shared_bytes": compiled.metadata.shared,
                        "warps": compiled.metadata.num_warps,
                    }
                )
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, action="append", help="compute capability x10 (default: 80 and 90)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = compile_all(args.arch or [80, 90])
    if args.json:
        sys.stdout.write(json.dumps(results) + "\n")
    else:
        for r in results:
            print(
                f"{r['variant']:45s} cubin {r['cubin_bytes']:7d} B  mma {r['tensor_core_mma']}  "
                f"warps {r['warps']}  smem {r['shared_bytes']}"
            )
    return 0


# ------------------------------------------------------------------------------------------------------
# Compiling as the JIT does: the launchers' real arguments at real layer shapes, specialized by Triton's own
# binder (ints equal to 1 become constants, ints and pointers divisible by 16 carry the hint). Used by
# compile_all above and by scripts/kernel_report.py.


class Launch:
    """One kernel launch as ops.py makes it: the kernel, its grid and its arguments."""

    def __init__(self, name, kernel, grid, args, kwargs):
        self.name, self.kernel, self.grid, self.args, self.kwargs = name, kernel, grid, args, kwargs

    @property
    def constexprs(self) -> dict:
        return {k: v for k, v in self.kwargs.items() if k.isupper()}


def layer_launch_calls(
    *,
    hidden: int,
    inter: int,
    experts: int,
    top_k: int,
    tokens: int,
    rank: int,
    dtype=None,
    nested: bool = True,
    weights: str | None = None,
    device: str = "cpu",
) -> list[tuple[str, Callable[[], object]]]:
    """(name, call) for the six launches of one MoE layer's forward and backward through the real launchers (bf16
    unless `dtype`, NF4 with nested scales unless not `nested`, or `weights` "nf4" / "nf4_nested" / "mxfp4"; LoRA),
    on tensors of the real shapes on `device` (weights zeros; activations uninitialised on the CPU, where only
    their shapes are read and untouched pages take no memory, zeros elsewhere). Uniform routing: tokens * top_k
    rows, spread evenly over the experts. capture_launches records them; scripts/sweep_kernels.py times them."""
    import torch

    from moe_qlora.moe.kernels import ops
    from moe_qlora.moe.mxfp4 import MXFP4Stack
    from moe_qlora.moe.nf4 import NF4Stack

    dtype = dtype or torch.bfloat16
    rows = tokens * top_k

    if weights is not None:
        nested = weights == "nf4_nested"

    def nf4(out, inp):
        if weights == "mxfp4":  # codes and one exponent byte per 32
            return MXFP4Stack(
                torch.zeros(experts * out * inp // 2, dtype=torch.uint8),
                torch.zeros(experts * out * inp // 32, dtype=torch.uint8),
                (experts, out, inp),
            )
        numel = experts * out * inp
        blocks = numel // 64
        packed = torch.zeros(numel // 2, dtype=torch.uint8)
        if not nested:  # one fp32 scale per 64-element block
            return NF4Stack(packed, torch.zeros(blocks), None, (experts, out, inp))
        second = (torch.zeros(-(-blocks // 256)), torch.zeros(256), 0.0)  # uint8 scale codes, then their scales
        return NF4Stack(packed, torch.zeros(blocks, dtype=torch.uint8), second, (experts, out, inp))

    def activation(*shape):  # Mixtral's (S, 2I) gradient at 16k tokens is 1.9 GB: on the CPU never touched
        return torch.empty(*shape, dtype=dtype) if device == "cpu" else torch.zeros(*shape, dtype=dtype)

    with torch.device(device):
        w1, w2 = nf4(2 * inter, hidden), nf4(hidden, inter)
        a1, b1 = torch.zeros(experts, rank, hidden), torch.zeros(experts, 2 * inter, rank)
        a2, b2 = torch.zeros(experts, rank, inter), torch.zeros(experts, hidden, rank)
        x, g = activation(tokens, hidden), activation(tokens, hidden)
        token = torch.arange(rows) % tokens
        counts = torch.full((experts,), rows // experts)
        counts[: rows % experts] += 1
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
        p = activation(rows, rank)
        act, grad_h = activation(rows, inter), activation(rows, 2 * inter)
    GW, LowRank = ops.GroupedWeight, ops.LowRank

    return [
        ("lora_a_dense", lambda: ops.grouped_matmul(x, GW.dense(a1, transpose=True), offsets, gather=token)),
        (
            "gate_up_nf4_nested_silu_mul",
            lambda: ops.grouped_matmul_silu_mul(
                x,
                GW.quantized(w1, transpose=True),
                offsets,
                gather=token,
                lora=LowRank(p, GW.dense(b1, transpose=True), 2.0),
            ),
        ),
        (
            "down_nf4_nested",
            lambda: ops.grouped_matmul(
                act, GW.quantized(w2, transpose=True), offsets, lora=LowRank(p, GW.dense(b2, transpose=True), 2.0)
            ),
        ),
        (
            "down_input_grad_nf4_nested",
            lambda: ops.grouped_matmul(
                g,
                GW.quantized(w2, transpose=False),
                offsets,
                gather=token,
                lora=LowRank(p, GW.dense(a2, transpose=False)),
            ),
        ),
        (
            "gate_up_input_grad_nf4_nested",
            lambda: ops.grouped_matmul(
                grad_h, GW.quantized(w1, transpose=False), offsets, lora=LowRank(p, GW.dense(a1, transpose=False))
            ),
        ),
        ("outer_product", lambda: ops.grouped_outer_product(x, p, offsets, gather=token)),
    ]


def capture_launches(*, arch: int = 90, **layer) -> list[Launch]:
    """The six launches of one MoE layer's forward and backward (`layer`: layer_launch_calls' keywords; launches of
    `weights` "mxfp4" named with "mxfp4" in place of "nf4_nested"), recorded from the real launchers on CPU tensors of
    the real shapes (only shapes, strides and alignment matter here), with `arch`'s default config (autotuning off:
    the config the GPU runs with MOE_QLORA_AUTOTUNE=0, and the autotuner's first candidate). Uniform routing:
    tokens * top_k rows, spread evenly over the experts."""
    from moe_qlora.moe.kernels import tiles, triton_kernels

    launches = layer_launch_calls(**layer)
    weights = layer.get("weights")
    recorded: list[Launch] = []
    real = {n: getattr(triton_kernels, n) for n in ("_grouped_matmul_kernel", "_grouped_outer_product_kernel")}

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: recorded.append(Launch("", self.kernel, grid, args, kwargs))

    try:
        for n, kernel in real.items():
            setattr(triton_kernels, n, Recorder(kernel))
        with tiles.pinned_config(arch):
            for name, launch in launches:
                name = name.replace("nf4_nested", "mxfp4") if weights == "mxfp4" else name
                first = len(recorded)
                launch()
                for rec in recorded[first:]:  # split-K makes two launches: partial sums, then their sum
                    rec.name = name if len(recorded) - first == 1 else f"{name}/split_k_phase{rec.kwargs['PHASE']}"
    finally:
        for n, kernel in real.items():
            setattr(triton_kernels, n, kernel)
    return recorded


class _Recorder:
    """Stands in for a jitted kernel: `kernel[grid](*args, **kwargs)` records the launch instead of running it."""

    def __init__(self, name: str, kernel, recorded: list):
        self.name, self.kernel, self.recorded = name, kernel, recorded

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.recorded.append(Launch(self.name, self.kernel, grid, args, kwargs))


def capture_row_launches(*, hidden: int, inter: int, tokens: int, top_k: int, dtype=None) -> list[Launch]:
    """The three row steps of one layer step (kernels/rows.py: the gate, its backward, the combine; each with its
    LoRA term), recorded from the real launchers on CPU tensors of the real shapes."""
    import torch

    from moe_qlora.moe.kernels import row_kernels, rows

    dtype = dtype or torch.bfloat16
    n = tokens * top_k
    y, u = torch.zeros(n, 2 * inter, dtype=dtype), torch.zeros(n, inter, dtype=dtype)
    sorted_rows, weights = torch.zeros(n, hidden, dtype=dtype), torch.zeros(tokens, top_k, dtype=dtype)
    names = {
        "_silu_mul_kernel": "silu_mul",
        "_silu_mul_backward_kernel": "silu_mul_backward",
        "_combine_kernel": "combine",
    }
    recorded: list[Launch] = []
    real = {name: getattr(row_kernels, name) for name in names}
    try:
        for name, kernel in real.items():
            setattr(row_kernels, name, _Recorder(names[name], kernel, recorded))
        rows.silu_mul(y, y.clone(), 2.0, True, True)
        rows.silu_mul_backward(y, u, u.clone(), 2.0, torch.zeros(n, dtype=dtype), True)
        rows.combine(sorted_rows, sorted_rows.clone(), 2.0, torch.arange(n), weights, top_k, True)
    finally:
        for name, kernel in real.items():
            setattr(row_kernels, name, kernel)
    return recorded


def nvidia_tool(name: str) -> str:
    """The path of one of NVIDIA's binary tools (cuobjdump, nvdisasm) shipped inside triton's wheel."""
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def resource_usage(compiled) -> tuple[int, int]:
    """(registers, spilled bytes: stack + local) from cuobjdump's resource usage of the cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run(
            [nvidia_tool("cuobjdump"), "-res-usage", f.name], check=True, capture_output=True, text=True
        ).stdout

    def figure(name):
        m = re.search(rf"{name}:(\d+)", text)
        return int(m.group(1)) if m else 0

    return figure("REG"), figure("STACK") + figure("LOCAL")


def compile_as_jit(launch: Launch, arch: int):
    """Compile `launch` for sm_`arch` through the JIT's own binder and argument packing (JITFunction.run
    without the driver): the same specialization, signature, constants and attributes the GPU would get.
    Gluon kernels (gluon_nf4.py) go through Gluon's own source class."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    if kernel_is_gluon(launch.kernel):
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource

    kernel = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, launch.kwargs, bound_args, specialization, options
    )
    src = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


def kernel_is_gluon(kernel) -> bool:
    return bool(getattr(kernel, "is_gluon", lambda: False)())


if __name__ == "__main__":
    raise SystemExit(main())
