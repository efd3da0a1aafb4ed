"""The CLI as the crash-and-resume tests drive it: real subprocesses, a SIGKILL after a given number of logged
steps, and the tensor-for-tensor comparison of the adapters two runs end with."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file


def subprocess_threads() -> str:
    """OMP_NUM_THREADS of a test's CLI subprocess: 1 under pytest-xdist (each worker has a core), else 2."""
    return "1" if "PYTEST_XDIST_WORKER" in os.environ else "2"


def isolated_env(tmp_path_factory) -> dict:
    """The environment of the subprocesses: the session's model cache (conftest's, never the user's: the builtin
    model is generated once a session, not once a module), one thread a core the test may use."""
    cache = str(tmp_path_factory.getbasetemp() / "moe-qlora-cache")
    return {**os.environ, "MOE_QLORA_CACHE": cache, "OMP_NUM_THREADS": subprocess_threads()}


def cli_command(subcommand: str, config: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "moe_qlora",
        subcommand,
        "--config",
        str(config),
        "--set",
        f"output.dir={out}",
        *extra,
    ]


def run_cli(subcommand, config, out, env, *extra, failpoint=None, env_extra=None) -> subprocess.CompletedProcess:
    """Run to the end (or to the failpoint, MOE_QLORA_FAILPOINT, e.g. "checkpoint-write@8"); `env_extra`: more
    environment variables (a fault to inject)."""
    env = {**env, **({"MOE_QLORA_FAILPOINT": failpoint} if failpoint else {}), **(env_extra or {})}
    return subprocess.run(
        cli_command(subcommand, config, out, *extra), env=env, capture_output=True, text=True, timeout=600
    )


def kill_after_steps(command: list[str], env: dict, out: Path, steps: int) -> int:
    """Start `command`, SIGKILL it once metrics.jsonl has `steps` lines; returns the steps it had logged."""
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = out / "metrics.jsonl"
    while proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    assert proc.wait() == -signal.SIGKILL, "the run must have been killed, not finished"
    return len(metrics.read_text().splitlines())


def assert_same_adapter(out: Path, reference: Path) -> None:
    a = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(reference / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def logged_losses(out: Path) -> list[tuple[int, float]]:
    """(step, loss) of every record in out/metrics.jsonl, each line parsed strictly (a torn line fails)."""
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def assert_same_run(out: Path, reference: Path, history=logged_losses) -> None:
    """The two runs ended with the same adapter, tensor for tensor, and logged the same `history`."""
    assert_same_adapter(out, reference)
    assert history(out) == history(reference)


def signal_after_steps(
    command: list[str], env: dict, out: Path, steps: int, sig: int, *, repeat: int = 1, gap: float = 0.05
) -> subprocess.CompletedProcess:
    """Start `command`, send `sig` (`repeat` times, `gap` seconds apart) once metrics.jsonl has `steps` lines,
    and let it finish on its own; returns the finished process with its output."""
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    while proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            for _ in range(repeat):
                proc.send_signal(sig)
                time.sleep(gap)
            break
        time.sleep(0.002)
    stdout, stderr = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def free_port() -> int:
    """A TCP port free on this machine now, for the rendezvous of a torchrun the tests start.

    Drawn below the kernel's ephemeral range, so no outgoing connection (gloo's, another worker's) can take it
    between this check and torchrun's listen, and from a slice of its own per pytest-xdist worker, so two workers
    never draw the same one. Asking the kernel for port 0 instead gave an ephemeral port that a gloo connection
    of a concurrent test took first (EADDRINUSE in CI)."""
    low, high = ephemeral_ports()[0] - 12_000, ephemeral_ports()[0]
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    span = (high - low) // 8
    start = low + (worker % 8) * span
    for port in random.sample(range(start, start + span), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in {start}-{start + span}")


def ephemeral_ports() -> tuple[int, int]:
    """The range the kernel hands out to sockets bound to port 0 (Linux's default when it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def torchrun(args: list[str], env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    """`moe_qlora` with `args` under torchrun: 2 processes on this machine."""
    return subprocess.run(torchrun_command(args), env=env, capture_output=True, text=True, timeout=timeout)


def script_on_ranks(script: Path, ranks: int, timeout: int = 300) -> subprocess.CompletedProcess:
    """`script` (a Python file) on `ranks` gloo processes under torchrun, one thread each; finished."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(ranks)]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def torchrun_command(args: list[str]) -> list[str]:
    """The command line of `moe_qlora` with `args` under torchrun, 2 processes on a free local port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "moe_qlora",
        *args,
    ]
