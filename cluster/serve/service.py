"""The serving core shared by the gRPC and HTTP front ends: validation, limits, auth, routing.

Front ends turn their wire format into `RequestOptions`, call `SpecService.build_request`, which
checks every field and names the bad one (InvalidRequest -> HTTP 400 / INVALID_ARGUMENT), then
`stream` or `generate`, which refuse work past the concurrency limit at once (Overloaded -> HTTP
503 / RESOURCE_EXHAUSTED) instead of queueing without bound.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Literal, Protocol, get_args

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr, ValidationError

from cluster.engine.config import Method
from cluster.engine.loop import EngineLoop, least_loaded, stream as loop_stream
from cluster.engine.request import GenerationOutput, GenerationRequest
from cluster.engine.spec_engine import StepEvent
from cluster.serve.api_key import resolve_api_key
from speculators.lookahead import LookaheadConfig
from speculators.sampling import SamplingParams


DEFAULT_MAX_NEW_TOKENS = 128


class Observer(Protocol):
    """Where the service reports what it served (cluster/serve/metrics.py records it for Prometheus)."""

    def chunk(self, tokens: int, seconds_since_last: float) -> None: ...

    def finished(self, output: GenerationOutput, protocol: str) -> None: ...


class InvalidRequest(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message

    def __reduce__(self):  # crosses Ray process boundaries (a replica's error reaches the proxy)
        return type(self), (self.field, self.message)


class Overloaded(RuntimeError):
    """Too many requests in flight: retry later (HTTP 503, gRPC RESOURCE_EXHAUSTED)."""


class Unauthorized(PermissionError):
    """Missing or wrong API key (HTTP 401, gRPC UNAUTHENTICATED)."""


class ServiceLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_prompt_tokens: int = Field(1536, ge=1, description="longest prompt accepted, in tokens")
    max_new_tokens: int = Field(512, ge=1, description="most tokens one request may ask for")
    max_concurrent_requests: int = Field(64, ge=1, description="requests in flight per replica; more are refused with 503 / RESOURCE_EXHAUSTED")
    max_stop_strings: int = Field(16, ge=0, description="most stop strings one request may give")
    max_stop_string_chars: int = Field(
        64, ge=1, description="longest stop string, in characters: streamed text is held back by this much "
        "while it could still turn into a stop string")
    request_timeout_s: float = Field(
        600.0, gt=0, description="a request still running after this many seconds is aborted with a retryable error")
    api_key: SecretStr | None = Field(
        None, description="when set, clients must send it (HTTP bearer, gRPC metadata 'authorization'); "
        "prefer api_key_env or api_key_file, which keep the key out of the Serve config")
    api_key_env: str | None = Field(None, description="name of an environment variable holding the API key")
    api_key_file: str | None = Field(
        None, description="path of a file holding the API key (a mounted Kubernetes Secret)")

    def resolved_api_key(self) -> SecretStr | None:
        """The key from whichever source is configured; a named source that is missing is an error,
        never a silently open server."""
        return resolve_api_key(self.api_key, self.api_key_env, self.api_key_file)


STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
"""Client input: no coercion of strings or booleans into numbers, no NaN or infinities."""
MAX_CHARS_PER_TOKEN = 16
"""A prompt longer than max_prompt_tokens x this many characters is refused before tokenizing it."""


class SpeculationOptions(BaseModel):
    """Per-request speculation; anything left None takes the deployment's default."""

    model_config = STRICT

    method: Literal[("default", "off", *get_args(Method))] = "default"
    lookahead: Literal["fixed", "heuristic", "confidence"] | None = None
    num_speculative_tokens: int | None = Field(
        None, ge=0, le=64, validation_alias=AliasChoices("num_speculative_tokens", "max_speculative_tokens"))
    confidence_threshold: float | None = Field(
        None, ge=0.0, le=1.0, validation_alias=AliasChoices("confidence_threshold", "assistant_confidence_threshold"))


