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


@contextmanager
def serve_on_local_ray(grpc_port: int, http_options: dict) -> Iterator[None]:
    """A private Ray (2 CPUs) with Serve's proxies started (gRPC on `grpc_port` with the app's
    servicers, HTTP as `http_options` say); Serve and Ray shut down on exit."""
    from ray import serve

    from cluster.serve.app import GRPC_SERVICERS

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_cpus=2, include_dashboard=False)
        try:
            serve.start(http_options=http_options, grpc_options={"port": grpc_port, "grpc_servicer_functions": GRPC_SERVICERS})
            yield
        finally:
            serve.shutdown()
            ray.shutdown()


@pytest.fixture(scope="module")
def channel(ports):
    """A gRPC channel to the module's app (its `ports` fixture gives the gRPC port first)."""
    import grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{ports[0]}")
    yield channel
    channel.close()
