"""OpenAI-compatible HTTP routes over a SpecService: /v1/models, /v1/completions, /v1/chat/completions.

Off-the-shelf OpenAI clients work unchanged: bodies are translated into `RequestOptions`, and the
service's answers come back in OpenAI's shapes, errors included (400 names the bad field in
`param`, 401 for a wrong key, 503 with Retry-After when the replica is full or a worker failed).
Speculation is chosen per request with a non-standard `speculation` object (the fields of
`SpeculationOptions`) and reported back in a non-standard `speculation` object.

Fields OpenAI defines but this server cannot honour (logprobs, penalties, n > 1...) are accepted at
their neutral values, which clients send by default, and refused otherwise: a silently ignored
`presence_penalty` would return output the client did not ask for.
"""
# no `from __future__ import annotations`: FastAPI must see real classes after Serve pickles the routes

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, suppress
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cluster.detokenize import IncrementalDetokenizer
from cluster.engine import StepEvent
from cluster.request import GenerationOutput, GenerationRequest
from cluster.service import InvalidRequest, Overloaded, SpecService, Unauthorized

FINISH_REASONS = ("stop", "length")
"""Endings OpenAI knows; any other ('error', 'abort') means the request failed."""
RETRY_AFTER_S = "1"
OPENAI_DEFAULT_TEMPERATURE = 1.0
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

# Fields that select what this server does, per endpoint; anything not listed here or below is refused.
COMMON_FIELDS = {"model", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "speculation"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "max_tokens"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_tokens", "max_completion_tokens"}
IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier"}
"""Bookkeeping that does not change the output."""
NEUTRAL_ONLY = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
}
"""Features this server lacks, with the values that ask for none of them."""


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


def _renamed(error: InvalidRequest, renames: dict[str, str]) -> InvalidRequest:
    """The service's complaint in the client's words: it names RequestOptions fields (max_new_tokens,
    prompt_token_ids), the client sent OpenAI ones (max_tokens, prompt)."""
    head, dot, rest = error.field.partition(".")
    if head not in renames:
        return error
    message = str(error).removeprefix(f"{error.field}: ")
    return InvalidRequest(renames[head] + dot + rest, message)


# ---- request bodies ----------------------------------------------------------------------------


@dataclass
class _Call:
    """One parsed request: what to generate and how the client wants it back."""

    request: GenerationRequest
    stream: bool
    include_usage: bool


async def _json_object(request: Request) -> dict:
    """The body as a dict; 400 rather than FastAPI's 422, since OpenAI clients expect 400."""
    try:
        body = json.loads(await request.body())
    except ValueError as error:  # JSONDecodeError and undecodable bytes
        raise InvalidRequest("body", f"is not valid JSON ({error})") from None
    if not isinstance(body, dict):
        raise InvalidRequest("body", "must be a JSON object")
    return body


def _check_fields(body: dict, accepted: set[str]) -> None:
    for name, value in body.items():
        if name in accepted or name in IGNORED_FIELDS:
            continue
        if name not in NEUTRAL_ONLY:
            raise InvalidRequest(name, "is not a recognised request argument")
        if value not in NEUTRAL_ONLY[name]:
            allowed = " or ".join(json.dumps(v) for v in NEUTRAL_ONLY[name])
            raise InvalidRequest(name, f"is not supported by this server; send {allowed}")


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest(name, "must be a boolean")
    return bool(value)


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options", "must be an object")
    value = options.get("include_usage")
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest("stream_options.include_usage", "must be a boolean")
    return bool(value)


