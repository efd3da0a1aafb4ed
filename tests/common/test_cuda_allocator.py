"""Every command runs torch's CUDA caching allocator with expandable segments, set before CUDA allocates, unless the
user chose the allocator's settings (either variable name torch reads)."""

import os
import subprocess
import sys

from moe_qlora.common.cuda_allocator import EXPANDABLE_SEGMENTS, choose_cuda_allocator


def test_expandable_segments_unless_the_user_chose():
    environ = {}
    assert choose_cuda_allocator(environ) == EXPANDABLE_SEGMENTS
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        mine = {name: "max_split_size_mb:128"}
        assert choose_cuda_allocator(mine) is None and mine == {name: "max_split_size_mb:128"}


def test_the_console_entry_sets_it_before_a_command_runs():
    """The entry point itself (what `moe-qlora ...` runs), with a command that reports the environment it got."""
    code = (
        "import os, sys; from moe_qlora.cli import app as a; "
        "a.app = lambda **kw: print('conf=' + os.environ.get('PYTORCH_CUDA_ALLOC_CONF', 'unset')); "
        "sys.argv = ['moe-qlora', 'plan']; a.main()"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "conf=expandable_segments:True" in out.stdout, out.stderr[-2000:]
    kept = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "conf=max_split_size_mb:64" in kept.stdout, kept.stderr[-2000:]
