"""scripts/kernel_report.py compiles the kernels as the JIT specializes them and reads their SASS. Run in a
subprocess without TRITON_INTERPRET (the interpreter replaces the jitted functions), at Qwen3-30B-A3B's real
shapes for sm_80 and sm_90 with each architecture's default config: the JSON has the keys the issue asks for,
and item 4's targets are held where they are met (no spills, packed codes read 16 bytes at a time on sm_90)
and today's readings pinned where they are not (non-MMA instructions per decoded element: 7.4-8.7 on sm_90,
13.2-16.1 on sm_80, against the issue's target of 6)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEYS = {
    "name",
    "arch",
    "regs",
    "spills",
    "smem_bytes",
    "mma_per_kstep",
    "instr_per_weight_element",
    "widest_packed_load_bytes",
    "tensor_core_ceiling_pct",
    "hbm_ceiling_pct",
    "blocks",
    "swap_ab",
    "mma_a_from_registers",
    "wgmma_max_pending",
    "barriers_per_kstep",
    "decoded_tile_stores_per_kstep",
    "table_loads_per_kstep",
    "item2_misses",
}
# sm_80's list also serves sm_86 / sm_89 (99 KiB per block), sm_90's the H100 (227 KiB).
SHARED_MEMORY_LIMIT = {"80": 99 * 1024, "90": 227 * 1024}


@pytest.fixture(scope="module")
def report():
    """{(arch, launch name): row} of the kernel report at Qwen3-30B-A3B shapes, sm_80 and sm_90."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOE_QLORA_TRITON_BLOCKS")}
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/kernel_report.py",
            "--arch",
            "80",
            "--arch",
            "90",
            "--shape",
            "qwen3-30b-a3b",
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    return {(r["arch"], r["name"].split("/", 1)[1]): r for r in rows}


def nf4_rows(report, arch):
    return {name: r for (a, name), r in report.items() if a == arch and "nf4" in name}


def test_kernel_report_reads_the_jit_specialized_sass(report):
    assert len(report) == 12 and all(KEYS <= set(r) for r in report.values())
    # 2048 tokens, 128 rows per expert: 64-row tiles, not swapped.
    assert all(r["blocks"][0] == 64 and not r["swap_ab"] for r in report.values())
    glu = report[("90", "gate_up_nf4_nested_silu_mul")]
    # 2 tiles (gate, up) x BLOCK_K 64 / 16 per HGMMA.64x64x16; the single-tile kernels half that.
    assert glu["mma_per_kstep"] == 8
    assert all(r["mma_per_kstep"] == 4 for n, r in nf4_rows(report, "90").items() if n != glu["name"].split("/")[1])
    assert report[("90", "lora_a_dense")]["instr_per_weight_element"] is None  # dense weights: nothing decoded


@pytest.mark.parametrize("arch", ["80", "90"])
def test_item4_targets_that_are_met(report, arch):
    """No spills and the block fits the GPU's shared memory for every kernel; packed NF4 codes read at least 8
    bytes at a time (sm_90's 64-code K-steps: 16; sm_80's 32-code ones: 8; it was 1 before the rewrites)."""
    assert all(
        r["spills"] == 0 and r["smem_bytes"] <= SHARED_MEMORY_LIMIT[arch] for (a, _), r in report.items() if a == arch
    )
    assert all(r["widest_packed_load_bytes"] >= 8 for r in nf4_rows(report, arch).values())
    if arch == "90":  # 64-code steps: each thread's run of a column is 4 words, LDGSTS.E.BYPASS.128
        assert all(r["widest_packed_load_bytes"] == 16 for r in nf4_rows(report, arch).values())


