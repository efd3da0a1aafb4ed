"""How a gloo rank ends. gloo's worker threads outlive destroy_process_group; one that drops a collective's
tensor while the interpreter finalizes is ended by CPython with pthread_exit inside the tensor's noexcept
destructor, and the process aborts ("terminate called without an active exception"; seen three times in CI,
each time a finished run reported failed). The scripts below make that race certain: the last exit handler
registered starts an asynchronous all_reduce and returns; the first registered (so run last) holds the GIL in
C while the all_reduce finishes, so its worker waits for the GIL to free the tensor's Python object until
finalization has begun, and an object's __del__ running bytecode at teardown hands it the GIL then."""

from helpers.crash import script_on_ranks

RACE = r"""
import atexit, os, sys
atexit.register(sum, range(100_000_000))  # C: holds the GIL (about 1.5 s) with no bytecode to hand it over
import time
import torch
import torch.distributed as dist
from moe_qlora.model.distributed import join


class BytecodeAtTeardown:
    def __del__(self, clock=time.perf_counter):
        end = clock() + 0.3
        while clock() < end:  # the eval loop hands the GIL to a thread waiting for it
            pass


ranks = join(60)


def collective_in_flight():  # the first exit handler to run
    os.write(1, f"rank {ranks.rank}: exit handlers ran\n".encode())
    t = torch.ones(4_000_000)
    work = dist.all_reduce(t, async_op=True)
    # returning drops t and work: the gloo worker thread holds the tensor's last reference


atexit.register(collective_in_flight)
keeper = BytecodeAtTeardown()
"""

THROUGH_MAIN = r"""
from moe_qlora.cli.app import entry_point

sys.argv = ["moe-qlora", "--version"]
entry_point()
os.write(1, b"entry_point returned\n")
"""


def test_a_rank_that_ends_by_finalizing_the_interpreter_aborts_the_control(tmp_path):
    """The race itself, with the process ending as a script does: the ranks abort. If this stops failing, the
    reproduction no longer reproduces, and the test below proves nothing."""
    script = tmp_path / "race.py"
    script.write_text(RACE)
    proc = script_on_ranks(script, 2, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "terminate called without an active exception" in out, out[-3000:]


def test_the_command_line_ends_a_gloo_rank_without_finalizing(tmp_path):
    """cli.app.entry_point on each rank of the race (the command `--version`): each ends through
    common/process_exit.py, its exit handlers run, entry_point never returns, and nothing aborts. (The status a
    failing command ends with: tests/common/test_process_exit.py; here a rank that failed first would have
    torchrun stop the other.)"""
    script = tmp_path / "race.py"
    script.write_text(RACE + THROUGH_MAIN)
    proc = script_on_ranks(script, 2, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "terminate called" not in out, out[-3000:]
    assert proc.stdout.count("moe-qlora ") == 2, out[-3000:]
    assert "rank 0: exit handlers ran" in proc.stdout and "rank 1: exit handlers ran" in proc.stdout, out[-3000:]
    assert "entry_point returned" not in proc.stdout
