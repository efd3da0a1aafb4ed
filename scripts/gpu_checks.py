"""The GPU-only checks of scripts/gpu_check.sh that are not tests: per MoE layer call, host syncs counted by
torch.cuda.set_sync_debug_mode; two identical steps compared bit for bit; every autotune candidate against the
default config bit for bit (so the autotuner's pick cannot change a result); the live JIT's register, spill and
shared-memory figures for every Triton kernel variant it compiled (bf16 and fp32); the self-check's verdict on
triton and grouped_mm. Prints a table, a verdict per check and JSON (--json PATH also writes it). The layer is
built and quantized once, on the GPU, and reused throughout (about 1 s; on a CPU it took ~100 s a build).

    python scripts/gpu_checks.py [--tokens 2048] [--tall-tokens 8192] [--decode-tokens 32] [--json out.json]

Layer: Qwen3-30B-A3B's expert shapes (hidden 2048, 128 experts of 768, top-8), NF4 with nested block scales (the
default), bf16 activations, LoRA r16, forward + backward, for kernels triton, grouped_mm and auto.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

HIDDEN, INTER, EXPERTS, TOP_K, RANK = 2048, 768, 128, 8, 16


_LAYER = {}


def qwen3_layer(kernels: str):
    """bench_moe's experts layer at Qwen3-30B-A3B's shapes (Mixtral's experts class: the same math), built and
    NF4-quantized once, on the GPU, and reused for every backend, candidate and token count: non-zero LoRA B,
    the default decode buffer, no self-check (each check here must see the backend it names)."""
    from bench_moe import experts_module, ours, set_kernels

    if "module" not in _LAYER:
        _LAYER["module"] = ours(*experts_module(HIDDEN, INTER, EXPERTS, TOP_K, torch.float32, "cuda"), "torch", RANK)
    set_kernels(_LAYER["module"], kernels, self_check=False)
    return _LAYER["module"]


def self_check_verdicts(x, idx, weights) -> dict[str, str | None]:
    """The self-check's verdict on each non-reference path at this layer and token count: None when it passed
    (the path is kept), else why it fell back."""
    from bench_moe import set_kernels

    from moe_qlora.moe.experts import kernel_self_check

    verdicts = {}
    for kernels in ("triton", "grouped_mm"):
        module = qwen3_layer(kernels)
        set_kernels(module, kernels, self_check=True)
        step(module, x, idx, weights)
        checker = kernel_self_check(module)
        verdicts[kernels] = next(iter(checker.failed.values()), None) if checker.verdicts else "not checked"
    return verdicts


def step(module, x, idx, weights):
    """One forward + backward; returns the output and every gradient."""
    xi, wi = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    for p in module.moe_lora.parameters():
        p.grad = None
    out = module(xi, idx, wi)
    out.float().square().mean().backward()
    return [out, xi.grad, wi.grad, *[p.grad for p in module.moe_lora.factors()]]


def routing(tokens: int):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, HIDDEN, generator=g).cuda().bfloat16()
    logits = torch.randn(tokens, EXPERTS, generator=g)
    weights, idx = torch.topk(logits.softmax(-1), TOP_K, dim=-1)
    return x, idx.cuda(), weights.cuda().bfloat16()


def count_syncs(module, x, idx, weights) -> int:
    """Host syncs of one forward + backward, as torch.cuda's sync debug mode reports them (one warning each)."""
    step(module, x, idx, weights)  # warm-up: JIT compiles and first allocations out of the count
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(module, x, idx, weights)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def bit_identical(module, x, idx, weights) -> bool:
    first, second = step(module, x, idx, weights), step(module, x, idx, weights)
    return all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def candidates_agree(x, idx, weights) -> dict[str, bool]:
    """Whether every autotune candidate of this GPU's list gives the triton layer's step the same bits as the
    default: then which one the autotuner picks (it may differ between processes, e.g. a run and its resume)
    cannot change a result. Returns {candidate: identical to the default}."""
    from moe_qlora.moe.kernels import tiles

    arch = tiles.target_arch("cuda")
    results, reference = {}, None
    for config in list(tiles.MATMUL_CONFIGS[arch]):
        with tiles.pinned_config(arch, config):
            out = step(qwen3_layer("triton"), x, idx, weights)  # the layer is built once: only the config changes
        reference = reference or out
        results[str(config)] = all(torch.equal(a, b) for a, b in zip(reference, out, strict=True))
    return results


def live_kernel_figures() -> list[dict]:
    """Registers, spills, shared memory, warps and stages of every variant the JIT compiled in this process."""
    from moe_qlora.moe.kernels import triton_kernels

    rows = []
    for name in ("_grouped_matmul_kernel", "_grouped_outer_product_kernel"):
        kernel = getattr(triton_kernels, name)
        for device_cache in kernel.device_caches.values():
            for key, compiled in device_cache[0].items():
                compiled._init_handles()
                rows.append(
                    {
                        "kernel": name,
                        "key": str(key)[:120],
                        "regs": compiled.n_regs,
                        "spills": compiled.n_spills,
                        "smem_bytes": compiled.metadata.shared,
                        "warps": compiled.metadata.num_warps,
                        "stages": compiled.metadata.num_stages,
                    }
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--tall-tokens", type=int, default=8192, help="tokens at which launches take 128-row tiles")
    ap.add_argument("--decode-tokens", type=int, default=32, help="tokens at which launches take swapped 16-row tiles")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_checks.py needs a CUDA GPU")
    x, idx, weights = routing(args.tokens)
    results = {"tokens": args.tokens, "syncs": {}, "bit_identical": {}}
    for kernels in ("triton", "grouped_mm", "auto"):
        module = qwen3_layer(kernels)
        results["syncs"][kernels] = count_syncs(module, x, idx, weights)
        results["bit_identical"][kernels] = bit_identical(module, x, idx, weights)
    step(qwen3_layer("triton"), x.float(), idx, weights.float())  # fp32 kernels too, for the spill figures
    results["self_check"] = self_check_verdicts(x, idx, weights)
    # At --tokens (64-row tiles at 2048), --tall-tokens (128-row tiles and their own candidates at 8192: 512 rows
    # per expert) and --decode-tokens (swapped 16-row tiles, as in decoding and GRPO sampling), each against the
    # first config of the list.
    results["candidates_bit_identical"] = candidates_agree(x, idx, weights)
    for tokens in (args.tall_tokens, args.decode_tokens):
        agree = candidates_agree(*routing(tokens))
        results["candidates_bit_identical"] |= {f"{name} @{tokens}": same for name, same in agree.items()}
    results["kernels"] = live_kernel_figures()
    print(f"{'kernels':<12}{'syncs per layer fwd+bwd':>26}{'two steps bit-identical':>26}")
    for k in results["syncs"]:
        print(f"{k:<12}{results['syncs'][k]:>26}{str(results['bit_identical'][k]):>26}")
    for kernels, verdict in results["self_check"].items():
        print(f"self-check {kernels}: {'kept' if verdict is None else verdict}")
    for row in results["kernels"]:
        print(
            f"  {row['kernel']:<32} regs {row['regs']:>4} spills {row['spills']:>4} smem {row['smem_bytes']:>7} "
            f"warps {row['warps']} stages {row['stages']}"
        )
    # grouped_mm under the default buffer budget decodes Qwen3's 768 MiB gate_up stack in chunks: one sync
    # per chunked projection call (3 per forward + backward) is by design; triton must have none.
    verdicts = {
        "triton: no host sync": results["syncs"]["triton"] == 0,
        "all backends: two identical steps bit-identical": all(results["bit_identical"].values()),
        "no kernel spills": all(r["spills"] == 0 for r in results["kernels"]),
        "every autotune candidate gives the default's bits": all(results["candidates_bit_identical"].values()),
        "self-check keeps triton and grouped_mm": all(v is None for v in results["self_check"].values()),
    }
    for name, ok in verdicts.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    results["verdicts"] = verdicts
    print(json.dumps(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    sys.exit(0 if all(verdicts.values()) else 1)


if __name__ == "__main__":
    main()