def test_instructions_per_decoded_element_as_measured(report):
    """Pinned readings of today's decode at the default config (the issue measured ~30 before; 16.8-23.2 two
    commits before the packed paths): sm_90 gate_up 7.4, down 8.7, input gradients 8.7 (9.2 before their
    K-steps went unmasked); sm_80 13.2-16.1. A regression past these bounds fails.
    The ceilings instruction issue then implies on sm_90: over 45% of tensor peak for gate_up (was 23.6%)."""
    sm90, sm80 = nf4_rows(report, "90"), nf4_rows(report, "80")
    assert sm90["gate_up_nf4_nested_silu_mul"]["instr_per_weight_element"] < 8
    assert all(r["instr_per_weight_element"] < 9 for r in sm90.values())
    assert all(r["instr_per_weight_element"] < 16.5 for r in sm80.values())
    assert sm90["gate_up_nf4_nested_silu_mul"]["tensor_core_ceiling_pct"] > 45
    assert all(r["hbm_ceiling_pct"] > 45 for r in sm90.values())


def test_compile_as_jit_specializes_like_the_jit():
    """The binder turns the activations' unit stride into a constant and hints 16-divisible sizes, which the
    old shape-free AOT variants did not (they compiled every stride as a runtime int)."""
    code = """
import json
from moe_qlora.moe.kernels.aot import capture_launches, compile_as_jit
launch = capture_launches(hidden=256, inter=128, experts=8, top_k=2, tokens=64, rank=16)[1]
k = compile_as_jit(launch, 90)
print(json.dumps({"constants": [str(c) for c in k.src.constants], "sig": k.src.signature, "attrs": str(k.src.attrs)}))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sig"]["stride_xk"] == "constexpr"  # x (T, H) contiguous: stride 1, specialized away
    assert out["sig"]["K"] == "i32" and "tt.divisibility" in out["attrs"]  # K = 256: divisible by 16


def test_the_packed_load_width_is_read_from_the_byte_tiles_layout():
    """_packed_load_bytes reads each thread's run of bytes from the blocked layout of 2-D byte-tile loads and
    passes over a column of nested scale codes; a tile read a byte at a time reads as 1 (the control)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from kernel_report import _packed_load_bytes

    ttgir = """#blocked = #ttg.blocked<{sizePerThread = [1, 8], threadsPerWarp = [8, 4], order = [1, 0]}>
#blocked1 = #ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [32, 1], order = [1, 0]}>
%1 = ttg.async_copy_global_to_local %a, %b mask %m : tensor<32x32x!tt.ptr<i8>, #blocked> -> <32x32xi8>
%2 = tt.load %c, %n : tensor<32x1x!tt.ptr<i8>, #blocked1>
"""
    assert _packed_load_bytes(ttgir) == 8
    # The packed paths' tiles of 4-byte words: each thread's 4 consecutive words are 16 bytes.
    words = ttgir.replace("32x32x!tt.ptr<i8>", "64x8x!tt.ptr<i32>").replace(
        "sizePerThread = [1, 8]", "sizePerThread = [1, 4]"
    )
    assert _packed_load_bytes(words) == 16
    assert _packed_load_bytes(ttgir.replace("sizePerThread = [1, 8]", "sizePerThread = [8, 1]")) == 1
    assert _packed_load_bytes(ttgir.replace("32x32x!tt.ptr<i8>", "32x32x!tt.ptr<bf16>")) is None


# The candidate sweeps of the tile classes with the least register pressure are opt-in (pytest -m aot_sweep, about
# 65 s of compiles on 2 cores): run them after changing the kernels or tiles.MATMUL_CONFIGS. The tall class's, the
# one whose accumulators come nearest to spilling, runs in CI.
SWEEP = pytest.mark.aot_sweep


