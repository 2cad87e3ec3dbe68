"""Local Ray clusters with fake GPUs, and Serve on them.

Fake GPUs (`num_gpus=4` on a machine without any) are enough for placement: Ray still hands each actor
its own `ray.get_gpu_ids()`, and the actors compute on the CPU. `address="local"` starts a new cluster
even when another one runs on this machine, and token auth is off so the cluster can be shut down.

Most modules share one such cluster (tests/conftest.py's `shared_ray`, started once and run last: a
start costs seconds): they ask for `ray_four_gpus`, and those that deploy an app to Serve on it for
`shared_serve`. A module that needs a cluster of its own (other resources, several nodes, Serve
with other options) starts one with `local_ray` or `serve_on_local_ray`.
"""
from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
def local_ray(num_gpus: int | None = None) -> Iterator[None]:
    """Ray on 2 CPUs and `num_gpus` fake GPUs (None: the machine's own), shut down on exit."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_cpus=2, num_gpus=num_gpus, include_dashboard=False)
        try:
            yield
        finally:
            ray.shutdown()


def wait_until_idle(timeout_s: float = 60) -> None:
    """Until every CPU and GPU of the cluster is free, as a module starting its own finds it: what
    the previous module ended (clusters, placement groups) gives its resources back asynchronously."""
    deadline = time.monotonic() + timeout_s
    while True:
        total, free = ray.cluster_resources(), ray.available_resources()
        held = {name: total[name] - free.get(name, 0.0) for name in ("CPU", "GPU") if free.get(name, 0.0) < total.get(name, 0)}
        if not held:
            return
        if time.monotonic() > deadline:
            groups = [group["name"] for group in ray.util.placement_group_table().values() if group["state"] != "REMOVED"]
            raise RuntimeError(f"the shared Ray still holds {held} {timeout_s} s after the previous module ended "
                               f"(placement groups not removed: {groups})")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def ray_four_gpus(shared_ray) -> Iterator[None]:
    """The shared Ray (2 CPUs, 4 fake GPUs) with all of it free when the module starts."""
    wait_until_idle()
    yield


@contextmanager
def serve_started(grpc_port: int, http_options: dict) -> Iterator[None]:
    """Serve's proxies started on this process's Ray (gRPC on `grpc_port` with the app's servicers,
    HTTP as `http_options` say); Serve shut down on exit."""
    from ray import serve

    from cluster.serve.app import GRPC_SERVICERS

    serve.start(http_options=http_options, grpc_options={"port": grpc_port, "grpc_servicer_functions": GRPC_SERVICERS})
    try:
        yield
    finally:
        serve.shutdown()


@contextmanager
def serve_on_local_ray(grpc_port: int, http_options: dict) -> Iterator[None]:
    """A private Ray (2 CPUs) with Serve's proxies started; Serve and Ray shut down on exit."""
    with local_ray(), serve_started(grpc_port, http_options):
        yield


@pytest.fixture(scope="module")
def shared_serve(ray_four_gpus, shared_serve_ports) -> Iterator[tuple[int, int]]:
    """(HTTP port, gRPC port) of Serve on the shared Ray; the applications the module deployed are
    deleted when it ends (their replicas give their CPUs back before the next module starts)."""
    from ray import serve

    yield shared_serve_ports
    for name in serve.status().applications:
        serve.delete(name)


@pytest.fixture(scope="module")
def channel(ports):
    """A gRPC channel to the module's app (its `ports` fixture gives the gRPC port first)."""
    import grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{ports[0]}")
    yield channel
    channel.close()


def ready_lines(app_name: str, timeout_s: float = 60) -> list[str]:
    """The `specserve ready` lines in the logs of `app_name`'s replicas on this process's Ray, once
    there is one (or none after `timeout_s`): the replica logs it when the application answers."""
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    deadline = time.time() + timeout_s
    while True:
        lines = [line for log in logs.glob(f"replica_{app_name}_SpecServer_*.log")
                 for line in log.read_text(errors="replace").splitlines() if "specserve ready" in line]
        if lines or time.time() > deadline:
            return lines
        time.sleep(0.5)
