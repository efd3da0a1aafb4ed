"""scripts/sweep_kernels.py (issue 67, item 5: one GPU session's timings of every kernel config and grid order, to
tune the autotune lists offline) at its CPU smoke size: every launch of a layer step is timed at each grid order
with the config it really ran recorded, rows appended as measured, and what the budget leaves out is named."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCHES = {
    "lora_a_dense",
    "gate_up_nf4_nested_silu_mul",
    "down_nf4_nested",
    "down_input_grad_nf4_nested",
    "gate_up_input_grad_nf4_nested",
    "outer_product",
}


def sweep(tmp_path, *extra):
    out = tmp_path / "sweep.jsonl"
    env = os.environ | {"TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "scripts/sweep_kernels.py", "--tiny", "--repeats", "1", "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_every_launch_is_timed_at_each_grid_order_with_the_config_it_ran(tmp_path):
    *rows, last = sweep(tmp_path)
    assert last == {"not_measured": []}
    assert {r["launch"] for r in rows} == LAUNCHES
    matmuls = [r for r in rows if r["launch"] != "outer_product"]
    assert {(r["launch"], r["group"]) for r in matmuls} == {
        (n, g) for n in LAUNCHES - {"outer_product"} for g in ("auto", "1", "0")
    }
    assert all(r["seconds"] > 0 and r["launched"][0]["BLOCK_N"] for r in matmuls)


def test_what_the_budget_leaves_out_is_named(tmp_path):
    *rows, last = sweep(tmp_path, "--budget-s", "0")
    assert rows == [] and len(last["not_measured"]) == 3 * (5 * 2 + 1)  # 3 orders x (5 matmuls x 2 configs + 1)
