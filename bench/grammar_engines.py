"""`specserve bench grammar-engines`: xgrammar against llguidance on this machine, for structured output.

What the engine asks of a grammar engine, with the default model's tokenizer (49,152 tokens):
compiling a spec (a JSON schema, any JSON object, a regular expression; first time and cached),
and, along a valid output, the per-token work of speculative decoding: filling the allowed-token
mask at a node, and a drafted token tried and rolled back. Each engine runs on its own, through the
API each documents; one missing from the environment is reported as such (only xgrammar is a
dependency of the project).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.specbench import RESULTS_DIR, command_line, machine, write_report

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "emails": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "kind": {"enum": ["customer", "supplier", "staff"]}},
    "required": ["name", "age", "emails", "address", "kind"], "additionalProperties": False}
PERSON_TEXT = ('{"name": "Ada Lovelace, Countess of Lovelace", "age": 36, "emails": ["ada@example.org", "countess@example.org"], '
               '"address": {"city": "London", "zip": "12345"}, "kind": "staff"}')
REGEX, REGEX_TEXT = r"[0-9]{3}-[0-9]{4} \([a-z ]+\)", "555-0199 (office line)"
SPECS = {"json_schema": (json.dumps(PERSON), PERSON_TEXT), "json_object": (None, PERSON_TEXT), "regex": (REGEX, REGEX_TEXT)}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int, eos: int):
        import xgrammar

        self.xgr, self.vocab = xgrammar, vocab
        self.compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab, stop_token_ids=[eos]))
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, kind: str, spec: str | None):
        if kind == "json_schema":
            return self.compiler.compile_json_schema(spec, any_whitespace=False)
        if kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        return self.compiler.compile_regex(spec)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher) -> None:
        matcher.fill_next_token_bitmask(self.bitmask, 0)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def rollback(self, matcher, tokens: int) -> None:
        matcher.rollback(tokens)


class LLGuidance:
    name = "llguidance"
    SEPARATED = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    """The separators xgrammar's compact JSON uses, so both engines match the same texts."""

    def __init__(self, tokenizer, vocab: int, eos: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.fill_mask = llguidance, llguidance.torch.fill_next_token_bitmask
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def compile(self, kind: str, spec: str | None):
        matcher = self.llg.LLMatcher
        if kind == "json_schema":
            return matcher.grammar_from_json_schema(spec, defaults=self.SEPARATED)
        if kind == "json_object":
            return matcher.grammar_from_json_schema('{"type": "object"}', defaults=self.SEPARATED)
        return matcher.grammar_from_regex(spec)

    def matcher(self, compiled):
        matcher = self.llg.LLMatcher(self.tokenizer, compiled, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, matcher) -> None:
        self.fill_mask(matcher, self.bitmask, 0)

    def accept(self, matcher, token: int) -> bool:
        return bool(matcher.validate_tokens([token])) and matcher.consume_token(token)  # a refused token errors it

    def rollback(self, matcher, tokens: int) -> None:
        matcher.rollback(tokens)


ENGINES = (XGrammar, LLGuidance)


def _seconds(work: Callable[[], object]) -> float:
    began = time.perf_counter()
    work()
    return time.perf_counter() - began


def measure(engine, tokenizer, kind: str, spec: str | None, text: str, walks: int = 5) -> dict:
    """Compile time (a first request: the spec compiled and a matcher made; then a cached spec),
    a matcher for one more request, and per-token times along `text`'s tokens over `walks` walks:
    the mask at each position, and a drafted token tried and rolled back."""
    first = _seconds(lambda: engine.matcher(engine.compile(kind, spec)))
    cached = statistics.median(_seconds(lambda: engine.compile(kind, spec)) for _ in range(5))
    compiled = engine.compile(kind, spec)
    matcher_s = statistics.median(_seconds(lambda: engine.matcher(compiled)) for _ in range(5))
    tokens = tokenizer.encode(text)
    fills, tries = [], []
    for _ in range(walks):
        matcher = engine.matcher(compiled)
        for token in tokens:
            fills.append(_seconds(lambda: engine.fill(matcher)))
            tries.append(_seconds(lambda: engine.accept(matcher, token) and engine.rollback(matcher, 1)))
            if not engine.accept(matcher, token):
                raise RuntimeError(f"{engine.name} refused token {token} of its own {kind} example")
    fills.sort()
    return {"compile_s": round(first, 4), "compile_cached_s": round(cached, 5), "matcher_ms": round(1000 * matcher_s, 3),
            "tokens": len(tokens), "mask_ms": round(1000 * statistics.median(fills), 4),
            "mask_p90_ms": round(1000 * fills[int(0.9 * len(fills))], 4), "mask_max_ms": round(1000 * fills[-1], 3),
            "try_and_rollback_ms": round(1000 * statistics.median(tries), 4)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from actors.model.loader import DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL, help="whose tokenizer the grammars are compiled for")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "grammar-engines.json", help="JSON report (and .md beside it)")


def run(args: argparse.Namespace) -> int:
    from actors.model.loader import load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.model)
    results = {}
    for kind in ENGINES:
        began = time.perf_counter()
        try:
            engine = kind(tokenizer, len(tokenizer), tokenizer.eos_token_id)
        except ImportError as error:
            results[kind.name] = {"error": f"not installed ({error})"}
            continue
        setup = time.perf_counter() - began
        results[kind.name] = {"tokenizer_setup_s": round(setup, 3),
                              **{spec_kind: measure(engine, tokenizer, spec_kind, *SPECS[spec_kind]) for spec_kind in SPECS}}
    report = {"command": command_line(args, "bench", "grammar-engines"),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "vocab": len(tokenizer), "engines": results}
    write_report(report, args.out, markdown)
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    lines = [f"# Grammar engines on this machine ({report['date']})", "", f"`{report['command']}`", "",
             f"Tokenizer: the default model's ({report['vocab']} tokens). Medians over the tokens of each spec's example.", "",
             "| engine | spec | tokenizer setup s | first request: compile + matcher s | cached compile s | matcher ms "
             "| mask ms (median) | mask p90 ms | mask max ms | try + rollback ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, result in report["engines"].items():
        if "error" in result:
            lines.append(f"| {name} | - | {result['error']} | | | | | | | |")
            continue
        for kind in SPECS:
            r = result[kind]
            lines.append(f"| {name} | {kind} | {result['tokenizer_setup_s']} | {r['compile_s']} | {r['compile_cached_s']} | "
                         f"{r['matcher_ms']} | {r['mask_ms']} | {r['mask_p90_ms']} | {r['mask_max_ms']} | "
                         f"{r['try_and_rollback_ms']} |")
    return "\n".join(lines) + "\n"
