"""One Serve application serving two models (the tiny model under two names, one drafting with
prompt lookup, one plain), routed by the name a request gives, over gRPC and HTTP; and the answers
Serve's proxies give for unknown models, unknown health services and refused requests."""
from __future__ import annotations

import time
from pathlib import Path

import grpc
import openai
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ray import serve

from actors.model.loader import load_model
from cluster.engine.build import local_engine
from cluster.engine.config import SchedulerConfig
from cluster.engine.request import GenerationRequest
from cluster.serve.app import AppArgs, SpecServer
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc
from tests.cluster.ray_fixtures import channel, ray_four_gpus, shared_serve  # noqa: F401  (module-scoped fixtures)
from tests.conftest import IdTokenizer

pytestmark = pytest.mark.default_model  # the tiny model directory borrows the default model's tokenizer
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    engine = local_engine(load_model(tiny_model_dir), IdTokenizer(), None, SchedulerConfig(max_len=128))
    return engine.generate([GenerationRequest("p", PROMPT, max_new_tokens=NEW_TOKENS)])[0].token_ids


@pytest.fixture(scope="module")
def earlier_logs(shared_serve) -> dict[Path, int]:
    """How much of each Serve log on the shared Ray earlier modules wrote: the logs checked here
    are what was written from this module's deploy on."""
    return {path: path.stat().st_size for path in serve_log_files()}


@pytest.fixture(scope="module")
def ports(shared_serve, earlier_logs, tiny_model_dir):
    """(gRPC port, HTTP port) of an application serving 'tiny-pld' and 'tiny-plain', deployed to
    Serve on the shared Ray."""

    def cluster(method: str) -> dict:
        return {"engine": {"model": str(tiny_model_dir), "method": method, "max_sequences": 2, "max_len": 128},
                "gpus_per_target_shard": 0, "gpus_per_draft_actor": 0}

    args = AppArgs.model_validate({
        "models": [{"model_id": "tiny-pld", "cluster": cluster("pld")},
                   {"model_id": "tiny-plain", "cluster": cluster("none")}],
        "limits": {"max_prompt_tokens": 64, "max_new_tokens": 64},
    })
    serve.run(SpecServer.options(ray_actor_options={"num_cpus": 0.1}).bind(args), name="models", route_prefix="/")
    http_port, grpc_port = shared_serve
    return grpc_port, http_port


def generate(channel, model: str) -> pb.GenerateResponse:
    stub = specserve_pb2_grpc.SpecServeStub(channel)
    return stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), model=model,
                                            sampling=pb.Sampling(max_new_tokens=NEW_TOKENS)), timeout=120)


def test_grpc_routes_by_model_name(channel, expected):
    stub = specserve_pb2_grpc.SpecServeStub(channel)
    listed = stub.ListModels(pb.ListModelsRequest(), timeout=30).models
    assert [(m.id, m.speculation_method) for m in listed] == [("tiny-pld", "pld"), ("tiny-plain", "none")]
    drafting, plain = generate(channel, "tiny-pld"), generate(channel, "tiny-plain")
    assert list(drafting.token_ids) == list(plain.token_ids) == expected
    assert drafting.stats.drafted > 0 and plain.stats.drafted == 0


@pytest.mark.parametrize("model,code", [("gpt-4", grpc.StatusCode.NOT_FOUND), ("", grpc.StatusCode.INVALID_ARGUMENT)])
def test_grpc_refuses_an_unknown_or_missing_model(channel, model, code):
    with pytest.raises(grpc.RpcError) as error:
        generate(channel, model)
    assert error.value.code() == code and "model" in error.value.details()


def test_http_lists_and_routes_both_models(ports, expected):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports[1]}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["tiny-pld", "tiny-plain"]
    for name in ("tiny-pld", "tiny-plain"):
        response = client.completions.create(model=name, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, logprobs=0)
        assert response.model == name and len(response.choices[0].logprobs.tokens) == len(expected)
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    assert error.value.body["code"] == "model_not_found"


def test_health_knows_its_services_only(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "specserve.SpecServe"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status == \
            health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as error:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=30)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_app_args_name_models_one_way():
    with pytest.raises(ValueError, match="either models or cluster"):
        AppArgs.model_validate({"models": [{"model_id": "a"}], "model_id": "b"})
    with pytest.raises(ValueError, match="distinct"):
        AppArgs.model_validate({"models": [{"model_id": "a"}, {"model_id": "a"}]})
    assert [served.model_id for served in AppArgs().served()] == ["smollm2-135m"]


def serve_log_files() -> list[Path]:
    return sorted((Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve").glob("*.log"))


def serve_logs(earlier: dict[Path, int]) -> str:
    """Everything the replicas and proxies have logged since this module deployed its app."""
    text = ""
    for path in serve_log_files():
        with path.open("rb") as handle:
            handle.seek(earlier.get(path, 0))
            text += handle.read().decode(errors="replace")
    return text


def test_a_refusal_is_logged_once_without_a_traceback(channel, ports, earlier_logs):
    stub = specserve_pb2_grpc.SpecServeStub(channel)
    bad = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), model="tiny-pld", sampling=pb.Sampling(temperature=-1))
    for call in (stub.Generate, lambda message, timeout: list(stub.GenerateStream(message, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as error:
            call(bad, timeout=60)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in error.value.details()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports[1]}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-pld", prompt=PROMPT, max_tokens=4, temperature=-1)
    grpc_line, http_line = "gRPC request refused with INVALID_ARGUMENT: temperature", "refused with 400"
    deadline = time.monotonic() + 10  # replicas write their logs a little later
    while time.monotonic() < deadline and (serve_logs(earlier_logs).count(grpc_line) < 2
                                           or serve_logs(earlier_logs).count(http_line) < 1):
        time.sleep(0.2)
    logs = serve_logs(earlier_logs)
    assert logs.count(grpc_line) == 2
    assert logs.count(http_line) == 1
    assert "Traceback" not in logs and "ERROR" not in logs
