"""scripts/gpu_check.sh fits a lent GPU machine: stages listed with their commands, each bounded by `timeout`,
about 47 minutes in all by the script's estimate (no more than 52), nothing that a CPU does (AOT compiles, SASS
readings, torch.compile), and a stage that fails says FAIL (here: the pre-flight, which needs CUDA)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_stages_are_listed_bounded_and_gpu_only():
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--stages"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    listed = [line for line in proc.stdout.splitlines() if re.match(r"^[a-z][\w-]+ +~\d+ min", line)]
    lines = [line for line in listed if not line.startswith("total ")]
    stages = {line.split()[0]: int(line.split()[1][1:]) for line in lines}
    assert list(stages)[:2] == ["wheels", "preflight"] and {"checks", "bench-qwen3", "bench-mixtral"} <= set(stages)
    assert {"train-bench", "rollout"} <= set(stages)
    assert all(minutes < 9 for minutes in stages.values()) and sum(stages.values()) <= 52
    # issue 58's measurements come right after the two stages every session runs
    assert list(stages)[2:5] == ["perf", "sweep", "long"] and stages["perf"] <= 7
    assert re.search(r"total ~(\d+) min, each stage bounded by timeout 540 s", proc.stdout)
    for cpu_work in ("kernel_report", "test_compile", "kernels.aot", "test_kernel_report"):
        assert cpu_work not in proc.stdout
    for path in re.findall(r"(?:scripts|tests)/[\w/]+\.py", proc.stdout):
        assert (ROOT / path).exists(), path


def test_a_failing_stage_says_fail(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "STAGE_TIMEOUT": "120", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "preflight", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and "no CUDA device" in proc.stdout
    assert (tmp_path / "verdicts.txt").read_text() == "FAIL  preflight\n"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "nonsense"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown stage" in proc.stderr


def collected(*args: str) -> set[str]:
    """The node ids pytest collects with `args`, one per line: PYTEST_ADDOPTS left out (a -v there prints a tree)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return {line for line in proc.stdout.splitlines() if "::" in line}


def test_the_kernels_stage_leaves_out_every_ahead_of_time_compile():
    """The `kernels` stage runs tests/moe/test_kernels.py on the GPU without its CPU-only tests: none of the AOT
    compiles (the row steps' among them, which a name filter once let through) nor the stubbed-launcher runs.
    Read from the stage's own command, collected as pytest would run it."""
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--stages"], cwd=ROOT, capture_output=True, text=True)
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("kernels ")]
    marker = re.search(r"-m '([^']+)'", line).group(1)
    stage = collected("-m", marker, "tests/moe/test_kernels.py")
    cpu_only = collected("-m", "cpu_only", "tests/moe/test_kernels.py")
    aot = {t for t in stage | cpu_only if re.search(r"compiles?_for", t)}  # the two sets are the whole file
    assert stage and not stage & cpu_only
    assert any("row_steps_compile_for" in t for t in aot) and aot <= cpu_only
