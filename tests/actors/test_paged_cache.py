"""The paged KV cache: where blocks go, prefix reuse, copy before a shared block is written, and
admission and preemption in the target worker, each checked against the model run alone."""
from __future__ import annotations

import pytest
import torch

from actors.messages import AdmitItem, Preempted, VerifyItem
from actors.model.block_pool import BlockPool, CacheFullError
from actors.model.kv_cache import KVCache
from actors.model.kv_manager import KVCacheManager
from actors.model.runner import ModelRunner
from actors.target_worker import CacheOptions, TargetWorker
from speculators.proposers.base import TreeInput
from speculators.sampling import SamplingParams
from speculators.tree import DraftTree, chain_parents

GREEDY = SamplingParams()


def logits_alone(model, ids):
    runner = ModelRunner(model, 1, 128)
    runner.add("s")
    return runner.forward([TreeInput("s", ids, chain_parents(len(ids)))])[0]


def prefill(runner, seq_id, tokens):
    runner.forward([TreeInput(seq_id, tokens, chain_parents(len(tokens)), logits="none")])
    runner.commit(seq_id, range(len(tokens)))


def test_pool_keeps_sequences_in_runs_and_evicts_only_what_nobody_holds():
    pool = BlockPool(16)
    first = pool.allocate()
    assert first == 0 and pool.allocate(first) == 1  # grows in place
    second = pool.allocate()
    assert second == 8  # the middle of the largest gap: room to grow on both sides
    assert pool.allocate(second) == 9
    pool.register(1, b"k")
    pool.release(1)  # cached, held by nobody: still available, still found
    assert pool.available == 16 - 3 and pool.lookup(b"k") == 1 and pool.holders(1) == 1
    pool.release(1)
    taken = [pool.allocate() for _ in range(12)]  # every truly free block first
    assert 1 not in taken and pool.available == 1
    assert pool.allocate() == 1 and pool.lookup(b"k") is None  # then the least recently used cached one
    with pytest.raises(CacheFullError, match="blocks"):
        pool.allocate()


def test_a_full_pool_grows_a_sequence_into_the_cached_block_next_door():
    pool = BlockPool(8)
    for block in range(8):
        assert pool.allocate(block - 1 if block else None) == block
        pool.register(block, bytes([block]))
    for block in (5, 2, 3, 4, 0, 1, 6, 7):  # cached, nobody holds them; 5 least recently used
        pool.release(block)
    first = pool.allocate(run=3)
    assert first == 5 and pool.allocate(first) == 6 and pool.allocate(6) == 7  # not 2 and 3, the next oldest
    assert pool.allocate(7) == 2 and pool.lookup(bytes([6])) is None and pool.lookup(bytes([3])) == 3


def test_a_pool_keeping_runs_takes_cached_blocks_for_them():
    """A long-running CPU server: cached blocks nobody holds lie everywhere, free gaps are one block.
    A pool keeping runs places a new run in the largest gap of blocks nobody holds and grows it next
    door, forgetting what was cached there, instead of starting a run in every free block."""
    pool = BlockPool(12, keep_runs=True)
    for block in range(12):
        assert pool.allocate(block - 1 if block else None) == block
    for block in range(12):
        if block % 4:
            pool.register(block, bytes([block]))
        if block not in (4, 5):
            pool.release(block)  # free: 0 and 8; cached: the rest; held: 4 and 5
    first = pool.allocate(run=4)
    assert first == 7  # centred in 6..11, the largest gap nobody holds, though 0 and 8 are free
    assert [pool.allocate(b) for b in (7, 8, 9)] == [8, 9, 10]  # next door: free or cached
    assert pool.lookup(bytes([7])) is None and pool.lookup(bytes([1])) == 1
    assert pool.allocate(run=1) == 0  # a free gap that holds the run comes first


def test_a_pool_not_keeping_runs_takes_free_blocks_before_cached_ones():
    pool = BlockPool(6)
    for block in range(6):
        assert pool.allocate(block - 1 if block else None) == block
        if block != 4:
            pool.register(block, bytes([block]))
        pool.release(block)  # free: 4; cached: the rest, nobody holding them
    assert pool.allocate(2) == 4 and pool.lookup(bytes([3])) == 3  # not 3, next door


