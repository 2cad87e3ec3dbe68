"""Suffix decoding: the trie of earlier outputs, and trees from the request's text and from them."""
import pytest

from actors.draft_worker import DraftWorker
from speculators.proposers.base import DraftRequest
from speculators.proposers.suffix import SuffixProposer, SuffixTrie


def test_trie_counts_substrings_and_matches_the_longest_suffix_with_a_continuation():
    trie = SuffixTrie(max_depth=4, max_tokens=100)
    trie.add([1, 2, 3, 1, 2, 4])
    node, length = trie.match([9, 1, 2])
    assert length == 2 and {t: c.count for t, c in node.children.items()} == {3: 1, 4: 1}
    assert trie.match([7, 8]) is None


def test_trie_memory_is_bounded_and_the_oldest_outputs_go_first():
    trie = SuffixTrie(max_depth=3, max_tokens=6)
    trie.add([1, 2, 3])
    trie.add([4, 5, 6])
    trie.add([7, 8, 9])  # 9 tokens > 6: [1, 2, 3] is evicted and leaves no node behind
    assert trie.tokens == 6 and 1 not in trie.root.children
    assert trie.match([4, 5]) is not None


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


def test_merged_trees_keep_every_source_path_and_the_likeliest_nodes():
    from speculators.proposers.continuations import merge_trees
    from speculators.tree import DraftTree

    own = DraftTree([9, 1, 2], [-1, 0, 1], confidence=[1.0, 0.9, 0.5])
    learned = DraftTree([9, 1, 3, 4], [-1, 0, 1, 0], confidence=[1.0, 0.6, 0.8, 0.3])
    merged = merge_trees([own, learned], max_nodes=3)
    # path 1 keeps its higher confidence (0.9); 1->3 (0.72) and 1->2 (0.45) beat 4 (0.3)
    assert merged.token_ids == [9, 1, 3, 2] and merged.parents == [-1, 0, 1, 1]
    assert merged.confidence[1] == 0.9
