"""One run at a time in an output folder: the lock (common/lock.py) between real processes, and `train` runs
started into a folder whose run is alive (refused, exit 2, nothing of that run touched) or was SIGKILLed (the
next one starts at once). A run that must still be alive when the second one reaches the lock is paused with
SIGSTOP (it keeps its lock) rather than made long: the tests then wait on events, never on timings."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from moe_qlora.common.lock import LOCK_NAME, LockUnsupported, RunDirLocked, RunLock, holder_pid, run_lock_for
from moe_qlora.train.checkpoint import latest_valid_checkpoint
from moe_qlora.train.runs import claim_output_dir, previous_run

from helpers.crash import cli_command

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
STEPS = 3
SHORT = ["--set", f"train.max_steps={STEPS}", "--set", "train.warmup_steps=1"]

HOLD = """
import sys, time
from moe_qlora.common.lock import RunLock
lock = RunLock.acquire(sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""
PROBE = "import sys; from moe_qlora.common.lock import RunLock; RunLock.acquire(sys.argv[1])"  # exit 1 if held


def train_command(out: Path, *extra: str) -> list[str]:
    return cli_command("train", DEMO, out, *SHORT, *extra)


def run_train(out: Path, env: dict, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(train_command(out, *extra), env=env, capture_output=True, text=True, timeout=300)


def start(command: list[str], env: dict, log: Path) -> subprocess.Popen:
    """Start `command` with its output in the file `log` (never a pipe nobody reads while it runs)."""
    return subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, log: Path) -> tuple[int, str]:
    """(exit code, output with its line breaks folded) once `proc` ends."""
    code = proc.wait(timeout=300)
    return code, " ".join(log.read_text().split())


def wait_until(condition, procs: list[subprocess.Popen], what: str) -> None:
    """Poll `condition` until true; fail if every process in `procs` has ended first."""
    deadline = time.monotonic() + 300
    while not condition():
        assert any(p.poll() is None for p in procs), f"every process ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def losses(out: Path) -> list[tuple[int, float]]:
    """(step, loss) of each record; the records' timings differ from run to run, these may not."""
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def adapter_bytes(out: Path) -> bytes:
    return (out / "adapter" / "adapter_model.safetensors").read_bytes()


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `folder`: its bytes and modification time."""
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()
    }


def refusal(out: Path, pid: int) -> str:
    return f"error: {out} is in use by another moe-qlora process (PID {pid}); wait for it to finish or stop it"


@pytest.fixture
def procs():
    """The processes a test starts; any still running when it ends (it failed half-way) is killed."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def lone(env, tmp_path_factory) -> Path:
    """The run alone in its folder: what a run that had a second one started beside it must still write."""
    out = tmp_path_factory.mktemp("lone") / "run"
    proc = run_train(out, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


# --- the lock itself, between two processes ------------------------------------------------------------------


@pytest.fixture
def holder(tmp_path):
    """A second process holding the lock of tmp_path/run (created by it), and that folder."""
    folder = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    yield proc, folder
    proc.kill()
    proc.wait()


def test_a_held_lock_refuses_with_the_holders_pid_and_is_free_once_the_holder_is_killed(holder):
    proc, folder = holder
    before = (folder / LOCK_NAME).read_bytes()
    with pytest.raises(RunDirLocked) as refused:
        RunLock.acquire(folder)
    assert refused.value.pid == str(proc.pid) and holder_pid(folder) == proc.pid
    assert str(refused.value).startswith(f"{folder} is in use by another moe-qlora process (PID {proc.pid});")
    assert (folder / LOCK_NAME).read_bytes() == before  # the refused process wrote nothing
    assert previous_run(folder) == []  # a lock file alone is no run
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert holder_pid(folder) == proc.pid  # its PID stays in the file, but no lock does
    with RunLock.acquire(folder):
        assert holder_pid(folder) == os.getpid()
    assert holder_pid(folder) is None  # released: cleared
    RunLock.acquire(folder).release()  # and free again, in this process too


def test_a_lock_file_removed_between_open_and_lock_is_not_trusted(tmp_path, monkeypatch):
    """A process that removes an unused run folder under its lock (fileio.remove_unused_run_folder) may do so
    between another's open and flock: that one must lock the new file, not the removed one."""
    from moe_qlora.common import lock

    folder, real = tmp_path / "run", lock.lock_or_refuse
    calls = []

    def removed_first(fd, where):
        if not calls:  # the first open's file goes, with its folder, before the lock is taken
            (folder / LOCK_NAME).unlink()
            folder.rmdir()
        calls.append(fd)
        real(fd, where)

    monkeypatch.setattr(lock, "lock_or_refuse", removed_first)
    with RunLock.acquire(folder):
        assert len(calls) == 2 and holder_pid(folder) == os.getpid()
        monkeypatch.setattr(lock, "lock_or_refuse", real)
        probe = subprocess.run([sys.executable, "-c", PROBE, str(folder)], capture_output=True, text=True, timeout=60)
        assert probe.returncode == 1 and "RunDirLocked" in probe.stderr


def test_overwrite_moves_the_run_aside_but_keeps_the_lock_of_the_live_run(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    with RunLock.acquire(out):
        claim_output_dir(out, resuming=False, overwrite=True, console=Console(quiet=True))
        (aside,) = tmp_path.glob("run.old-*")
        assert (aside / "metrics.jsonl").exists() and not (aside / LOCK_NAME).exists()
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
        probe = subprocess.run([sys.executable, "-c", PROBE, str(out)], capture_output=True, text=True, timeout=60)
        assert probe.returncode == 1 and "RunDirLocked" in probe.stderr  # still locked in its new, empty folder
        claim_output_dir(out, resuming=False, overwrite=False, console=None)  # the lock file is no run to refuse


def test_a_command_writing_into_a_run_locks_that_run(holder, tmp_path):
    proc, folder = holder
    with pytest.raises(RunDirLocked):
        run_lock_for(folder / "plots")
    assert run_lock_for(tmp_path / "elsewhere" / "plots") is None  # no run there: nothing to lock


def test_a_filesystem_without_flock_runs_unlocked_with_a_warning(tmp_path, monkeypatch):
    import errno

    from moe_qlora.common import lock
    from moe_qlora.model.distributed import SINGLE
    from moe_qlora.train.runs import output_dir_locked

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock.fcntl, "flock", no_flock)
    with pytest.raises(LockUnsupported):
        RunLock.acquire(tmp_path / "a")
    console = Console(record=True, width=200)
    with output_dir_locked(tmp_path / "b", SINGLE, console):
        pass
    assert "its filesystem cannot lock files" in console.export_text()


@pytest.mark.parametrize("command", ["train", "grpo"])
def test_train_and_grpo_are_refused_before_reading_a_held_folder(holder, command):
    from moe_qlora.config.load import load_config
    from moe_qlora.train.grpo import grpo
    from moe_qlora.train.sft import train

    proc, folder = holder
    config = ROOT / "configs" / ("demo.yaml" if command == "train" else "grpo-demo.yaml")
    cfg = load_config(
        config, [f"output.dir={folder}", "train.resume=auto", "train.max_steps=1", "train.warmup_steps=0"]
    )
    with pytest.raises(RunDirLocked, match=f"PID {proc.pid}"):
        {"train": train, "grpo": grpo}[command](cfg, Console(quiet=True), overwrite=True)
    assert sorted(p.name for p in folder.iterdir()) == [LOCK_NAME]


# --- train ---------------------------------------------------------------------------------------------------


def test_two_runs_started_at_once_the_second_is_refused_and_the_first_writes_what_it_would_alone(
    env, lone, procs, tmp_path
):
    out = tmp_path / "twin"
    procs += [start(train_command(out), env, tmp_path / f"{i}.log") for i in (0, 1)]
    wait_until(lambda: holder_pid(out) in (procs[0].pid, procs[1].pid), procs, "a run to take the lock")
    winner = 0 if holder_pid(out) == procs[0].pid else 1
    first, second = procs[winner], procs[1 - winner]
    first.send_signal(signal.SIGSTOP)  # alive, holding the lock, until the second has tried
    try:
        code, output = finish(second, tmp_path / f"{1 - winner}.log")
    finally:
        first.send_signal(signal.SIGCONT)
    assert code == 2 and refusal(out, first.pid) in output, output[-2000:]
    code, output = finish(first, tmp_path / f"{winner}.log")
    assert code == 0, output[-2000:]
    assert losses(out) == losses(lone)  # steps 1, 2, 3 once each, not 1, 1, 2, 2...
    assert adapter_bytes(out) == adapter_bytes(lone)


def test_a_resume_is_refused_while_the_run_lives_and_starts_at_once_after_its_sigkill(env, lone, procs, tmp_path):
    """The issue's second case (a --resume with another lr, 14 s after the first run started), then the same
    folder once its holder was SIGKILLed: nothing stale is left to refuse the next run."""
    out = tmp_path / "run"
    first = start(train_command(out, "--set", "train.save_every=1"), env, tmp_path / "first.log")
    procs.append(first)
    wait_until(lambda: latest_valid_checkpoint(out) is not None, [first], "a checkpoint")
    first.send_signal(signal.SIGSTOP)  # alive, holding the lock, until the resume has tried
    before = snapshot(out)
    second = run_train(out, env, "--resume", "--set", "train.lr=1e-3")
    assert snapshot(out) == before  # nothing touched: no metrics truncated, no checkpoint set aside
    message = " ".join(second.stderr.split())
    assert second.returncode == 2 and refusal(out, first.pid) in message, message[-2000:]
    first.send_signal(signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    assert holder_pid(out) == first.pid  # the dead holder's PID is still in the file: no matter
    third = run_train(out, env, "--resume", "--set", "train.save_every=1")
    assert third.returncode == 0, third.stderr[-3000:]
    assert "resumed from" in third.stdout
    assert losses(out) == losses(lone)  # each step once, as if never interrupted


def test_under_torchrun_a_refused_rank_0_stops_every_rank(env, tmp_path):
    from helpers.crash import torchrun

    out = tmp_path / "run"
    with RunLock.acquire(out):
        proc = torchrun(
            ["train", "--config", str(DEMO), *SHORT, "--set", "train.dist_timeout_s=120", "--set", f"output.dir={out}"],
            {**env, "OMP_NUM_THREADS": "1"},
            timeout=240,
        )
    output = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0
    assert refusal(out, os.getpid()) in output  # rank 0's sentence
    assert f"error: rank 0 failed (RunDirLocked): {out} is in use" in output  # rank 1's
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
