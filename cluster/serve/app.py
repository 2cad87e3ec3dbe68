"""The Ray Serve application: one deployment, `SpecServer`, reachable over gRPC and OpenAI-style HTTP.

Each replica of `SpecServer` owns one SpecCluster (its target groups and draft actors, placed on
their own GPU sets) and serves it through the same SpecService for both protocols: the gRPC
methods below (names match protos/specserve.proto; Serve's gRPC proxy routes an RPC to the method
of the same name) and the FastAPI routes of openai_api.py. Scaling the deployment scales
target groups; `record_autoscaling_stats` feeds autoscaling.py's policy.

`build_app(args)` is the import path for `ray serve run configs/serve.yaml` and `serve build`.
"""
from __future__ import annotations

import asyncio
import logging

import grpc
from fastapi import FastAPI
from grpc_health.v1 import health_pb2
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve

from cluster.runtime.placement import ClusterSpec
from cluster.runtime.spec_cluster import SpecCluster
from cluster.serve.grpc_api import (
    WorkerFailed, checked, metadata_value, options_from, response_message, stats_message, status_of,
)
from cluster.serve.metrics import SAMPLE_PERIOD_S, ServingMetrics
from cluster.serve.openai_api import RETRY_AFTER_S, build_openai_router
from cluster.serve.service import ServiceLimits, SpecService
from protos import specserve_pb2 as pb

log = logging.getLogger(__name__)
RETRYABLE_CODES = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
GRPC_SERVICERS = [
    "cluster.serve.grpc_api.add_SpecServeServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]


class AppArgs(BaseModel):
    """The `args` of the application in a Serve config file."""

    model_config = ConfigDict(extra="forbid")

    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="what each replica runs and where")
    limits: ServiceLimits = Field(default_factory=ServiceLimits, description="request limits and the API key")
    model_id: str | None = Field(None, description="name clients use for the model (default: the engine's model)")

    @model_validator(mode="after")
    def _requests_fit_the_context_window(self) -> AppArgs:
        """Checked when the app starts: otherwise the longest allowed prompt asking for the most
        tokens would be cut short by the context window, not by the limit the client was told."""
        limits, max_len = self.limits, self.cluster.engine.max_len
        if limits.max_prompt_tokens + limits.max_new_tokens > max_len:
            raise ValueError(
                f"limits.max_prompt_tokens ({limits.max_prompt_tokens}) + limits.max_new_tokens "
                f"({limits.max_new_tokens}) must be <= cluster.engine.max_len ({max_len})")
        return self


def current_service() -> SpecService:
    """The service of the replica handling this request. Found through Serve's replica context,
    not a module global: Serve pickles the ingress class and app by value, with copies of globals."""
    return serve.get_replica_context().servable_object.service


http_app = FastAPI(title="specserve", description="Lossless speculative decoding, OpenAI-compatible API")
http_app.include_router(build_openai_router(current_service))


