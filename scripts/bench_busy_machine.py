"""A demo on a busy CPU: the same command quiet and beside N busy processes (`python -c "while True: pass"`), with
the threads moe-qlora chooses (common/cpu_threads.py) and with OMP_NUM_THREADS at every core (what it ran with
before it chose), side by side. Prints a table and JSON: wall seconds, and each contender's busy / quiet ratio.

    python scripts/bench_busy_machine.py                                   # the SFT demo, 20 steps, 2 busy
    python scripts/bench_busy_machine.py --config configs/grpo-demo.yaml --steps 4 --json out.json

The load average is what moe-qlora reads, and it follows new load over about a minute: the busy processes start
--settle seconds before each busy run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_demo(config: str, steps: int, threads: str | None, cache: str) -> float:
    """Wall seconds of `moe-qlora train|grpo --config config` for `steps` steps (threads: OMP_NUM_THREADS or None)."""
    command = "grpo" if "grpo" in Path(config).name else "dpo" if "dpo" in Path(config).name else "train"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env["MOE_QLORA_CACHE"] = cache
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    with tempfile.TemporaryDirectory() as out:
        args = [sys.executable, "-m", "moe_qlora", command, "--config", config, "--set", f"train.max_steps={steps}"]
        args += ["--set", f"output.dir={out}/run"]
        start = time.perf_counter()
        proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return seconds


def busy_processes(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--busy", type=int, default=2, help="busy processes beside the busy runs")
    ap.add_argument("--settle", type=float, default=40.0, help="seconds the busy processes run before each run")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    cores = str(len(os.sched_getaffinity(0)))
    contenders = {"moe-qlora's choice": None, f"OMP_NUM_THREADS={cores} (before)": cores}
    with tempfile.TemporaryDirectory() as cache:
        run_demo(args.config, 1, "1", cache)  # the tiny model generated once, outside the timings
        results = {name: {"quiet": run_demo(args.config, args.steps, t, cache)} for name, t in contenders.items()}
        for name, threads in contenders.items():
            loops = busy_processes(args.busy)
            try:
                time.sleep(args.settle)
                results[name]["busy"] = run_demo(args.config, args.steps, threads, cache)
            finally:
                for loop in loops:
                    loop.kill()
                    loop.wait()
            time.sleep(args.settle)  # the load average back down before the next quiet or busy run
    print(f"{args.config}, {args.steps} steps, {cores} cores, {args.busy} busy processes beside the busy runs")
    print(f"{'contender':32} {'quiet s':>9} {'busy s':>9} {'busy/quiet':>11}")
    for name, r in results.items():
        r["ratio"] = r["busy"] / r["quiet"]
        print(f"{name:32} {r['quiet']:>9.1f} {r['busy']:>9.1f} {r['ratio']:>10.2f}x")
    payload = {"config": args.config, "steps": args.steps, "cores": int(cores), "busy": args.busy, "results": results}
    print(json.dumps(payload))
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
