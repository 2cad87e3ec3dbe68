"""REST: the suffix array, the datastore's lookups, the proposer's trees, `specserve build-datastore`,
and greedy output unchanged by its drafts (which the target accepts when the corpus holds its text)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from cluster.engine.build import build_engine, encode_prompt, rest_proposer
from cluster.engine.config import EngineConfig
from cluster.engine.request import GenerationRequest
from specserve.cli import main
from speculators.datastore import SEPARATOR, Datastore, write_datastore
from speculators.lookahead import LookaheadConfig
from speculators.proposers.base import DraftRequest
from speculators.proposers.rest import RestProposer
from speculators.suffix_array import build_suffix_array, occurrences
from tests.cluster.engine.test_engine_lossless import LOOKAHEADS, PROMPTS, run_engine


def test_the_suffix_array_sorts_suffixes_as_a_brute_force_sort_does():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(SEPARATOR, rng.integers(1, 6), rng.integers(0, 80)).astype(np.int32)
        expected = sorted(range(len(tokens)), key=lambda start: tokens[start:].tolist())
        assert build_suffix_array(tokens).tolist() == expected


def test_occurrences_are_every_start_of_the_run():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 3, 500).astype(np.int32)
    suffixes = build_suffix_array(tokens)
    for run in ([0], [1, 2], [2, 2, 0], [0, 1, 2, 0, 1], [3]):
        lo, hi = occurrences(tokens, suffixes, run)
        starts = [i for i in range(len(tokens)) if tokens[i:i + len(run)].tolist() == run]
        assert sorted(suffixes[lo:hi].tolist()) == starts


def store(tmp_path, documents, vocab_size=100) -> Datastore:
    write_datastore(tmp_path / "store", documents, "sha256:test", vocab_size)
    return Datastore.open(tmp_path / "store")


def test_the_longest_matching_suffix_and_what_followed_it(tmp_path):
    datastore = store(tmp_path, [[5, 1, 2, 3, 4], [9, 2, 3, 7, 8], [2, 3, 4, 6], [1, 2, 3]])
    lo, hi, length = datastore.longest_match([8, 1, 2, 3], max_length=16, min_length=2)
    assert length == 3 and hi - lo == 2  # "1 2 3" twice; "8 1 2 3" never
    # the second occurrence ends its document: its continuation is empty and left out
    assert datastore.follows(lo, hi, length, depth=4, limit=8) == [[4]]
    lo, hi, length = datastore.longest_match([0, 2, 3], max_length=16, min_length=2)
    assert (length, hi - lo) == (2, 4)
    assert sorted(datastore.follows(lo, hi, length, depth=2, limit=8)) == [[4], [4, 6], [7, 8]]
    assert datastore.longest_match([0, 3], max_length=16, min_length=2) is None  # "0 3" never occurs
    assert not datastore.tokens.flags.writeable and not datastore.suffixes.flags.writeable  # memory-mapped, read-only


def test_a_sample_of_occurrences_keeps_each_continuations_share(tmp_path):
    datastore = store(tmp_path, [[1, 2, 3]] * 300 + [[1, 2, 4]] * 100)
    lo, hi, length = datastore.longest_match([1, 2], max_length=16, min_length=2)
    follows = datastore.follows(lo, hi, length, depth=1, limit=40)
    assert len(follows) == 40 and follows.count([3]) == 30


def test_the_tree_is_the_most_frequent_continuations_best_first(tmp_path):
    proposer = RestProposer(store(tmp_path, [[7, 1, 2, 3, 4, 5]] * 3 + [[1, 2, 3, 6]]))
    tree = proposer.propose([DraftRequest("r", [9, 1, 2, 3], num_speculative_tokens=4, max_nodes=8)])[0]
    assert tree.token_ids == [3, 4, 5, 6]  # 4 (3 of 4) first, then its child 5, then 6 (1 of 4)
    assert tree.parents == [-1, 0, 1, 0]
    assert tree.confidence[1] == pytest.approx(3 / (4 + 1 / 3))  # continuations.confidence over the 3-token match
    nothing = proposer.propose([DraftRequest("r", [9, 8], num_speculative_tokens=4, max_nodes=8)])[0]
    assert nothing.num_drafted == 0


def sequences_store(tmp_path, sequences) -> RestProposer:
    return RestProposer(store(tmp_path, sequences, vocab_size=64))


@pytest.fixture(scope="module")
def plain(tiny_model):
    return [output.token_ids for output in run_engine(tiny_model[0], None, PROMPTS)]


@pytest.mark.parametrize("lookahead", LOOKAHEADS, ids=lambda v: f"{v.policy}-{v.num_speculative_tokens}")
@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
def test_greedy_output_is_plain_decodings_and_drafts_are_accepted(tmp_path, tiny_model, plain, lookahead, pipeline):
    """A corpus holding the target's own continuations, with others beside them, partly wrong."""
    rng = np.random.default_rng(2)
    corpus = [p + out for p, out in zip(PROMPTS, plain)]
    corpus += [p + rng.integers(0, 64, 24).tolist() for p in PROMPTS]
    outputs = run_engine(tiny_model[0], sequences_store(tmp_path, corpus), PROMPTS, lookahead, pipeline=pipeline)
    assert [o.token_ids for o in outputs] == plain
    assert sum(o.stats.accepted for o in outputs) > 0


