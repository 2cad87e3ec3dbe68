"""OpenAI-compatible HTTP routes over the served models: /v1/models, /v1/completions, /v1/chat/completions.

Off-the-shelf OpenAI clients work unchanged: bodies are translated into `RequestOptions` for the
model they name, and the service's answers come back in OpenAI's shapes (openai_schema.py), errors
included (400 names the bad field in `param`, 401 for a wrong key, 404 `model_not_found` for a model
that is not served, 503 with Retry-After when the replica is full or a worker failed). A refusal is
logged once, at INFO, without a traceback: it is the client's mistake, not the server's. Speculation
is chosen per request with a non-standard `speculation` object (the fields of `SpeculationOptions`)
and reported back in a non-standard `speculation` object. `GET /health` answers 200 while every
engine loop of the replica serves and 503 otherwise (a target group being rebuilt too), without an
API key (as vLLM's does).

A body is parsed and tokenized on a worker thread (`asyncio.to_thread`), not on the replica's event
loop, where a large prompt would stall every stream; its grammar compiles on a compile thread, and the
route awaits it on the loop, so slow compiles hold no parsing thread.
"""
# no `from __future__ import annotations`: FastAPI must see real classes after Serve pickles the routes

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, suppress

import ray
from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cluster.engine.request import GenerationOutput
from cluster.engine.spec_engine import StepEvent
from cluster.runtime.placement import pending_placements
from cluster.serve.models import ModelNotFound, ServedModels
from cluster.serve.openai_schema import FINISH_REASONS, Call, ResponseShape, parse_call, speculation_stats, sse
from cluster.serve.service import InvalidRequest, Overloaded, Unauthorized

RETRY_AFTER_S = "1"
PLACEMENTS_TTL_S = 1.0
"""How long /health reuses Ray's list of waiting placements: probes come often, and the list is read
from the cluster-wide placement group table."""
log = logging.getLogger("ray.serve")  # Serve writes this logger to the replica's log file
SampleEvents = AsyncIterator[tuple[int, StepEvent]]