def test_a_finished_sequence_is_forgotten_from_its_last_block():
    """Blocks go back last first, so eviction (least recently given back first, where the pool does
    not keep runs: a GPU's) takes a prefix's tail before its head, which every longer hit needs."""
    manager = KVCacheManager(KVCache(1, 4, 4, 64, 1, 2), prefix_caching=True)
    manager.add("a", "t")
    manager.allocate("a", 12)
    manager.commit("a", list(range(1, 13)))  # three full blocks, registered
    manager.remove("a")
    manager.add("b", "u")
    manager.allocate("b", 5)  # two blocks: the free one, then a's last
    manager.add("c", "t")
    assert manager.reuse_prefix("c", list(range(1, 13))) == 8


def test_fragmented_sequences_attend_like_the_model_alone(tiny_model):
    model, _ = tiny_model
    runner = ModelRunner(model, 1, 128, kv_blocks=10, block_size=4)
    tokens = {seq_id: [] for seq_id in "abcd"}

    def grow(seq_id, count):
        new = [(len(tokens[seq_id]) * 7 + ord(seq_id)) % 60 for _ in range(count)]
        tokens[seq_id] += new
        prefill(runner, seq_id, new)

    for seq_id in tokens:  # four sequences spread over the pool, each grown into its neighbour block
        runner.add(seq_id)
        grow(seq_id, 4)
    for seq_id in tokens:
        grow(seq_id, 4)
    runner.remove("d")
    del tokens["d"]
    for seq_id in tokens:
        grow(seq_id, 3)
    assert len(runner.cache.runs(runner.kv_manager.block_table("a"), 11)) == 2  # its next block was taken
    tree = DraftTree([2, 8, 9, 4], [-1, 0, 0, 1])
    logits = runner.forward([TreeInput("a", tree.token_ids, tree.parents)])[0]
    assert len(runner.cache.runs(runner.kv_manager.block_table("a"), 15)) == 2
    for path in tree.paths:
        expected = logits_alone(model, tokens["a"] + [tree.token_ids[n] for n in path])[len(tokens["a"]):]
        torch.testing.assert_close(logits[path], expected, rtol=1e-9, atol=1e-9)
    runner.truncate("a", 11)
    got = runner.forward([TreeInput(s, [5], [-1]) for s in tokens])  # fragmented and whole ones in one pass
    for seq_id, row in zip(tokens, got):
        torch.testing.assert_close(row, logits_alone(model, tokens[seq_id] + [5])[-1:], rtol=1e-9, atol=1e-9)


def test_a_cached_prefix_is_reused_in_its_scope_only_and_copied_before_a_rewrite(tiny_model):
    model, _ = tiny_model
    runner = ModelRunner(model, 1, 128, kv_blocks=16, block_size=4, prefix_caching=True)
    prompt = [3, 7, 1, 9, 4, 4, 2, 8, 5, 6]
    runner.add("a", "tenant-1")
    prefill(runner, "a", prompt)
    runner.add("b", "tenant-1")
    runner.add("c", "tenant-2")
    assert runner.reuse_prefix("b", prompt + [1]) == 8 and runner.reuse_prefix("c", prompt) == 0
    assert runner.kv_manager.block_table("b") == runner.kv_manager.block_table("a")[:2]
    prefill(runner, "b", prompt[8:] + [1])
    runner.remove("a")  # its full blocks stay cached
    runner.add("d", "tenant-1")
    assert runner.reuse_prefix("d", prompt) == 8
    prefill(runner, "d", prompt[8:])
    runner.truncate("d", 6)  # back into a shared block: d gets its own copy, b keeps its K/V
    assert runner.kv_manager.block_table("d")[1] != runner.kv_manager.block_table("b")[1]
    prefill(runner, "d", [11, 12])
    tree = DraftTree([2, 8], [-1, 0])
    got = runner.forward([TreeInput(s, tree.token_ids, tree.parents) for s in "bd"])
    for tokens, logits in zip((prompt + [1], prompt[:6] + [11, 12]), got):
        torch.testing.assert_close(logits, logits_alone(model, tokens + tree.token_ids)[len(tokens):], rtol=1e-9, atol=1e-9)


