"""Every entrance's one way from what a client sent to what the engine runs.

HTTP, gRPC, `specserve generate` and every benchmark turn their input into `RequestOptions` and call
`RequestBuilder.build_request` (or `build_samples` for `n` / `best_of`), which checks every field and
names the bad one (InvalidRequest -> HTTP 400 / INVALID_ARGUMENT). So a benchmark cannot measure a
request no client can send: per-request speculation options only cap what the engine's planner
may draft, and `speculation.method: off` is the one way to opt out.
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
import uuid
from dataclasses import replace
from functools import cached_property
from typing import Literal, get_args

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError

from cluster.engine.config import EngineConfig, Method
from cluster.engine.grammar import CACHE_SIZE, CompiledGrammar, CompileTimeout, Compiling, GrammarCompiler, GrammarSpec
from cluster.engine.request import GenerationRequest
from cluster.serve.limits import ServiceLimits
from cluster.serve.samples import Samples
from cluster.serve.token_strings import TokenStrings
from speculators.logprobs import MAX_TOP_LOGPROBS
from speculators.lookahead import LookaheadConfig
from speculators.penalties import Penalties
from speculators.sampling import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 128
TENANT_HEADER = "x-specserve-tenant"
"""The HTTP header (gRPC metadata key) naming a request's tenant, read only with `limits.tenant_from` header."""
OPEN_DEPLOYMENT = "\0a deployment without API keys"
"""The one tenant of a deployment that has no keys (no key file can name a tenant with a NUL in it)."""