def build_http_app(get_models: Callable[[], ServedModels]) -> FastAPI:
    """The HTTP app. FastAPI's own /docs, /redoc and /openapi.json are off (they answer anyone); the
    router serves /docs and /openapi.json behind the key, and only with `limits.api_docs`."""
    app = FastAPI(title="specserve", description="Lossless speculative decoding, OpenAI-compatible API",
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(build_openai_router(get_models))
    return app


def build_openai_router(get_models: Callable[[], ServedModels]) -> APIRouter:
    """The routes, resolving the served models per request (a Serve replica builds them after the app)."""
    router = APIRouter()
    created = int(time.time())
    placements = _Recent(lambda: pending_placements(), PLACEMENTS_TTL_S)

    @router.get("/v1/models")
    async def list_models(request: Request) -> Response:
        async def models(served: ServedModels, tenant: str | None) -> Response:
            cards = [{"id": service.model_id, "object": "model", "created": created, "owned_by": "specserve"}
                     for service in served]
            return JSONResponse({"object": "list", "data": cards})

        return await _answer(request, get_models, models)

    @router.get("/health")
    async def health() -> Response:
        """200 while every engine loop of this replica serves, 503 otherwise, a target group being rebuilt
        included (vLLM's /health, for load balancers, readiness probes and benchmark tools). No API
        key, as in vLLM. On a Ray cluster,
        placement groups of this project that wait for room (a replica or drafter being added)
        are listed under `pending_placements`, with Ray's reason (read at most once a PLACEMENTS_TTL_S)."""
        try:
            loops = [loop for service in get_models() for loop in service.loops]
        except Exception as error:  # not serving yet (no replica context) or shutting down
            return _unhealthy(f"the replica is not serving: {error}")
        dead = sum(not loop.alive for loop in loops)
        if dead:
            return _unhealthy(f"{dead} of {len(loops)} engine loops stopped")
        rebuilding = sum(not loop.ready for loop in loops)
        if rebuilding:
            return _unhealthy(f"{rebuilding} of {len(loops)} target groups are being rebuilt")
        pending = await placements.get() if ray.is_initialized() else []
        return JSONResponse({"status": "ok", **({"pending_placements": pending} if pending else {})})

    @router.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> Response:
        async def schema(served: ServedModels, tenant: str | None) -> Response:
            return JSONResponse(request.app.openapi()) if served.limits.api_docs else _not_found()

        return await _answer(request, get_models, schema)

    @router.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> Response:
        async def page(served: ServedModels, tenant: str | None) -> Response:
            return get_swagger_ui_html(openapi_url="/openapi.json", title="specserve") if served.limits.api_docs \
                else _not_found()

        return await _answer(request, get_models, page)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _answer(request, get_models, lambda served, tenant: _complete(served, tenant, request, chat=False))

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _answer(request, get_models, lambda served, tenant: _complete(served, tenant, request, chat=True))

    return router


class _Recent:
    """A slow call's last answer (made on a worker thread), reused for `ttl_s` seconds; probes that
    come while it runs wait for the same call."""

    def __init__(self, fetch: Callable[[], object], ttl_s: float):
        self.fetch, self.ttl_s = fetch, ttl_s
        self._value, self._at, self._running = None, float("-inf"), None

    async def get(self):
        if time.monotonic() - self._at < self.ttl_s:
            return self._value
        if self._running is None:
            self._running = asyncio.ensure_future(asyncio.to_thread(self.fetch))
        running = self._running
        try:
            value = await asyncio.shield(running)
        finally:
            if self._running is running and running.done():
                self._running = None
        self._value, self._at = value, time.monotonic()
        return value


# ---- errors ------------------------------------------------------------------------------------


class BodyTooLarge(ValueError):
    """A body over `limits.max_body_bytes` (413): refused before it is read whole."""


async def _body(request: Request, limit: int) -> bytes:
    """The body, read no further than `limit` bytes (Content-Length, when given, is checked first)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the body has {int(declared)} bytes; the limit is {limit} (limits.max_body_bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"the body has more than {limit} bytes, the limit (limits.max_body_bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def _error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _answer(request: Request, get_models: Callable[[], ServedModels],
                  produce: Callable[[ServedModels, str | None], Awaitable[Response]]) -> Response:
    """Authorize (the key names the caller's tenant), run the route, and turn the service's refusals into OpenAI error responses.

    A router cannot carry exception handlers (they belong to the app), so each route goes through here.
    """
    try:
        served = get_models()
        tenant = served.authorize(request.headers.get("authorization"))
        return await produce(served, tenant)
    except Unauthorized as error:
        status, response = 401, _error(401, str(error), "invalid_request_error", code="invalid_api_key",
                                       headers={"WWW-Authenticate": "Bearer"})
    except ModelNotFound as error:
        status, response = 404, _error(404, str(error), "invalid_request_error", param="model", code="model_not_found")
    except InvalidRequest as error:
        status, response = 400, _error(400, str(error), "invalid_request_error", param=error.field)
    except BodyTooLarge as error:
        status, response = 413, _error(413, str(error), "invalid_request_error", param="body", code="request_too_large")
    except Overloaded as error:
        status, response = 503, _error(503, str(error), "overloaded", headers={"Retry-After": RETRY_AFTER_S})
    log.info("%s %s refused with %d: %s", request.method, request.url.path, status, response.body.decode())
    return response


def _not_found() -> JSONResponse:
    """What an absent route answers (Starlette's 404)."""
    return JSONResponse({"detail": "Not Found"}, status_code=404)


def _unhealthy(reason: str) -> JSONResponse:
    return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503,
                        headers={"Retry-After": RETRY_AFTER_S})


def _failed(output: GenerationOutput) -> JSONResponse:
    """A request the engine could not finish (a failed worker): retryable, so 503 rather than 500."""
    return _error(503, _failure_message(output), "server_error", headers={"Retry-After": RETRY_AFTER_S})


def _failure_message(output: GenerationOutput) -> str:
    return output.error or f"the request ended with {output.finish_reason!r}"


# ---- running -----------------------------------------------------------------------------------


async def _start(call: Call) -> tuple[tuple[int, StepEvent], SampleEvents]:
    """The call's first (request index, step event) and the stream of the rest.

    Waiting for the first event surfaces Overloaded, which the service raises only when the stream
    is first read, before a streamed response has sent its 200 headers.
    """
    events = call.service.stream_samples(call.samples)
    return await anext(events), events


async def _final_outputs(call: Call) -> list[GenerationOutput]:
    """Every request's final output, in request order (a failed one ends the wait)."""
    first, events = await _start(call)
    outputs: dict[int, GenerationOutput] = {}
    async with aclosing(events):
        item = first
        while True:
            index, event = item
            if event.finished is not None:
                outputs[index] = event.finished
                if event.finished.finish_reason not in FINISH_REASONS or len(outputs) == len(call.samples.requests):
                    break
            item = await anext(events)
    return [outputs[i] for i in sorted(outputs)]


async def _until_disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body has been read, so only 'http.disconnect' is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _outputs_unless_abandoned(call: Call, request: Request) -> list[GenerationOutput] | None:
    """The whole outputs, or None once the client has gone: its requests are then aborted instead of
    being decoded to the end for nobody (clients that time out also retry, doubling the load)."""
    work = asyncio.ensure_future(_final_outputs(call))
    departure = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait((work, departure), return_when=asyncio.FIRST_COMPLETED)
    finally:
        departure.cancel()
        if not work.done():
            work.cancel()  # closes the step stream, which aborts the requests in the engine
            with suppress(asyncio.CancelledError):
                await work
    return None if work.cancelled() else work.result()


async def _complete(served: ServedModels, tenant: str | None, request: Request, chat: bool) -> Response:
    request_id = uuid.uuid4().hex
    body = await _body(request, served.limits.max_body_bytes)
    # tokenizing, and compiling a grammar above all, would stall every stream of the replica on its
    # event loop: a worker thread of the loop's (bounded) default executor parses and starts the compile,
    # which is awaited here, so slow compiles hold none of those threads
    call = await asyncio.to_thread(parse_call, body, served, chat, request_id, request.headers, tenant,
                                   wait_for_grammar=False)
    await call.await_grammars()
    service = call.service
    strings = service.token_strings if call.logprobs else None
    shape = ResponseShape(id=("chatcmpl-" if chat else "cmpl-") + request_id, created=int(time.time()), model=service.model_id,
                          chat=chat, strings=strings)
    if call.stream:
        first, events = await _start(call)
        finished = first[1].finished
        if finished is not None and finished.finish_reason not in FINISH_REASONS:
            await events.aclose()
            return _failed(finished)  # no header sent yet: a real status beats an error event
        return _EventStreamResponse(_sse_events(shape, call, first, events), events)
    outputs = await _outputs_unless_abandoned(call, request)
    if outputs is None:
        return Response(status_code=499)  # nobody is listening; the status only shows in access logs
    failed = next((output for output in outputs if output.finish_reason not in FINISH_REASONS), None)
    if failed is not None:
        return _failed(failed)
    return JSONResponse(shape.response(call.samples.choices(outputs), call.prompt_tokens, outputs))


async def _sse_events(shape: ResponseShape, call: Call, first: tuple[int, StepEvent],
                      events: SampleEvents) -> AsyncIterator[str]:
    """The server-sent events of one streamed call: each choice's text deltas (with their logprobs)
    and its finish, then usage when asked, then [DONE]; or an error event when a request failed."""
    samples = call.samples
    if shape.chat:
        for index in range(samples.n):
            yield sse(shape.chunk(index, role=True))
    offsets = [0] * samples.n  # characters of each completion's logprobs tokens sent so far
    outputs: dict[int, GenerationOutput] = {}
    item = first
    while True:
        request_index, event = item
        output = event.finished
        if output is not None and output.finish_reason not in FINISH_REASONS:
            yield sse({"error": {"message": _failure_message(output), "type": "server_error", "param": None, "code": None}})
            break
        for index in samples.choice_indices(request_index):
            logprobs = shape.logprobs(event.logprobs, offsets[index])
            if logprobs is not None and not shape.chat:
                offsets[index] += sum(len(token) for token in logprobs["tokens"])
            if event.text or (logprobs is not None and event.new_token_ids):
                yield sse(shape.chunk(index, event.text, logprobs=logprobs))
            if output is not None:
                final = shape.chunk(index, finish_reason=output.finish_reason, finish_detail=output.finish_detail)
                yield sse(final | {"speculation": speculation_stats([output])})
        if output is not None:
            outputs[request_index] = output
            if len(outputs) == len(samples.requests):
                if call.include_usage:
                    yield sse(shape.usage_chunk(samples.choices([outputs[i] for i in sorted(outputs)]), call.prompt_tokens))
                break
        item = await anext(events)
    yield sse("[DONE]")


class _EventStreamResponse(StreamingResponse):
    """Server-sent events that close the call's step stream when the response stops, however it
    stops: closing it is what aborts the requests in the engine when the client hangs up.

    Starlette does not close the body iterator when a client disconnects; it just stops iterating,
    possibly before the first chunk, and leaves the clean-up to garbage collection.
    """

    def __init__(self, body: AsyncIterator[str], events: SampleEvents):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()
