"""The CPU threads a command computes with (common/cpu_threads.py): one a core the load leaves free, at least one,
waiting passively on a busy machine; a user's own OMP_NUM_THREADS kept. scripts/bench_busy_machine.py measures
what it changes (docs/benchmarks.md)."""

import pytest

from moe_qlora.common import cpu_threads
from moe_qlora.common.cpu_threads import choose_cpu_threads, threads_for


@pytest.mark.parametrize(
    ("cores", "busy", "threads", "passive"),
    [
        (2, 0.0, 2, False),  # a quiet machine: every core
        (2, 0.3, 2, False),  # a shell, an editor: still every core
        (2, 0.7, 1, True),  # one busy process: the other core
        (2, 2.0, 1, True),  # the machine (two busy loops): one thread, never none
        (2, 5.0, 1, True),
        (16, 3.2, 13, True),
    ],
)
def test_one_thread_a_core_the_load_leaves_free(cores, busy, threads, passive):
    chosen = threads_for(cores, busy)
    assert (chosen.threads, chosen.passive) == (threads, passive)


def test_a_busy_machine_gets_fewer_threads_that_wait_passively(monkeypatch):
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(cpu_threads, "other_load", lambda: 2.0)
    environ = {}
    assert choose_cpu_threads(environ).threads == 1
    assert environ == {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    environ = {"OMP_WAIT_POLICY": "ACTIVE"}
    choose_cpu_threads(environ)
    assert environ == {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "ACTIVE"}  # the user's policy kept
    monkeypatch.setattr(cpu_threads, "other_load", lambda: 0.1)
    environ = {}
    choose_cpu_threads(environ)
    assert environ == {"OMP_NUM_THREADS": "2"}  # quiet: every core, OpenMP's own wait


def test_the_users_thread_count_is_kept(monkeypatch):
    monkeypatch.setattr(cpu_threads, "other_load", lambda: 9.0)
    environ = {"OMP_NUM_THREADS": "3"}
    assert choose_cpu_threads(environ) is None and environ == {"OMP_NUM_THREADS": "3"}
