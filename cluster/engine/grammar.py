"""Structured output: grammars compiled for the target's tokenizer, and the matchers that follow them.

Built on xgrammar, the grammar engine vLLM and SGLang use by default; measured against llguidance
on this project's CPU in `bench/grammar_engines.py` (results in bench/results/grammar-engines.md).
A request names a JSON object (any), a JSON schema, a regular expression or an EBNF grammar; the
service compiles it once per distinct spec (cached) and the engine gives each request its own
matcher, which `constraints.RequestRules` walks over draft trees and rolls back.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch
import xgrammar

GrammarKind = Literal["json_object", "json_schema", "regex", "grammar"]
CACHE_LIMIT_BYTES = 256 * 2**20
"""Bytes of compiled grammars xgrammar keeps per compiler (it evicts the least recently used past this)."""
CACHE_SIZE = 64
"""Distinct specs whose outcome (compiled grammar or refusal) a GrammarCompiler keeps, least recently used first out."""
ANY_OBJECT = '{"type": "object"}'
"""What json_object asks for. JSON is generated compact (no optional whitespace, xgrammar's
`any_whitespace=False`): a model free to add whitespace may add it without end, as small ones do."""


class CompileTimeout(TimeoutError):
    """A spec did not compile within the caller's deadline (it goes on compiling, and is kept)."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    value: str | None = None
    """The JSON schema (as JSON text), the regular expression or the EBNF grammar; None for json_object."""