def _prompt_fields(prompt) -> dict:
    """OpenAI's prompt: text, token ids, or a batch of either; a batch must hold exactly one."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise InvalidRequest("prompt", "batches of prompts are not supported; send one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, list):
        return {"prompt_token_ids": prompt}
    return {"prompt": prompt}


def _message(message: object) -> object:
    """A chat message as the service takes it: text content, and OpenAI's newer 'developer' role
    as the 'system' role chat templates know. Anything else is left for the service to refuse."""
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        content = "".join(str(part.get("text", "")) for part in content)
    role = "system" if message.get("role") == "developer" else message.get("role")
    return {"role": role, "content": content}


def _options(body: dict, chat: bool, service: SpecService) -> tuple[dict, dict[str, str]]:
    """RequestOptions fields from an OpenAI body, and the wire name of each field renamed on the way.

    Unset or null fields take OpenAI's defaults where OpenAI defines one (temperature 1, 16 tokens
    for completions); chat has no token default, so it may use the whole per-request limit.
    """
    if chat:
        messages = body.get("messages")
        fields = {"messages": [_message(m) for m in messages] if isinstance(messages, list) else messages}
        tokens_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        default_tokens = service.limits.max_new_tokens
    else:
        fields = _prompt_fields(body.get("prompt"))
        tokens_name, default_tokens = "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS
    given = {name: body[name] for name in ("temperature", "top_p", "top_k", "seed", "stop", "speculation")
             if body.get(name) is not None}
    if isinstance(given.get("stop"), str):
        given["stop"] = [given["stop"]]
    if given.get("top_k") == -1:  # vLLM's spelling of "no top-k"
        given["top_k"] = 0
    max_tokens = body.get(tokens_name)
    fields |= {"temperature": OPENAI_DEFAULT_TEMPERATURE,
               "max_new_tokens": default_tokens if max_tokens is None else max_tokens} | given
    return fields, {"max_new_tokens": tokens_name, "prompt_token_ids": "prompt"}


async def _parse(request: Request, service: SpecService, chat: bool, request_id: str) -> _Call:
    body = await _json_object(request)
    _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    stream, include_usage = _flag(body, "stream"), _include_usage(body)
    fields, renames = _options(body, chat, service)
    try:
        generation = service.build_request(service.parse_options(fields), request_id)
    except InvalidRequest as error:
        raise _renamed(error, renames) from None
    return _Call(generation, stream, include_usage)


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
    call = await _parse(request, service, chat, request_id)
    shape = _Shape(("chatcmpl-" if chat else "cmpl-") + request_id, int(time.time()), service.model_id, chat)
    if call.stream:
        first, events = await _start(service, call.request)
        if first.finished is not None and first.finished.finish_reason not in FINISH_REASONS:
            await events.aclose()
            return _failed(first.finished)  # no header sent yet: a real status beats an error event
        detokenizer = IncrementalDetokenizer(service.tokenizer, call.request.stop)
        return _EventStreamResponse(_sse_events(shape, call, first, events, detokenizer), events)
    output = await _output_unless_abandoned(service, call.request, request)
    if output is None:
        return Response(status_code=499)  # nobody is listening; the status only shows in access logs
    if output.finish_reason not in FINISH_REASONS:
        return _failed(output)
    return JSONResponse(shape.response(output, len(call.request.prompt_ids)))


# ---- responses ---------------------------------------------------------------------------------


@dataclass
class _Shape:
    """OpenAI's response objects for one request, text completion or chat."""

    id: str
    created: int
    model: str
    chat: bool

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def response(self, output: GenerationOutput, prompt_tokens: int) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": output.text}}
        else:
            choice = {"index": 0, "text": output.text}
        choice |= {"finish_reason": output.finish_reason, "logprobs": None}
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        return body | {"usage": _usage(output, prompt_tokens), "speculation": _speculation(output)}

    def chunk(self, text: str = "", finish_reason: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text}
        choice |= {"finish_reason": finish_reason, "logprobs": None}
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, output: GenerationOutput, prompt_tokens: int) -> dict:
        """What stream_options.include_usage asks for: a last chunk with no choices."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(kind, []) | {"usage": _usage(output, prompt_tokens)}


def _usage(output: GenerationOutput, prompt_tokens: int) -> dict:
    completion_tokens = len(output.token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _speculation(output: GenerationOutput) -> dict:
    stats = output.stats
    return {"drafted": stats.drafted, "accepted": stats.accepted, "mean_accepted_tokens": output.mean_accepted_tokens,
            "target_forwards": stats.target_forwards, "time_to_first_token": stats.time_to_first_token}


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def _sse_events(shape: _Shape, call: _Call, first: StepEvent, events: AsyncIterator[StepEvent],
                      detokenizer: IncrementalDetokenizer) -> AsyncIterator[str]:
    """The server-sent events of one streamed request: text deltas, the finish (or an error), [DONE]."""
    if shape.chat:
        yield _sse(shape.chunk(role=True))
    event = first
    while event.finished is None:
        text = detokenizer.add(event.new_token_ids)
        if text:
            yield _sse(shape.chunk(text))
        event = await anext(events)
    output = event.finished
    if output.finish_reason not in FINISH_REASONS:
        yield _sse({"error": {"message": _failure_message(output), "type": "server_error", "param": None, "code": None}})
    else:
        rest = detokenizer.finish(output.text)
        if rest:
            yield _sse(shape.chunk(rest))
        yield _sse(shape.chunk(finish_reason=output.finish_reason) | {"speculation": _speculation(output)})
        if call.include_usage:
            yield _sse(shape.usage_chunk(output, len(call.request.prompt_ids)))
    yield _sse("[DONE]")


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
