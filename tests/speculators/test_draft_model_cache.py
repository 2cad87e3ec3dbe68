"""The draft model's KV cache under pressure: it shares prompt prefixes, drops idle requests' sequences
to make room, and drafts nothing for a request that still does not fit instead of failing the call."""
from __future__ import annotations

from actors.model.runner import ModelRunner
from speculators.proposers.base import DraftRequest
from speculators.proposers.draft_model import DraftModelProposer

BLOCK = 4
SMALL_CACHE = 12
"""Blocks: 48 positions, enough for one 30-token request and its tree, not for two."""


def _proposer(model, blocks: int | None = SMALL_CACHE) -> DraftModelProposer:
    return DraftModelProposer(ModelRunner(model, 4, 64, kv_blocks=blocks, block_size=BLOCK, prefix_caching=True),
                              width=2)


def _request(name: str, tokens: list[int], scope: str | None = "") -> DraftRequest:
    return DraftRequest(name, tokens, 3, 6, cache_scope=scope)


def _same_tree(a, b) -> bool:
    return a.token_ids == b.token_ids and a.parents == b.parents


A = [(7 * i) % 60 + 1 for i in range(30)]
B = [(11 * i) % 60 + 2 for i in range(30)]


def test_an_idle_request_makes_room_and_drafts_the_same_tree_when_it_returns(tiny_model):
    model, _ = tiny_model
    small, roomy = _proposer(model), _proposer(model, blocks=None)
    expected = {name: roomy.propose([_request(name, tokens)])[0] for name, tokens in (("a", A), ("b", B))}
    first = small.propose([_request("a", A)])[0]
    second = small.propose([_request("b", B)])[0]  # "a" holds most of the cache and is not drafting
    assert not small.model.has("a")
    again = small.propose([_request("a", A)])[0]
    assert _same_tree(first, expected["a"]) and _same_tree(second, expected["b"]) and _same_tree(again, expected["a"])
    assert again.num_drafted > 0


def test_a_request_that_does_not_fit_drafts_nothing_this_step_and_the_others_draft(tiny_model):
    model, _ = tiny_model
    small = _proposer(model)
    trees = small.propose([_request("a", A), _request("b", B)])
    assert trees[0].num_drafted > 0
    assert trees[1].token_ids == [B[-1]] and trees[1].parents == [-1]


def test_requests_of_one_scope_share_the_draft_cache_for_a_common_prefix(tiny_model):
    model, _ = tiny_model
    shared = A[:24]
    first, second = shared + [5, 6, 7, 8], shared + [9, 10, 11, 12]
    roomy = _proposer(model, blocks=None)
    expected = roomy.propose([_request("a", first, None), _request("b", second, None)])
    for scope, fits_both in (("tenant", True), (None, False)):
        small = _proposer(model)
        trees = [small.propose([_request("a", first, scope)])[0], small.propose([_request("b", second, scope)])[0]]
        assert all(_same_tree(x, y) for x, y in zip(trees, expected))
        assert small.model.has("a") is fits_both  # else "a" was dropped to make room for "b"


def test_a_request_asked_again_without_a_new_token_drafts_the_same_tree(tiny_model):
    """A request the target did not verify last step (a full pass, a preemption) comes back with the
    same tokens: its root is fed again, where the draft used to find no new token to feed and fail
    the whole call (every request of it then decoded without speculation)."""
    model, _ = tiny_model
    proposer = _proposer(model, blocks=None)
    first = proposer.propose([_request("a", A), _request("b", B)])
    proposer.on_accept("a", A)  # verified nothing new
    again = proposer.propose([_request("a", A), _request("b", B + [3])])
    assert _same_tree(again[0], first[0]) and again[0].num_drafted > 0
