"""One MoE experts layer, forward + backward: time and peak memory, with a roofline line per case.

python scripts/bench_moe.py                 # CPU: shapes shrunk 8x (about 2 minutes on 2 cores)
python scripts/bench_moe.py --full          # GPU: Mixtral-8x7B and Qwen3-30B-A3B layer shapes, 512..16k tokens

Contenders, side by side in one run, on the same random weights and routing:
  moe-qlora triton      NF4 experts, grouped Triton kernels decoding NF4 in registers (CUDA only)
  moe-qlora grouped_mm  NF4 experts, each stack decoded to a buffer, then torch._grouped_mm (LoRA unmerged)
  moe-qlora auto        per call: triton below model.fused_below_rows rows per expert, grouped_mm above (CUDA)
  moe-qlora torch       NF4 experts, the per-expert torch reference
  transformers+PEFT     bf16/fp32 experts (what bitsandbytes leaves), PEFT target_parameters LoRA on them,
                        transformers' grouped_mm and eager experts
Roofline: the bytes the layer must read (NF4 experts of the experts that get tokens, activations) and the
FLOPs it must do, and the ideal time on an H100 (3.35 TB/s, 990 TFLOP/s bf16 dense).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

H100_BYTES_PER_S, H100_FLOPS = 3.35e12, 990e12
SHAPES = {"mixtral-8x7b": (4096, 14336, 8, 2), "qwen3-30b-a3b": (2048, 768, 128, 8)}  # hidden, inter, E, top-k


def experts_module(hidden, inter, num_experts, top_k, dtype):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=num_experts,
                        num_experts_per_tok=top_k)  # fmt: skip
    torch.manual_seed(0)
    module = MixtralExperts(cfg).to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return module, cfg


def ours(module, cfg, kernels, rank):
    """The experts module as a default run holds it: NF4 stacks with nested block scales
    (model.expert_double_quant), expert LoRA of `rank`, `kernels`."""
    from moe_qlora.config import ModelSection
    from moe_qlora.experts import attach_expert_lora, register_experts_implementation, set_moe_kernels
    from moe_qlora.nf4 import quantize_stack

    nested = ModelSection.model_fields["expert_double_quant"].default
    for name in ("gate_up_proj", "down_proj"):
        setattr(module, name, quantize_stack(getattr(module, name).detach().float(), double_quant=nested))
    register_experts_implementation()
    cfg._experts_implementation = "moe_qlora"
    attach_expert_lora(module, rank=rank, alpha=2 * rank, seed=0)
    set_moe_kernels(module, kernels)
    return module


def peft(module, cfg, implementation, rank):
    from peft import LoraConfig, inject_adapter_in_model

    cfg._experts_implementation = implementation
    for p in module.parameters():
        p.requires_grad_(False)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[], target_parameters=["gate_up_proj", "down_proj"])
    wrapper = torch.nn.ModuleDict({"experts": module})
    inject_adapter_in_model(lora, wrapper)
    return wrapper["experts"]


def roofline(tokens, hidden, inter, num_experts, top_k, rank, active):
    """(bytes, flops, ideal seconds on an H100) of forward + backward with NF4 experts and LoRA."""
    rows = tokens * top_k
    expert_bytes = active * 3 * hidden * inter * (0.5 + 4 / 64)  # NF4 codes + fp32 absmax per 64
    act_bytes = 2 * (tokens * hidden * 4 + rows * 3 * inter * 2)  # x, out, grads (bf16) and h, a kept
    fwd = 2 * rows * 3 * hidden * inter + 2 * rows * rank * 2 * (hidden + 3 * inter)
    flops = fwd * 2  # backward: the input gradient (same size) + LoRA gradients (rank-sized, in fwd term)
    total = 2 * expert_bytes + act_bytes  # experts read in forward and again in backward
    return total, flops, max(total / H100_BYTES_PER_S, flops / H100_FLOPS)


def measure(layer, x, idx, weights, repeats):
    """(best seconds, peak MiB above what was allocated before the step) of forward + backward.

    Peak: CUDA's allocator peak, or on the CPU the resident-set watermark (VmHWM, restarted before each step
    after freed heap pages are returned), both minus the memory held before the step: the step's
    activations, saved tensors and transient (e.g. dequantized) weights, not the stored experts."""
    from moe_qlora.memory import peak_rss_mib, release_freed_memory, reset_peak_rss, rss_mib

    cuda = x.device.type == "cuda"
    times, peaks = [], []
    for i in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() / 2**20
        else:
            release_freed_memory()
            before = rss_mib() if reset_peak_rss() else float("nan")
        t0 = time.perf_counter()
        xi = x.clone().requires_grad_(True)
        layer(xi, idx, weights).float().square().mean().backward()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mib()
        for p in layer.parameters():
            p.grad = None
        if i:  # the first run warms up (kernel compilation, allocator)
            times.append(seconds)
            peaks.append(peak - before)
    return min(times), max(peaks)


def stored_mib(layer) -> float:
    """Expert weights (NF4 codes and scales, or the dense stacks) plus LoRA factors, in MiB."""
    from moe_qlora.nf4 import stack_nbytes

    total = 0
    for p in layer.parameters():
        total += stack_nbytes(p) if hasattr(p, "quant_state") else p.numel() * p.element_size()
    return total / 2**20


def print_table(results, rooflines):
    """One block per (shape, tokens): its roofline line, then a row per contender."""
    print(f"{'contender':34s} {'fwd+bwd':>10s} {'x ideal':>8s} {'stored MiB':>10s} {'step peak MiB':>13s}")
    case = None
    for r in results:
        if (r["shape"], r["tokens"]) != case:
            case = r["shape"], r["tokens"]
            rl = rooflines[case]
            print(
                f"{case[0]} x {case[1]} tokens: must read {rl['bytes'] / 2**20:.1f} MiB and do "
                f"{rl['flops'] / 1e9:.1f} GFLOP; H100 ideal {rl['h100_ideal_s'] * 1e6:.1f} us ({rl['bound']}-bound)"
            )
        if "skipped" in r:
            print(f"  {r['contender']:32s} skipped: {r['skipped']}")
        else:
            print(f"  {r['contender']:32s} {r['seconds'] * 1e3:8.1f}ms {r['x_over_ideal']:8.0f} "
                  f"{r['stored_mib']:10.1f} {r['step_peak_mib']:13.1f}")  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="real layer shapes (needs a GPU)")
    parser.add_argument("--tokens", type=int, nargs="*")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shrink = 1 if args.full else 8
    token_counts = args.tokens or [512, 2048, 8192, 16384]
    contenders = [("moe-qlora triton", "ours", "triton"), ("moe-qlora grouped_mm", "ours", "grouped_mm"),
                  ("moe-qlora auto", "ours", "auto"), ("moe-qlora torch", "ours", "torch"),
                  ("transformers grouped_mm + PEFT", "peft", "grouped_mm"),
                  ("transformers eager + PEFT", "peft", "eager")]  # fmt: skip
    results, rooflines = [], {}
    for shape_name, (hidden, inter, num_experts, top_k) in SHAPES.items():
        hidden, inter = hidden // shrink, inter // shrink
        for tokens in token_counts:
            g = torch.Generator().manual_seed(1)
            x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
            logits = torch.randn(tokens, num_experts, generator=g)
            weights, idx = torch.topk(logits.softmax(-1), top_k, dim=-1)
            idx, weights = idx.to(device), weights.to(device, dtype)
            active = int(torch.unique(idx).numel())
            nbytes, flops, ideal = roofline(tokens, hidden, inter, num_experts, top_k, args.rank, active)
            rooflines[shape_name, tokens] = {"bytes": nbytes, "flops": flops, "h100_ideal_s": ideal,
                                             "bound": "memory" if nbytes / H100_BYTES_PER_S > flops / H100_FLOPS
                                             else "compute"}  # fmt: skip
            for name, owner, kind in contenders:
                if kind in ("triton", "auto") and owner == "ours" and not cuda:
                    results.append({"shape": shape_name, "tokens": tokens, "contender": name,
                                    "skipped": "needs CUDA"})  # fmt: skip
                    continue
                module, cfg = experts_module(hidden, inter, num_experts, top_k, dtype)
                layer = (ours if owner == "ours" else peft)(module, cfg, kind, args.rank)
                layer = layer.to(device)
                try:
                    seconds, peak = measure(layer, x, idx, weights, args.repeats)
                except Exception as exc:  # a contender that cannot run this case says why, the others go on
                    results.append({"shape": shape_name, "tokens": tokens, "contender": name,
                                    "skipped": f"{type(exc).__name__}: {exc}"[:200]})  # fmt: skip
                    continue
                results.append({"shape": shape_name, "hidden": hidden, "intermediate": inter, "tokens": tokens,
                                "contender": name, "seconds": seconds, "step_peak_mib": peak,
                                "stored_mib": stored_mib(layer), "bytes": nbytes, "flops": flops,
                                "h100_ideal_s": ideal, "x_over_ideal": seconds / ideal})  # fmt: skip
                del layer, module
    print_table(results, rooflines)
    print(json.dumps({"device": device, "dtype": str(dtype), "shrink": shrink, "results": results}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    # On a GPU every case of ours must run: one that raised is a failure, not a skipped contender.
    failed = [r for r in results if cuda and "skipped" in r and r["contender"].startswith("moe-qlora")]
    for r in failed:
        print(f"FAIL  {r['contender']} at {r['shape']}, {r['tokens']} tokens: {r['skipped']}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
