"""Suffix decoding: the trie of earlier outputs, and trees from the request's text and from them."""
import gc
import random
import tracemalloc

import pytest

from actors.draft_worker import DraftWorker
from speculators.proposers.base import DraftRequest
from speculators.proposers.suffix import SuffixCache, SuffixProposer, SuffixTrie, continuations


def test_trie_counts_substrings_and_matches_the_longest_suffix_with_a_continuation():
    trie = SuffixTrie(max_depth=4)
    trie.add([1, 2, 3, 1, 2, 4])
    position, length = trie.match([9, 1, 2])
    assert length == 2 and {token: count for token, count, _ in continuations(position)} == {3: 1, 4: 1}
    assert trie.match([7, 8]) is None


def test_trie_memory_is_bounded_and_the_oldest_outputs_go_first():
    cache = SuffixCache(max_depth=3, max_tokens=6)
    cache.add([1, 2, 3])
    cache.add([4, 5, 6])
    cache.add([7, 8, 9])  # 9 tokens > 6: [1, 2, 3] is evicted and leaves no node behind
    assert cache.tokens == 6 and 1 not in cache.tries[""].root.children
    assert cache.match([4, 5]) is not None


def _counted(documents, depth):
    """Every substring of up to `depth` tokens of the documents, with how often it occurs."""
    counts = {}
    for document in documents:
        for start in range(len(document)):
            for end in range(start + 1, min(start + depth, len(document)) + 1):
                counts[tuple(document[start:end])] = counts.get(tuple(document[start:end]), 0) + 1
    return counts


def test_the_compressed_trie_counts_what_a_trie_of_one_node_per_token_would():
    """Added and removed in any order, the path-compressed trie's continuations are the substring
    counts, and removing every document leaves nothing behind (its size counters included)."""
    rng = random.Random(0)
    depth, trie, kept = 5, SuffixTrie(5), []
    for step in range(120):
        if kept and rng.random() < 0.4:
            trie.remove(kept.pop(rng.randrange(len(kept))))
        else:
            kept.append([rng.randrange(4) for _ in range(rng.randrange(1, 30))])
            trie.add(kept[-1])
        counts = _counted(kept, depth)
        for gram in [g for g in counts if len(g) < depth][:40]:
            position = trie._walk(gram)
            assert position is not None
            expected = {g[-1]: c for g, c in counts.items() if len(g) == len(gram) + 1 and g[:-1] == gram}
            assert {token: count for token, count, _ in continuations(position)} == expected
    for document in kept:
        trie.remove(document)
    assert trie.empty and (trie.size.nodes, trie.size.dicts, trie.size.label_tokens) == (0, 0, 0)


def _probe(proposer, text, scope, request_id="probe"):
    """Drafted tokens for a request whose context ends in the first half of `text` (its own text
    holds no repeat, so whatever it drafts comes from earlier outputs)."""
    tree = proposer.propose([DraftRequest(request_id, [999] + text[:6], 8, 16, cache_scope=scope)])[0]
    proposer.release(request_id)
    return tree.num_drafted


def test_a_request_drafts_only_from_outputs_of_its_own_scope():
    proposer = SuffixProposer()
    secret, public = list(range(100, 112)), list(range(200, 212))
    proposer.learn(secret, "tenant:b")
    proposer.learn(public, "")
    assert _probe(proposer, secret, "tenant:a") == 0  # another tenant's output: nothing to see
    assert _probe(proposer, secret, "tenant:b") > 0  # the same tenant's: drafted
    assert _probe(proposer, secret, "") == 0 and _probe(proposer, public, "tenant:a") == 0
    assert _probe(proposer, public, "") > 0  # the global scope shares among its own requests


def test_a_request_that_shares_nothing_drafts_from_its_own_text_alone():
    proposer = SuffixProposer()
    text = list(range(100, 112))
    proposer.learn(text, "")
    proposer.learn(text, None)  # not learned at all
    assert _probe(proposer, text, None) == 0 and set(proposer.outputs.tries) == {""}
    own = proposer.propose([DraftRequest("r", text + text[:4], 8, 16, cache_scope=None)])[0]
    assert own.token_ids[1:4] == text[4:7]  # its own repeat still drafts


def test_the_byte_bound_holds_over_all_scopes_after_many_outputs():
    rng = random.Random(1)
    budget = 400_000
    tracemalloc.start()
    cache = SuffixCache(24, max_tokens=10**9, max_bytes=budget)
    for index in range(300):
        cache.add([rng.randrange(50_000) for _ in range(rng.randrange(20, 300))], f"tenant:{index % 7}")
        assert cache.bytes <= budget
    # what the cache holds: its tries and documents, and the tokens' int objects (made by random);
    # a full collection first empties the interpreter's free lists of tuples, which it does not hold
    gc.collect()
    held = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/speculators/proposers/suffix.py"),
                                                      tracemalloc.Filter(True, "*/random.py")])
    tracemalloc.stop()
    assert sum(stat.size for stat in held.statistics("filename")) <= budget  # the estimate is not below it
    assert 400 < cache.tokens < budget // 300  # evicted down to the bound, not to nothing
    assert len(cache.tries) <= 7


