"""The Ray Serve application: one deployment, `SpecServer`, reachable over gRPC and OpenAI-style HTTP.

Each replica of `SpecServer` owns one SpecCluster per served model (its target groups and draft
actors, placed on their own GPU sets) and serves each through one SpecService for both protocols,
routed by the model a request names (models.py): the gRPC
methods below (names match protos/specserve.proto; Serve's gRPC proxy routes an RPC to the method
of the same name) and the FastAPI routes of openai_api.py. Scaling the deployment scales
target groups; `record_autoscaling_stats` feeds autoscaling.py's policy. `GET /health` (openai_api.py)
and grpc.health.v1 answer whether every engine loop of a replica serves now (readiness); Serve's
health check, whether it can recover (`check_health`, cluster/engine/recovery.py). Once the
application answers, its first replica logs `specserve ready: model ..., HTTP on HOST:PORT, gRPC on PORT`.

`build_app(args)` is the import path for `ray serve run configs/serve.yaml` and `serve build`.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
from grpc_health.v1 import health_pb2
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve

from cluster.engine.request import GenerationRequest
from cluster.runtime.cluster_spec import ClusterSpec
from cluster.runtime.spec_cluster import SpecCluster
from cluster.serve.direct_ingress import replica_ports
from cluster.serve.grpc_api import (
    WorkerFailed,
    checked,
    chunk_message,
    metadata_value,
    options_from,
    response_message,
    status_of,
)
from cluster.serve.metrics import SAMPLE_PERIOD_S, ServingMetrics
from cluster.serve.models import ServedModels
from cluster.serve.openai_api import RETRY_AFTER_S, build_http_app
from cluster.serve.requests import TENANT_HEADER
from cluster.serve.service import InvalidRequest, ServiceLimits, SpecService
from protos import specserve_pb2 as pb

log = logging.getLogger("ray.serve")  # Serve writes this logger to the replica's log file
RETRYABLE_CODES = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
SERVER_ERRORS = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
"""What the server got wrong or could not do: logged as errors; every other status is a refusal."""
GRPC_SERVICERS = [
    "cluster.serve.grpc_api.add_SpecServeServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]


class ServedModel(BaseModel):
    """One model of an application that serves several, under the name clients use for it."""

    model_config = ConfigDict(extra="forbid")

    model_id: str = Field(min_length=1, description="name clients use for the model")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="what each replica runs for it and where")


class AppArgs(BaseModel):
    """The `args` of the application in a Serve config file: one model (`cluster`, `model_id`), or
    several (`models`), routed by the name a request gives."""

    model_config = ConfigDict(extra="forbid")

    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="what each replica runs and where")
    limits: ServiceLimits = Field(default_factory=ServiceLimits, description="request limits and the API key")
    model_id: str | None = Field(None, description="name clients use for the model (default: the engine's model)")
    models: list[ServedModel] = Field(
        default_factory=list, description="several models, each with its own cluster, routed by the request's "
        "`model` (instead of cluster and model_id)")

    @model_validator(mode="after")
    def _one_way_to_name_models(self) -> AppArgs:
        if self.models and {"cluster", "model_id"} & self.model_fields_set:
            raise ValueError("give either models or cluster (and model_id), not both")
        ids = [served.model_id for served in self.served()]
        if len(set(ids)) != len(ids):
            raise ValueError(f"model ids must be distinct: {ids}")
        return self

    @model_validator(mode="after")
    def _requests_fit_the_context_window(self) -> AppArgs:
        """Checked when the app starts: otherwise the longest allowed prompt asking for the most
        tokens would be cut short by the context window, not by the limit the client was told. With
        max_prompt_tokens null each request is held to the window instead (RequestBuilder)."""
        limits = self.limits
        for served in self.served():
            max_len = served.cluster.engine.max_len
            if (limits.max_prompt_tokens or 1) + limits.max_new_tokens > max_len:
                raise ValueError(
                    f"limits.max_prompt_tokens ({limits.max_prompt_tokens or 1}) + limits.max_new_tokens "
                    f"({limits.max_new_tokens}) must be <= cluster.engine.max_len ({max_len}) of {served.model_id}")
        return self

    def served(self) -> list[ServedModel]:
        """Every model this application serves."""
        return self.models or [ServedModel(model_id=self.model_id or self.cluster.engine.model, cluster=self.cluster)]


def current_models() -> ServedModels:
    """The models of the replica handling this request. Found through Serve's replica context,
    not a module global: Serve pickles the ingress class and app by value, with copies of globals."""
    return serve.get_replica_context().servable_object.models


http_app = build_http_app(current_models)
HEALTH_SERVICES = ("", "specserve.SpecServe")
"""What grpc.health.v1.Health/Check knows: the whole server ("") and its service; others are NOT_FOUND."""
READY_POLL_S = 0.5
READY_WAIT_S = 900.0
"""How often, and how long, the first replica asks Serve whether the application is running yet."""


def serve_details():
    """Serve's view of itself (applications, proxies, their ports): what `serve status` shows.
    `serve.status()` drops the ports, so this asks the controller through Serve's client."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeInstanceDetails

    return ServeInstanceDetails(**_get_global_client().get_serve_details())


