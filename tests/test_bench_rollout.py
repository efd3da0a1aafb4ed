"""scripts/bench_rollout.py at its smallest: a GRPO step of the tiny demo model split into generation, scoring and
update that add up to the step, and generation counted alike for moe-qlora and transformers + PEFT."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROMPTS, GROUP, NEW_TOKENS = 2, 4, 8


@pytest.mark.slow
def test_bench_rollout_splits_a_step_and_counts_generated_tokens(tmp_path):
    out = tmp_path / "rollout.json"
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/bench_rollout.py",
            "--prompts",
            str(PROMPTS),
            "--group-size",
            str(GROUP),
            "--max-new-tokens",
            str(NEW_TOKENS),
            "--steps",
            "1",
            "--only",
            "moe-qlora",
            "transformers+bnb+peft",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    payload = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == payload  # the JSON line is what --json wrote
    rows = {r["contender"]: r for r in payload["results"]}
    assert set(rows) == {"moe-qlora", "transformers+bnb+peft"}
    ours = rows["moe-qlora"]
    assert set(ours["phases"]) == {"generation", "scoring", "update"}
    assert all(p["s"] > 0 for p in ours["phases"].values())
    # the phases partition the step (rounded to the microsecond)
    assert sum(p["s"] for p in ours["phases"].values()) == pytest.approx(ours["step_s"], abs=1e-5)
    assert ours["sequences_trained"] > 0  # the dense reward leaves groups with a spread: the update has rows
    for r in rows.values():
        assert r["sequences"] == PROMPTS * GROUP
        assert 0 < r["tokens"] <= PROMPTS * GROUP * NEW_TOKENS
        assert 0 < r["decode_steps"] <= NEW_TOKENS and r["tokens_per_s"] > 0
    assert ours["param_mib"]["experts_nf4"] > 0 and rows["transformers+bnb+peft"]["param_mib"]["experts_dense"] > 0


def test_a_contender_past_its_share_of_the_budget_is_stopped_and_what_ran_is_kept(tmp_path):
    """--budget-s 2: each contender is stopped at the end of its share (the first 1 s, the second what is left),
    each says so in the JSON, written as each one ends, and the run exits 1."""
    out = tmp_path / "rollout.json"
    cmd = [sys.executable, "scripts/bench_rollout.py", "--budget-s", "2", "--only", "moe-qlora", "transformers+bnb"]
    proc = subprocess.run([*cmd, "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    payload = json.loads(out.read_text())
    assert payload["budget_s"] == 2
    assert [r["contender"] for r in payload["results"]] == ["moe-qlora", "transformers+bnb"]
    assert all(r["error"].startswith("not measured: still running after") for r in payload["results"])


def test_each_contender_gets_an_equal_share_of_what_is_left():
    import time

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_rollout

    start = time.monotonic()
    assert bench_rollout.contender_timeout(None, start, 3) is None
    assert bench_rollout.contender_timeout(300, start, 3) == pytest.approx(100, abs=1)
    assert bench_rollout.contender_timeout(300, start - 600, 2) == 0
