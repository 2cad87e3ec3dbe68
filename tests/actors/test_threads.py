"""Torch's thread count follows the cores its threads actually get (actors/model/threads.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from actors.model import threads


class Machine:
    """A fake clock, run-queue wait and /proc/stat on two cores."""

    def __init__(self, monkeypatch):
        self.wall = self.waiting = self.busy = 0.0
        monkeypatch.setattr(threads, "time", SimpleNamespace(monotonic=lambda: self.wall))
        monkeypatch.setattr(threads, "_waiting_seconds", lambda: self.waiting)
        monkeypatch.setattr(threads, "_busy_seconds", lambda cpus: self.busy)
        monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})

    def second(self, share: threads.CoreShare, busy: float, waiting: float = 0.0) -> int:
        """One second in which both cores together were busy `busy` seconds and this process's
        threads waited `waiting` seconds for a core; the count `share` chooses after it."""
        self.wall += 1.0
        self.busy += busy
        self.waiting += waiting
        return share.update()


def test_threads_kept_waiting_give_a_core_up_and_take_it_back_once_idle(monkeypatch):
    machine = Machine(monkeypatch)
    share = threads.CoreShare(most=2)
    assert machine.second(share, busy=2.0, waiting=0.01) == 2  # alone
    assert machine.second(share, busy=2.0, waiting=0.8) == 2  # a CPU-bound process takes a core ...
    assert machine.second(share, busy=2.0, waiting=0.8) == 1  # ... and keeps it
    assert machine.second(share, busy=2.0, waiting=0.0) == 1  # it keeps it: no core idle
    assert machine.second(share, busy=1.0) == 2  # it left
    assert machine.second(share, busy=2.0, waiting=0.02) == 2


def test_light_or_alternating_work_takes_no_thread(monkeypatch):
    machine = Machine(monkeypatch)
    share = threads.CoreShare(most=2)
    for waiting in (0.2, 0.7, 0.25, 0.6, 0.3):  # serving work beside the passes, a busy moment now and then
        assert machine.second(share, busy=1.9, waiting=waiting) == 2
    assert machine.second(share, busy=2.0, waiting=1.9) == 2
    assert machine.second(share, busy=2.0, waiting=1.9) == 1  # never below one thread
    assert machine.second(share, busy=2.0, waiting=0.35) == 1  # a two-thread neighbour: still no core idle


def test_decides_once_an_interval_has_passed_and_never_above_most(monkeypatch):
    machine = Machine(monkeypatch)
    assert machine.second(threads.CoreShare(most=1), busy=2.0, waiting=1.0) == 1
    assert machine.second(threads.CoreShare(most=1), busy=0.0) == 1
    share = threads.CoreShare(most=2, interval=1.0)
    for expected in (2, 1):  # a core's worth of waiting, seen only once a whole interval has passed
        machine.wall += 0.5
        machine.waiting += 1.0
        assert share.update() == 2
        machine.wall += 0.5
        assert share.update() == expected


def test_an_explicit_count_is_kept(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_share", threads._UNSET)
    try:
        assert threads.use_cores(3) == 3
        threads.follow_load(torch.device("cpu"))
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not threads._whole_machine(),
                    reason="needs two cores of a machine whose /proc/stat is this process's, and schedstat")
def test_a_real_busy_process_takes_a_thread(monkeypatch):
    """On this machine: torch on two threads beside a CPU-bound process drops to one."""
    before = torch.get_num_threads()
    two = set(sorted(os.sched_getaffinity(0))[:2])
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: two)
    monkeypatch.setattr(threads, "_share", threads.CoreShare(most=2))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        torch.set_num_threads(2)
        x = torch.randn(192, 192)
        deadline = time.monotonic() + 10
        while torch.get_num_threads() == 2 and time.monotonic() < deadline:
            threads.follow_load(torch.device("cpu"))
            for _ in range(20):
                x = torch.tanh(x @ x)
        assert torch.get_num_threads() == 1
    finally:
        busy.kill()
        busy.wait()
        torch.set_num_threads(before)


@pytest.mark.skipif(not Path("/proc/self/task").exists() or len(os.sched_getaffinity(0)) < 2,
                    reason="counts threads through /proc, and a product starts OpenMP threads only on 2+ cores")
def test_finding_onednn_dtypes_leaves_no_openmp_threads_on_the_calling_thread():
    """The probe computes on a thread that ends with it. A pool of OpenMP threads left on the thread
    that imports the model code (a Serve replica's main thread) made the engine thread's passes
    1.6-2x slower; the control shows that a product on the calling thread does leave one."""
    script = (
        "import os, time, torch\n"
        "from actors.model import projection\n"
        "count = lambda: len(os.listdir('/proc/self/task'))\n"
        "before = count(); projection.onednn_dtypes(); time.sleep(0.2); probed = count()\n"
        "x = torch.ones(512, 512); x @ x; print(before, probed, count())\n")
    before, probed, after_product = map(int, subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True,
        cwd=Path(__file__).resolve().parents[2]).stdout.split())
    assert probed == before
    assert after_product > before