@pytest.mark.parametrize(
    "tokens",
    [pytest.param(2048, marks=SWEEP), pytest.param(32, marks=SWEEP), 8192],
    ids=["64_row_tiles", "swapped_16_row_tiles", "128_row_tiles"],
)
def test_every_autotune_candidate_compiles_without_spills(tokens):
    """The autotuner may pick any candidate that serves a launch on the GPU, so each is held to item 4's no-spill
    target and the shared-memory limit, at Qwen3-30B-A3B shapes, for both architectures: 128 rows per expert
    (64-row tiles), 2 (swapped 16-row tiles) and 512 (the tall class's 128-row tiles)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOE_QLORA_TRITON_BLOCKS")}
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/kernel_report.py",
            "--candidates",
            "--shape",
            "qwen3-30b-a3b",
            "--tokens",
            str(tokens),
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    from moe_qlora.moe.kernels.tiles import MATMUL_CONFIGS

    # 5 autotuned launches per narrow candidate of the class; a wide one (128 columns) only where it serves:
    # the down projection in 64- and 128-row tiles, both forward projections in swapped 16-row ones; a tall
    # one in 4 warps not for gate_up (its two 128-row accumulators spill there).
    tall = tokens == 8192
    narrow = sum(
        not c.wide and c.tall == tall and not (tall and c.num_warps < 8) for cs in MATMUL_CONFIGS.values() for c in cs
    )
    four_warp_tall = sum(c.tall and not c.wide and c.num_warps < 8 for cs in MATMUL_CONFIGS.values() for c in cs)
    wide = {(r["arch"], r["name"].split("/")[1].split("@")[0]) for r in rows if r["blocks"][1] == 128}
    served = ["down_nf4_nested"] + (["gate_up_nf4_nested_silu_mul"] if tokens == 32 else [])
    assert wide == {(arch, name) for arch in ("80", "90") for name in served}
    # In swapped tiles the NF4 launches (4 of the 5) leave out sm_90's narrow candidates whose MMA M side (their 32
    # weight columns) makes them mma.sync where the default is wgmma (tiles.mma_kind).
    other_mma = sum(not c.wide and not c.tall and c.block_n < 64 for c in MATMUL_CONFIGS[90]) if tokens == 32 else 0
    assert len(rows) == 5 * narrow + (4 * four_warp_tall if tall else 0) + len(wide) - 4 * other_mma
    assert all(r["blocks"][0] == (128 if tall else 16 if tokens == 32 and "nf4" in r["name"] else 64) for r in rows)
    assert all(r["swap_ab"] == (tokens == 32 and "nf4" in r["name"]) for r in rows)
    bad = [
        (r["name"], r["arch"], r["spills"])
        for r in rows
        if r["spills"] or r["smem_bytes"] > SHARED_MEMORY_LIMIT[r["arch"]]
    ]
    assert not bad


def test_few_rows_per_expert_take_swapped_16_row_tiles():
    """At 32 tokens (Qwen3-30B-A3B: 2 rows per expert, a decode or GRPO sampling step) the packed NF4 kernels
    compute their tiles transposed with 16 token rows (the MMA's narrow side) instead of 64, without spills;
    sm_90 then reads 8.0-9.1 instructions per decoded element, and the weight tile 64 x 64 in 16-byte loads."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOE_QLORA_TRITON_BLOCKS")}
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/kernel_report.py",
            "--arch",
            "90",
            "--shape",
            "qwen3-30b-a3b",
            "--tokens",
            "32",
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["name"].split("/", 1)[1]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
    nf4 = {n: r for n, r in rows.items() if "nf4" in n}
    assert len(nf4) == 4 and all(r["swap_ab"] and r["blocks"] == [16, 64, 64] for r in nf4.values())
    assert not rows["lora_a_dense"]["swap_ab"]  # dense weights: the plain tiles
    assert all(r["spills"] == 0 and r["widest_packed_load_bytes"] == 16 for r in nf4.values())
    assert all(r["instr_per_weight_element"] < 10 for r in nf4.values())


