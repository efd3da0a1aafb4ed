"""common/process_exit.py: a `moe-qlora` process ends without the interpreter's finalization, yet does what an
exit observably does. The script below leaves each of those things for the exit to do, then ends through
cli.app.entry_point (`--version`: no torch) or, as the control, through a bare os._exit."""

import gzip
import os
import subprocess
import sys

import pytest

from moe_qlora.cli.app import exit_status

SCRIPT = r"""
import atexit, ctypes, gzip, io, os, sys, threading, time
out, how, args = sys.argv[1], sys.argv[2], sys.argv[3:]
log = open(os.path.join(out, "unclosed.txt"), "w")
log.write("written, never flushed")  # a reward module's log, say
packed = gzip.open(os.path.join(out, "unclosed.gz"), "wt")
packed.write("gzip's trailer is written when it closes")
beside = io.TextIOWrapper(open(1, "wb", closefd=False))  # a second writer on stdout, never flushed
beside.write("a second writer on stdout")


def late_writer():
    time.sleep(0.3)
    with open(os.path.join(out, "thread.txt"), "w") as f:
        f.write("joined")


threading.Thread(target=late_writer).start()  # not a daemon: an exit waits for it
atexit.register(lambda: open(os.path.join(out, "atexit.txt"), "w").write("ran"))
ctypes.CDLL(None).printf(b"from C's stdio, no newline")  # a pipe: C buffers it until exit flushes
if how == "bare":
    os._exit(0)
from moe_qlora.cli.app import entry_point

sys.argv = ["moe-qlora", *args]
entry_point()
"""


def run(tmp_path, how: str, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "ends.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # which unbuffers C's stdout too
    command = [sys.executable, str(script), str(tmp_path), how, *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def what_the_exit_did(tmp_path, proc) -> dict:
    def text(name):
        path = tmp_path / name
        return path.read_text() if path.exists() else ""

    try:
        packed = gzip.decompress((tmp_path / "unclosed.gz").read_bytes()).decode()
    except (EOFError, OSError):  # no trailer, or nothing
        packed = ""
    return {
        "unclosed file": text("unclosed.txt"),
        "gzip file": packed,
        "thread": text("thread.txt"),
        "exit handler": text("atexit.txt"),
        "C stdio": "from C's stdio" in proc.stdout,
        "second writer on stdout": "a second writer on stdout" in proc.stdout,
    }


EXPECTED = {
    "unclosed file": "written, never flushed",
    "gzip file": "gzip's trailer is written when it closes",
    "thread": "joined",
    "exit handler": "ran",
    "C stdio": True,
    "second writer on stdout": True,
}


@pytest.mark.parametrize(("args", "status"), [(["--version"], 0), (["no-such-command"], 2)])
def test_the_command_line_ends_as_an_exit_would_with_the_commands_status(tmp_path, args, status):
    proc = run(tmp_path, "main", *args)
    assert proc.returncode == status, proc.stderr
    assert what_the_exit_did(tmp_path, proc) == EXPECTED
    assert ("moe-qlora " in proc.stdout) == (status == 0) and ("No such command" in proc.stderr) == (status == 2)


def test_a_bare_os_exit_loses_all_of_it_the_control(tmp_path):
    proc = run(tmp_path, "bare")
    assert proc.returncode == 0
    assert all(not v for v in what_the_exit_did(tmp_path, proc).values()), what_the_exit_did(tmp_path, proc)


def test_the_exit_status_of_system_exit_is_the_interpreters(capsys):
    assert [exit_status(None), exit_status(0), exit_status(3)] == [0, 0, 3]
    assert exit_status("bad input") == 1 and capsys.readouterr().err == "bad input\n"
