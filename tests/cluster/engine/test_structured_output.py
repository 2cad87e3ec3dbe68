"""Structured output with speculation on: every output parses and validates, greedy output equals
plain constrained decoding for every drafter, and drafts are pruned and accepted under the grammar.

A tiny random float64 Llama with the default model's tokenizer (49,152 tokens, so the grammar
engine works with a real byte-level vocabulary); bounded schemas, so that its random preferences end.
"""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch

from actors.model.llama import layer_skip_draft
from actors.model.loader import load_tokenizer
from actors.model.runner import ModelRunner
from cluster.engine.build import local_engine
from cluster.engine.config import SchedulerConfig
from cluster.engine.constraints import RequestRules
from cluster.engine.grammar import GrammarCompiler, GrammarSpec
from cluster.engine.request import GenerationRequest
from speculators.lookahead import LookaheadConfig
from speculators.proposers.draft_model import DraftModelProposer
from speculators.proposers.prompt_lookup import PromptLookupProposer
from speculators.proposers.suffix import SuffixProposer
from speculators.sampling import SamplingParams
from speculators.tree import DraftTree
from tests.conftest import tiny_pair

pytestmark = pytest.mark.default_model

SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}
SCHEMAS = [
    ({"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": SMALL_INT},
      "required": ["name", "age"], "additionalProperties": False}, {"name": "Ada", "age": 36}),
    ({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
      "additionalProperties": False}, {"color": "green"}),
    ({"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}},
      "required": ["ok", "note"], "additionalProperties": False}, {"ok": True, "note": None}),
    ({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
     [1, 2, 3]),
    ({"type": "object", "properties": {"point": {"type": "object", "properties": {"x": SMALL_INT, "y": SMALL_INT},
                                                 "required": ["x", "y"], "additionalProperties": False}},
      "required": ["point"], "additionalProperties": False}, {"point": {"x": 1, "y": 2}}),
    ({"anyOf": [SMALL_INT, {"type": "string", "maxLength": 5}]}, 42),
    ({"type": "string", "pattern": "^[a-c]{2,4}$"}, "abca"),
    ({"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 3}},
                                 "required": ["id"], "additionalProperties": False}, "maxItems": 3}, [{"id": 1}]),
    ({"enum": ["yes", "no"]}, "yes"),
    ({"type": "object", "properties": {"a": SMALL_INT, "b": {"type": "string", "maxLength": 4}}, "required": ["a"],
      "additionalProperties": False}, {"a": 5, "b": "x"}),
    ({"type": "string", "minLength": 2, "maxLength": 3}, "hey"),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
                                       "count": SMALL_INT},
      "required": ["tags", "count"], "additionalProperties": False}, {"tags": ["x"], "count": 1}),
]
NEW_TOKENS = 64
DRAFTERS = ["none", "pld", "suffix", "draft", "draft-tree"]


@pytest.fixture(scope="module")
def setup(default_model_path):
    tokenizer = load_tokenizer(default_model_path)
    model, _ = tiny_pair(dtype=torch.float64, vocab_size=len(tokenizer), max_position_embeddings=512)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    grammars = [compiler.compile(GrammarSpec("json_schema", json.dumps(schema))) for schema, _ in SCHEMAS]
    prompts = [tokenizer.encode(f"Answer in JSON, for example {json.dumps(example)} or {json.dumps(example)}. JSON: ")
               for _, example in SCHEMAS]
    return tokenizer, model, grammars, prompts


def proposer(kind: str, model):
    if kind == "pld":
        return PromptLookupProposer(num_tokens=8, max_branches=2)
    if kind == "suffix":
        return SuffixProposer(max_spec_factor=4.0)
    if kind.startswith("draft"):
        runner = ModelRunner(layer_skip_draft(model, 2), len(SCHEMAS), 512)
        return DraftModelProposer(runner, width=3 if kind == "draft-tree" else 1)
    return None


def generate(setup, kind: str, sampling=SamplingParams()):
    tokenizer, model, grammars, prompts = setup
    engine = local_engine(model, tokenizer, proposer(kind, model), SchedulerConfig(max_sequences=len(SCHEMAS), max_len=512),
                          eos_token_ids=[tokenizer.eos_token_id])
    lookahead = LookaheadConfig(policy="fixed", num_speculative_tokens=6)
    return engine.generate([GenerationRequest(f"s{i}", prompt, sampling, NEW_TOKENS, lookahead=lookahead, grammar=grammar)
                            for i, (prompt, grammar) in enumerate(zip(prompts, grammars))])


def assert_valid(outputs):
    for (schema, _), output in zip(SCHEMAS, outputs):
        assert output.finish_reason == "stop", (schema, output.text)
        jsonschema.validate(json.loads(output.text), schema)


@pytest.fixture(scope="module")
def plain(setup):
    outputs = generate(setup, "none")
    assert_valid(outputs)
    return outputs


@pytest.mark.parametrize("kind", DRAFTERS[1:])
def test_greedy_constrained_output_equals_plain_constrained_decoding(setup, plain, kind):
    outputs = generate(setup, kind)
    assert [o.token_ids for o in outputs] == [p.token_ids for p in plain]
    assert_valid(outputs)
    drafted, accepted = sum(o.stats.drafted for o in outputs), sum(o.stats.accepted for o in outputs)
    assert sum(o.stats.grammar_pruned for o in outputs) > 0  # drafted tokens that break it: pruned, not verified
    if kind in ("pld", "suffix"):  # copied text follows the prompt's example: drafted and accepted under the grammar
        assert drafted > accepted > 0