def test_many_rows_per_expert_take_128_row_tiles():
    """At 8192 tokens (Qwen3-30B-A3B: 512 rows per expert, past tiles.TALL_MIN_ROWS) every grouped launch takes
    the tall class's 128-row tiles at its default (gate_up in 8 warps), without spills, and the issue-bound
    ceilings rise from 45-53% of tensor peak at 64-row tiles (sm_90) to 77-86%, from 47-56% to 70-82% on sm_80."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOE_QLORA_TRITON_BLOCKS")}
    proc = subprocess.run(
        [sys.executable, "scripts/kernel_report.py", "--shape", "qwen3-30b-a3b", "--tokens", "8192", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {(r["arch"], r["name"].split("/", 1)[1]): r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
    grouped = {key: r for key, r in rows.items() if key[1] != "outer_product"}
    assert len(grouped) == 10 and all(r["blocks"][0] == 128 and r["spills"] == 0 for r in grouped.values())
    assert all(r["warps"] == (8 if "gate_up_nf4_nested_silu" in name else 4) for (_, name), r in grouped.items())
    nf4 = {key: r for key, r in grouped.items() if "nf4" in key[1]}
    floor = {"90": 75, "80": 65}  # % of tensor peak; at 64-row tiles: 45-53 (sm_90), 47-56 (sm_80)
    assert all(r["tensor_core_ceiling_pct"] > floor[arch] for (arch, _), r in nf4.items())
    assert all(r["widest_packed_load_bytes"] >= 8 for r in nf4.values())


def test_split_k_launches_compile_without_spills():
    """Split-K's two launches (partial sums, then their ordered sum and the epilogue) compiled as the JIT would
    for sm_80 and sm_90. At the real models' shapes the launches have enough tiles that no split is chosen, so
    the SM count is raised here to force one (4 splits of gate_up at 32 Qwen3-30B-A3B tokens, 2 of down)."""
    code = """
import json, sys
sys.path.insert(0, "scripts")
from kernel_report import resource_usage
from moe_qlora.moe.kernels import ops, tiles
from moe_qlora.moe.kernels.aot import capture_launches, compile_as_jit
tiles.SPLIT_K_SMS = 10**4
out = []
for arch in (80, 90):
    for launch in capture_launches(hidden=2048, inter=768, experts=128, top_k=8, tokens=32, rank=16, arch=arch):
        if "split_k" in launch.name:
            k = compile_as_jit(launch, arch)
            out.append([arch, launch.name, launch.kwargs["SPLIT_K"], k.metadata.shared, resource_usage(k)[1]])
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOE_QLORA_TRITON_BLOCKS")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    names = {name for _, name, *_ in rows}
    assert {
        "gate_up_nf4_nested_silu_mul/split_k_phase1",
        "gate_up_nf4_nested_silu_mul/split_k_phase2",
        "down_input_grad_nf4_nested/split_k_phase1",
        "down_input_grad_nf4_nested/split_k_phase2",
    } <= names
    assert all(
        split >= 2 and smem <= SHARED_MEMORY_LIMIT[str(arch)] and spills == 0 for arch, _, split, smem, spills in rows
    )
    assert {split for arch, name, split, *_ in rows if name.startswith("gate_up_nf4_nested_silu_mul")} == {4}


