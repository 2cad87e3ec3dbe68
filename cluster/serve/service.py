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
from dataclasses import replace
from functools import cached_property
from collections.abc import AsyncIterator, Sequence
from typing import Literal, Protocol, get_args

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr, ValidationError

from cluster.engine.config import Method
from cluster.engine.loop import EngineLoop, least_loaded, stream as loop_stream
from cluster.engine.grammar import CompiledGrammar, GrammarCompiler, GrammarSpec
from cluster.engine.request import GenerationOutput, GenerationRequest
from cluster.engine.spec_engine import StepEvent
from cluster.serve.api_key import resolve_api_key
from cluster.serve.samples import Samples
from cluster.serve.token_strings import TokenStrings
from speculators.logprobs import MAX_TOP_LOGPROBS
from speculators.lookahead import LookaheadConfig
from speculators.penalties import Penalties
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
    max_n: int = Field(16, ge=1, le=128, description="most choices (n, best_of) one request may ask for")
    max_grammar_chars: int = Field(
        65536, ge=1, description="longest JSON schema, regular expression or grammar a request may give, in characters")
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


class StructuredOutput(BaseModel):
    """What the output must match: any JSON object, a JSON schema (as JSON text), a regular
    expression or an EBNF grammar."""

    model_config = STRICT

    kind: Literal["json_object", "json_schema", "regex", "grammar"]
    value: str | None = None


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """Alternatives wanted at each position (0: the chosen token's log-probability only); None: none."""
    n: int = Field(1, ge=1)
    best_of: int | None = Field(None, ge=1)
    structured_output: StructuredOutput | None = None
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
        sampling = _checked(SamplingParams, options.temperature, options.top_k, options.top_p, options.seed)
        penalties = _checked(Penalties, options.presence_penalty, options.frequency_penalty, options.repetition_penalty)
        method = options.speculation.method
        if method not in ("default", "off", "none", self.method):
            raise InvalidRequest("speculation.method", f"this deployment drafts with {self.method!r}; use it, 'default' or 'off'")
        self._check_stop(options.stop)
        request = GenerationRequest(
            request_id or uuid.uuid4().hex, self._prompt_ids(options), sampling, max_new_tokens,
            list(options.stop), speculate=method not in ("off", "none") and self.method != "none",
            lookahead=self._lookahead(options.speculation), penalties=penalties if penalties.active else None,
            logprobs=options.logprobs, grammar=self._grammar(options.structured_output),
        )
        try:
            self.loops[0].engine.validate(request)  # the engine's own limits (context window, vocabulary)
        except ValueError as error:
            raise InvalidRequest("prompt", str(error)) from None
        return request

    def build_samples(self, options: RequestOptions, request_id: str) -> Samples:
        """The engine requests behind a call's `n` choices (the best `n` of `best_of` when more).

        A greedy call is deterministic, so its `n` choices are copies of one request's output (as
        vLLM's are). Sampled requests are independent: with a seed s, request i is seeded s + i, so
        the first choice is what the same call with n = 1 returns.
        """
        n, best_of = options.n, options.best_of or options.n
        if best_of < n:
            raise InvalidRequest("best_of", f"must be at least n ({n})")
        if best_of > self.limits.max_n:
            raise InvalidRequest("n" if options.best_of is None else "best_of", f"must be at most {self.limits.max_n}")
        if best_of > n and options.logprobs is None:  # ranking needs each sample's log-probability
            options = options.model_copy(update={"logprobs": 0})
        first = self.build_request(options, request_id)
        if first.sampling.greedy or best_of == 1:
            return Samples([first], n)
        seed = first.sampling.seed
        return Samples([replace(first, request_id=f"{request_id}-{i}",
                                sampling=replace(first.sampling, seed=None if seed is None else seed + i))
                        for i in range(best_of)], n)

    def _grammar(self, structured: StructuredOutput | None) -> CompiledGrammar | None:
        if structured is None:
            return None
        if structured.kind != "json_object" and not structured.value:
            raise InvalidRequest("structured_output", f"{structured.kind} needs its {structured.kind.replace('_', ' ')}")
        if len(structured.value or "") > self.limits.max_grammar_chars:
            raise InvalidRequest("structured_output", f"has {len(structured.value)} characters; the limit is "
                                                      f"{self.limits.max_grammar_chars}")
        try:
            return self.grammars.compile(GrammarSpec(structured.kind, structured.value))
        except ValueError as error:
            raise InvalidRequest("structured_output", str(error)) from None

    @cached_property
    def grammars(self) -> GrammarCompiler:
        """Compiles structured-output specs for the target's tokenizer (built on the first that asks)."""
        engine = self.loops[0].engine
        return GrammarCompiler(self.tokenizer, engine.vocab_size or len(self.tokenizer), engine.eos_token_ids)

    @cached_property
    def token_strings(self) -> TokenStrings:
        """Token texts and bytes for log-probabilities (built on the first request that wants them)."""
        return TokenStrings(self.tokenizer)

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

    def _loop(self, chosen: EngineLoop | None = None) -> EngineLoop:
        """`chosen`, or the least loaded loop, if this replica may take one more request."""
        if self.in_flight >= self.limits.max_concurrent_requests:
            raise Overloaded(f"{self.in_flight} requests in flight; the limit is {self.limits.max_concurrent_requests}")
        return chosen or least_loaded(self.loops)

    async def stream(self, request: GenerationRequest, protocol: str = "http",
                     loop: EngineLoop | None = None) -> AsyncIterator[StepEvent]:
        """The request's step events, from `loop` (the least loaded when None), within the limits."""
        loop = self._loop(loop)
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

    async def stream_samples(self, samples: Samples, protocol: str = "http") -> AsyncIterator[tuple[int, StepEvent]]:
        """(index in samples.requests, event) for every request of a call, interleaved as they come.

        All of them go to one engine loop, so requests admitted together share their prompt's
        prefill. Closing this iterator aborts every request still running.
        """
        if len(samples.requests) == 1:
            async with contextlib.aclosing(self.stream(samples.requests[0], protocol)) as events:
                async for event in events:
                    yield 0, event
            return
        loop, queue = self._loop(), asyncio.Queue()

        async def pump(index: int, request: GenerationRequest) -> None:
            try:
                async with contextlib.aclosing(self.stream(request, protocol, loop)) as events:
                    async for event in events:
                        queue.put_nowait((index, event))
            except Exception as error:  # Overloaded, or a failure: the caller raises it
                queue.put_nowait((index, error))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(samples.requests)]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                running -= item.finished is not None
                yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def generate(self, request: GenerationRequest, protocol: str = "http") -> GenerationOutput:
        async for event in self.stream(request, protocol):
            if event.finished:
                return event.finished
        raise RuntimeError("the engine ended the stream without a final output")

    @property
    def queue_depth(self) -> int:
        return sum(loop.engine.queue_depth for loop in self.loops)


def _checked(make, *args):
    """`make(*args)`, whose ValueError names the field first, as InvalidRequest naming that field."""
    try:
        return make(*args)
    except ValueError as error:
        raise InvalidRequest(str(error).split(" ")[0], str(error)) from None