@serve.deployment(name="SpecServer", max_ongoing_requests=64, graceful_shutdown_timeout_s=30, health_check_period_s=10)
@serve.ingress(http_app)
class SpecServer:
    def __init__(self, args: AppArgs):
        self.cluster = SpecCluster(args.cluster).start()
        engine = args.cluster.engine
        self.metrics = ServingMetrics()
        self.service = SpecService(
            self.cluster.loops, self.cluster.tokenizer, args.model_id or engine.model, engine.method,
            engine.lookahead, args.limits, observer=self.metrics,
        )
        self._sampler = asyncio.get_event_loop().create_task(self._sample_forever())

    async def _sample_forever(self) -> None:
        while True:
            self.metrics.sample(self.cluster.loops)
            await asyncio.sleep(SAMPLE_PERIOD_S)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom metrics for SpeculationAwarePolicy (ongoing, queued, tokens_per_step)."""
        return self.metrics.sample(self.cluster.loops)

    def engine_state(self) -> dict[str, int]:
        """Requests held by this replica's engines (operators and tests: a cancelled stream frees its slot)."""
        return {
            "active": sum(len(loop.engine.active) for loop in self.cluster.loops),
            "waiting": sum(loop.engine.queue_depth for loop in self.cluster.loops),
            "in_flight": self.service.in_flight,
        }

    def cost_curves(self) -> list[list[dict] | None]:
        """Each target group's measured verification cost curve (None: the planner is off), for
        operators: `serve.get_deployment_handle("SpecServer", app).cost_curves.remote()`."""
        return [None if loop.engine.planner is None else loop.engine.planner.cost.to_json() for loop in self.cluster.loops]

    def check_health(self) -> None:
        """Serve restarts a replica whose engine loops died."""
        dead = [loop for loop in self.cluster.loops if not loop.alive]
        if dead:
            raise RuntimeError(f"{len(dead)} engine loops stopped")

    def __del__(self):
        cluster = getattr(self, "cluster", None)
        if cluster is not None:
            cluster.shutdown()

    # ---- gRPC -----------------------------------------------------------------------------------

    def _request(self, message: pb.GenerateRequest, grpc_context):
        self.service.authorize(metadata_value(grpc_context, "authorization"))
        return self.service.build_request(options_from(checked(message)))

    @staticmethod
    def _fail(grpc_context, error: Exception) -> None:
        code = status_of(error)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("gRPC request failed", exc_info=error)
        if grpc_context is not None:
            grpc_context.set_code(code)
            grpc_context.set_details(str(error))
            if code in RETRYABLE_CODES:  # the hint HTTP gives in Retry-After
                grpc_context.set_trailing_metadata([("retry-after", RETRY_AFTER_S)])

    async def Generate(self, message: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:
        try:
            request = self._request(message, grpc_context)
            output = await self.service.generate(request, protocol="grpc")
        except Exception as error:
            self._fail(grpc_context, error)
            return pb.GenerateResponse()
        if output.finish_reason == "error":
            self._fail(grpc_context, WorkerFailed(output.error or "generation failed; retry"))
            return pb.GenerateResponse()
        return response_message(output, len(request.prompt_ids))

    async def GenerateStream(self, message: pb.GenerateRequest, grpc_context=None):
        try:
            request = self._request(message, grpc_context)
            async for event in self.service.stream(request, protocol="grpc"):
                finished = event.finished
                if finished and finished.finish_reason == "error":
                    raise WorkerFailed(finished.error or "generation failed; retry")
                chunk = pb.GenerateChunk(token_ids=event.new_token_ids, text=event.text)
                if finished:
                    chunk.finish_reason, chunk.finish_detail = finished.finish_reason, finished.finish_detail or ""
                    chunk.stats.CopyFrom(stats_message(finished.stats, len(finished.token_ids)))
                yield chunk
        except Exception as error:
            # a server stream carries its status only on a yielded message or an exception
            self._fail(grpc_context, error)
            raise

    async def ListModels(self, message: pb.ListModelsRequest, grpc_context=None) -> pb.ListModelsResponse:
        try:
            self.service.authorize(metadata_value(grpc_context, "authorization"))
        except Exception as error:
            self._fail(grpc_context, error)
            return pb.ListModelsResponse()
        return pb.ListModelsResponse(models=[pb.ModelInfo(id=self.service.model_id, speculation_method=self.service.method)])

    async def Check(self, message: health_pb2.HealthCheckRequest, grpc_context=None) -> health_pb2.HealthCheckResponse:
        """grpc.health.v1.Health/Check: SERVING while every engine loop runs."""
        serving = all(loop.alive for loop in self.cluster.loops)
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)


def build_app(args: dict) -> serve.Application:
    """Application builder named by `import_path: cluster.app:build_app` in a Serve config."""
    return SpecServer.bind(AppArgs.model_validate(args or {}))