def test_the_hybrid_learns_under_the_scope_it_is_given():
    from speculators.proposers.base import Proposer
    from speculators.proposers.hybrid import HybridProposer
    from speculators.tree import DraftTree

    class NoHead(Proposer):
        def propose(self, requests):
            return [DraftTree.root_only(r.token_ids[-1]) for r in requests]

    hybrid = HybridProposer(SuffixProposer(), NoHead())
    hybrid.learn(list(range(100, 112)), "tenant:a")
    for _ in hybrid.learn_steps(list(range(200, 212)), "tenant:b"):
        pass
    assert set(hybrid.suffix.outputs.tries) == {"tenant:a", "tenant:b"}
    assert _probe(hybrid, list(range(100, 112)), "tenant:b") == 0 and _probe(hybrid, list(range(100, 112)), "tenant:a") > 0


def test_evicted_scopes_leave_no_trie_behind():
    cache = SuffixCache(4, max_tokens=10)
    for index in range(20):
        cache.add([index, index + 1, index + 2, index + 3, index + 4], f"s{index}")
    assert set(cache.tries) == {"s18", "s19"} and cache.tokens == 10


def test_own_text_continuations_are_taken_most_frequent_first():
    # after "5", 6 followed twice and 7 once
    tokens = [5, 6, 5, 6, 5, 7, 5]
    tree = SuffixProposer(max_spec_factor=4.0).propose([DraftRequest("r", tokens, 4, 8)])[0]
    first = [tree.token_ids[n] for n in range(1, tree.size) if tree.parents[n] == 0]
    assert first[0] == 6 and 7 in first
    assert tree.confidence[1] > tree.confidence[tree.token_ids.index(7)]


def test_earlier_outputs_are_learned_through_the_draft_worker():
    worker = DraftWorker(lambda: SuffixProposer(max_spec_factor=2.0))
    request = DraftRequest("new", [40, 41, 10, 11, 12], 4, 8)
    assert worker.propose([request]).trees[0].num_drafted == 0
    worker.release(["old"], outputs=[[10, 11, 12, 13, 14, 15]])
    tree = worker.propose([DraftRequest("new2", [40, 41, 10, 11, 12], 4, 8)]).trees[0]
    assert tree.token_ids[:4] == [12, 13, 14, 15]


def test_draft_size_adapts_to_the_match_length():
    proposer = SuffixProposer(max_spec_factor=1.0)
    proposer.learn([1, 2, 3, 4, 5, 6, 7, 8, 9])
    short = proposer.propose([DraftRequest("a", [0, 3], 8, 8)])[0]  # 1 matched token: 1 drafted
    long = proposer.propose([DraftRequest("b", [1, 2, 3], 8, 8)])[0]  # 3 matched tokens: 3 drafted
    assert short.token_ids == [3, 4] and long.token_ids == [3, 4, 5, 6]


def test_bad_suffix_parameters_are_refused():
    with pytest.raises(ValueError):
        SuffixProposer(max_depth=1)
    with pytest.raises(ValueError):
        SuffixProposer(max_cached_bytes=0)


def test_the_background_learner_learns_every_released_output_off_the_propose_path():
    worker = DraftWorker(lambda: SuffixProposer(max_spec_factor=2.0), learn_in_background=True)
    outputs = [[index * 1000 + t for t in range(400)] for index in range(1, 9)]
    worker.release(["old"], outputs, ["tenant:a"] * len(outputs))
    first = worker.propose([DraftRequest("new", [5, 6, 1010, 1011, 1012], 4, 8, cache_scope="tenant:a")])
    assert first.trees[0].token_ids[0] == 1012  # answered whatever the learner had done by then
    assert worker.flush(timeout=30)
    for index in range(1, 9):
        request = DraftRequest(f"r{index}", [5, 6, index * 1000 + 300, index * 1000 + 301], 4, 8, cache_scope="tenant:a")
        assert worker.propose([request]).trees[0].token_ids[1:3] == [index * 1000 + 302, index * 1000 + 303]
        other = DraftRequest(f"o{index}", [5, 6, index * 1000 + 300, index * 1000 + 301], 4, 8, cache_scope="tenant:b")
        assert worker.propose([other]).trees[0].num_drafted == 0


def test_merged_trees_keep_every_source_path_and_the_likeliest_nodes():
    from speculators.proposers.continuations import merge_trees
    from speculators.tree import DraftTree

    own = DraftTree([9, 1, 2], [-1, 0, 1], confidence=[1.0, 0.9, 0.5])
    learned = DraftTree([9, 1, 3, 4], [-1, 0, 1, 0], confidence=[1.0, 0.6, 0.8, 0.3])
    merged = merge_trees([own, learned], max_nodes=3)
    # path 1 keeps its higher confidence (0.9); 1->3 (0.72) and 1->2 (0.45) beat 4 (0.3)
    assert merged.token_ids == [9, 1, 3, 2] and merged.parents == [-1, 0, 1, 1]
    assert merged.confidence[1] == 0.9
