"""A run that several tests read, made once per test session however xdist spreads those tests over its workers."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path


def session_folder(tmp_path_factory) -> Path:
    """The folder every xdist worker of this session shares (the parent of the workers' own base folders), or the
    session's base folder without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


def once_per_session(
    tmp_path_factory, name: str, run: Callable[[Path], subprocess.CompletedProcess]
) -> tuple[Path, subprocess.CompletedProcess]:
    """(folder, finished process) of `run(folder)`, run by the first worker to ask for `name` under a file lock;
    the others wait on the lock and read what it left (the process's return code and output, kept in the folder;
    a run that raised, e.g. on its timeout, as return code -1 with the exception). Tests must only read the
    folder."""
    shared = session_folder(tmp_path_factory)
    folder = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        finished = folder / "finished.json"
        if not finished.exists():
            folder.mkdir(exist_ok=True)
            try:
                proc = run(folder)
                said = {"args": proc.args, "returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
            except Exception as exc:  # a timeout: every worker reads this failure, none runs again in its folder
                said = {"args": name, "returncode": -1, "stdout": "", "stderr": f"{type(exc).__name__}: {exc}"}
            finished.write_text(json.dumps(said))
        said = json.loads(finished.read_text())
    return folder, subprocess.CompletedProcess(**said)
