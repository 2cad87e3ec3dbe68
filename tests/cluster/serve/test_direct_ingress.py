"""Direct ingress (`make serve`): the replica answers HTTP and gRPC on the config's ports itself, the
proxy moved aside; configs that need the proxy (several replicas or applications) stay as they are."""
from __future__ import annotations

import http.client
import json
import time
from pathlib import Path

import grpc
import pytest
import ray
import yaml
from ray import serve

from cluster.serve import direct_ingress
from cluster.serve.app import build_app
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc
from tests.cluster.ray_fixtures import free_port, ready_lines, serve_on_local_ray

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "serve.yaml"
ARGS = {
    "cluster": {"engine": {"model": "smollm2-135m", "method": "pld", "max_sequences": 2, "max_len": 256},
                "gpus_per_target_shard": 0, "gpus_per_draft_actor": 0},
    "limits": {"max_prompt_tokens": 192, "max_new_tokens": 16, "max_concurrent_requests": 4},
}


def test_the_shipped_config_runs_direct_on_its_own_ports_with_the_proxy_moved_aside():
    config = yaml.safe_load(CONFIG.read_text())
    planned, environment = direct_ingress.plan(config)
    assert (planned["http_options"]["port"], planned["grpc_options"]["port"]) == (8100, 9100)
    assert planned["grpc_options"]["grpc_servicer_functions"] == config["grpc_options"]["grpc_servicer_functions"]
    assert planned["applications"] == config["applications"]
    assert environment["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    ranges = {name: int(value) for name, value in environment.items() if "_PORT" in name and "QUARANTINE" not in name}
    assert ranges == {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": 8000, "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": 8001,
                      "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": 9000, "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": 9001}


def two_replicas_at_most(config: dict) -> None:
    config["applications"][0]["deployments"][0]["autoscaling_config"]["max_replicas"] = 2


def three_fixed_replicas(config: dict) -> None:
    deployment = config["applications"][0]["deployments"][0]
    del deployment["autoscaling_config"]
    deployment["num_replicas"] = 3


def a_second_application(config: dict) -> None:
    config["applications"].append({**config["applications"][0], "name": "second", "route_prefix": "/second"})


def no_proxies(config: dict) -> None:
    config["proxy_location"] = "Disabled"


@pytest.mark.parametrize("change", [two_replicas_at_most, three_fixed_replicas, a_second_application, no_proxies])
def test_configs_that_need_the_proxy_are_left_as_they_are(change):
    config = yaml.safe_load(CONFIG.read_text())
    change(config)
    assert direct_ingress.plan(config) == (config, {})


def test_the_command_writes_the_config_and_prints_the_environment(tmp_path, capsys):
    target = tmp_path / "serve.yaml"
    direct_ingress.main([str(CONFIG), str(target)])
    exports = dict(line.removeprefix("export ").split("=", 1) for line in capsys.readouterr().out.splitlines())
    planned, environment = direct_ingress.plan(yaml.safe_load(CONFIG.read_text()))
    assert exports == environment and yaml.safe_load(target.read_text()) == planned


@pytest.fixture(scope="module")
def direct_ports():
    """(HTTP, gRPC) ports the replica listens on itself; Serve on a Ray of its own, started under
    the environment `plan` gives (Ray's processes read it when they start)."""
    http_port, grpc_port = free_port(), free_port()
    config = {"http_options": {"host": "127.0.0.1", "port": http_port}, "grpc_options": {"port": grpc_port},
              "applications": [{"name": "direct", "deployments": [{"name": "SpecServer"}]}]}
    planned, environment = direct_ingress.plan(config)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environment.items():
            patch.setenv(name, value)
        with serve_on_local_ray(planned["grpc_options"]["port"], planned["http_options"]):
            serve.run(build_app(ARGS), name="direct", route_prefix="/")
            yield http_port, grpc_port


def chat(port: int) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
            "temperature": 0}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    return {"status": response.status, **json.loads(response.read())}


def generate(port: int) -> pb.GenerateResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = pb.GenerateRequest(text="Say hello.", sampling=pb.Sampling(max_new_tokens=8))
        return specserve_pb2_grpc.SpecServeStub(channel).Generate(request, timeout=120)


@pytest.mark.default_model
def test_the_replica_answers_http_and_grpc_on_the_configs_ports_and_says_so(direct_ports):
    http_port, grpc_port = direct_ports
    answer = chat(http_port)
    assert answer["status"] == 200 and answer["usage"]["completion_tokens"] == 8
    assert len(generate(grpc_port).token_ids) == 8
    expected = f"HTTP on 127.0.0.1:{http_port}, gRPC on {grpc_port} (this replica; Serve's proxy on"
    lines = ready_lines("direct")
    assert len(lines) == 1 and expected in lines[0], lines


@pytest.mark.default_model
def test_a_replica_started_again_takes_the_same_ports_back(direct_ports):
    """The port is the replica's alone: Serve's replacement for a dead replica must get it again at once."""
    http_port, grpc_port = direct_ports
    replica = next(actor for actor in ray.util.list_named_actors(all_namespaces=True)
                   if "SERVE_REPLICA" in actor["name"] and "SpecServer" in actor["name"])
    ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)
    deadline, answer = time.monotonic() + 180, None
    while time.monotonic() < deadline:
        try:
            answer = chat(http_port)
            if answer["status"] == 200:
                break
        except (OSError, http.client.HTTPException, json.JSONDecodeError):
            pass
        time.sleep(1)
    assert answer is not None and answer["status"] == 200, answer
    assert len(generate(grpc_port).token_ids) == 8