def test_a_prefix_hit_is_copied_on_a_cpu_while_free_blocks_allow_and_held_otherwise(tiny_model):
    model, _ = tiny_model
    runner = ModelRunner(model, 1, 128, kv_blocks=16, block_size=4, prefix_caching=True)
    prompt = list(range(1, 14))
    runner.add("a", "t")
    prefill(runner, "a", prompt)
    runner.add("b", "t")
    runner.add("x")
    prefill(runner, "x", [7] * 20)  # 5 blocks after a's 4: b's copies must sit apart from a's
    free = runner.pool.free
    assert runner.reuse_prefix("b", prompt, room_to_copy=True) == 12
    table_a, table_b = runner.kv_manager.block_table("a"), runner.kv_manager.block_table("b")
    assert not set(table_a) & set(table_b) and len(runner.cache.runs(table_b, 12)) == 1
    assert runner.pool.free == free - 3 and all(runner.pool.holders(block) == 1 for block in table_a)
    prefill(runner, "b", prompt[12:])
    got = runner.forward([TreeInput("b", [5, 6], [-1, 0])])[0]
    torch.testing.assert_close(got, logits_alone(model, prompt + [5, 6])[-2:], rtol=1e-9, atol=1e-9)
    runner.add("c", "t")  # without room (the caller's fit policy) the hit is held, not copied
    assert runner.reuse_prefix("c", prompt) == 12 and runner.kv_manager.block_table("c") == table_a[:3]
    runner.add("d", "t")
    prefill(runner, "x", [7] * (runner.pool.free * 4))  # no free block left: held, though room is claimed
    assert runner.pool.free == 0
    assert runner.reuse_prefix("d", prompt, room_to_copy=True) == 12 and runner.kv_manager.block_table("d") == table_a[:3]


def test_the_worker_admits_what_fits_and_preempts_the_newest(tiny_model):
    model, _ = tiny_model
    worker = TargetWorker(model, 8, 64, cache=CacheOptions(blocks=8, block_size=4, prefix_caching=True))
    admission = worker.start([AdmitItem(request_id="a", tokens=list(range(1, 14)), sampling=GREEDY, cache_scope="t"),
                              AdmitItem(request_id="b", tokens=list(range(21, 34)), sampling=GREEDY, cache_scope="t"),
                              AdmitItem(request_id="c", tokens=list(range(41, 54)), sampling=GREEDY, cache_scope="t")])
    assert admission.refused == ["c"] and admission.cached_tokens == {"a": 0, "b": 0}
    no_scope = AdmitItem(request_id="c", tokens=list(range(1, 15)), sampling=GREEDY)
    assert worker.start([no_scope]).refused == ["c"]  # no scope: a's blocks are not its
    in_scope = AdmitItem(request_id="c", tokens=list(range(1, 15)), sampling=GREEDY, cache_scope="t")
    again = worker.start([in_scope])  # a's prompt prefix: one new block for it
    assert again.refused == [] and again.cached_tokens == {"c": 12}
    trees = [VerifyItem(s, DraftTree([t] + [5] * n, chain_parents(n + 1)))
             for s, t, n in (("a", 13, 3), ("b", 33, 6), ("c", 14, 6))]
    # 4 more blocks wanted, 1 free: c, then b, give theirs up; a grows by one block, c's (into b's
    # first, next door, b's prefix would be gone: on a CPU a run comes before a cached prefix)
    results = worker.verify(trees).results
    assert isinstance(results[1], Preempted) and isinstance(results[2], Preempted) and len(results[0].new_tokens) >= 1
    assert not worker.runner.has("b") and not worker.runner.has("c")
    resumed = worker.start([AdmitItem(request_id="b", tokens=list(range(21, 34)), sampling=GREEDY, cache_scope="t")])
    assert resumed.cached_tokens == {"b": 12}  # its own blocks are still cached


def test_a_pass_preempts_a_request_outside_the_call_that_holds_the_blocks(tiny_model):
    """Pipelined, the other micro-batch's requests hold blocks a call's trees need: the newest request
    is preempted though it is no item of the call, and named in the reply's `preempted`."""
    model, _ = tiny_model
    worker = TargetWorker(model, 8, 64, cache=CacheOptions(blocks=8, block_size=4))
    worker.start([AdmitItem(request_id="a", tokens=list(range(1, 14)), sampling=GREEDY),
                  AdmitItem(request_id="b", tokens=list(range(21, 34)), sampling=GREEDY)])
    assert worker.runner.pool.available == 2  # 3 blocks each
    reply = worker.verify([VerifyItem("a", DraftTree([13] + [5] * 8, chain_parents(9)))])  # 3 more blocks
    assert reply.preempted == ["b"] and not worker.runner.has("b")
    assert len(reply.results[0].new_tokens) >= 1 and worker.runner.committed_length("a") > 12


