"""Torch's threads in a process that runs a model: one per core the process may use.

Ray sets OMP_NUM_THREADS=1 in an actor that reserves less than one CPU, and every target shard and
draft actor reserves none (a CPU slot would compete with the node's other work for nothing), so a
served shard computed on one core of two: plain decoding through `make serve` ran 21 tokens/s
against 29 with two threads. The cores a process may use are its CPU affinity, narrowed by a
cgroup CPU quota where one is set (a container limited to 4 CPUs on a 64-core host).
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch

CGROUP_V2_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1 = Path("/sys/fs/cgroup/cpu")


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


def use_cores(threads: int | None = None) -> int:
    """Run torch on `threads` threads (None: every core this process may use); the count used."""
    count = threads or available_cores()
    torch.set_num_threads(count)
    return count