def serving_ready(details, app_name: str) -> bool:
    """The application runs (every replica it wants answers), a proxy is up and none is starting
    (EveryNode drains the proxies of nodes without replicas: those do not count)."""
    app = details.applications.get(app_name)
    statuses = [proxy.status for proxy in details.proxies.values()]
    return app is not None and app.status == "RUNNING" and "STARTING" not in statuses and (
        not statuses or "HEALTHY" in statuses)


def ready_line(model_ids: list[str], details) -> str:
    """`specserve ready: model M, HTTP on HOST:PORT, gRPC on PORT`, from Serve's proxy options, or
    the replica's own ports under direct ingress (direct_ingress.py), the proxy's after them."""
    if str(getattr(details.proxy_location, "value", details.proxy_location)) == "Disabled":
        where = "no HTTP or gRPC proxy (proxy_location: Disabled)"
    else:
        http, grpc_options = details.http_options, details.grpc_options
        served_grpc = grpc_options is not None and grpc_options.grpc_servicer_functions
        direct = replica_ports() if http is not None else None
        http_port, grpc_port = direct or (http and http.port, grpc_options and grpc_options.port)
        where = f"HTTP on {http.host}:{http_port}" if http is not None else "HTTP off"
        where += f", gRPC on {grpc_port}" if served_grpc else ", gRPC off (no grpc_servicer_functions)"
        if direct is not None:
            where += f" (this replica; Serve's proxy on {http.port}" + (f" and {grpc_options.port})" if served_grpc else ")")
    return f"specserve ready: model {', '.join(model_ids)}, {where}"


