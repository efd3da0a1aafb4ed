"""One MoE experts layer, forward + backward: time and peak memory, with a roofline line per case.

python scripts/bench_moe.py                 # CPU: shapes shrunk 8x (about 2 minutes on 2 cores)
python scripts/bench_moe.py --full          # GPU: Mixtral-8x7B and Qwen3-30B-A3B layer shapes, 512..16k tokens

Contenders, side by side in one run, on the same random weights and routing:
  moe-qlora triton      NF4 experts, grouped Triton kernels decoding NF4 in registers (CUDA only)
  moe-qlora grouped_mm  NF4 experts, each stack decoded to a buffer, then torch._grouped_mm (LoRA unmerged)
  moe-qlora auto        per call: triton below model.fused_below_rows rows per expert, grouped_mm above (CUDA)
  moe-qlora torch       NF4 experts, the per-expert torch reference
  moe-qlora auto, CUDA graph  auto's forward and backward captured once (torch.cuda.make_graphed_callables, after
                        warming up) and replayed: what the host's launches cost a step, against `auto` (CUDA)
  transformers+PEFT     bf16/fp32 experts (what bitsandbytes leaves), PEFT target_parameters LoRA on them,
                        transformers' grouped_mm and eager experts
Each contender runs as a default run holds it (moe-qlora: nested NF4 scales, the 256 MB decode buffer, the
self-check) and is checked at every shape against its fp32 reference on the same weights (ours: the per-expert torch
reference; PEFT's: transformers' eager experts): output and every gradient within TOLERANCE, and no self-check
fallback, or the run fails. Wall time and, on a GPU, kernel time by CUDA events.
Roofline: the bytes the layer must read (the stored bytes of the experts that get tokens: NF4 codes, block and
nested scales; the activations) and the FLOPs it must do, and the ideal time on an H100 (3.35 TB/s, 990 TFLOP/s
bf16 dense). Each layer is built once per shape, on the device (a GPU quantizes it), and reused across token counts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

H100_BYTES_PER_S, H100_FLOPS = 3.35e12, 990e12
SHAPES = {"mixtral-8x7b": (4096, 14336, 8, 2), "qwen3-30b-a3b": (2048, 768, 128, 8)}  # hidden, inter, E, top-k


def experts_module(hidden, inter, num_experts, top_k, dtype, device="cpu"):
    """transformers' MixtralExperts with random weights, built on `device` (a GPU quantizes its own stacks:
    bitsandbytes' CPU quantizer takes ~100 s per Qwen3-30B-A3B layer, its CUDA kernel well under one)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(
        hidden_size=hidden, intermediate_size=inter, num_local_experts=num_experts, num_experts_per_tok=top_k
    )
    torch.manual_seed(0)
    with torch.device(device):
        module = MixtralExperts(cfg).to(dtype)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02, generator=g)
    return module, cfg


def ours(module, cfg, kernels, rank, *, self_check=True):
    """The experts module as a default run holds it: NF4 stacks with nested block scales
    (model.expert_double_quant), expert LoRA of `rank` with non-zero B (so every gradient is exercised), the
    default decode buffer (model.dequant_buffer_mb) and the self-check (model.kernel_self_check), `kernels`."""
    from moe_qlora.config.sections import ModelSection
    from moe_qlora.moe.expert_lora import attach_expert_lora
    from moe_qlora.moe.experts import register_experts_implementation
    from moe_qlora.moe.nf4 import quantize_stack

    nested = ModelSection.model_fields["expert_double_quant"].default
    for name in ("gate_up_proj", "down_proj"):
        setattr(module, name, quantize_stack(getattr(module, name).detach().float(), double_quant=nested))
    register_experts_implementation()
    cfg._experts_implementation = "moe_qlora"
    attach_expert_lora(module, rank=rank, alpha=2 * rank, seed=0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for b in (module.moe_lora.gate_up_b, module.moe_lora.down_b):
            b.copy_(torch.randn(b.shape, generator=g) * 0.01)
    set_kernels(module, kernels, self_check=self_check)
    return module


def set_kernels(module, kernels, *, self_check=True):
    """kernels with a default run's decode buffer and, if `self_check`, a fresh self-check."""
    from moe_qlora.config.sections import ModelSection
    from moe_qlora.moe.experts import set_moe_kernels

    defaults = ModelSection.model_fields
    set_moe_kernels(
        module,
        kernels,
        fused_below_rows=defaults["fused_below_rows"].default,
        dequant_buffer_mb=defaults["dequant_buffer_mb"].default,
        self_check=self_check,
    )


def peft(module, cfg, implementation, rank):
    """PEFT's target_parameters LoRA on the 16-bit stacks (what bitsandbytes leaves), non-zero B like ours."""
    from peft import LoraConfig, inject_adapter_in_model

    cfg._experts_implementation = implementation
    for p in module.parameters():
        p.requires_grad_(False)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[], target_parameters=["gate_up_proj", "down_proj"])
    wrapper = torch.nn.ModuleDict({"experts": module})
    inject_adapter_in_model(lora, wrapper)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    return wrapper["experts"]


