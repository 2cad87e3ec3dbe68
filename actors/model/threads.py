"""Torch's threads in a process that runs a model: one per core the process may use, asleep when idle.

Ray sets OMP_NUM_THREADS=1 in an actor that reserves less than one CPU, and every target shard and
draft actor reserves none (a CPU slot would compete with the node's other work for nothing), so a
served shard computed on one core of two: plain decoding through `make serve` ran 21 tokens/s
against 29 with two threads. OpenMP's threads also spin while they wait for work: with another busy
process on one of two cores, 64 tokens of plain decoding took 55 s instead of 3 to 4, because each
step's threads waited spinning for the one that shared a core with it. Asleep while waiting
(OMP_WAIT_POLICY=PASSIVE, read once when the OpenMP runtime starts, so it must be in the process's
environment before torch loads), they leave a shared machine usable.
"""
from __future__ import annotations

import os

import torch

MODEL_PROCESS_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Environment of every process that runs a model (Ray actors get it through their runtime_env)."""


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    return len(os.sched_getaffinity(0))


def use_cores(threads: int | None = None) -> int:
    """Run torch on `threads` threads (None: every core this process may use); the count used."""
    count = threads or available_cores()
    torch.set_num_threads(count)
    return count