def test_a_corpus_of_noise_leaves_the_output_as_it_is(tmp_path, tiny_model, plain):
    rng = np.random.default_rng(3)
    proposer = sequences_store(tmp_path, [rng.integers(0, 64, 200).tolist() for _ in range(20)])
    outputs = run_engine(tiny_model[0], proposer, PROMPTS, LookaheadConfig(policy="fixed", num_speculative_tokens=6))
    assert [o.token_ids for o in outputs] == plain


def test_method_rest_needs_a_readable_datastore_built_with_the_targets_tokenizer(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="rest_datastore"):
        EngineConfig(method="rest")
    with pytest.raises(ValueError, match="rest_datastore"):
        EngineConfig(method="rest", rest_datastore=str(tmp_path / "missing"))
    write_datastore(tmp_path / "other", [[1, 2, 3]], "sha256:another-tokenizer", 64, model="another")
    config = EngineConfig(model=str(tiny_model_dir), method="rest", rest_datastore=str(tmp_path / "other"))
    with pytest.raises(ValueError, match="rest_datastore .* tokenizer of 'another'"):
        rest_proposer(config)


@pytest.mark.default_model
def test_build_datastore_from_a_corpus_the_model_then_drafts_from(tmp_path, capsys, default_model_path,
                                                                  default_model_cost_curve):
    """The command line end to end: the corpus holds the text the target is about to write, so REST
    drafts it, the target accepts it, and greedy output stays plain decoding's."""
    prompt = "Write one sentence about the sea."
    engine, tokenizer = build_engine(EngineConfig(model=str(default_model_path), method="none", max_sequences=1))
    ids = encode_prompt(tokenizer, prompt, chat=True)
    plain = engine.generate([GenerationRequest("plain", ids, max_new_tokens=24, speculate=False)])[0]
    (tmp_path / "notes.txt").write_text(f"Unrelated first document.\n\n{plain.text}\n")
    (tmp_path / "more.jsonl").write_text(json.dumps({"text": "A second file, another document."}) + "\n")
    out = tmp_path / "store"
    assert main(["build-datastore", "--model", str(default_model_path), "--corpus", str(tmp_path / "notes.txt"),
                 str(tmp_path / "more.jsonl"), "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["documents"] == 3 and manifest["vocab_size"] == len(tokenizer)
    assert manifest["tokens"] == len(Datastore.open(out).tokens) - 3  # a separator after each document

    engine, _ = build_engine(EngineConfig(model=str(default_model_path), method="rest", rest_datastore=str(out),
                                          max_sequences=1))
    output = engine.generate([GenerationRequest("rest", ids, max_new_tokens=24)])[0]
    assert output.token_ids == plain.token_ids
    assert output.stats.accepted > 0 and output.stats.target_forwards < plain.stats.target_forwards