def experts_config(layer):
    """The config a (PEFT-wrapped) experts module dispatches on (its _experts_implementation)."""
    return next(m.config for m in layer.modules() if hasattr(m, "config"))


def expert_bytes(layer) -> float:
    """Bytes one expert's weights take as stored (NF4 codes, block scales and nested scales; or 16-bit)."""
    from moe_qlora.moe.nf4 import stack_nbytes

    total = sum(
        stack_nbytes(p) if hasattr(p, "quant_state") else p.numel() * p.element_size()
        for n, p in layer.named_parameters()
        if n.split(".")[-1] in ("gate_up_proj", "down_proj")
        or n.endswith(("gate_up_proj.base_layer", "down_proj.base_layer"))
    )
    return total / experts_config(layer).num_local_experts


def roofline(tokens, hidden, inter, top_k, rank, active, bytes_per_expert, act_size):
    """(bytes, flops, ideal seconds on an H100) of forward + backward: each active expert's stored bytes read in
    the forward and again in the backward, the activations (x, out and their gradients; h and a kept), the
    FLOPs of the six projections' frozen and LoRA products."""
    rows = tokens * top_k
    act_bytes = act_size * (2 * tokens * hidden * 2 + rows * 3 * inter * 2)
    fwd = 2 * rows * 3 * hidden * inter + 2 * rows * rank * 2 * (hidden + 3 * inter)
    flops = fwd * 2  # backward: the input gradient (same size) + LoRA gradients (rank-sized)
    total = 2 * active * bytes_per_expert + act_bytes
    return total, flops, max(total / H100_BYTES_PER_S, flops / H100_FLOPS)


def step(layer, x, idx, weights, seed):
    """One forward + backward; [output, grad x, grad routing weights, LoRA grads...] (fp32, detached)."""
    xi, wi = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    lora = [p for p in layer.parameters() if p.requires_grad]
    for p in lora:
        p.grad = None
    out = layer(xi, idx, wi)
    out.backward(seed.to(out.dtype))
    return [t.detach().float() for t in (out, xi.grad, wi.grad, *[p.grad for p in lora])]


