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
