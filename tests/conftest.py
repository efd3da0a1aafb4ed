"""Shared fixtures: tiny MoE checkpoints generated with a fixed seed, saved in HF format; the demo trained once."""

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Without a GPU the Triton kernels run in Triton's interpreter. The switch is read when triton is first
# imported (its own jitted helpers are built then), so it is set here, before anything imports triton;
# it is what running `TRITON_INTERPRET=1 pytest` does. With CUDA the kernels are compiled and run for real.
if os.environ.get("CUDA_VISIBLE_DEVICES", None) != "" and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist each worker takes one core: the workers are the parallelism, and two threads a worker (or a
# worker's CLI subprocess) on two cores would make the OpenMP pools spin against each other. Set before torch is
# imported, so the worker and every subprocess it starts read it.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch

from moe_qlora.model.tiny import build_byte_tokenizer, save_tiny_model

from helpers.once import once_per_session
from helpers.tiny_configs import tiny_mixtral_config

IN_XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ
torch.set_num_threads(1 if IN_XDIST_WORKER else min(2, os.cpu_count() or 1))


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="session")
def dev() -> str:
    """Where the Triton kernels run: the GPU when there is one (compiled), else the CPU (interpreted)."""
    return "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: on a machine without it they are skipped, saying so. A test of the ahead-of-time
    compiles (fixture `compiled_variants`) is a CPU's check: marked `cpu_only`, which the GPU stages leave out."""
    for item in items:
        if "compiled_variants" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cpu_only)
    if torch.cuda.is_available():
        return
    reason = (
        "needs a CUDA GPU (none here); on CPU the kernels are checked in Triton's interpreter "
        "(tests/moe/test_kernels*.py) and compiled ahead of time for sm_80/sm_90"
    )
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """The environment of a module's CLI subprocesses (crash, resume and lock tests): the session's model cache,
    a thread a core the test may use."""
    from helpers.crash import isolated_env

    return isolated_env(tmp_path_factory)


@pytest.fixture
def small_triton_blocks():
    """16-wide blocks, so the small test shapes span several tiles in every dimension."""
    from moe_qlora.moe.kernels.tiles import kernel_settings_overridden

    with kernel_settings_overridden(block_override=(16, 16, 16)):
        yield


@pytest.fixture
def wide_triton_blocks():
    """64-wide blocks: the interpreter runs a step of the tests' few tokens about 3x faster than at the 16-row
    swapped tiles they would take. For tests whose subject is not the tiling (the parity tests run the others)."""
    from moe_qlora.moe.kernels.tiles import kernel_settings_overridden

    with kernel_settings_overridden(block_override=(64, 64, 64)):
        yield


@pytest.fixture
def override_kernel_settings():
    """Replaces fields of the kernel settings for the rest of the test (tiles.kernel_settings_overridden, undone at
    teardown): override_kernel_settings(autotune=False, target_arch=90). The settings are read from the environment
    once, so a test's setenv would not reach them."""
    from moe_qlora.moe.kernels.tiles import kernel_settings_overridden

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(kernel_settings_overridden(**changes))


@pytest.fixture
def inject_faults():
    """Injects faults for the rest of the test (common.injection.injected, undone at teardown):
    inject_faults(kernel_fault="grouped_mm:wrong"). The environment's request is read once, so a test's setenv
    would not reach it; subprocesses are still given the environment variables."""
    from moe_qlora.common.injection import injected

    with contextlib.ExitStack() as stack:
        yield lambda **faults: stack.enter_context(injected(**faults))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Generated builtin models go to a per-session temp dir, never the user's cache."""
    monkeypatch.setenv("MOE_QLORA_CACHE", str(tmp_path_factory.getbasetemp() / "moe-qlora-cache"))


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory):
    """2 layers, 8 experts, top-2, hidden 64, expert intermediate 128: experts (64*128) fill whole NF4 blocks."""
    path = tmp_path_factory.mktemp("tiny-mixtral")
    tok = build_byte_tokenizer()
    return save_tiny_model(path, tiny_mixtral_config(len(tok)), seed=0, tokenizer=tok)


@dataclass(frozen=True)
class DemoRun:
    """configs/demo.yaml trained from the CLI: its output.dir, the finished process, the environment it ran in."""

    out: Path
    proc: subprocess.CompletedProcess
    env: dict


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> DemoRun:
    """The README's demo command run as a user would (a subprocess of the installed CLI, all 30 epochs), once for
    the whole test run: the first xdist worker to ask trains it under a file lock in the folder the workers
    share, the others read what it left (tests only read the run)."""
    root = Path(__file__).resolve().parent.parent

    def train(folder: Path) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "moe_qlora", "train", "--config", "configs/demo.yaml"]
        command += ["--set", f"output.dir={folder / 'run'}"]
        env = {**os.environ, "MOE_QLORA_CACHE": str(folder / "cache")}
        return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=1800)

    folder, proc = once_per_session(tmp_path_factory, "demo", train)
    return DemoRun(folder / "run", proc, {**os.environ, "MOE_QLORA_CACHE": str(folder / "cache")})