class RequestOptions(BaseModel):
    """Everything a client may send, in one wire-independent shape."""

    model_config = STRICT

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    max_new_tokens: int | None = None
    """None: DEFAULT_MAX_NEW_TOKENS, within the deployment's limit."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = Field(None, ge=-2**63, lt=2**64)
    stop: list[str] = Field(default_factory=list)
    speculation: SpeculationOptions = Field(default_factory=SpeculationOptions)


def _check_utf8(field: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequest(field, f"is not valid UTF-8 text ({error.reason} at character {error.start})") from None


class SpecService:
    def __init__(
        self,
        loops: Sequence[EngineLoop],
        tokenizer,
        model_id: str,
        method: str,
        default_lookahead: LookaheadConfig,
        limits: ServiceLimits = ServiceLimits(),
        observer: Observer | None = None,
    ):
        self.loops, self.tokenizer, self.model_id, self.method = list(loops), tokenizer, model_id, method
        self.default_lookahead, self.limits, self.observer = default_lookahead, limits, observer
        self._api_key = limits.resolved_api_key()
        self.in_flight = 0

    # ---- auth and validation -----------------------------------------------------------------

    def authorize(self, header_value: str | None) -> None:
        """Accepts 'Bearer KEY' or the bare key; constant-time comparison."""
        if self._api_key is None:
            return
        presented = (header_value or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(presented.encode(errors="replace"), self._api_key.get_secret_value().encode()):
            raise Unauthorized("missing or invalid API key")

    def _prompt_ids(self, options: RequestOptions) -> list[int]:
        given = [name for name in ("prompt", "prompt_token_ids", "messages") if getattr(options, name) not in (None, [], "")]
        if len(given) != 1:
            raise InvalidRequest("prompt", "give exactly one of prompt, prompt_token_ids or messages")
        if options.prompt:
            self._check_text("prompt", options.prompt)
            ids = self.tokenizer.encode(options.prompt)
        elif options.prompt_token_ids:
            ids = list(options.prompt_token_ids)
        else:
            for index, message in enumerate(options.messages):
                if not isinstance(message, dict) or not isinstance(message.get("content"), str) \
                        or message.get("role") not in ("system", "user", "assistant"):
                    raise InvalidRequest(f"messages[{index}]", "needs role (system, user or assistant) and string content")
            self._check_text("messages", "".join(m["content"] for m in options.messages))
            ids = list(self.tokenizer.apply_chat_template(
                [{"role": m["role"], "content": m["content"]} for m in options.messages],
                add_generation_prompt=True, tokenize=True, return_dict=False))
        if not ids:
            raise InvalidRequest("prompt", "is empty")
        if len(ids) > self.limits.max_prompt_tokens:
            raise InvalidRequest("prompt", f"has {len(ids)} tokens; the limit is {self.limits.max_prompt_tokens}")
        vocab = len(self.tokenizer)
        if any(not 0 <= token < vocab for token in ids):
            raise InvalidRequest("prompt_token_ids", f"token ids must be in [0, {vocab})")
        return ids

    def _check_text(self, field: str, text: str) -> None:
        """Text must be UTF-8 (no lone surrogates) and short enough to tokenize without a stall."""
        most = self.limits.max_prompt_tokens * MAX_CHARS_PER_TOKEN
        if len(text) > most:
            raise InvalidRequest(field, f"has {len(text)} characters; the limit is {most} "
                                        f"({self.limits.max_prompt_tokens} tokens)")
        _check_utf8(field, text)

    def _check_stop(self, stop: list[str]) -> None:
        """Stop strings are capped in number and length: text is held back while it could still
        become one, so a very long stop string would hold back the whole stream."""
        if len(stop) > self.limits.max_stop_strings:
            raise InvalidRequest("stop", f"has {len(stop)} strings; the limit is {self.limits.max_stop_strings}")
        for index, text in enumerate(stop):
            if not text:
                raise InvalidRequest(f"stop[{index}]", "stop strings must be non-empty")
            if len(text) > self.limits.max_stop_string_chars:
                raise InvalidRequest(f"stop[{index}]", f"has {len(text)} characters; the limit is "
                                                       f"{self.limits.max_stop_string_chars}")
            _check_utf8(f"stop[{index}]", text)

    def _lookahead(self, speculation: SpeculationOptions) -> LookaheadConfig:
        updates = {}
        if speculation.lookahead is not None:
            updates["policy"] = speculation.lookahead
        if speculation.num_speculative_tokens is not None:
            updates["num_speculative_tokens"] = speculation.num_speculative_tokens
        if speculation.confidence_threshold is not None:
            updates["confidence_threshold"] = speculation.confidence_threshold
        return self.default_lookahead.model_copy(update=updates)

    def build_request(self, options: RequestOptions, request_id: str | None = None) -> GenerationRequest:
        max_new_tokens = options.max_new_tokens
        if max_new_tokens is None:
            max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, self.limits.max_new_tokens)
        if not 1 <= max_new_tokens <= self.limits.max_new_tokens:
            raise InvalidRequest("max_new_tokens", f"must be in [1, {self.limits.max_new_tokens}]")
        try:
            sampling = SamplingParams(options.temperature, options.top_k, options.top_p, options.seed)
        except ValueError as error:
            field = str(error).split(" ")[0]
            raise InvalidRequest(field, str(error)) from None
        method = options.speculation.method
        if method not in ("default", "off", "none", self.method):
            raise InvalidRequest("speculation.method", f"this deployment drafts with {self.method!r}; use it, 'default' or 'off'")
        self._check_stop(options.stop)
        request = GenerationRequest(
            request_id or uuid.uuid4().hex, self._prompt_ids(options), sampling, max_new_tokens,
            list(options.stop), speculate=method not in ("off", "none") and self.method != "none",
            lookahead=self._lookahead(options.speculation),
        )
        try:
            self.loops[0].engine.validate(request)  # the engine's own limits (context window, vocabulary)
        except ValueError as error:
            raise InvalidRequest("prompt", str(error)) from None
        return request

    @staticmethod
    def parse_options(payload: dict) -> RequestOptions:
        """RequestOptions from a dict, with pydantic's complaint turned into InvalidRequest(field)."""
        try:
            return RequestOptions.model_validate(payload)
        except ValidationError as error:
            first = error.errors()[0]
            field = ".".join(str(part) for part in first["loc"]) or "request"
            raise InvalidRequest(field, first["msg"]) from None

    # ---- running -------------------------------------------------------------------------------

    def _loop(self) -> EngineLoop:
        if self.in_flight >= self.limits.max_concurrent_requests:
            raise Overloaded(f"{self.in_flight} requests in flight; the limit is {self.limits.max_concurrent_requests}")
        return least_loaded(self.loops)

    async def stream(self, request: GenerationRequest, protocol: str = "http") -> AsyncIterator[StepEvent]:
        loop = self._loop()
        self.in_flight += 1
        last = time.perf_counter()
        try:
            async with contextlib.aclosing(loop_stream(loop, request)) as events:  # abort at once when closed
                async for event in self._within_deadline(events, request):
                    if self.observer:
                        now = time.perf_counter()
                        self.observer.chunk(len(event.new_token_ids), now - last)
                        last = now
                        if event.finished:
                            self.observer.finished(event.finished, protocol)
                    yield event
        finally:
            self.in_flight -= 1

    async def _within_deadline(self, events: AsyncIterator[StepEvent],
                               request: GenerationRequest) -> AsyncIterator[StepEvent]:
        """The events until the request's deadline; then a retryable error ends it (closing `events`
        aborts it in the engine), so no client waits without bound."""
        limit = self.limits.request_timeout_s
        deadline = time.monotonic() + limit
        while True:
            try:
                event = await asyncio.wait_for(anext(events), max(0.0, deadline - time.monotonic()))
            except (TimeoutError, asyncio.TimeoutError):
                reason = f"the request ran past the server's {limit:g} s limit; retry it (perhaps with fewer tokens)"
                yield StepEvent(request.request_id, [], GenerationOutput.refused(request, reason))
                return
            except StopAsyncIteration:
                return
            yield event
            if event.finished:
                return

    async def generate(self, request: GenerationRequest, protocol: str = "http") -> GenerationOutput:
        async for event in self.stream(request, protocol):
            if event.finished:
                return event.finished
        raise RuntimeError("the engine ended the stream without a final output")

    @property
    def queue_depth(self) -> int:
        return sum(loop.engine.queue_depth for loop in self.loops)