@pytest.mark.parametrize("kind", ["pld", "draft-tree"])
def test_sampled_constrained_output_validates(setup, kind):
    assert_valid(generate(setup, kind, SamplingParams(1.0, seed=3)))


def mask_after(grammar, tokens):
    rules = RequestRules(GenerationRequest("x", [1], grammar=grammar))
    rules.commit(tokens)
    return rules.shaping(DraftTree.root_only(0), [1]).allowed[0]


def test_a_tree_is_pruned_and_masked_and_the_matcher_rolled_back(setup, plain):
    """Prompt lookup's kind of tree: an allowed path and a token the grammar rules out, under a
    committed prefix. The ruled-out token and its subtree go; each kept node's row is the mask after
    its own path; and the matcher ends where it started, then takes the committed tokens."""
    tokenizer, _, grammars, _ = setup
    grammar, output = grammars[0], plain[0].token_ids
    rules = RequestRules(GenerationRequest("x", [1], grammar=grammar))
    rules.commit(output[:3])
    bad = tokenizer.encode("zzz")[0]
    tree = DraftTree([output[2], output[3], bad, output[4], output[4]], [-1, 0, 0, 1, 2])
    pruned, dropped = rules.prune(tree)
    assert (pruned.token_ids, pruned.parents, dropped) == ([output[2], output[3], output[4]], [-1, 0, 1], 2)
    allowed = rules.shaping(pruned, [1, *output[:3]]).allowed
    for node, path in enumerate([output[:3], output[:4], output[:5]]):
        assert torch.equal(allowed[node], mask_after(grammar, path)), node
    rules.commit(output[3:5])
    assert torch.equal(rules.shaping(DraftTree.root_only(0), [1]).allowed[0], mask_after(grammar, output[:5]))


def test_a_sampled_tree_keeps_a_ruled_out_node_for_the_verifier(setup, plain):
    """Its later siblings were drawn without replacement after it: only its subtree goes."""
    tokenizer, _, grammars, _ = setup
    grammar, output = grammars[0], plain[0].token_ids
    rules = RequestRules(GenerationRequest("x", [1], grammar=grammar))
    bad = tokenizer.encode("zzz")[0]
    tree = DraftTree([0, bad, output[0], 5], [-1, 0, 0, 1], draft_probs=torch.full((4, 8), 0.125))
    pruned, dropped = rules.prune(tree)
    assert (pruned.token_ids, pruned.parents, dropped) == ([0, bad, output[0]], [-1, 0, 0], 1)
    assert pruned.draft_probs.shape == (3, 8)


# ---- the compiled-grammar cache ----------------------------------------------------------------


def counting_compiler(cache_size: int, monkeypatch, compile=None) -> tuple[GrammarCompiler, list[GrammarSpec]]:
    """A compiler whose compiling is replaced by `compile` (default: a fresh object), with the specs it compiled."""
    compiler, compiled = GrammarCompiler(None, 64, [], cache_size=cache_size), []

    def count(spec):
        compiled.append(spec)
        return (compile or (lambda _: object()))(spec)

    monkeypatch.setattr(compiler, "_compile", count)
    return compiler, compiled


def test_a_spec_is_compiled_once_while_it_is_among_the_last_used(monkeypatch):
    compiler, compiled = counting_compiler(2, monkeypatch)
    a, b, c = (GrammarSpec("regex", value) for value in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(GrammarSpec("regex", "a+")) is first and compiled == [a]
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recently used: c evicts b
    compiler.compile(c)
    assert compiler.compile(a) is first and compiled == [a, b, c]
    compiler.compile(b)
    assert compiled == [a, b, c, b]
    assert compiler.cache_info() == {"hits": 3, "misses": 4, "size": 2, "limit": 2}


def test_a_refused_spec_is_remembered_and_a_zero_size_cache_keeps_nothing(monkeypatch):
    def refuse(spec):
        raise ValueError(f"cannot compile the regex: {spec.value}")

    compiler, compiled = counting_compiler(4, monkeypatch, refuse)
    for _ in range(2):
        with pytest.raises(ValueError, match="cannot compile the regex: [(]"):
            compiler.compile(GrammarSpec("regex", "("))
    assert len(compiled) == 1
    uncached, compiled = counting_compiler(0, monkeypatch)
    assert uncached.compile(GrammarSpec("regex", "a")) is not uncached.compile(GrammarSpec("regex", "a"))
    assert len(compiled) == 2 and uncached.cache_info()["size"] == 0


def test_requests_for_a_spec_being_compiled_wait_for_that_compile(monkeypatch):
    started, release = threading.Event(), threading.Event()

    def slow(spec):
        started.set()
        release.wait(10)
        return object()

    compiler, compiled = counting_compiler(4, monkeypatch, slow)
    spec = GrammarSpec("json_object")
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(compiler.compile, spec)
        assert started.wait(10)
        others = [pool.submit(compiler.compile, spec) for _ in range(3)]
        release.set()
        results = {id(future.result(10)) for future in [first, *others]}
    assert len(results) == 1 and compiled == [spec]


def test_the_real_compiler_compiles_a_spec_once(setup):
    tokenizer = setup[0]
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS[0][0]))
    grammar = compiler.compile(spec)
    assert compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMAS[0][0]))) is grammar
    assert compiler.cache_info()["misses"] == 1 and compiler.cache_info()["hits"] == 1
    with pytest.raises(ValueError, match="cannot compile the json schema"):
        compiler.compile(GrammarSpec("json_schema", "{not json"))
