"""Host memory while loading: allocations that stay off the resident set until written (common/memory.py)."""

import subprocess
import sys

import pytest

GROWTH_SCRIPT = """
import sys
import torch
from moe_qlora.common.memory import large_allocations_mapped, unwritten

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))

def growth(mib):
    before = rss_mib()
    t = unwritten(mib * 2**20, torch.uint8, "cpu")
    t[: 2**20] = 7  # one MiB written, as a rank writes its experts' rows
    grown = rss_mib() - before
    assert int(t[2**20 :].count_nonzero()) == 0 and int(t[: 2**20].sum()) == 7 * 2**20  # zeros where unwritten
    return grown

torch.set_num_threads(1)
growth(2)  # the first fill and count load code and start threads: resident pages that are not the tensor's

if sys.argv[1] == "mapped":
    with large_allocations_mapped():
        print(growth(30))  # 30 MiB, under glibc's own 32 MiB mmap threshold
else:
    print(growth(30))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc: Linux only")
def test_an_unwritten_allocation_while_loading_is_resident_only_where_written():
    """Under large_allocations_mapped a 30 MiB placeholder (a rank's whole-stack tensor of which it writes its own
    experts' rows) grows the resident set by about the MiB written; control: without it the same allocation is
    zeroed by unwritten (glibc may hand back heap memory under 32 MiB), all 30 MiB resident. Each in a fresh
    process, so that no earlier allocation of the test session's is reused, after the same steps on 2 MiB (the
    first fill loads code and starts threads: 10 MiB once, in a CI run without it). Bounds: 8 MiB for the written
    MiB, a 2 MiB huge page and the interpreter's own; 24 MiB for the control's 30."""

    def growth(mode: str) -> float:
        proc = subprocess.run(
            [sys.executable, "-c", GROWTH_SCRIPT, mode], capture_output=True, text=True, timeout=120, check=True
        )
        return float(proc.stdout.strip().splitlines()[-1])

    assert growth("mapped") < 8
    assert growth("default") > 24
