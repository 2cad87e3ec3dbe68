"""A private local Ray cluster with fake GPUs, started once per test module.

Fake GPUs (`num_gpus=4` on a machine without any) are enough for placement: Ray still hands each actor
its own `ray.get_gpu_ids()`, and the actors compute on the CPU. `address="local"` starts a new cluster
even when another one runs on this machine, and token auth is off so the cluster can be shut down.
"""
from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import ray


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for Serve's HTTP and gRPC proxies)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def local_ray(num_gpus: int) -> Iterator[None]:
    """Ray on 2 CPUs and `num_gpus` fake GPUs, shut down on exit."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_cpus=2, num_gpus=num_gpus, include_dashboard=False)
        try:
            yield
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def ray_four_gpus() -> Iterator[None]:
    with local_ray(num_gpus=4):
        yield