def test_the_24_gb_cards_compile_within_their_shared_memory():
    """RTX 3090 / 4090 class GPUs (sm_86, sm_89) take sm_80's list (tiles.target_arch) but allow a block only
    99 KB of shared memory: every candidate, at 2048, 32 and 8192 Qwen3-30B-A3B tokens (64-row, swapped and
    128-row tiles; a candidate that does not serve a launch compiles the default there), compiled for them, fits it
    without spills."""
    code = """
import json, sys
sys.path.insert(0, "scripts")
from kernel_report import resource_usage
from moe_qlora.moe.kernels import ops, tiles
from moe_qlora.moe.kernels.aot import capture_launches, compile_as_jit
out = []
for config in list(tiles.MATMUL_CONFIGS[80]):
    tiles.MATMUL_CONFIGS[80] = [config]
    for tokens in (2048, 32, 8192):
        for launch in capture_launches(hidden=2048, inter=768, experts=128, top_k=8, tokens=tokens, rank=16, arch=80):
            for arch in (86, 89):
                k = compile_as_jit(launch, arch)
                out.append([arch, launch.name, tokens, k.metadata.shared, resource_usage(k)[1]])
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOE_QLORA_TRITON_BLOCKS")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    from moe_qlora.moe.kernels.tiles import MATMUL_CONFIGS

    assert len(rows) == len(MATMUL_CONFIGS[80]) * 3 * 6 * 2  # candidates x token counts x launches x archs
    assert [r for r in rows if r[3] > 99 * 1024 or r[4]] == []


@pytest.mark.parametrize("tokens", [2048, 32])
def test_fp32_kernels_compile_without_spills(tokens):
    """fp32 activations multiply on the FMA units (exact IEEE products), where the bf16 tiles spill 300-11,552
    bytes per thread on sm_90; fp32 launches take tiles.FP32_CONFIG and the outer product OUTER_BLOCKS_FP32, which
    spill nowhere, on either architecture, at 128 and at 2 rows per expert (never swapped in fp32)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOE_QLORA_TRITON_BLOCKS")}
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/kernel_report.py",
            "--dtype",
            "fp32",
            "--shape",
            "qwen3-30b-a3b",
            "--tokens",
            str(tokens),
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 12 and not any(r["swap_ab"] for r in rows)
    assert all(r["mma_per_kstep"] == 0 for r in rows)  # no tensor cores: exact products
    bad = [
        (r["name"], r["arch"], r["regs"], r["spills"])
        for r in rows
        if r["spills"] or r["smem_bytes"] > SHARED_MEMORY_LIMIT[r["arch"]]
    ]
    assert not bad


@pytest.mark.parametrize("tokens", [2048, 64], ids=["128_row_tiles", "swapped_16_row_tiles"])
def test_mxfp4_kernels_compile_without_spills(tokens):
    """gpt-oss's MXFP4 experts at gpt-oss-20b's layer shape, sm_80 and sm_90 defaults: every launch gpt-oss makes
    (its gate is its own, so gate_up runs as a plain matmul like down) takes the packed paths without spills, and
    issues as many instructions per decoded weight as NF4 does there (measured: sm_90 9.3-10.0 against NF4's
    10.2-10.8 at 2048 tokens; sm_80 12.2-21.2), its codes read as 4-byte words (NF4's too at this shape; the
    exponent bytes, a K x 2 tile, are not code loads). The fused silu(gate) * up variant, which gpt-oss never runs,
    spills 8 bytes on sm_80 at 128-row tiles and is left out."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOE_QLORA_TRITON_BLOCKS")}
    command = [sys.executable, "scripts/kernel_report.py", "--arch", "80", "--arch", "90", "--shape", "gpt-oss-20b"]
    command += ["--weights", "mxfp4", "--tokens", str(tokens), "--json"]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [r for r in json.loads(proc.stdout.strip().splitlines()[-1]) if "mxfp4" in r["name"]]
    gpt_oss = [r for r in rows if "silu_mul" not in r["name"]]
    assert len(gpt_oss) == 6
    assert all(r["spills"] == 0 and r["smem_bytes"] <= SHARED_MEMORY_LIMIT[r["arch"]] for r in gpt_oss), gpt_oss
    assert all(r["instr_per_weight_element"] < (11 if r["arch"] == "90" else 22) for r in gpt_oss)
    assert all(r["widest_packed_load_bytes"] >= 4 for r in gpt_oss)  # codes as whole words, as NF4's at this shape


@pytest.mark.parametrize("tokens", [2048, pytest.param(64, marks=SWEEP)], ids=["128_row_tiles", "swapped_16_row_tiles"])
def test_mxfp4_kernels_compile_without_spills_at_deepseek_v4_flash_shape(tokens):
    """DeepSeek-V4-Flash's FP4 experts kept as MXFP4, at its layer shape (hidden 4096, inter 2048, 256 experts,
    top-6), sm_80 and sm_90 defaults: every launch compiles without spills, the fused silu(gate) * up one included
    (V4 gates with its own clamped SwiGLU, so its gate_up runs as the plain matmul down runs), with the codes read
    16 bytes at a time on sm_90 and 8 on sm_80. Measured at 2048 tokens: sm_90 6.7-8.1 instructions per decoded
    weight, sm_80 12.1-14.8."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MOE_QLORA_TRITON_BLOCKS")}
    command = [sys.executable, "scripts/kernel_report.py", "--arch", "80", "--arch", "90"]
    command += ["--shape", "deepseek-v4-flash", "--weights", "mxfp4", "--tokens", str(tokens), "--json"]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [r for r in json.loads(proc.stdout.strip().splitlines()[-1]) if "mxfp4" in r["name"]]
    assert len(rows) == 8
    assert all(r["spills"] == 0 and r["smem_bytes"] <= SHARED_MEMORY_LIMIT[r["arch"]] for r in rows), rows
    assert all(r["widest_packed_load_bytes"] == (16 if r["arch"] == "90" else 8) for r in rows), rows
    assert all(r["instr_per_weight_element"] < (11 if r["arch"] == "90" else 22) for r in rows)