def test_chunked_prefill_computes_what_one_pass_does(tiny_model):
    model, _ = tiny_model
    prompt = list(range(1, 40))
    whole = TargetWorker(model, 2, 64)
    whole.start([AdmitItem(request_id="a", tokens=prompt, sampling=GREEDY)])
    chunked = TargetWorker(model, 2, 64)
    assert chunked.start([AdmitItem(request_id="a", tokens=prompt, sampling=GREEDY)], prefill=False).cached_tokens == {"a": 0}
    for count in (16, 16, 6):
        [done] = chunked.verify([], [("a", count)]).prefill
        assert done.seq_id == "a" and chunked.runner.committed_length("a") == done.start + count
    with pytest.raises(ValueError, match="left"):
        chunked.verify([], [("a", 1)])
    tree = DraftTree([39, 3, 4], [-1, 0, 1])
    expected, got = (w.runner.forward([TreeInput("a", tree.token_ids, tree.parents)])[0] for w in (whole, chunked))
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


def test_a_prompt_admitted_beside_one_with_its_prefix_takes_the_blocks_the_other_fills(tiny_model):
    model, _ = tiny_model
    shared = list(range(1, 34))
    worker = TargetWorker(model, 2, 64, cache=CacheOptions(blocks=32, block_size=8, prefix_caching=True))
    admission = worker.start([AdmitItem(request_id="a", tokens=shared + [40, 41], sampling=GREEDY, cache_scope="t"),
                              AdmitItem(request_id="b", tokens=shared + [50, 51], sampling=GREEDY, cache_scope="t")],
                             prefill=False)
    assert admission.cached_tokens == {"a": 0, "b": 0}  # nothing computed yet
    [first] = worker.verify([], [("a", 34)]).prefill
    assert (first.start, first.tokens, first.cached) == (0, 34, 0)
    [second] = worker.verify([], [("b", 20)]).prefill  # a filled 4 whole blocks of the shared prefix meanwhile
    assert (second.start, second.tokens, second.cached) == (32, 2, 32)
    table_a, table_b = (worker.runner.kv_manager.block_table(s) for s in "ab")
    assert not set(table_a) & set(table_b)  # on a CPU a's K/V is copied into b's reserved blocks:
    assert len(worker.runner.cache.runs(table_b, 34)) == 1  # b stays one run, attended as one view
    assert worker.runner.committed_length("b") == 34 and "b" not in worker._prompts
    tree = DraftTree([51, 3, 4], [-1, 0, 1])
    got = worker.runner.forward([TreeInput("b", tree.token_ids, tree.parents)])[0]
    torch.testing.assert_close(got, logits_alone(model, shared + [50, 51, 3, 4])[-3:], rtol=1e-9, atol=1e-9)


def test_prompts_with_a_common_prefix_in_one_pass_compute_it_once(tiny_model):
    model, _ = tiny_model
    shared = list(range(1, 34))
    worker = TargetWorker(model, 2, 64, cache=CacheOptions(blocks=32, block_size=8, prefix_caching=True))
    prompts = {"a": shared + [40, 41], "b": shared + [50, 51], "c": [9] * 20}
    worker.start([AdmitItem(request_id=seq_id, tokens=prompt, sampling=GREEDY, cache_scope="t")
                  for seq_id, prompt in prompts.items()], prefill=False)
    first = worker.verify([], [("a", 34), ("b", 34), ("c", 19)]).prefill
    assert [(c.seq_id, c.tokens, c.cached) for c in first] == [("a", 34, 0), ("b", 0, 0), ("c", 19, 0)]
    [second] = worker.verify([], [("b", 34)]).prefill
    assert (second.tokens, second.cached) == (2, 32)
    tree = DraftTree([51, 3, 4], [-1, 0, 1])
    got = worker.runner.forward([TreeInput("b", tree.token_ids, tree.parents)])[0]
    torch.testing.assert_close(got, logits_alone(model, shared + [50, 51, 3, 4])[-3:], rtol=1e-9, atol=1e-9)
