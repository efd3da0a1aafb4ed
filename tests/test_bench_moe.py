"""scripts/bench_moe.py can fail: every contender's output and gradients are checked against its fp32 reference,
and a self-check fallback fails the run. CPU, Qwen3-30B-A3B's layer shrunk 8x (hidden 256, 128 experts of 96)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bench(tmp_path, fault=None):
    env = {k: v for k, v in os.environ.items() if k != "MOE_QLORA_INJECT_KERNEL_FAULT"}
    if fault:
        env["MOE_QLORA_INJECT_KERNEL_FAULT"] = fault
    out = tmp_path / f"bench-{fault or 'clean'}.json"
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/bench_moe.py",
            "--shape",
            "qwen3-30b-a3b",
            "--tokens",
            "64",
            "--repeats",
            "1",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, {r["contender"]: r for r in json.loads(out.read_text())}


def test_bench_moe_checks_every_contender_and_fails_on_a_wrong_one(tmp_path):
    proc, rows = bench(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    ran = {name: r for name, r in rows.items() if "skipped" not in r}
    assert set(ran) == {
        "moe-qlora grouped_mm",
        "moe-qlora torch",
        "transformers grouped_mm + PEFT",
        "transformers eager + PEFT",
    }
    assert all(r["correct"] and r["max_relative_error"] <= r["tolerance"] == 1e-4 for r in ran.values())
    # The roofline reads the stored bytes: nested scales, one byte per 64 weights plus fp32 per 256 blocks.
    hidden, inter = 256, 96
    per_expert = 3 * hidden * inter * (0.5 + 1 / 64 + 4 / (64 * 256))
    assert abs(rows["moe-qlora torch"]["expert_bytes"] / per_expert - 1) < 1e-3
    assert rows["transformers eager + PEFT"]["expert_bytes"] == 3 * hidden * inter * 4  # fp32 stacks on the CPU
    # A grouped_mm that computes wrong: the self-check falls back, and the run fails naming it.
    proc, rows = bench(tmp_path, fault="grouped_mm:wrong")
    assert proc.returncode == 1 and "FAIL  moe-qlora grouped_mm" in proc.stdout
    assert not rows["moe-qlora grouped_mm"]["correct"] and rows["moe-qlora grouped_mm"]["self_check_fallbacks"]
    assert rows["moe-qlora torch"]["correct"]