class LayerCall(torch.nn.Module):
    """The experts layer called as (x, idx, weights): what make_graphed_callables captures, leaving the layer
    itself as it was (the other contenders run it eagerly)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, idx, weights):
        return self.layer(x, idx, weights)


def graphed_layer(layer, x, idx, weights):
    """`layer`'s forward and backward as CUDA graphs, captured after 3 eager warm-up calls (kernel compilation,
    autotuning and the self-check happen there): x requires a gradient, the routing weights do not, as measure()
    calls it."""
    sample = (x.clone().requires_grad_(True), idx, weights)
    return torch.cuda.make_graphed_callables(LayerCall(layer), sample, num_warmup_iters=3)


def graphed_step(graphed, x, idx, weights, seed):
    """step() through the graphs: [output, grad x, None in place of the routing weights' gradient (the graphs
    take them as constants), LoRA grads...]; compared on what it has."""
    xi = x.clone().requires_grad_(True)
    lora = [p for p in graphed.parameters() if p.requires_grad]
    for p in lora:
        p.grad = None
    out = graphed(xi, idx, weights)
    out.backward(seed.to(out.dtype))
    return [t.detach().float() if t is not None else None for t in (out, xi.grad, None, *[p.grad for p in lora])]


def max_relative_difference(got: list, expected: list) -> float:
    """The largest over the tensors of max |got - expected| / max |expected| (a None in `got`: not compared)."""
    pairs = [(a, b) for a, b in zip(got, expected, strict=True) if a is not None]
    return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in pairs)


def measure(layer, x, idx, weights, seed, repeats):
    """(best wall seconds, best GPU seconds by CUDA events or None, peak MiB above what was allocated before
    the step, every timed run's GPU seconds) of forward + backward.

    Peak: CUDA's allocator peak, or on the CPU the resident-set watermark (VmHWM, restarted before each step
    after freed heap pages are returned), both minus the memory held before the step: the step's
    activations, saved tensors and transient (e.g. dequantized) weights, not the stored experts."""
    from moe_qlora.common.memory import peak_rss_mib, release_freed_memory, reset_peak_rss, rss_mib

    cuda = x.device.type == "cuda"
    times, gpu_times, peaks = [], [], []
    for i in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() / 2**20
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            release_freed_memory()
            before = rss_mib() if reset_peak_rss() else float("nan")
        t0 = time.perf_counter()
        xi = x.clone().requires_grad_(True)
        layer(xi, idx, weights).backward(seed.to(x.dtype))
        if cuda:
            end.record()
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mib()
        for p in layer.parameters():
            p.grad = None
        if i:  # the first run warms up (kernel compilation, autotuning, the self-check, allocator)
            times.append(seconds)
            gpu_times.append(start.elapsed_time(end) / 1e3 if cuda else None)
            peaks.append(peak - before)
    return min(times), (min(gpu_times) if cuda else None), max(peaks), (gpu_times if cuda else [])


def stored_mib(layer) -> float:
    """Expert weights (NF4 codes and scales, or the dense stacks) plus LoRA factors, in MiB."""
    from moe_qlora.moe.nf4 import stack_nbytes

    total = 0
    for p in layer.parameters():
        total += stack_nbytes(p) if hasattr(p, "quant_state") else p.numel() * p.element_size()
    return total / 2**20


def print_table(results, rooflines):
    """One block per (shape, tokens): its roofline line, then a row per contender."""
    print(
        f"{'contender':34s} {'wall':>9s} {'GPU':>9s} {'x ideal':>8s} {'max rel err':>11s} {'stored MiB':>10s} "
        f"{'step peak MiB':>13s}  check"
    )
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
            continue
        gpu = f"{r['gpu_seconds'] * 1e3:7.2f}ms" if r["gpu_seconds"] is not None else f"{'-':>9s}"
        print(
            f"  {r['contender']:32s} {r['seconds'] * 1e3:7.2f}ms {gpu} {r['x_over_ideal']:8.1f} "
            f"{r['max_relative_error']:11.2e} {r['stored_mib']:10.1f} {r['step_peak_mib']:13.1f}  "
            f"{'PASS' if r['correct'] else 'FAIL'}"
        )


# max |contender - reference| / max |reference| over the output and every gradient, the reference in fp32 on the
# same weights (ours: the per-expert torch reference on the same NF4 stacks and LoRA; PEFT's: transformers' eager
# experts with the same PEFT LoRA). 16-bit contenders round inputs, weights, h and the activation (2**-8 each
# in bf16, compounding through two projections and the gate); fp32 ones differ in summation order only. A wrong
# kernel (gate and up swapped, a routing weight dropped, experts rolled) is off by O(1).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
CONTENDERS = [
    ("moe-qlora triton", "ours", "triton"),
    ("moe-qlora grouped_mm", "ours", "grouped_mm"),
    ("moe-qlora auto", "ours", "auto"),
    ("moe-qlora torch", "ours", "torch"),
    # the 24 GB cards' kernels (sm_80 / sm_89: mma.sync, their tile list) on this GPU: issue 58's item 4
    ("moe-qlora triton, sm_80 configs", "ours", "triton@80"),
    ("transformers grouped_mm + PEFT", "peft", "grouped_mm"),
    ("transformers eager + PEFT", "peft", "eager"),
    # last: a capture that fails leaves the other contenders' figures measured first
    ("moe-qlora auto, CUDA graph", "ours", "auto+graph"),
]


def target_arch(arch: str | None):
    """Launches inside take `arch`'s config list (tiles.MATMUL_CONFIGS) on any GPU, autotuned over it; none: the
    device's own."""
    import contextlib

    from moe_qlora.moe.kernels.tiles import kernel_settings_overridden

    return kernel_settings_overridden(target_arch=int(arch)) if arch else contextlib.nullcontext()


