"""OpenAI-compatible HTTP routes over a SpecService: /v1/models, /v1/completions, /v1/chat/completions.

Off-the-shelf OpenAI clients work unchanged: bodies are translated into `RequestOptions`, and the
service's answers come back in OpenAI's shapes (openai_schema.py), errors included (400 names the
bad field in `param`, 401 for a wrong key, 503 with Retry-After when the replica is full or a worker
failed). Speculation is chosen per request with a non-standard `speculation` object (the fields of
`SpeculationOptions`) and reported back in a non-standard `speculation` object.
"""
# no `from __future__ import annotations`: FastAPI must see real classes after Serve pickles the routes

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, suppress

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cluster.engine.request import GenerationOutput, GenerationRequest
from cluster.engine.spec_engine import StepEvent
from cluster.serve.openai_schema import FINISH_REASONS, Call, ResponseShape, parse_call, speculation_stats, sse
from cluster.serve.service import InvalidRequest, Overloaded, SpecService, Unauthorized

RETRY_AFTER_S = "1"


def build_openai_router(get_service: Callable[[], SpecService]) -> APIRouter:
    """The routes, resolving the service per request (a Serve replica builds it after the app)."""
    router = APIRouter()
    created = int(time.time())

    @router.get("/v1/models")
    async def list_models(request: Request) -> Response:
        async def models(service: SpecService) -> Response:
            card = {"id": service.model_id, "object": "model", "created": created, "owned_by": "specserve"}
            return JSONResponse({"object": "list", "data": [card]})

        return await _answer(request, get_service, models)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _answer(request, get_service, lambda service: _complete(service, request, chat=False))

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _answer(request, get_service, lambda service: _complete(service, request, chat=True))

    return router


# ---- errors ------------------------------------------------------------------------------------


def _error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _answer(request: Request, get_service: Callable[[], SpecService],
                  produce: Callable[[SpecService], Awaitable[Response]]) -> Response:
    """Authorize, run the route, and turn the service's refusals into OpenAI error responses.

    A router cannot carry exception handlers (they belong to the app), so each route goes through here.
    """
    try:
        service = get_service()
        service.authorize(request.headers.get("authorization"))
        return await produce(service)
    except Unauthorized as error:
        return _error(401, str(error), "invalid_request_error", code="invalid_api_key",
                      headers={"WWW-Authenticate": "Bearer"})
    except InvalidRequest as error:
        return _error(400, str(error), "invalid_request_error", param=error.field)
    except Overloaded as error:
        return _error(503, str(error), "overloaded", headers={"Retry-After": RETRY_AFTER_S})


def _failed(output: GenerationOutput) -> JSONResponse:
    """A request the engine could not finish (a failed worker): retryable, so 503 rather than 500."""
    return _error(503, _failure_message(output), "server_error", headers={"Retry-After": RETRY_AFTER_S})


def _failure_message(output: GenerationOutput) -> str:
    return output.error or f"the request ended with {output.finish_reason!r}"


# ---- running -----------------------------------------------------------------------------------


async def _start(service: SpecService, request: GenerationRequest) -> tuple[StepEvent, AsyncIterator[StepEvent]]:
    """The request's first step event and the stream of the rest.

    Waiting for the first event surfaces Overloaded, which the service raises only when the stream
    is first read, before a streamed response has sent its 200 headers.
    """
    events = service.stream(request)
    return await anext(events), events


async def _final_output(service: SpecService, request: GenerationRequest) -> GenerationOutput:
    first, events = await _start(service, request)
    async with aclosing(events):
        event = first
        while event.finished is None:
            event = await anext(events)
        return event.finished


async def _until_disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body has been read, so only 'http.disconnect' is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _output_unless_abandoned(service: SpecService, generation: GenerationRequest,
                                   request: Request) -> GenerationOutput | None:
    """The whole output, or None once the client has gone: its request is then aborted instead of
    being decoded to the end for nobody (clients that time out also retry, doubling the load)."""
    work = asyncio.ensure_future(_final_output(service, generation))
    departure = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait((work, departure), return_when=asyncio.FIRST_COMPLETED)
    finally:
        departure.cancel()
        if not work.done():
            work.cancel()  # closes the step stream, which aborts the request in the engine
            with suppress(asyncio.CancelledError):
                await work
    return None if work.cancelled() else work.result()


async def _complete(service: SpecService, request: Request, chat: bool) -> Response:
    request_id = uuid.uuid4().hex
    call = parse_call(await request.body(), service, chat, request_id)
    shape = ResponseShape(("chatcmpl-" if chat else "cmpl-") + request_id, int(time.time()), service.model_id, chat)
    if call.stream:
        first, events = await _start(service, call.request)
        if first.finished is not None and first.finished.finish_reason not in FINISH_REASONS:
            await events.aclose()
            return _failed(first.finished)  # no header sent yet: a real status beats an error event
        return _EventStreamResponse(_sse_events(shape, call, first, events), events)
    output = await _output_unless_abandoned(service, call.request, request)
    if output is None:
        return Response(status_code=499)  # nobody is listening; the status only shows in access logs
    if output.finish_reason not in FINISH_REASONS:
        return _failed(output)
    return JSONResponse(shape.response(output, len(call.request.prompt_ids)))


async def _sse_events(shape: ResponseShape, call: Call, first: StepEvent,
                      events: AsyncIterator[StepEvent]) -> AsyncIterator[str]:
    """The server-sent events of one streamed request: text deltas, the finish (or an error), [DONE]."""
    if shape.chat:
        yield sse(shape.chunk(role=True))
    event = first
    while event.finished is None:
        if event.text:
            yield sse(shape.chunk(event.text))
        event = await anext(events)
    output = event.finished
    if output.finish_reason not in FINISH_REASONS:
        yield sse({"error": {"message": _failure_message(output), "type": "server_error", "param": None, "code": None}})
    else:
        if event.text:
            yield sse(shape.chunk(event.text))
        final = shape.chunk(finish_reason=output.finish_reason, finish_detail=output.finish_detail)
        yield sse(final | {"speculation": speculation_stats(output)})
        if call.include_usage:
            yield sse(shape.usage_chunk(output, len(call.request.prompt_ids)))
    yield sse("[DONE]")


class _EventStreamResponse(StreamingResponse):
    """Server-sent events that close the request's step stream when the response stops, however it
    stops: closing it is what aborts the request in the engine when the client hangs up.

    Starlette does not close the body iterator when a client disconnects; it just stops iterating,
    possibly before the first chunk, and leaves the clean-up to garbage collection.
    """

    def __init__(self, body: AsyncIterator[str], events: AsyncIterator[StepEvent]):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()
