"""EAGLE and Medusa proposers on their own: tree shapes, confidences, the hidden rows they need,
rollback, and the distributions sampled drafts carry."""
from __future__ import annotations

import pytest
import torch

from speculators.hidden import TargetHidden
from speculators.proposers.base import DraftRequest
from speculators.proposers.eagle import EagleProposer
from speculators.proposers.medusa import MedusaProposer
from speculators.proposers.static_tree import StaticTree
from speculators.sampling import SamplingParams
from tests.speculators.heads_fixtures import HIDDEN, LAYERS, VOCAB, random_eagle3, random_medusa

TOKENS = [5, 9, 13, 2, 7, 7, 30, 41, 3, 12]


def rows(start, end, width=3 * HIDDEN, seed=0):
    return TargetHidden(start, torch.randn(end - start, width, generator=torch.Generator().manual_seed(seed),
                                           dtype=torch.float64))


def eagle(width=1, seed=1):
    head = random_eagle3(seed, own_embedding=True)
    return EagleProposer(head, width), head


def check_tree(tree, max_nodes):
    assert tree.num_drafted <= max_nodes
    for node in range(1, tree.size):
        siblings = [tree.token_ids[k] for k in tree.children[tree.parents[node]]]
        assert len(siblings) == len(set(siblings))
        assert 0 < tree.confidence[node] <= 1


def test_a_chain_stops_at_its_depth_and_at_the_first_unsure_token():
    proposer, _ = eagle()
    deep = proposer.propose([DraftRequest("a", TOKENS, 5, 32, hidden=rows(0, len(TOKENS) - 1))])[0]
    assert deep.parents == [-1, 0, 1, 2, 3, 4]
    threshold = sorted(deep.confidence[1:])[2]  # the third most confident drafted token's probability
    proposer, _ = eagle()
    cut = proposer.propose([DraftRequest("a", TOKENS, 5, 32, confidence_threshold=threshold,
                                         hidden=rows(0, len(TOKENS) - 1))])[0]
    first_unsure = next(i for i, c in enumerate(deep.confidence[1:], start=1) if c < threshold)
    assert cut.token_ids == deep.token_ids[: first_unsure + 1]  # the unsure token stays, its children go


def test_the_dynamic_tree_keeps_the_likeliest_nodes():
    proposer, _ = eagle(width=3)
    tree = proposer.propose([DraftRequest("a", TOKENS, 4, 10, hidden=rows(0, len(TOKENS) - 1))])[0]
    check_tree(tree, 10)
    assert tree.num_drafted == 10 and len(tree.children[0]) == 3 and tree.max_depth >= 2
    values = [1.0]
    for node in range(1, tree.size):
        values.append(values[tree.parents[node]] * tree.confidence[node])
    # every node kept is at least as likely as every leaf left out of a full expansion
    full, _ = eagle(width=3)
    every = full.propose([DraftRequest("a", TOKENS, 4, 1000, hidden=rows(0, len(TOKENS) - 1))])[0]
    every_values = [1.0]
    for node in range(1, every.size):
        every_values.append(every_values[every.parents[node]] * every.confidence[node])
    assert min(values[1:]) >= sorted(every_values[1:], reverse=True)[9] - 1e-12


def test_no_draft_until_the_rows_reach_the_root_and_a_gap_starts_over():
    proposer, _ = eagle()
    short = proposer.propose([DraftRequest("a", TOKENS, 3, 8, hidden=rows(0, 5))])[0]
    assert short.num_drafted == 0  # rows 0..4 only: the root's row (8) is missing
    assert proposer.propose([DraftRequest("a", TOKENS, 3, 8, hidden=rows(5, 9))])[0].num_drafted == 3
    later = TOKENS + [4, 4, 4]
    fresh = proposer.propose([DraftRequest("a", later, 3, 8, hidden=rows(11, 12))])[0]  # rows 9, 10 lost
    assert fresh.num_drafted == 3  # drafts from the rows it has
    assert proposer._committed["a"].first == 11


