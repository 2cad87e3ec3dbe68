"""`make serve`'s direct ingress: the replica itself answers HTTP and gRPC on the config's ports.

Serve's proxy costs a served stream a hop: every streamed chunk goes from the replica to the proxy
process as a Ray call, and on a small CPU machine that work takes cores from the model's passes
(docs/benchmarks.md, "Direct ingress"). Ray Serve 2.60 can have an ingress replica listen on ports
of its own (`RAY_SERVE_ENABLE_DIRECT_INGRESS`), taken from a range per node, while the head node
keeps a proxy as a fallback. Where a config can run that way (one application, one replica of
each deployment, proxies not disabled), `python -m cluster.serve.direct_ingress SOURCE TARGET`
writes the config to TARGET with the proxy moved PROXY_PORT_SHIFT ports up and prints the
environment (shell `export` lines) that gives the replica the config's own ports, so clients keep
calling 8000 and 9000. Any other config is written unchanged, and nothing is printed.

Ray reads these variables when its processes start: `make serve` sets them before `ray start`.
"""
from __future__ import annotations

import os
import sys

import yaml

PROXY_PORT_SHIFT = 100
"""The proxy's ports, above the config's: 8100 for HTTP and 9100 for gRPC by default."""
DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT = 8000, 9000  # Serve's own defaults
ENABLE = "RAY_SERVE_ENABLE_DIRECT_INGRESS"


def most_replicas(deployment: dict) -> int:
    """The most replicas a deployment of the config may run (1 where it says nothing, as Serve)."""
    autoscaling = deployment.get("autoscaling_config")
    if isinstance(autoscaling, dict):
        return int(autoscaling.get("max_replicas", 1))
    replicas = deployment.get("num_replicas", 1)
    return 1 if replicas == "auto" else int(replicas)


def applies(config: dict) -> bool:
    """One application whose deployments each run one replica at most, behind proxies: one port each
    for HTTP and gRPC is enough. Several replicas or applications need the proxy to share a port."""
    apps = config.get("applications") or []
    return (len(apps) == 1 and str(config.get("proxy_location", "HeadOnly")) != "Disabled"
            and all(most_replicas(deployment) <= 1 for deployment in apps[0].get("deployments") or []))


def plan(config: dict) -> tuple[dict, dict[str, str]]:
    """The config to run and the environment for Ray: direct ingress where it applies, else as given."""
    if not applies(config):
        return config, {}
    http = dict(config.get("http_options") or {})
    grpc = dict(config.get("grpc_options") or {})
    http_port, grpc_port = int(http.get("port", DEFAULT_HTTP_PORT)), int(grpc.get("port", DEFAULT_GRPC_PORT))
    http["port"], grpc["port"] = http_port + PROXY_PORT_SHIFT, grpc_port + PROXY_PORT_SHIFT
    environment = {
        ENABLE: "1",
        # each range is [min, max): exactly the config's port
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http_port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http_port + 1),
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(grpc_port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(grpc_port + 1),
        # no load balancer in front to drain or to forget a port: a restarted replica takes it back at once
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }
    return {**config, "http_options": http, "grpc_options": grpc}, environment


def replica_ports() -> tuple[int, int] | None:
    """(HTTP port, gRPC port) this replica listens on itself, or None behind Serve's proxy."""
    if os.environ.get(ENABLE) != "1":
        return None
    return (int(os.environ.get("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", 30000)),
            int(os.environ.get("RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT", 40000)))  # Ray's defaults


def main(argv: list[str]) -> None:
    source, target = argv
    with open(source) as file:
        config, environment = plan(yaml.safe_load(file))
    with open(target, "w") as file:
        yaml.safe_dump(config, file, sort_keys=False)
    for name, value in environment.items():
        print(f"export {name}={value}")


if __name__ == "__main__":
    main(sys.argv[1:])
