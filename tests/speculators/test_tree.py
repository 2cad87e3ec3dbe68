import pytest
import torch

from speculators.tree import DraftTree, ancestor_mask, chain_parents, node_depths


def test_hand_built_tree_masks_depths_and_paths():
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    tree = DraftTree([10, 11, 12, 13, 14, 15], [-1, 0, 0, 1, 1, 2])
    assert tree.depths == [0, 1, 1, 2, 2, 2]
    assert tree.children == [[1, 2], [3, 4], [5], [], [], []]
    assert tree.paths == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree.mask, expected)


def test_chain_is_a_causal_tree():
    tree = DraftTree.chain(1, [2, 3, 4])
    assert tree.parents == [-1, 0, 1, 2]
    assert torch.equal(tree.mask, torch.ones(4, 4, dtype=torch.bool).tril())
    assert tree.paths == [[0, 1, 2, 3]]
    assert chain_parents(3, first_parent=4) == [4, 5, 6]


def test_from_paths_merges_common_prefixes():
    tree = DraftTree.from_paths(7, [[1, 2, 3], [1, 2, 4], [5]])
    assert tree.token_ids == [7, 1, 2, 3, 4, 5]
    assert tree.parents == [-1, 0, 1, 2, 2, 0]
    assert tree.num_drafted == 5 and tree.max_depth == 3


def test_forest_helpers_handle_several_roots():
    assert node_depths([-1, 0, -1, 2]) == [0, 1, 0, 1]
    mask = ancestor_mask([-1, 0, -1, 2])
    assert not mask[3, 0] and mask[3, 2] and mask[1, 0]


@pytest.mark.parametrize("tokens,parents", [([1, 2], [0, 0]), ([1, 2, 3], [-1, 2, 0]), ([1, 2], [-1]), ([], [])])
def test_malformed_trees_are_refused(tokens, parents):
    with pytest.raises(ValueError):
        DraftTree(tokens, parents)
