"""Every Triton kernel variant compiled exactly as the JIT specializes it at real layer shapes, read from its
SASS: registers, spills, shared memory, warps and stages, MMA instructions per K-step, non-MMA instructions
per decoded weight element, the widest global load of packed NF4 bytes, and the ceilings instruction issue
alone implies (% of tensor-core peak, % of HBM bandwidth). No GPU needed.

    python scripts/kernel_report.py [--arch 80 --arch 90] [--shape qwen3-30b-a3b] [--json]

The arguments come from the real launchers (moe/kernels/ops.py) called at Qwen3-30B-A3B and Mixtral-8x7B layer
shapes with the kernel replaced by a recorder; they then go through Triton's own binder and argument packing
(the code path of JITFunction.run, minus the driver), so every int equal to 1 becomes a constant and every
int or pointer divisible by 16 carries the divisibility hint, exactly as on the GPU. The inner loop is the
SASS between the loop's label and its backward branch; its instructions are counted with nvdisasm's output.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moe_qlora.moe.kernels import tiles  # noqa: E402
from moe_qlora.moe.kernels.aot import capture_launches, compile_as_jit, nvidia_tool, resource_usage  # noqa: E402

SHAPES = {  # hidden, inter, E, top-k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "gpt-oss-20b": (2880, 2880, 32, 4),
    "deepseek-v4-flash": (4096, 2048, 256, 6),
}
# Per GPU: SMs, boost clock, dense bf16 tensor-core peak, HBM bandwidth (H100 SXM for sm_90, A100-80GB SXM for
# sm_80). Each SM issues at most 4 warp instructions a clock (one per scheduler).
GPUS = {
    90: dict(sms=132, ghz=1.83, tflops=989.4, hbm_tbs=3.35),
    80: dict(sms=108, ghz=1.41, tflops=312.0, hbm_tbs=2.04),
}
TOKENS, RANK = 2048, 16
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def sass_of(cubin: bytes) -> tuple[list[str], dict[str, int]]:
    """The instructions of a cubin's SASS (nvdisasm) and each branch label's instruction index."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [nvidia_tool("nvdisasm"), "-c", f.name], check=True, capture_output=True, text=True
        ).stdout
    instructions, labels = [], {}
    for line in text.splitlines():
        if m := re.match(r"^\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(instructions)
        elif re.search(r"/\*[0-9a-f]{4,}\*/", line):
            instructions.append(line)
    return instructions, labels


def _opcode(line: str) -> str:
    body = re.sub(r"/\*[0-9a-f]+\*/", "", line).strip().rstrip(";").strip()
    body = re.sub(r"^@!?U?P\w+\s+", "", body)
    return body.split()[0] if body else ""


def innermost_loop(sass: tuple[list[str], dict[str, int]]) -> list[str]:
    """The hottest loop's instructions: among the backward branches (a branch to an earlier label) whose body
    holds MMAs, the longest (the K loop, which decodes the weights; the fused LoRA term's rank loop may hold
    more MMAs, of a smaller shape, in a much shorter body); for MMA-free kernels the longest loop."""
    instructions, labels = sass
    best, best_key = [], (-1, -1)
    for i, line in enumerate(instructions):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", line)
        if m is None or labels.get(m.group(1), i + 1) > i:
            continue
        body = instructions[labels[m.group(1)] : i + 1]
        key = (min(1, sum(_is_mma(_opcode(b)) for b in body)), len(body))
        if key > best_key:
            best, best_key = body, key
    return best


def _is_mma(op: str) -> bool:
    return op.startswith(("HMMA", "HGMMA", "WGMMA", "IMMA"))


def mma_feed(loop: list[str]) -> dict:
    """How the K loop feeds the tensor cores, read from its SASS (instructions predicated never, `@!PT`, left out):

    mma_a_from_registers            every HGMMA takes A from registers (`HGMMA... Rd, Ra, gdesc[...]`), not from
                                    a shared-memory descriptor; HMMA (sm_80) always reads registers: True; no MMA:
                                    None
    wgmma_max_pending               the wgmma groups left in flight by the loop's strictest wait
                                    (`WARPGROUP.DEPBAR.LE gsb0, N`): 0 drains the MMAs every K-step, >= 1 overlaps
                                    them with the next step's loads and decode; None without HGMMA
    barriers_per_kstep              BAR.* (CTA-wide barriers) in the loop
    decoded_tile_stores_per_kstep   STS* (stores to shared memory) in the loop: the decoded weight tile's round
                                    trip to the MMA, and the NF4 table's refills
    table_loads_per_kstep           LDS* that are not ldmatrix (LDSM): Triton's tl.gather of the NF4 table reads
                                    it from shared memory, one load per decoded weight"""
    live = [x for x in loop if not re.search(r"@!PT\b", x)]
    ops = [_opcode(x) for x in live]
    hgmma = [x for x, op in zip(live, ops, strict=True) if op.startswith("HGMMA")]
    waits = [int(m.group(1), 16) for x in live if (m := re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*(0x[0-9a-f]+)", x))]
    if hgmma:
        a_regs = all(re.search(r"HGMMA\S*\s+R\d+,\s*R\d+,", x) for x in hgmma)
    else:
        a_regs = True if any(op.startswith("HMMA") for op in ops) else None
    return {
        "mma_a_from_registers": a_regs,
        "wgmma_max_pending": (min(waits) if waits else None) if hgmma else None,
        "barriers_per_kstep": sum(op.startswith("BAR.") or op == "BAR" for op in ops),
        "decoded_tile_stores_per_kstep": sum(op.startswith("STS") for op in ops),
        "table_loads_per_kstep": sum(op.startswith("LDS") and not op.startswith("LDSM") for op in ops),
    }


# Issue 67's item 2, per NF4 launch: what the fastest 4-bit kernels' K loops look like (Machete, Marlin).
ITEM2 = dict(max_regs=240, max_barriers_per_kstep=1, max_instr_per_weight_element=5.0)


def item2_misses(row: dict) -> list[str]:
    """Which of issue 67's targets an NF4 launch's row misses (none: [])."""
    if row.get("instr_per_weight_element") is None:
        return []
    misses = []
    if row["spills"]:
        misses.append(f"spills {row['spills']} B")
    if row["regs"] > ITEM2["max_regs"]:
        misses.append(f"{row['regs']} registers")
    if row["instr_per_weight_element"] > ITEM2["max_instr_per_weight_element"]:
        misses.append(f"{row['instr_per_weight_element']} instructions per decoded weight")
    if row["table_loads_per_kstep"]:
        misses.append(f"{row['table_loads_per_kstep']} NF4 table loads from shared memory")
    if row["arch"] == "90":
        if not row["wgmma_max_pending"]:
            misses.append("wgmma drained every K-step")
        if not row["mma_a_from_registers"] and row["decoded_tile_stores_per_kstep"]:
            misses.append("decoded tile stored to shared memory for the MMA")
        if row["barriers_per_kstep"] > ITEM2["max_barriers_per_kstep"]:
            misses.append(f"{row['barriers_per_kstep']} barriers per K-step")
    elif row["decoded_tile_stores_per_kstep"]:
        misses.append("decoded tile through shared memory")
    return misses


_CODE_TILE_LOAD = re.compile(r"(?:tt\.load|async_copy_global_to_local).*tensor<(\d+)x(\d+)x!tt\.ptr<(i8|i32)>, (#\w+)>")


def _packed_load_bytes(ttgir: str) -> int | None:
    """Bytes each thread loads at once from the packed NF4 codes, read from the TTGIR the JIT compiles: the
    loads (or cp.async copies into shared memory) of 2-D tiles of bytes, or of the 4-byte words the packed
    paths read, whose blocked layout gives each thread sizePerThread[order[0]] consecutive elements along the
    contiguous dim (the narrowest such load, so one byte-at-a-time read is not hidden by a wide one). The
    nested scale codes are bytes too, but one per column or row (a 1 x N or K x 1 tensor), and so are MXFP4's
    exponents, one per 32 codes (a K x 2 tensor for a 64-code step): not counted. In the SASS 16-byte runs become
    LDGSTS.E.BYPASS.128, 8-byte ones LDGSTS.E.64."""
    layouts = dict(re.findall(r"^(#\w+) = #ttg\.blocked<(.*)>$", ttgir, re.M))
    widths = []
    for rows, cols, element, layout in _CODE_TILE_LOAD.findall(ttgir):
        scales = min(int(rows), int(cols)) == 1 or (element == "i8" and min(int(rows), int(cols)) <= 4)
        if scales or layout not in layouts:
            continue
        size = [int(v) for v in re.search(r"sizePerThread = \[([\d, ]+)\]", layouts[layout]).group(1).split(",")]
        order = [int(v) for v in re.search(r"order = \[([\d, ]+)\]", layouts[layout]).group(1).split(",")]
        widths.append(min(size[order[0]] * (4 if element == "i32" else 1), 16))
    return min(widths, default=None)


def report(
    archs: list[int],
    shapes: list[str],
    *,
    candidates: bool = False,
    tokens: int = TOKENS,
    dtype: str = "bf16",
    weights: str = "nf4_nested",
) -> list[dict]:
    """One row per launch, shape and arch with the config it takes when not autotuned (its class's default:
    tiles.launch_candidates); with `candidates`, one per autotune candidate the autotuner times for the launch
    (named launch@BLOCK_MxBLOCK_NxBLOCK_K/warps/stages; tiles.MatmulConfig.serves) instead. `dtype`: the
    activations, bf16 or fp32 (whose launches all take tiles.FP32_CONFIG, so `candidates` adds nothing there).
    `weights`: the experts' storage, nf4_nested (the default), nf4 or mxfp4 (gpt-oss's, as published)."""
    rows = []
    for shape in shapes:
        for arch in archs:
            for config in tiles.MATMUL_CONFIGS[arch] if candidates else [None]:
                rows += _report_config(shape, arch, config, tokens, dtype, weights)
    return rows


def _tag(config) -> str:
    return f"@{config.block_m}x{config.block_n}x{config.block_k}/{config.num_warps}/{config.num_stages}"


def _timed_for(launch, config, tall: bool, arch: int) -> bool:
    """Whether the autotuner times `config` for this launch (tiles.MatmulConfig.serves; `tall`: the launch has
    the rows per expert of the 128-row class; the same tensor-core instruction as the class's default,
    tiles.mma_kind) and the launch recorded with it pinned ran it (not the shipped default a pinned config that
    does not serve falls back to)."""
    c, kw = launch.constexprs, launch.kwargs
    flags = (bool(c.get("K_PACKED")), bool(c.get("GLU")), bool(c.get("SWAP_AB")), tall)
    if not config.serves(*flags):
        return False
    default = next(d for d in tiles.MATMUL_CONFIGS[arch] if d.serves(*flags))
    if tiles.mma_kind(config, arch, flags[2]) != tiles.mma_kind(default, arch, flags[2]):
        return False
    rows = 64 if c.get("SWAP_AB") else c["BLOCK_M"]  # swapped 16-row tiles run the 64-row class's configs
    ran = (rows, c["BLOCK_N"], c["BLOCK_K"], kw["num_warps"], kw["num_stages"])
    return ran == (config.block_m, config.block_n, config.block_k, config.num_warps, config.num_stages)


def _report_config(
    shape: str, arch: int, config, tokens: int, dtype: str = "bf16", weights: str = "nf4_nested"
) -> list[dict]:
    import torch

    hidden, inter, experts, top_k = SHAPES[shape]
    with tiles.pinned_config(arch, config):
        launches = capture_launches(
            hidden=hidden,
            inter=inter,
            experts=experts,
            top_k=top_k,
            tokens=tokens,
            rank=RANK,
            arch=arch,
            dtype=getattr(torch, DTYPES[dtype]),
            weights=weights,
        )
    rows = []
    for launch in launches:
        tall = tiles.takes_tall_tiles(tokens * top_k, experts, bool(launch.constexprs.get("SWAP_AB")))
        if config is not None and (launch.name == "outer_product" or not _timed_for(launch, config, tall, arch)):
            continue  # not autotuned, or a candidate the autotuner never times for this launch
        tag = _tag(config) if config is not None else ""
        c = launch.constexprs
        compiled = compile_as_jit(launch, arch)
        meta = compiled.metadata
        regs, spilled = resource_usage(compiled)
        loop = innermost_loop(sass_of(compiled.asm["cubin"]))
        mma = sum(_is_mma(_opcode(x)) for x in loop)
        non_mma = len(loop) - mma
        nf4 = bool(c.get("W_NF4"))
        # Weight elements decoded per K-step: a BLOCK_K x BLOCK_N tile (two with the fused gate/up). SASS
        # runs per thread, and a thread decodes 1 / (32 x warps) of them.
        decoded = c["BLOCK_K"] * c["BLOCK_N"] * (2 if c.get("GLU") else 1) if nf4 else 0
        per_thread = decoded / (32 * meta.num_warps)
        row = {
            "name": f"{shape}/{launch.name}{tag}",
            "arch": str(arch),
            "regs": regs,
            "spills": spilled,
            "smem_bytes": meta.shared,
            "warps": meta.num_warps,
            "stages": meta.num_stages,
            "mma_per_kstep": mma,
            "loop_instructions": len(loop),
            "instr_per_weight_element": round(non_mma / per_thread, 1) if decoded else None,
            "widest_packed_load_bytes": _packed_load_bytes(compiled.asm["ttgir"]) if nf4 else None,
            "blocks": [c["BLOCK_M"], c["BLOCK_N"], c.get("BLOCK_K", c.get("BLOCK_S"))],
            "swap_ab": bool(c.get("SWAP_AB")),
            **mma_feed(loop),
        }
        row["item2_misses"] = item2_misses(row)
        rows.append(row | implied_ceilings(c, len(loop), meta.num_warps, arch))
    return rows


def implied_ceilings(c: dict, loop_instructions: int, warps: int, arch: int) -> dict:
    """Upper bounds from instruction issue alone, the kernel's inner loop running on every SM: the share of
    the tensor-core peak its MMAs could use, and of HBM bandwidth its weight reads could use.

    One K-step of a CTA issues loop_instructions x warps warp-instructions, at most 4 a clock per SM; in that
    time it does 2 x BLOCK_M x BLOCK_N x BLOCK_K FLOP (twice with the fused gate/up) and reads its weight
    tile: BLOCK_K x BLOCK_N / 2 NF4 bytes plus one 1-byte (nested) or 4-byte scale per 64 (MXFP4: one exponent
    byte per 32), or 2 bytes per element dense. Latency, occupancy and memory stalls only lower these: a ceiling,
    not a prediction."""
    gpu = GPUS[arch]
    block_k = c.get("BLOCK_K", c.get("BLOCK_S"))
    tiles = 2 if c.get("GLU") else 1
    flop = 2 * c["BLOCK_M"] * c["BLOCK_N"] * block_k * tiles
    elements = block_k * c["BLOCK_N"] * tiles
    if c.get("MXFP4"):
        weight_bytes = elements / 2 + elements / 32
    elif c.get("W_NF4"):
        weight_bytes = elements / 2 + elements / 64 * (1 if c.get("NESTED") else 4)
    else:
        weight_bytes = elements * 2
    issue_clocks = loop_instructions * warps / 4
    mma_clocks = flop / (gpu["tflops"] * 1e12 / (gpu["sms"] * gpu["ghz"] * 1e9))
    hbm_per_clock = gpu["hbm_tbs"] * 1e12 / (gpu["ghz"] * 1e9)
    clocks = max(issue_clocks, mma_clocks)
    return {
        "tensor_core_ceiling_pct": round(100 * mma_clocks / clocks, 1),
        "hbm_ceiling_pct": round(min(100.0, 100 * weight_bytes * gpu["sms"] / clocks / hbm_per_clock), 1),
    }


GLUON_STEPS_PER_LOOP = 4  # gluon_nf4's K loop is unrolled by its four activation slots


def gluon_report(arch: int, shapes: list[str], block_t: int = 64, rank: int = RANK) -> list[dict]:
    """Rows of the Gluon NF4 kernel (moe/kernels/gluon_nf4.py; gluon_nf4_sm80.py below sm_90) for each shape's two
    forward launches with their LoRA term of rank `rank`: down (N = hidden, K = inter), and gate_up with silu(gate)
    * up fused, reading the tokens by index (N = 2 inter, K = hidden); plus on sm_90 the control of the first: the
    same kernel waiting for each wgmma to finish (drained). Counts are per K-step (the loop holds four);
    lora_k_per_block is the K the LoRA term's MMAs cover per 64 weight rows (the rank rounded up to the MMA's 16,
    not to a K-step)."""
    import torch

    from moe_qlora.moe.kernels import gluon_decode, gluon_nf4
    from moe_qlora.moe.kernels.aot import Launch
    from moe_qlora.moe.kernels.ops import GroupedWeight, LowRank
    from moe_qlora.moe.nf4 import NF4Stack

    def tiny(dtype):  # only the pointer's alignment reaches the compiler
        return torch.zeros(64, dtype=dtype)

    rows = []
    for shape in shapes:
        hidden, inter, experts, _ = SHAPES[shape]
        for wname, (n, k) in {"down": (hidden, inter), "gate_up": (2 * inter, hidden)}.items():
            for pending in (1, 0) if (shape, wname) == (shapes[0], "down") and arch == 90 else (1,):
                stack = NF4Stack(tiny(torch.uint8), tiny(torch.uint8), (tiny(torch.float32), tiny(torch.float32), 0.01),
                                 (experts, n, k))  # fmt: skip
                tiles = tuple(tiny(torch.int32) for _ in range(3))
                x, out = torch.empty(0, k, dtype=torch.bfloat16), torch.empty(0, n, dtype=torch.bfloat16)
                lora = LowRank(torch.empty(0, rank, dtype=torch.bfloat16),
                               GroupedWeight.dense(torch.empty(experts, rank, n), transpose=False), 2.0)  # fmt: skip
                act = torch.empty(0, n // 2, dtype=torch.bfloat16) if wname == "gate_up" else None
                gather = tiny(torch.int32) if wname == "gate_up" else None  # the gate_up launch reads tokens by index
                kernel, grid, args, kwargs = gluon_nf4.swapped_launch(
                    x, stack, tiles, out, block_t, pending, arch, lora=lora, act=act, gather=gather
                )
                compiled = compile_as_jit(Launch(wname, kernel, grid, args, kwargs), arch)
                regs, spilled = resource_usage(compiled)
                sass = sass_of(compiled.asm["cubin"])
                loop = innermost_loop(sass)
                mma = sum(_is_mma(_opcode(x)) for x in loop)
                per_step = (len(loop) - mma) / GLUON_STEPS_PER_LOOP
                feed = mma_feed(loop)
                for key in ("barriers_per_kstep", "decoded_tile_stores_per_kstep", "table_loads_per_kstep"):
                    feed[key] /= GLUON_STEPS_PER_LOOP
                outside = sum(_is_mma(_opcode(x)) for x in sass[0]) - mma * (1 if arch == 90 else 1)
                # sm_90: one HGMMA 64 x T x 16 per block per 16 of K; sm_80: per warp, T / 8 HMMA.16816 per 16 of K
                lora_k = outside * 16 / 2 / (1 if arch == 90 else block_t // 8)
                c = dict(
                    BLOCK_M=block_t,
                    BLOCK_N=gluon_decode.BLOCK_N.value,
                    BLOCK_K=gluon_decode.BLOCK_K.value,
                    W_NF4=True,
                    NESTED=True,
                )
                row = {
                    "name": f"{shape}/gluon_{wname}" + ("" if pending else "/drained_control"),
                    "arch": str(arch),
                    "regs": regs,
                    "spills": spilled,
                    "smem_bytes": compiled.metadata.shared,
                    "warps": compiled.metadata.num_warps,
                    "stages": 4,
                    "mma_per_kstep": mma / GLUON_STEPS_PER_LOOP,
                    "loop_instructions": len(loop),
                    "instr_per_weight_element": round(per_step / (c["BLOCK_K"] * c["BLOCK_N"] / 128), 1),
                    "widest_packed_load_bytes": 16,
                    "blocks": [block_t, c["BLOCK_N"], c["BLOCK_K"]],
                    "swap_ab": True,
                    "rank": rank,
                    "lora_k_per_block": lora_k,
                    **feed,
                }
                row["item2_misses"] = item2_misses(row)
                rows.append(row | implied_ceilings(c, round(per_step + mma / GLUON_STEPS_PER_LOOP), 4, arch))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, action="append")
    ap.add_argument("--shape", action="append", choices=list(SHAPES))
    ap.add_argument("--json", action="store_true", help="print only the JSON list")
    ap.add_argument("--candidates", action="store_true", help="also every autotune candidate, not only defaults")
    ap.add_argument(
        "--tokens",
        type=int,
        default=TOKENS,
        help="tokens per layer call (few rows per expert: the packed paths' swapped tiles)",
    )
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="activations (fp32: exact IEEE products)")
    ap.add_argument(
        "--weights", choices=["nf4_nested", "nf4", "mxfp4"], default="nf4_nested", help="the experts' storage"
    )
    ap.add_argument("--gluon", action="store_true", help="the Gluon NF4 kernels instead of the Triton ones")
    ap.add_argument("--rank", type=int, default=RANK, help="the LoRA rank of the Gluon rows")
    args = ap.parse_args()
    if args.gluon:
        shapes = args.shape or ["qwen3-30b-a3b", "mixtral-8x7b"]
        rows = [row for arch in args.arch or [80, 90] for row in gluon_report(arch, shapes, rank=args.rank)]
        print(json.dumps(rows))
        return
    rows = report(
        args.arch or [80, 90],
        args.shape or list(SHAPES),
        candidates=args.candidates,
        tokens=args.tokens,
        dtype=args.dtype,
        weights=args.weights,
    )
    if args.json:
        print(json.dumps(rows))
        return
    head = f"{'variant':<52}{'arch':>5}{'regs':>6}{'spill':>6}{'smem':>8}{'w/s':>6}{'mma/k':>7}"
    head += f"{'instr/elt':>10}{'ld B':>6}{'TC %':>7}{'HBM %':>7}"
    print(head)
    for r in rows:
        per = "-" if r["instr_per_weight_element"] is None else f"{r['instr_per_weight_element']:.1f}"
        ld = "-" if r["widest_packed_load_bytes"] is None else str(r["widest_packed_load_bytes"])
        print(
            f"{r['name']:<52}{r['arch']:>5}{r['regs']:>6}{r['spills']:>6}{r['smem_bytes']:>8}"
            f"{str(r['warps']) + '/' + str(r['stages']):>6}{r['mma_per_kstep']:>7}{per:>10}{ld:>6}"
            f"{r['tensor_core_ceiling_pct']:>7.1f}{r['hbm_ceiling_pct']:>7.1f}"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
