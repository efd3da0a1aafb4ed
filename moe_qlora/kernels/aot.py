"""Compile every Triton kernel variant ahead of time for NVIDIA targets, without a GPU.

python -m moe_qlora.kernels.aot [--arch 80 --arch 90] [--json]

Each variant (weights dense / NF4 / NF4 with nested scales, with the fused LoRA term and the fused
silu(gate) * up epilogue, fp32 / bf16 inputs) goes through Triton's
whole pipeline to a cubin for each architecture, so code the interpreter accepts but the compiler
rejects is caught on a CPU machine. Run without TRITON_INTERPRET (it replaces the jitted functions).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

INT = "i32"


def _signature(kernel, types: dict, constexprs: dict) -> dict:
    return {n: ("constexpr" if n in constexprs else types.get(n, INT)) for n in kernel.arg_names}


MATMUL_WEIGHTS = {  # name: (NF4, nested scales, fused LoRA term, fused silu(gate) * up)
    "dense": (False, False, False, False),  # the LoRA A projections x A^T
    "nf4": (True, False, True, False),  # down projection and input gradients, LoRA fused
    "nf4_nested": (True, True, True, False),
    "nf4_nested_silu_mul": (True, True, True, True),  # the gate_up projection with its gating epilogue
}


def matmul_variants():
    """(name, constexprs, pointer/scalar types) of the grouped matmul kernel."""
    for weights, (nf4, nested, lora, glu) in MATMUL_WEIGHTS.items():
        for dtype in ("fp32", "bf16"):
            constexprs = {"W_NF4": nf4, "NESTED": nested, "GATHER": True, "HAS_BIAS": True, "HAS_LORA": lora,
                          "GLU": glu, "STORE_Y": True, "BLOCKSIZE": 64, "IEEE": dtype == "fp32",
                          "DOT_FP32": False, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}  # fmt: skip
            types = {"x_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "act_ptr": f"*{dtype}", "p_ptr": f"*{dtype}",
                     "gather_ptr": "*i64", "tiles_ptr": "*i32", "w_ptr": "*u8" if nf4 else f"*{dtype}",
                     "code_ptr": "*fp32", "absmax_ptr": "*u8" if nested else "*fp32", "absmax2_ptr": "*fp32",
                     "code2_ptr": "*fp32", "offset2": "fp32", "bias_ptr": "*fp32", "l_ptr": "*fp32",
                     "lora_scale": "fp32", "stride_we": "i64"}  # fmt: skip
            yield f"grouped_matmul/{weights}/{dtype}", constexprs, types


def outer_product_variants():
    for dtype in ("fp32", "bf16"):
        constexprs = {"GATHER": True, "IEEE": dtype == "fp32", "DOT_FP32": False, "BLOCK_M": 64, "BLOCK_N": 64,
                      "BLOCK_S": 32}  # fmt: skip
        types = {"a_ptr": f"*{dtype}", "gather_ptr": "*i64", "b_ptr": f"*{dtype}", "offsets_ptr": "*i64",
                 "out_ptr": "*fp32"}  # fmt: skip
        yield f"grouped_outer_product/{dtype}", constexprs, types


def compile_all(archs: list[int]) -> list[dict]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter replaces the kernels that would be compiled")
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .triton_kernels import _grouped_matmul_kernel, _grouped_outer_product_kernel

    results = []
    for kernel, variants in ((_grouped_matmul_kernel, matmul_variants()),
                             (_grouped_outer_product_kernel, outer_product_variants())):  # fmt: skip
        for name, constexprs, types in variants:
            src = ASTSource(fn=kernel, signature=_signature(kernel, types, constexprs), constexprs=constexprs)
            for arch in archs:
                compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
                ptx = compiled.asm["ptx"]
                results.append({"variant": f"{name}/sm_{arch}", "cubin_bytes": len(compiled.asm["cubin"]),
                                "tensor_core_mma": "mma" in ptx, "shared_bytes": compiled.metadata.shared,
                                "warps": compiled.metadata.num_warps})  # fmt: skip
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
            print(f"{r['variant']:45s} cubin {r['cubin_bytes']:7d} B  mma {r['tensor_core_mma']}  "
                  f"warps {r['warps']}  smem {r['shared_bytes']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# ------------------------------------------------------------------------------------------------------
# Compiling as the JIT does: the launchers' real arguments at real layer shapes, specialized by Triton's own
# binder (ints equal to 1 become constants, ints and pointers divisible by 16 carry the hint). Used by
# scripts/kernel_report.py; compile_all above keeps its fixed, shape-free variants as a quick smoke test.


class Launch:
    """One kernel launch as ops.py makes it: the kernel, its grid and its arguments."""

    def __init__(self, name, kernel, grid, args, kwargs):
        self.name, self.kernel, self.grid, self.args, self.kwargs = name, kernel, grid, args, kwargs

    @property
    def constexprs(self) -> dict:
        return {k: v for k, v in self.kwargs.items() if k.isupper()}


def capture_launches(*, hidden: int, inter: int, experts: int, top_k: int, tokens: int, rank: int,
                     dtype=None) -> list[Launch]:  # fmt: skip
    """The six launches of one MoE layer's forward and backward (bf16, NF4 with nested scales, LoRA), recorded
    from the real launchers on CPU tensors of the real shapes (weights are zeros: only shapes, strides and
    alignment matter here). Uniform routing: tokens * top_k rows, spread evenly over the experts."""
    import torch

    from ..nf4 import NF4Stack
    from . import ops, triton_kernels

    dtype = dtype or torch.bfloat16
    rows = tokens * top_k

    def nf4(out, inp):
        numel = experts * out * inp
        blocks = numel // 64
        nested = (torch.zeros(-(-blocks // 256)), torch.zeros(256), 0.0)
        return NF4Stack(torch.zeros(numel // 2, dtype=torch.uint8), torch.zeros(blocks, dtype=torch.uint8), nested,
                        (experts, out, inp))  # fmt: skip

    w1, w2 = nf4(2 * inter, hidden), nf4(hidden, inter)
    a1, b1 = torch.zeros(experts, rank, hidden), torch.zeros(experts, 2 * inter, rank)
    a2, b2 = torch.zeros(experts, rank, inter), torch.zeros(experts, hidden, rank)
    x, g = torch.zeros(tokens, hidden, dtype=dtype), torch.zeros(tokens, hidden, dtype=dtype)
    token = torch.arange(rows) % tokens
    counts = torch.full((experts,), rows // experts)
    counts[: rows % experts] += 1
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    p = torch.zeros(rows, rank, dtype=dtype)
    act, grad_h = torch.zeros(rows, inter, dtype=dtype), torch.zeros(rows, 2 * inter, dtype=dtype)
    GW, LowRank = ops.GroupedWeight, ops.LowRank

    recorded: list[Launch] = []
    real = {n: getattr(triton_kernels, n) for n in ("_grouped_matmul_kernel", "_grouped_outer_product_kernel")}

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: recorded.append(Launch("", self.kernel, grid, args, kwargs))

    launches = [
        ("lora_a_dense", lambda: ops.grouped_matmul(x, GW.dense(a1, transpose=True), offsets, gather=token)),
        ("gate_up_nf4_nested_silu_mul", lambda: ops.grouped_matmul_silu_mul(
            x, GW.quantized(w1, transpose=True), offsets, gather=token,
            lora=LowRank(p, GW.dense(b1, transpose=True), 2.0))),
        ("down_nf4_nested", lambda: ops.grouped_matmul(act, GW.quantized(w2, transpose=True), offsets,
                                                       lora=LowRank(p, GW.dense(b2, transpose=True), 2.0))),
        ("down_input_grad_nf4_nested", lambda: ops.grouped_matmul(
            g, GW.quantized(w2, transpose=False), offsets, gather=token,
            lora=LowRank(p, GW.dense(a2, transpose=False)))),
        ("gate_up_input_grad_nf4_nested", lambda: ops.grouped_matmul(
            grad_h, GW.quantized(w1, transpose=False), offsets, lora=LowRank(p, GW.dense(a1, transpose=False)))),
        ("outer_product", lambda: ops.grouped_outer_product(x, p, offsets, gather=token)),
    ]  # fmt: skip
    try:
        for n, kernel in real.items():
            setattr(triton_kernels, n, Recorder(kernel))
        for name, launch in launches:
            launch()
            recorded[-1].name = name
    finally:
        for n, kernel in real.items():
            setattr(triton_kernels, n, kernel)
    return recorded


def compile_as_jit(launch: Launch, arch: int):
    """Compile `launch` for sm_`arch` through the JIT's own binder and argument packing (JITFunction.run
    without the driver): the same specialization, signature, constants and attributes the GPU would get."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs, bound_args, specialization,
                                                              options)  # fmt: skip
    src = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)
