"""A private local Ray cluster with fake GPUs, started once per test module.

Fake GPUs (`num_gpus=4` on a machine without any) are enough for placement: Ray still hands each actor
its own `ray.get_gpu_ids()`, and the actors compute on the CPU. `address="local"` starts a new cluster
even when another one runs on this machine, and token auth is off so the cluster can be shut down.
"""
from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import ray


PORTS = range(20000, 32000)
"""Where test servers listen: above Ray's worker ports (10002-19999) and below Linux's ephemeral
range (32768-60999). A port the kernel hands out as free (bind to port 0) comes from that range,
which every outgoing connection of Ray's own processes also draws from, so one of them could take it
before Serve's proxy binds it (seen once: "Address already in use" for every test of a module)."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for Serve's HTTP and gRPC proxies)."""
    for port in random.sample(PORTS, 100):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in {PORTS.start}-{PORTS.stop - 1}")


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