def test_rows_past_a_shorter_sequence_are_dropped():
    proposer, _ = eagle()
    proposer.propose([DraftRequest("a", TOKENS, 3, 8, hidden=rows(0, 9))])
    proposer.on_accept("a", TOKENS[:6])
    assert proposer._committed["a"].end == 5
    assert proposer.propose([DraftRequest("a", TOKENS[:6], 3, 8)])[0].num_drafted == 0
    proposer.release("a")
    assert "a" not in proposer._committed


@pytest.mark.parametrize("width", [1, 3])
def test_sampled_drafts_carry_distributions_over_the_target_vocabulary(width):
    proposer, head = eagle(width)
    sampling = SamplingParams(temperature=0.8, top_k=20, seed=3, rule="rejection")
    tree = proposer.propose([DraftRequest("a", TOKENS, 4, 12, sampling=sampling, hidden=rows(0, 9))])[0]
    check_tree(tree, 12)
    assert tree.draft_probs.shape == (tree.size, VOCAB)
    outside = ~head.t2d
    for node in range(1, tree.size):
        q = tree.draft_probs[node]
        assert q.sum().item() == pytest.approx(1.0, abs=1e-5) and q[outside].sum() == 0
        assert (q > 0).sum() <= 20 and q[tree.token_ids[node]] == pytest.approx(tree.confidence[node])
    assert len(tree.children[0]) == width


def test_medusa_choices_compile_to_a_tree():
    tree = StaticTree.from_choices([[1], [0], [0, 0], [0, 1], [0, 0, 0]])
    assert tree.parents == (-1, 0, 0, 1, 1, 3) and tree.ranks == (0, 0, 1, 0, 1, 0)
    with pytest.raises(ValueError, match="no parent"):
        StaticTree.from_choices([[0], [1, 0]])


def test_medusa_drafts_ranked_tokens_from_the_last_row():
    heads = random_medusa()
    proposer = MedusaProposer(heads, LAYERS, [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert proposer.hidden_layers == (LAYERS,)
    assert proposer.propose([DraftRequest("a", TOKENS, 3, 8, hidden=rows(0, 7, HIDDEN))])[0].num_drafted == 0
    last = rows(0, 9, HIDDEN)
    tree = proposer.propose([DraftRequest("a", TOKENS, 3, 8, hidden=TargetHidden(7, last.states[7:]))])[0]
    logits = heads(last.states[-1:])[:, 0]
    ranked = heads.token_map[logits.topk(2, dim=-1).indices]  # [head, rank] -> target token
    assert tree.token_ids[1:] == [int(ranked[0, 0]), int(ranked[0, 1]), int(ranked[1, 0]), int(ranked[1, 1]),
                                  int(ranked[1, 0]), int(ranked[2, 0])]
    assert tree.parents == [-1, 0, 0, 1, 1, 2, 3]
    check_tree(tree, 8)
    assert proposer.propose([DraftRequest("a", TOKENS, 1, 8)])[0].num_drafted == 2  # depth bounds the tree


def test_medusa_sampled_children_are_drawn_without_replacement_from_their_head():
    heads = random_medusa()
    proposer = MedusaProposer(heads, LAYERS, [[0], [1], [2], [0, 0], [0, 1]])
    sampling = SamplingParams(temperature=1.0, seed=5, rule="rejection")
    tree = proposer.propose([DraftRequest("a", TOKENS, 3, 8, sampling=sampling, hidden=rows(0, 9, HIDDEN))])[0]
    assert len(tree.children[0]) == 3 and tree.draft_probs.shape == (tree.size, VOCAB)
    assert torch.equal(tree.draft_probs[1], tree.draft_probs[2])  # siblings share their head's distribution
    assert not torch.equal(tree.draft_probs[1], tree.draft_probs[4])  # depth 2 reads the next head
    check_tree(tree, 8)
