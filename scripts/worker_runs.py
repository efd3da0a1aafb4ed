"""A benchmark contender in a subprocess of its own, under a time limit that keeps what it finished.

The worker prints each finished measurement at once, as one line `@record {json}` (emit()); the driver
(run_worker()) reads the lines as they come, so a worker stopped by its time limit, or dying, still hands over
every measurement it finished. Its stderr goes to a file (a full pipe would block it), whose last line is the
error when it exits non-zero. A worker still running at its limit is killed with its whole process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field

RECORD = "@record "  # starts every result line on a worker's stdout; other lines are the worker's own output


def emit(record: dict) -> None:
    """In the worker: hand one finished measurement to the driver now."""
    print(RECORD + json.dumps(record), flush=True)


@dataclass
class WorkerRun:
    """What a worker handed over (`records`, in order) and, when it did not end cleanly, why (`error`: its last
    line of stderr, its exit status, or the time limit it ran past)."""

    records: list[dict] = field(default_factory=list)
    error: str | None = None
    timed_out: bool = False


def run_worker(cmd: list[str], *, timeout: float | None = None, env=None, cwd=None) -> WorkerRun:
    """Runs `cmd` to its end or for `timeout` seconds, whichever comes first, collecting its emit()ted records."""
    run = WorkerRun()
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, cwd=cwd, start_new_session=True
        )
        reader = threading.Thread(target=_collect, args=(proc.stdout, run.records), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            run.timed_out = True
            run.error = f"not measured: still running after {timeout:.0f} s"
        reader.join()
        if not run.timed_out and proc.returncode != 0:
            stderr.seek(0)
            lines = stderr.read().strip().splitlines()
            run.error = lines[-1] if lines else f"exited with {proc.returncode}"
    return run


def _collect(stream, records: list[dict]) -> None:
    for line in stream:
        if line.startswith(RECORD):
            records.append(json.loads(line[len(RECORD) :]))
