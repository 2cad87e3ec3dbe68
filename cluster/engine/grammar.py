"""Structured output: grammars compiled for the target's tokenizer, and the matchers that follow them.

Built on xgrammar, the grammar engine vLLM and SGLang use by default; measured against llguidance
on this project's CPU in `bench/grammar_engines.py` (results in bench/results/grammar-engines.md).
A request names a JSON object (any), a JSON schema, a regular expression or an EBNF grammar; the
service compiles it once per distinct spec (cached) and the engine gives each request its own
matcher, which `constraints.RequestRules` walks over draft trees and rolls back.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch
import xgrammar

GrammarKind = Literal["json_object", "json_schema", "regex", "grammar"]
CACHE_LIMIT_BYTES = 256 * 2**20
"""Compiled grammars kept per compiler (xgrammar evicts the least recently used past this)."""
ANY_OBJECT = '{"type": "object"}'
"""What json_object asks for. JSON is generated compact (no optional whitespace, xgrammar's
`any_whitespace=False`): a model free to add whitespace may add it without end, as small ones do."""


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


class GrammarCompiler:
    """Compiles specs for one tokenizer; thread-safe, and each distinct spec is compiled once."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self._lock = threading.Lock()

    @cached_property
    def _compiler(self) -> xgrammar.GrammarCompiler:
        """Built on first use: reading a large vocabulary takes about a second."""
        info = xgrammar.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None)
        return xgrammar.GrammarCompiler(info, cache_limit_bytes=CACHE_LIMIT_BYTES)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar, or ValueError saying what is wrong with the spec."""
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


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
