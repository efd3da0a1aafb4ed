"""scripts/bench_gluon.py on the CPU: the tiny launches (rank-16 LoRA; gate_up with the GLU fused) through Triton's
interpreter and grouped_mm, every result checked against grouped_mm's before it is timed, the Gluon rows listed as
not measured (they need an sm_80 to sm_90 GPU); and the check itself catches a wrong product (control: the experts
rolled)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_gluon  # noqa: E402


def test_the_tiny_run_checks_and_times_each_path_and_lists_the_gluon_rows(tmp_path):
    out = tmp_path / "gluon.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "scripts/bench_gluon.py", "--tiny", "--repeats", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    paths = ("triton fused (auto on sm_80/89)", "dequantize + grouped_mm (auto on sm_90)", "grouped_mm alone")
    assert {(r["weights"], r["contender"]) for r in result["rows"]} == {
        (w, c if c != "grouped_mm alone" else "grouped_mm alone (weights decoded)")
        for w in ("down", "gate_up")
        for c in paths
    }
    assert all(r["agrees"] and r["ms"] > 0 for r in result["rows"])
    assert result["not_measured"] == [
        f"tiny/{w}/32 gluon: needs an sm_80 to sm_90 GPU and the real shapes" for w in ("down", "gate_up")
    ]


def test_the_agreement_check_catches_rolled_experts():
    counts = torch.tensor([40, 0, 24, 64])
    torch.manual_seed(0)
    stack = bench_gluon.NF4Stack.from_param(bench_gluon.quantize_stack(torch.randn(4, 64, 128), double_quant=True))
    x = torch.randn(int(counts.sum()), 128).bfloat16()
    ends = torch.cumsum(counts, 0).to(torch.int32)
    w = stack.decode(0, 4, torch.bfloat16)
    reference = bench_gluon.gmm_rows(x, w.transpose(1, 2), ends).float()
    magnitude = bench_gluon.gmm_rows(x.abs(), w.abs().transpose(1, 2), ends).float()
    assert bench_gluon.agreement(reference.bfloat16(), reference, magnitude)[1]
    rolled = bench_gluon.gmm_rows(x, w.roll(1, 0).transpose(1, 2), ends)
    assert not bench_gluon.agreement(rolled, reference, magnitude)[1]