def path_taken(kernels: str, rows: int, num_experts: int) -> str:
    """The path a layer call of `rows` rows takes with `kernels` as a default run sets it (auto: by rows per
    expert against model.fused_below_rows); the self-check may still send it elsewhere (self_check_fallbacks)."""
    from moe_qlora.config.sections import ModelSection
    from moe_qlora.moe.kernel_rule import call_path

    return call_path(kernels, rows, num_experts, ModelSection.model_fields["fused_below_rows"].default)


def out_of_time_row(shape_name: str, tokens: int, rank: int, contender: str) -> dict:
    return {"shape": shape_name, "tokens": tokens, "rank": rank, "contender": contender, "skipped": OUT_OF_TIME}


OUT_OF_TIME = "not measured: out of time"


def bench_shape(shape_name, dims, token_counts, *, device, dtype, rank, repeats, only=None, deadline=None):
    """Every contender (or those named in `only`) at every token count for one layer shape; each layer is built
    (and quantized, on the device) once and reused across token counts. A token count reached after `deadline`
    (time.monotonic()) is not measured: its rows say so. Returns (rows, rooflines)."""
    import copy

    from moe_qlora.moe.experts import kernel_self_check

    hidden, inter, num_experts, top_k = dims
    cuda = device == "cuda"
    contenders = [c for c in CONTENDERS if only is None or c[0] in only]

    def out_of_time():
        return deadline is not None and time.monotonic() > deadline

    if out_of_time():  # read before the layers are built: building a real shape takes seconds
        return [
            out_of_time_row(shape_name, tokens, rank, name) for tokens in token_counts for name, *_ in contenders
        ], {}
    ours_layer = ours(*experts_module(*dims, torch.float32, device), "torch", rank)
    peft_layer = peft(*experts_module(*dims, dtype, device), "grouped_mm", rank)
    peft_reference = copy.deepcopy(peft_layer).float()
    experts_config(peft_reference)._experts_implementation = "eager"
    rows, rooflines = [], {}
    for tokens in token_counts:
        if out_of_time():
            rows += [out_of_time_row(shape_name, tokens, rank, name) for name, *_ in contenders]
            continue
        g = torch.Generator().manual_seed(1)
        x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
        logits = torch.randn(tokens, num_experts, generator=g)
        weights, idx = torch.topk(logits.softmax(-1), top_k, dim=-1)
        idx, weights = idx.to(device), weights.to(device, dtype)
        seed = torch.randn(tokens, hidden, generator=g).to(device)
        active = int(torch.unique(idx).numel())
        per_expert = expert_bytes(ours_layer)
        nbytes, flops, ideal = roofline(
            tokens, hidden, inter, top_k, rank, active, per_expert, torch.finfo(dtype).bits // 8
        )
        rooflines[shape_name, tokens] = {
            "bytes": nbytes,
            "flops": flops,
            "h100_ideal_s": ideal,
            "bound": "memory" if nbytes / H100_BYTES_PER_S > flops / H100_FLOPS else "compute",
        }
        set_kernels(ours_layer, "torch")
        expected = {
            "ours": step(ours_layer, x.float(), idx, weights.float(), seed),
            "peft": step(peft_reference, x.float(), idx, weights.float(), seed),
        }
        for name, owner, kind in contenders:
            row = {"shape": shape_name, "hidden": hidden, "intermediate": inter, "tokens": tokens, "rank": rank}
            row["contender"] = name
            kind, arch = kind.split("@") if "@" in kind else (kind, None)
            kind, graphed = kind.removesuffix("+graph"), kind.endswith("+graph")
            if kind in ("triton", "auto") and owner == "ours" and not cuda:
                rows.append(row | {"skipped": "needs CUDA"})
                continue
            if owner == "ours":
                layer = ours_layer
                set_kernels(layer, kind)
            else:
                layer = peft_layer
                experts_config(layer)._experts_implementation = kind
            try:
                with target_arch(arch):
                    if graphed:
                        layer = graphed_layer(layer, x, idx, weights)
                        error = max_relative_difference(graphed_step(layer, x, idx, weights, seed), expected[owner])
                    else:
                        error = max_relative_difference(step(layer, x, idx, weights, seed), expected[owner])
                    seconds, gpu_seconds, peak, gpu_all = measure(layer, x, idx, weights, seed, repeats)
            except Exception as exc:  # a contender that cannot run this case says why, the others go on
                rows.append(row | {"skipped": f"{type(exc).__name__}: {exc}"[:200]})
                continue
            checker = kernel_self_check(ours_layer) if owner == "ours" else None
            fell_back = [
                f"{key[0]} at {key[-1]} rows/expert: {why}" for key, why in (checker.failed.items() if checker else [])
            ]
            correct = error <= TOLERANCE[dtype] and not fell_back
            best = gpu_seconds if gpu_seconds is not None else seconds
            rows.append(
                row
                | {
                    "seconds": seconds,
                    "gpu_seconds": gpu_seconds,
                    "gpu_seconds_all": gpu_all,
                    "path": path_taken(kind, tokens * top_k, num_experts) if owner == "ours" else kind,
                    "step_peak_mib": peak,
                    "stored_mib": stored_mib(ours_layer if owner == "ours" else layer),
                    "bytes": nbytes,
                    "flops": flops,
                    "expert_bytes": per_expert if owner == "ours" else expert_bytes(layer),
                    "h100_ideal_s": ideal,
                    "x_over_ideal": best / ideal,
                    "max_relative_error": error,
                    "tolerance": TOLERANCE[dtype],
                    "self_check_fallbacks": fell_back,
                    "correct": correct,
                }
            )
    del ours_layer, peft_layer, peft_reference
    return rows, rooflines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="real layer shapes (needs a GPU)")
    parser.add_argument("--shape", choices=list(SHAPES), action="append", help="default: both")
    parser.add_argument("--tokens", type=int, nargs="*")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shrink = 1 if args.full else 8
    token_counts = args.tokens or [512, 2048, 8192, 16384]
    results, rooflines = [], {}
    for shape_name in args.shape or list(SHAPES):
        hidden, inter, num_experts, top_k = SHAPES[shape_name]
        dims = (hidden // shrink, inter // shrink, num_experts, top_k)
        rows, lines = bench_shape(
            shape_name, dims, token_counts, device=device, dtype=dtype, rank=args.rank, repeats=args.repeats
        )
        results += rows
        rooflines |= lines
    print_table(results, rooflines)
    print(json.dumps({"device": device, "dtype": str(dtype), "shrink": shrink, "results": results}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    # Every contender that ran must match its reference; on a GPU every case of ours must also run (one that
    # raised is a failure, not a skipped contender).
    failed = [
        r
        for r in results
        if (not r.get("correct", True)) or (cuda and "skipped" in r and r["contender"].startswith("moe-qlora"))
    ]
    for r in failed:
        why = r.get("skipped") or f"max relative error {r['max_relative_error']:.3g} (tolerance {r['tolerance']:g})" + (
            f"; self-check fell back: {r['self_check_fallbacks']}" if r["self_check_fallbacks"] else ""
        )
        print(f"FAIL  {r['contender']} at {r['shape']}, {r['tokens']} tokens: {why}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