def test_the_mma_feed_is_read_off_the_loop_sass():
    """kernel_report.mma_feed on SASS lines as nvdisasm prints them (Triton 3.9, sm_90): A from registers or from a
    shared-memory descriptor, the strictest wgmma wait, barriers, shared stores and table loads, with the never-run
    `@!PT` loads left out."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from kernel_report import mma_feed

    pipelined = [
        "        /*0a10*/                   LDS R20, [R8+0x3000] ;",
        "        /*0a20*/                   @!PT LDS RZ, [RZ] ;",
        "        /*0a30*/                   STS.128 [R35+UR5+0x2800], R8 ;",
        "        /*0a40*/                   LDSM.16.M88.4 R4, [R33+UR5+0x2800] ;",
        "        /*0a50*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;",
        "        /*0a60*/                   HGMMA.64x16x16.F32.BF16 R24, R44, gdesc[UR12], R24, gsb0 ;",
        "        /*0a70*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;",
    ]
    assert mma_feed(pipelined) == {
        "mma_a_from_registers": True,
        "wgmma_max_pending": 1,
        "barriers_per_kstep": 1,
        "decoded_tile_stores_per_kstep": 1,
        "table_loads_per_kstep": 1,
    }
    drained = [
        "        /*0b00*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24, gsb0 ;",
        "        /*0b10*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
        "        /*0b20*/                   WARPGROUP.DEPBAR.LE gsb0, 0x2 ;",
    ]
    feed = mma_feed(drained)
    assert (feed["mma_a_from_registers"], feed["wgmma_max_pending"]) == (False, 0)  # the strictest wait decides
    assert mma_feed(["        /*0c00*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;"])[
        "mma_a_from_registers"
    ]


@pytest.mark.parametrize("arch", ["80", "90"])
def test_item2_targets_are_not_met_yet_and_each_miss_is_named(report, arch):
    """Issue 67, item 2 (tensor cores fed as the fastest 4-bit kernels feed them) is not done: today's NF4 launches
    (the control the targets must fail) decode through Triton's tl.gather, which reads the NF4 table from shared
    memory for every weight, and on sm_90 hand the decoded tile to the wgmma through shared memory, which then
    drains every K-step. Each miss is named in the report (item2_misses); this test pins them, so the first
    launch that meets a target fails it, and the docs' table is brought up to date."""
    for name, r in nf4_rows(report, arch).items():
        misses = " | ".join(r["item2_misses"])
        assert "NF4 table loads from shared memory" in misses and r["table_loads_per_kstep"] > 0, name
        if arch == "90":
            assert r["wgmma_max_pending"] == 0 and not r["mma_a_from_registers"], name
            assert "wgmma drained every K-step" in misses, name
        else:
            assert "decoded tile through shared memory" in misses, name
