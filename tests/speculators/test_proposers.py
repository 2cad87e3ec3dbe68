import pytest

from speculators.lookahead import LookaheadConfig, make_policy
from speculators.proposers.base import DraftRequest
from speculators.proposers.prompt_lookup import NgramIndex, PromptLookupProposer, lookup


def find_continuations(tokens, max_ngram_size, length, max_branches):
    index = NgramIndex(max_ngram_size)
    index.sync(tokens)
    return lookup(index, length, max_branches).paths


def test_longest_ngram_wins_and_recent_matches_come_first():
    tokens = [5, 6, 7, 1, 2, 9, 5, 6, 8, 1, 2]
    assert find_continuations(tokens, 2, 3, 1) == [[9, 5, 6]]
    assert find_continuations(tokens, 1, 2, 3) == [[9, 5]]  # the 1-gram "2" occurs once before
    assert find_continuations([4, 5, 6], 2, 3, 1) == []


def test_several_matches_become_branches():
    tokens = [1, 2, 3, 0, 1, 2, 4, 0, 1, 2]
    assert find_continuations(tokens, 2, 2, 3) == [[4, 0], [3, 0]]
    tree = PromptLookupProposer(num_tokens=2, max_branches=3).propose(
        [DraftRequest("r", tokens, num_speculative_tokens=20, max_nodes=10)])[0]
    assert tree.token_ids == [2, 4, 0, 3, 0] and tree.parents == [-1, 0, 1, 0, 3]
    assert tree.draft_probs is None


def test_prompt_lookup_scores_nodes_by_how_often_and_how_long_they_matched():
    # "1 2" occurred twice before, once followed by 3 and once by 4: each branch gets about half
    tokens = [1, 2, 3, 0, 1, 2, 4, 0, 1, 2]
    tree = PromptLookupProposer(num_tokens=2, max_branches=3).propose(
        [DraftRequest("r", tokens, num_speculative_tokens=20, max_nodes=10)])[0]
    first, second = tree.confidence[1], tree.confidence[3]
    assert first == second and 0.3 < first < 0.5
    assert tree.confidence[2] > first  # the path's own continuation agrees with all its occurrences
    # a single earlier occurrence of a long run is trusted more than of a short one
    short = PromptLookupProposer(max_ngram_size=1).propose([DraftRequest("a", [7, 8, 9, 7], 4, 4)])[0]
    long = PromptLookupProposer(max_ngram_size=3).propose([DraftRequest("b", [6, 7, 8, 9, 5, 6, 7, 8], 4, 4)])[0]
    assert long.confidence[1] > short.confidence[1]


def test_prompt_lookup_stops_a_branch_after_a_node_below_the_confidence_threshold():
    tokens = [1, 2, 3, 0, 1, 2, 4, 0, 1, 2]
    request = DraftRequest("r", tokens, num_speculative_tokens=20, max_nodes=10, confidence_threshold=0.45)
    tree = PromptLookupProposer(num_tokens=2, max_branches=3).propose([request])[0]
    assert tree.token_ids == [2, 4, 3]  # each first token stays, nothing is drafted after it


def test_depth_and_node_budget_are_respected():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    proposer = PromptLookupProposer(num_tokens=10)
    assert proposer.propose([DraftRequest("r", tokens, 3, 10)])[0].token_ids == [2, 3, 4, 5]
    assert proposer.propose([DraftRequest("r", tokens, 10, 2)])[0].token_ids == [2, 3, 4]
    assert proposer.propose([DraftRequest("r", tokens, 0, 10)])[0].num_drafted == 0


def test_prompt_lookup_parameters_are_checked():
    with pytest.raises(ValueError):
        PromptLookupProposer(num_tokens=0)


def test_heuristic_lookahead_grows_and_shrinks():
    policy = make_policy(LookaheadConfig(policy="heuristic", initial_tokens=5, num_speculative_tokens=8))
    assert policy.depth() == 5
    policy.observe(5, 5)
    assert policy.depth() == 7
    policy.observe(7, 7)
    assert policy.depth() == 8  # capped
    policy.observe(8, 2)
    assert policy.depth() == 7
    for _ in range(10):
        policy.observe(policy.depth(), 0)
    assert policy.depth() == 1


def test_fixed_and_confidence_policies():
    fixed = make_policy(LookaheadConfig(policy="fixed", num_speculative_tokens=4))
    fixed.observe(4, 0)
    assert fixed.depth() == 4 and fixed.confidence_threshold == 0
    confident = make_policy(LookaheadConfig())
    assert confident.depth() == 20 and confident.confidence_threshold == 0.4


def test_lookahead_config_names_bad_fields():
    with pytest.raises(ValueError, match="threshold"):
        LookaheadConfig(threshold=1.5)


def test_lookahead_config_accepts_the_names_of_vllm_transformers_and_earlier_releases():
    old = LookaheadConfig(max_tokens=7, threshold=0.2)
    hf = LookaheadConfig(assistant_confidence_threshold=0.2, num_assistant_tokens=3)
    assert old.num_speculative_tokens == 7 and old.confidence_threshold == 0.2
    assert hf.confidence_threshold == 0.2 and hf.initial_tokens == 3