@serve.deployment(name="SpecServer", max_ongoing_requests=64, graceful_shutdown_timeout_s=30, health_check_period_s=10)
@serve.ingress(http_app)
class SpecServer:
    def __init__(self, args: AppArgs):
        started = time.monotonic()
        self.metrics = ServingMetrics()
        self.clusters, services = [], []
        for served in args.served():
            cluster = SpecCluster(served.cluster).start()
            self.clusters.append(cluster)
            engine = served.cluster.engine
            services.append(SpecService(cluster.loops, cluster.tokenizer, served.model_id, engine.method,
                                        engine.lookahead, args.limits, observer=self.metrics))
            # a fast tokenizer whose file turns truncation or padding on changes it on its first use;
            # changing it while another thread tokenizes raises "Already borrowed", and requests are
            # tokenized on worker threads: settle it here, once
            cluster.tokenizer.encode("ready")
        self.models = ServedModels(services)
        self._sampler = asyncio.get_event_loop().create_task(self._sample_forever())
        self._announcer = asyncio.get_event_loop().create_task(self._announce_ready(started))

    @property
    def loops(self) -> list:
        """Every engine loop of every model."""
        return [loop for cluster in self.clusters for loop in cluster.loops]

    async def _announce_ready(self, started: float) -> None:
        """Logs `specserve ready: ...` (models and ports) once the application answers: the first
        replica (rank 0) asks Serve until the application and its proxies run. The "ray.serve"
        logger goes to the replica's log file and its stderr, which `serve run` shows."""
        context = serve.get_replica_context()
        rank = getattr(context, "rank", 0)
        if getattr(rank, "rank", rank) != 0:
            return
        model_ids = [service.model_id for service in self.models]
        try:
            while not serving_ready(details := await asyncio.to_thread(serve_details), context.app_name):
                if time.monotonic() - started > READY_WAIT_S:
                    log.warning("application %s is not running %.0f s after this replica started",
                                context.app_name, READY_WAIT_S)
                    return
                await asyncio.sleep(READY_POLL_S)
        except Exception as error:  # Serve's client changed: the replica answers; the ports are unknown
            log.info("specserve ready: model %s (this replica; no proxy ports from Serve: %s)",
                     ", ".join(model_ids), error)
            return
        log.info("%s (%.1f s after this replica started)", ready_line(model_ids, details), time.monotonic() - started)

    async def _sample_forever(self) -> None:
        while True:
            self.metrics.sample(self.loops)
            await asyncio.sleep(SAMPLE_PERIOD_S)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom metrics for SpeculationAwarePolicy (ongoing, queued, tokens_per_step)."""
        return self.metrics.sample(self.loops)

    def engine_state(self) -> dict[str, int]:
        """Requests held by this replica's engines (operators and tests: a cancelled stream frees its slot)."""
        return {
            "active": sum(len(loop.engine.active) for loop in self.loops),
            "waiting": sum(loop.engine.queue_depth for loop in self.loops),
            "in_flight": sum(service.in_flight for service in self.models),
        }

    def cost_curves(self) -> list[list[dict] | None]:
        """Each target group's measured verification cost curve (None: the planner is off), for
        operators: `serve.get_deployment_handle("SpecServer", app).cost_curves.remote()`."""
        planners = [loop.engine.speculation.planner for loop in self.loops]
        return [None if planner is None else planner.cost.to_json() for planner in planners]

    def check_health(self) -> None:
        """Serve replaces a replica whose engine loops died or whose target could not be rebuilt; a
        rebuild under way is no failure (it outlasts Serve's three checks), only not ready (readiness:
        `GET /health` and gRPC Check)."""
        dead = [loop for loop in self.loops if not loop.alive]
        if dead:
            raise RuntimeError(f"{len(dead)} engine loops stopped or failed to rebuild their target")

    def __del__(self):
        for cluster in getattr(self, "clusters", ()):
            cluster.shutdown()

    # ---- gRPC -----------------------------------------------------------------------------------

    async def _request(self, message: pb.GenerateRequest, grpc_context) -> tuple[SpecService, GenerationRequest]:
        """The request's service and engine request, built (tokenized, its grammar's compile started) on a
        worker thread, not on the event loop, where it would stall every stream; the compile is awaited
        on the loop, holding no worker thread (slow compiles would otherwise starve parsing)."""
        key_tenant = self.models.authorize(metadata_value(grpc_context, "authorization"))
        message = checked(message)
        if message.ByteSize() > self.models.limits.max_body_bytes:  # Serve's proxy takes up to 2 GiB
            raise InvalidRequest("request", f"has {message.ByteSize()} bytes; the limit is "
                                            f"{self.models.limits.max_body_bytes} (limits.max_body_bytes)")
        service = self.models.resolve(message.model)
        options = options_from(message)
        options.tenant = service.tenant(key_tenant, metadata_value(grpc_context, TENANT_HEADER))  # what it may share
        request = await asyncio.to_thread(service.build_request, options, wait_for_grammar=False)
        await service.await_grammars([request])
        return service, request

    @staticmethod
    def _fail(grpc_context, error: Exception) -> None:
        """Answer with the error's status. Only a bug (INTERNAL) is logged with its traceback; a failed
        worker (UNAVAILABLE, retryable) is a warning, and a refusal is logged once, at INFO."""
        code = status_of(error)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("gRPC request failed", exc_info=error)
        elif code in SERVER_ERRORS:
            log.warning("gRPC request failed with %s: %s", code.name, error)
        else:
            log.info("gRPC request refused with %s: %s", code.name, error)
        if grpc_context is not None:
            grpc_context.set_code(code)
            grpc_context.set_details(str(error))
            if code in RETRYABLE_CODES:  # the hint HTTP gives in Retry-After
                grpc_context.set_trailing_metadata([("retry-after", RETRY_AFTER_S)])

    async def Generate(self, message: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:
        try:
            service, request = await self._request(message, grpc_context)
            output = await service.generate(request, protocol="grpc")
        except Exception as error:
            self._fail(grpc_context, error)
            return pb.GenerateResponse()
        if output.finish_reason == "error":
            self._fail(grpc_context, WorkerFailed(output.error or "generation failed; retry"))
            return pb.GenerateResponse()
        return response_message(output, len(request.prompt_ids), service)

    async def GenerateStream(self, message: pb.GenerateRequest, grpc_context=None):
        """One chunk per verification pass. A refused request (bad input, unknown model, full
        replica) ends the stream with its status after one empty chunk: Serve's gRPC proxy carries a
        stream's status only on a yielded message or an exception, and logs an exception as a server
        error with its traceback. Failures (INTERNAL, UNAVAILABLE) are raised."""
        sent = False
        try:
            service, request = await self._request(message, grpc_context)
            async for event in service.stream(request, protocol="grpc"):
                finished = event.finished
                if finished and finished.finish_reason == "error":
                    raise WorkerFailed(finished.error or "generation failed; retry")
                yield chunk_message(event, service)
                sent = True
        except Exception as error:
            self._fail(grpc_context, error)
            if sent or status_of(error) in SERVER_ERRORS:
                raise
            yield pb.GenerateChunk()

    async def ListModels(self, message: pb.ListModelsRequest, grpc_context=None) -> pb.ListModelsResponse:
        try:
            self.models.authorize(metadata_value(grpc_context, "authorization"))
        except Exception as error:
            self._fail(grpc_context, error)
            return pb.ListModelsResponse()
        return pb.ListModelsResponse(models=[pb.ModelInfo(id=service.model_id, speculation_method=service.method)
                                             for service in self.models])

    async def Check(self, message: health_pb2.HealthCheckRequest, grpc_context=None) -> health_pb2.HealthCheckResponse:
        """grpc.health.v1.Health/Check: SERVING while every engine loop serves (NOT_SERVING while a
        target group is rebuilt); NOT_FOUND for a service this server does not have (the health
        protocol's answer)."""
        if message.service not in HEALTH_SERVICES:
            if grpc_context is not None:
                grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
                grpc_context.set_details(f"unknown service {message.service!r}; known: {', '.join(map(repr, HEALTH_SERVICES))}")
            return health_pb2.HealthCheckResponse()
        serving = all(loop.ready for loop in self.loops)
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)


def build_app(args: dict) -> serve.Application:
    """Application builder named by `import_path: cluster.app:build_app` in a Serve config."""
    return SpecServer.bind(AppArgs.model_validate(args or {}))