class InvalidRequest(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message

    def __reduce__(self):  # crosses Ray process boundaries (a replica's error reaches the proxy)
        return type(self), (self.field, self.message)


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
    """None: default_max_new_tokens, within the deployment's limit and what fits the context window."""
    default_max_new_tokens: int = Field(DEFAULT_MAX_NEW_TOKENS, ge=1)
    """The front end's default when the client gives no max_new_tokens (OpenAI's 16 for completions)."""
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
    tenant: str | None = None
    """Who sent the request, as the front end identified them (`RequestBuilder.tenant`, never a body
    field): with `limits.cache_sharing` tenant, the request drafts only from its tenant's earlier
    outputs. None: unknown (such a request shares nothing)."""
    cache_salt: str | None = None
    """vLLM's per-request salt: the request shares cached prefixes and earlier outputs only with
    requests of its tenant that give the same salt."""


def _check_utf8(field: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequest(field, f"is not valid UTF-8 text ({error.reason} at character {error.start})") from None


class RequestBuilder:
    """Builds engine requests for one served model (its engine gives the context window, the
    vocabulary and the end-of-sequence tokens; None only where no request is ever built)."""

    def __init__(self, engine, tokenizer, model_id: str, method: str, default_lookahead: LookaheadConfig,
                 limits: ServiceLimits = ServiceLimits()):
        self.engine, self.tokenizer, self.model_id, self.method = engine, tokenizer, model_id, method
        self.default_lookahead, self.limits = default_lookahead, limits

    @classmethod
    def in_process(cls, engine, tokenizer, config: EngineConfig) -> RequestBuilder:
        """The builder of an engine run in this process (`specserve generate`, the benchmarks): the
        service's rules, with the whole context window as the prompt and output limits."""
        window = config.max_len - 1
        return cls(engine, tokenizer, config.model, config.method, config.lookahead,
                   ServiceLimits(max_prompt_tokens=window, max_new_tokens=window, cache_sharing="global"))

    def tenant(self, key_tenant: str | None = None, header: str | None = None, user: object = None) -> str | None:
        """Who sent a request, as `limits.tenant_from` identifies tenants: the tenant the presented API
        key names (`SpecService.authorize`; a deployment without keys is one tenant, so its requests
        share with each other), the TENANT_HEADER, or the OpenAI body's `user`; a hash naming its
        source, never the value itself; None when a header or user source is empty (nothing shared).
        Front ends put it in RequestOptions.tenant."""
        source = self.limits.tenant_from
        if source == "api_key":
            value = key_tenant or OPEN_DEPLOYMENT
        elif source == "header":
            value = (header or "").strip()
        else:
            if user is not None and not isinstance(user, str):
                raise InvalidRequest("user", "must be a string")
            value = (user or "").strip()
        if not value:
            return None
        digest = hashlib.sha256(f"specserve tenant\0{source}\0{value}".encode(errors="replace")).hexdigest()
        return f"{source}:{digest[:32]}"

    def _cache_scope(self, tenant: str | None, salt: str | None) -> str | None:
        """GenerationRequest.cache_scope (the prefix cache's and the suffix index's) under
        `limits.cache_sharing`, salted by the request's `cache_salt`."""
        if salt is not None:
            if not salt:
                raise InvalidRequest("cache_salt", "must be a non-empty string when given")
            _check_utf8("cache_salt", salt)
        sharing = self.limits.cache_sharing
        if sharing == "request" or (sharing == "tenant" and not tenant):
            return None
        scope = "" if sharing == "global" else "tenant:" + tenant
        if salt is None:
            return scope
        return f"{scope}\0salt:{hashlib.sha256(salt.encode()).hexdigest()[:32]}"

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
            if len(options.messages) > self.limits.max_messages:
                raise InvalidRequest("messages", f"has {len(options.messages)} messages; the limit is "
                                                 f"{self.limits.max_messages}")
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
        most = self._prompt_limit()
        if len(ids) > most:
            raise InvalidRequest("prompt", f"has {len(ids)} tokens; the limit is {most}")
        vocab = len(self.tokenizer)
        if any(not 0 <= token < vocab for token in ids):
            raise InvalidRequest("prompt_token_ids", f"token ids must be in [0, {vocab})")
        return ids

    def _check_text(self, field: str, text: str) -> None:
        """Text must be UTF-8 (no lone surrogates) and short enough to tokenize without a stall."""
        tokens = self._prompt_limit()
        most = tokens * MAX_CHARS_PER_TOKEN
        if len(text) > most:
            raise InvalidRequest(field, f"has {len(text)} characters; the limit is {most} ({tokens} tokens)")
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

    def build_request(self, options: RequestOptions, request_id: str | None = None, *,
                      wait_for_grammar: bool = True) -> GenerationRequest:
        """The engine request; `wait_for_grammar` False: a grammar still compiling is left in it as
        `Compiling`, for the caller to await on its event loop (`await_grammars`) before running it."""
        prompt_ids = self._prompt_ids(options)
        max_new_tokens = self._max_new_tokens(options.max_new_tokens, options.default_max_new_tokens, len(prompt_ids))
        sampling = _checked(SamplingParams, options.temperature, options.top_k, options.top_p, options.seed)
        penalties = _checked(Penalties, options.presence_penalty, options.frequency_penalty, options.repetition_penalty)
        method = options.speculation.method
        if method not in ("default", "off", "none", self.method):
            raise InvalidRequest("speculation.method", f"this deployment drafts with {self.method!r}; use it, 'default' or 'off'")
        self._check_stop(options.stop)
        request = GenerationRequest(
            request_id=request_id or uuid.uuid4().hex, prompt_ids=prompt_ids, sampling=sampling,
            max_new_tokens=max_new_tokens, stop=list(options.stop),
            speculate=method not in ("off", "none") and self.method != "none",
            lookahead=self._lookahead(options.speculation), penalties=penalties if penalties.active else None,
            logprobs=options.logprobs, grammar=self._grammar(options.structured_output, wait_for_grammar),
            cache_scope=self._cache_scope(options.tenant, options.cache_salt),
        )
        try:
            self.engine.validate(request)  # the engine's own limits (context window, vocabulary)
        except ValueError as error:
            raise InvalidRequest("prompt", str(error)) from None
        return request

    def _max_new_tokens(self, asked: int | None, default: int, prompt_tokens: int) -> int:
        """The request's output limit: what the client asked for, within the deployment's limit and,
        as vLLM holds requests to max_model_len, within the context window after the prompt (where
        the client asked for none, the default is cut to what fits)."""
        window = self._context_window()
        room = min(self.limits.max_new_tokens, window - prompt_tokens)
        if asked is None:
            return max(1, min(default, room))
        if not 1 <= asked <= self.limits.max_new_tokens:
            raise InvalidRequest("max_new_tokens", f"must be in [1, {self.limits.max_new_tokens}]")
        if asked > room:
            raise InvalidRequest("max_new_tokens", f"is {asked}, but the prompt has {prompt_tokens} tokens and the "
                                                   f"context window {window}: at most {max(room, 0)} fit")
        return asked

    def _context_window(self) -> int:
        """The engine's max_len: prompt and output together."""
        config = getattr(self.engine, "config", None)
        return getattr(config, "max_len", None) or EngineConfig.model_fields["max_len"].default

    def _prompt_limit(self) -> int:
        """Longest prompt accepted: limits.max_prompt_tokens, or the context window less one new token."""
        return self.limits.max_prompt_tokens or self._context_window() - 1

    def build_samples(self, options: RequestOptions, request_id: str, *, wait_for_grammar: bool = True) -> Samples:
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
        first = self.build_request(options, request_id, wait_for_grammar=wait_for_grammar)
        if first.sampling.greedy or best_of == 1:
            return Samples([first], n)
        seed = first.sampling.seed
        return Samples([replace(first, request_id=f"{request_id}-{i}",
                                sampling=replace(first.sampling, seed=None if seed is None else seed + i))
                        for i in range(best_of)], n)

    def _grammar(self, structured: StructuredOutput | None, wait: bool) -> CompiledGrammar | Compiling | None:
        """The compiled grammar; with `wait` False, its compile (still running) rather than a wait for it."""
        if structured is None:
            return None
        if structured.kind != "json_object" and not structured.value:
            raise InvalidRequest("structured_output", f"{structured.kind} needs its {structured.kind.replace('_', ' ')}")
        if len(structured.value or "") > self.limits.max_grammar_chars:
            raise InvalidRequest("structured_output", f"has {len(structured.value)} characters; the limit is "
                                                      f"{self.limits.max_grammar_chars}")
        compiling = self.grammars.start(GrammarSpec(structured.kind, structured.value))
        if not wait and not compiling.done:
            return compiling
        with self._grammar_refusals():
            return compiling.result(self.limits.grammar_compile_timeout_s)

    async def await_grammars(self, requests: list[GenerationRequest]) -> None:
        """Puts in each request built with `wait_for_grammar` False its compiled grammar, awaited on the
        event loop: a thread per slow compile, each waiting out its deadline, would starve the parsing of
        every other request. InvalidRequest as `build_request` raises it (compile deadline, bad spec)."""
        for request in requests:
            if isinstance(request.grammar, Compiling):
                with self._grammar_refusals():
                    request.grammar = await request.grammar.compiled(self.limits.grammar_compile_timeout_s)

    @contextlib.contextmanager
    def _grammar_refusals(self):
        """A spec that does not compile, or not in time, as InvalidRequest naming structured_output."""
        try:
            yield
        except ValueError as error:
            raise InvalidRequest("structured_output", str(error)) from None
        except CompileTimeout:
            timeout = self.limits.grammar_compile_timeout_s
            raise InvalidRequest("structured_output", f"did not compile within the server's {timeout:g} s "
                                                      "(limits.grammar_compile_timeout_s); simplify it, or send it "
                                                      "again later: its compile goes on") from None

    grammar_cache_size: int = CACHE_SIZE
    """Distinct structured-output specs whose compiled grammar (or refusal) is kept, per served model."""
    _grammars_lock = threading.Lock()

    @cached_property
    def grammars(self) -> GrammarCompiler:
        """Compiles structured-output specs for the target's tokenizer (built on the first that asks).
        Requests are built on worker threads, so two may ask at once: both get the same compiler."""
        with RequestBuilder._grammars_lock:
            if "grammars" not in self.__dict__:
                engine = self.engine
                self.__dict__["grammars"] = GrammarCompiler(
                    self.tokenizer, engine.vocab_size or len(self.tokenizer), engine.eos_token_ids,
                    self.grammar_cache_size, self.limits.grammar_compile_threads)
            return self.__dict__["grammars"]

    @cached_property
    def token_strings(self) -> TokenStrings:
        """Token texts and bytes for log-probabilities (a served model's is built at its start, SpecService)."""
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


def _checked(make, *args):
    """`make(*args)`, whose ValueError names the field first, as InvalidRequest naming that field."""
    try:
        return make(*args)
    except ValueError as error:
        raise InvalidRequest(str(error).split(" ")[0], str(error)) from None
