"""bfloat16 on a CPU (the default where it is native): greedy speculative output is plain decoding's,
token for token, whatever was drafted, batched beside it, cached or preempted.

A tiny model with small random weights has flat logits, so near-ties, where one rounding more or
less swaps the top two tokens, are everywhere: the hard case. It holds because every product gives
a row the same bits whatever else its call holds (projections: actors/model/llama.py `project`;
attention: our kernel, actors/model/cpu_attention.py), so a verified token is computed exactly as
the same token decoded alone.
"""
from __future__ import annotations

import copy

import pytest
import torch

from actors.model import kernels
from actors.model.precision import cpu_has_bfloat16
from tests.cluster.engine.test_engine_lossless import PIPELINE, PROMPTS, SHARED, make_proposer, run_engine
from tests.conftest import tiny_pair

pytestmark = pytest.mark.skipif(not (cpu_has_bfloat16() and kernels.available()),
                                reason="bfloat16 is the CPU default only with native bfloat16 and our kernel")
KINDS = ["pld", "pld-tree", "suffix", "draft", "draft-tree"]
NEW_TOKENS = 48
_generator = torch.Generator().manual_seed(3)
PROMPTS_BF16 = PROMPTS + [torch.randint(60, (length,), generator=_generator).tolist() for length in (45, 70, 100, 140)]
"""Prompts of mixed lengths, repetitive ones (drafts accepted) and random ones (near-ties)."""


@pytest.fixture(scope="module")
def flat_model():
    full, _ = tiny_pair(dtype=torch.float32, initializer_range=0.02)
    return copy.deepcopy(full).to(torch.bfloat16)


@pytest.fixture(scope="module")
def plain(flat_model):
    return [o.token_ids for o in run_engine(flat_model, None, PROMPTS_BF16, slots=8, max_new_tokens=NEW_TOKENS)]


@pytest.mark.parametrize("kind", KINDS)
@PIPELINE
def test_greedy_speculation_in_bfloat16_is_plain_decoding(flat_model, plain, kind, pipeline):
    outputs = run_engine(flat_model, make_proposer(kind, flat_model, 8), PROMPTS_BF16, slots=8, pipeline=pipeline,
                         max_new_tokens=NEW_TOKENS)
    assert [o.token_ids for o in outputs] == plain
    assert sum(o.stats.accepted for o in outputs) > 0


@pytest.mark.parametrize("kind", ["suffix", "draft-tree"])
@pytest.mark.parametrize("chunk", [None, 8], ids=["whole-prefill", "chunked-prefill"])
def test_prefix_hits_chunks_and_preemption_in_bfloat16_keep_each_requests_output(flat_model, kind, chunk):
    """Requests share cached prompt blocks, are prefilled in chunks beside others' trees, and are
    preempted and resumed (their tokens so far prefilled again): each output is what the request
    gets alone, decoded plainly with its prompt prefilled whole."""
    prompts = [SHARED + [1, 2], SHARED + [5], SHARED[:20] + [9, 9, 9], [7, 8, 9], SHARED + [1, 2, 3]]
    tight = {"kv_cache_bytes": 24 * 4 * flat_model.kv_bytes_per_position(), "block_size": 4, "max_len": 96,
             "prefill_chunk_tokens": chunk}
    alone = [run_engine(flat_model, None, [p], slots=1, cache={"prefill_chunk_tokens": None})[0] for p in prompts]
    outputs = run_engine(flat_model, make_proposer(kind, flat_model, 8), prompts, slots=8, cache=tight,
                         cache_scope="tenant")
    assert [o.token_ids for o in outputs] == [o.token_ids for o in alone]
    assert sum(o.stats.preemptions for o in outputs) > 0
    assert sum(o.stats.cached_prompt_tokens for o in outputs) >= 28