class GrammarMatcher:
    """One request's position in its grammar: accepts tokens, rolls back, fills allowed-token rows."""

    def __init__(self, compiled: xgrammar.CompiledGrammar, words: int):
        self._matcher = xgrammar.GrammarMatcher(compiled)
        self.words = words
        """int32 words per allowed-token row."""

    def accept(self, token: int) -> bool:
        """Take `token` if the grammar allows it here (else nothing changes)."""
        return self._matcher.accept_token(token)

    def rollback(self, tokens: int) -> None:
        self._matcher.rollback(tokens)

    @property
    def terminated(self) -> bool:
        """It took a stop token: the output is complete and nothing may follow."""
        return self._matcher.is_terminated()

    def fill(self, allowed: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of an int32 bitmask [n, words]."""
        self._matcher.fill_next_token_bitmask(allowed, row)


@dataclass
class CompiledGrammar:
    compiled: xgrammar.CompiledGrammar
    words: int

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self.compiled, self.words)


@dataclass(frozen=True)
class Compiling:
    """One caller's wait for a spec's compile (`GrammarCompiler.start`), with a deadline counted from
    when it asked: on a thread (`result`), or on an event loop (`compiled`), where a waiting request
    holds no thread, so slow compiles cannot take every thread that parses requests."""

    outcome: Future
    """Settles to a CompiledGrammar or the refusal's message."""
    started: float
    """time.monotonic() when the caller asked for it."""

    @property
    def done(self) -> bool:
        return self.outcome.done()

    def _left(self, timeout: float | None) -> float | None:
        return None if timeout is None else max(0.0, self.started + timeout - time.monotonic())

    def result(self, timeout: float | None = None) -> CompiledGrammar:
        """The compiled grammar, waited for on this thread; ValueError for a spec that does not
        compile, CompileTimeout once `timeout` seconds have passed since the caller asked."""
        try:
            outcome = self.outcome.result(self._left(timeout))
        except concurrent.futures.TimeoutError:
            raise CompileTimeout(f"did not compile within {timeout:g} s") from None
        return _settled(outcome)

    async def compiled(self, timeout: float | None = None) -> CompiledGrammar:
        """`result`, awaited on the running event loop instead of a thread."""
        waiting = asyncio.shield(asyncio.wrap_future(self.outcome))  # a deadline must not cancel the shared compile
        try:
            outcome = await asyncio.wait_for(waiting, self._left(timeout))
        except TimeoutError:
            raise CompileTimeout(f"did not compile within {timeout:g} s") from None
        return _settled(outcome)


class GrammarCompiler:
    """Compiles specs for one tokenizer. Thread-safe: front ends start compiles from the threads that
    parse requests, several at once (xgrammar's compiler is thread-safe and releases the GIL while it
    compiles), and await them on the event loop (`Compiling.compiled`).

    The outcome of the last `cache_size` distinct specs is kept (LRU), refusals included, so a spec
    sent again, even one that does not compile, costs nothing; requests with a spec being compiled
    wait for that compilation rather than start their own. Compiles run on `threads` threads of their
    own, so slow ones queue behind each other, not behind (or in front of) other work.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = CACHE_SIZE,
                 threads: int = 2):
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, not {cache_size}")
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self.cache_size = cache_size
        self._lock = threading.Lock()  # builds the xgrammar compiler once
        self._cache_lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        """Each spec's outcome: a CompiledGrammar or the refusal's message (a Future while compiling)."""
        self.hits = self.misses = 0

    @cached_property
    def _compiler(self) -> xgrammar.GrammarCompiler:
        """Built on first use: reading a large vocabulary takes about a second."""
        info = xgrammar.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None)
        return xgrammar.GrammarCompiler(info, cache_limit_bytes=CACHE_LIMIT_BYTES)

    def compile(self, spec: GrammarSpec, timeout: float | None = None) -> CompiledGrammar:
        """The compiled grammar, or ValueError saying what is wrong with the spec (each compiled once
        while it stays among the last `cache_size` distinct specs); CompileTimeout past `timeout`
        seconds, waiting for a compile thread included."""
        return self.start(spec).result(timeout)

    def start(self, spec: GrammarSpec) -> Compiling:
        """`spec`'s compile, started on a compile thread unless its outcome is kept or under way; the
        caller chooses how to wait for it."""
        started = time.monotonic()
        with self._cache_lock:
            outcome = self._cache.get(spec)
            compiles_here = outcome is None
            if compiles_here:
                self.misses += 1
                outcome = Future()
                if self.cache_size:
                    self._cache[spec] = outcome
                    while len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(spec)
                self.hits += 1
        if compiles_here:
            self._executor.submit(self._settle, spec, outcome)
        return Compiling(outcome, started)

    def _settle(self, spec: GrammarSpec, outcome: Future) -> None:
        """Compile `spec` into `outcome`, for whoever waits on it (on a compile thread); an unexpected
        failure reaches the waiters and is not kept."""
        try:
            result: CompiledGrammar | str = self._compile(spec)
        except ValueError as error:
            result = str(error)
        except BaseException as error:
            with self._cache_lock:
                if self._cache.get(spec) is outcome:
                    del self._cache[spec]
            outcome.set_exception(error)
            return
        outcome.set_result(result)

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compiles `spec` (no cache); ValueError saying what is wrong with it."""
        with self._lock:
            compiler = self._compiler
        try:
            if spec.kind in ("json_object", "json_schema"):
                schema = ANY_OBJECT if spec.kind == "json_object" else spec.value
                json.loads(schema)
                compiled = compiler.compile_json_schema(schema, any_whitespace=False)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.value or "")
            else:
                compiled = compiler.compile_grammar(spec.value or "")
        except Exception as error:  # xgrammar raises RuntimeError or its own errors with the parser's message
            raise ValueError(f"cannot compile the {spec.kind.replace('_', ' ')}: {_first_line(error)}") from None
        return CompiledGrammar(compiled, xgrammar.get_bitmask_shape(1, self.vocab_size)[1])

    def cache_info(self) -> dict[str, int]:
        """Hits, misses, specs kept and the limit (operators, tests)."""
        with self._cache_lock:
            return {"hits": self.hits, "misses": self.misses, "size": len(self._cache), "limit": self.cache_size}


def _settled(outcome: CompiledGrammar | str) -> CompiledGrammar:
    """A compile's outcome as its waiters get it: the refusal's message as ValueError."""
    if isinstance(outcome, str):
        raise ValueError(outcome)
    return outcome


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
