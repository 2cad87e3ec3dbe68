"""Torch's threads in a process that runs a model: one per core the process may use, fewer while
other work holds those cores.

Ray sets OMP_NUM_THREADS=1 in an actor that reserves less than one CPU, and every target shard and
draft actor reserves none (a CPU slot would compete with the node's other work for nothing), so a
served shard computed on one core of two, and plain decoding through `make serve` ran markedly
slower than with two threads. The cores a process may use are its CPU affinity, narrowed by a
cgroup CPU quota where one is set (a container limited to 4 CPUs on a 64-core host).

The opposite fault: OpenMP threads spin at every barrier of a pass, so when another process keeps
one of two cores busy, each pass waits for a thread the kernel has descheduled: `specserve generate`
beside a torch job on the other core ran many times slower on two threads than on one (figures:
docs/benchmarks.md, "Measurements behind the code"). `CoreShare` sees it in the scheduler's
run-queue wait of the process's threads and gives the core up while the neighbour holds it;
`follow_load` applies its count before each pass, on the thread that runs it. An explicit count
(`cpu_threads`) is kept.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from pathlib import Path
from time import perf_counter  # not `time.`: tests give CoreShare a clock of their own

import torch

log = logging.getLogger(__name__)

CGROUP_V2_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
PROC_STAT = Path("/proc/stat")
TASKS = Path("/proc/self/task")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cgroup_cpus() -> float | None:
    """The CPU quota of this process's cgroup in cores (None: no quota)."""
    try:
        if CGROUP_V2_MAX.exists():
            quota, period = CGROUP_V2_MAX.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota = int((CGROUP_V1 / "cpu.cfs_quota_us").read_text())
        period = int((CGROUP_V1 / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity, within its cgroup's CPU quota."""
    cores = len(os.sched_getaffinity(0))
    quota = _cgroup_cpus()
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


def _busy_seconds(cpus: frozenset[int]) -> float | None:
    """CPU seconds spent so far, by every process, on `cpus` (None where /proc/stat is missing)."""
    try:
        lines = PROC_STAT.read_text().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, rest.split()[:8])
            ticks += user + nice + system + irq + softirq + steal
    return ticks / CLOCK_TICKS


PASS_THREAD_NAME = "specserve-pass"
"""The OS name (Linux `comm`) of the threads that run passes: the calling thread and its OpenMP threads."""
PROBE_SECONDS = 0.06
"""How long the probe that finds OpenMP threads already started computes: several clock ticks (the
resolution of a thread's CPU time) for each of them."""


def name_pass_thread(most: int | None = None) -> None:
    """Name the calling thread and its OpenMP threads, so their run-queue waits can be told from the
    waits of the process's other threads (a Serve replica's event loop, Ray's own threads), which
    wait whenever the passes hold both cores. OpenMP threads started later inherit the name; those
    already started are the threads that compute while this thread runs a parallel operation on
    `most` threads (the most its passes will use; None: torch's count now)."""
    global _pass_threads
    now = torch.get_num_threads()
    try:
        (TASKS / str(threading.get_native_id()) / "comm").write_text(PASS_THREAD_NAME)
        before = _cpu_ticks()
        torch.set_num_threads(most or now)
        probe, deadline = torch.ones(256, 256), perf_counter() + PROBE_SECONDS
        while perf_counter() < deadline:
            probe = torch.tanh(probe @ probe)
        for thread, ticks in _cpu_ticks().items():
            if ticks - before.get(thread, ticks) > 0:
                (TASKS / thread / "comm").write_text(PASS_THREAD_NAME)
        _pass_threads = (-math.inf, [])
    except OSError:  # not Linux: every thread's waits count
        pass
    finally:
        torch.set_num_threads(now)


def _cpu_ticks() -> dict[str, int]:
    """CPU time (clock ticks) of each thread of the process not named yet."""
    ticks = {}
    for thread in os.listdir(TASKS):
        try:
            stat = (TASKS / thread / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if _comm(thread) != PASS_THREAD_NAME:
            ticks[thread] = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks


THREADS_RESCAN_SECONDS = 5.0
"""How long the list of pass threads is trusted: a Serve replica runs ~100 threads, and reading every
thread's name at each sample costs a file read (and a GIL hand-over) each on the engine's thread.
OpenMP threads started in between (torch's count raised again) are found at the next scan."""
_pass_threads: tuple[float, list[str]] = (-math.inf, [])


def _threads_to_watch() -> list[str]:
    """The threads named by `name_pass_thread` (every thread of the process where none is), listed
    again every THREADS_RESCAN_SECONDS."""
    global _pass_threads
    listed_at, threads = _pass_threads
    if time.monotonic() - listed_at >= THREADS_RESCAN_SECONDS or not threads:
        everyone = os.listdir(TASKS)
        threads = [thread for thread in everyone if _comm(thread) == PASS_THREAD_NAME] or everyone
        _pass_threads = (time.monotonic(), threads)
    return threads


def _waiting_seconds() -> float | None:
    """Seconds the threads that run passes have spent runnable but waiting for a CPU, summed (the
    scheduler's per-thread schedstat; None where the kernel keeps none)."""
    try:
        threads = _threads_to_watch()
    except OSError:
        return None
    total, seen = 0, False
    for thread in threads:
        try:
            total += int((TASKS / thread / "schedstat").read_text().split()[1])
            seen = True
        except (OSError, IndexError, ValueError):  # a thread that has just ended
            continue
    return total / 1e9 if seen else None


def _comm(thread: str) -> str | None:
    try:
        return (TASKS / thread / "comm").read_text().strip()
    except OSError:
        return None


class CoreShare:
    """How many threads to run torch on, from whether they get the cores they ask for.

    A torch thread is never left runnable without a core on a machine it has to itself: it computes,
    spins at a barrier, or sleeps. Time the pass threads spend runnable but waiting for a core
    (the scheduler's run-queue wait) is time another process held the cores they asked for, and
    with barriers every pass, one waiting thread holds up the others. Sampled every `interval`
    seconds: when half a thread or more waited through two intervals in a row (a busy moment of the
    serving processes beside a shard is not a neighbour), it drops a thread per thread's worth of
    waiting; it adds one back when the machine-wide CPU time on the process's cores shows a core
    idle beside it, and the next intervals say whether the core stays free. Never fewer than one
    thread nor more than `most`. (Measured beside `make serve`'s replica, proxy and a client at 1
    and 16 requests in flight: a shard's two threads waited 0.2-0.3 threads' worth, now and then
    0.5-0.7 for one interval; beside a CPU-bound process, 0.75-1.)
    """

    WAITING_TO_DROP = 0.5  # threads' worth of run-queue wait before one is given up ...
    INTERVALS_TO_DROP = 2  # ... in so many intervals in a row (a busy moment of the replica is not a neighbour)
    IDLE_TO_ADD = 0.5  # idle cores beside the threads in use before one is taken back

    def __init__(self, most: int, interval: float = 0.25):
        name_pass_thread(most)  # made on the thread that runs the passes
        self.most = most
        self.threads = most
        self.interval = interval
        self._cpus = frozenset(os.sched_getaffinity(0))
        self._kept_waiting = 0
        self._last = self._sample()

    def _sample(self) -> tuple[float, float | None, float | None]:
        return time.monotonic(), _waiting_seconds(), _busy_seconds(self._cpus)

    def update(self) -> int:
        """The thread count to use now (decides at most once per interval)."""
        if self.most <= 1 or time.monotonic() - self._last[0] < self.interval:
            return self.threads
        now, last = self._sample(), self._last
        self._last = now
        wall = now[0] - last[0]
        if now[1] is None or last[1] is None or now[2] is None or last[2] is None:
            return self.threads
        waiting = max(0.0, now[1] - last[1]) / wall  # threads that ended take their waits along
        idle = len(self._cpus) - (now[2] - last[2]) / wall
        chosen = self.threads
        self._kept_waiting = self._kept_waiting + 1 if waiting >= self.WAITING_TO_DROP else 0
        if self._kept_waiting >= self.INTERVALS_TO_DROP:
            self._kept_waiting = 0
            chosen = max(1, self.threads - max(1, round(waiting)))
        elif idle >= self.IDLE_TO_ADD:
            chosen = min(self.most, self.threads + 1)
        if chosen != self.threads:
            (log.warning if chosen < self.threads else log.info)(
                "torch threads %d -> %d: %.2f threads waiting for a core, %.2f cores idle",
                self.threads, chosen, waiting, idle)
            self.threads = chosen
        return self.threads


_UNSET = object()
_share: CoreShare | None | object = _UNSET  # until use_cores or the first pass decides


def _whole_machine() -> bool:
    """Whether `CoreShare` can judge: the cores in this process's affinity are all its to use (no
    tighter cgroup quota, so the machine-wide /proc/stat says what the neighbours take from it)
    and the kernel keeps run-queue waits."""
    return available_cores() == len(os.sched_getaffinity(0)) and PROC_STAT.exists() \
        and _waiting_seconds() is not None


def use_cores(threads: int | None = None, ranks: int = 1) -> int:
    """Run torch on `threads` threads, or (None) on the cores this process may use split between
    `ranks` processes of one group, fewer while other work holds them; the count used now."""
    global _share
    if threads is not None:
        _share = None
        torch.set_num_threads(threads)
        return threads
    most = max(1, available_cores() // ranks)
    _share = CoreShare(most) if _whole_machine() else None
    torch.set_num_threads(most)
    return most


def follow_load(device: torch.device) -> None:
    """Before a pass, on the thread that runs it: torch's thread count as `use_cores` chose it now
    (OpenMP keeps a count per calling thread, so it is set where the work runs). A process that
    never called `use_cores` keeps the count torch started with (OMP_NUM_THREADS, or
    `torch.set_num_threads`) as its most."""
    global _share
    if device.type != "cpu":
        return
    if _share is _UNSET:
        most = torch.get_num_threads()
        _share = CoreShare(most) if most > 1 and _whole_machine() else None
    if _share is not None:
        threads = _share.update()
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
