"""Prompt lookup decoding: continue the text by copying what followed the same n-gram earlier.

`num_tokens` and `max_ngram_size` are transformers' `prompt_lookup_num_tokens` and
`max_matching_ngram_size` (llama-cpp-python's `num_pred_tokens` and `max_ngram_size`). Beyond them,
`max_branches` > 1 turns several earlier matches into the branches of one tree, so the target
checks all of them in the same pass.
"""
from __future__ import annotations

from collections.abc import Sequence

from speculators.proposers.base import DraftRequest, Proposer
from speculators.tree import DraftTree


def find_continuations(
    tokens: Sequence[int], max_ngram_size: int, length: int, max_branches: int
) -> list[list[int]]:
    """Continuations of the longest n-gram suffix that occurs earlier, most recent match first."""
    total = len(tokens)
    for size in range(min(max_ngram_size, total - 1), 0, -1):
        suffix = list(tokens[total - size:])
        found: list[list[int]] = []
        for start in range(total - size - 1, -1, -1):
            if list(tokens[start:start + size]) != suffix:
                continue
            follow = list(tokens[start + size:start + size + length])
            if follow and not any(other[:len(follow)] == follow for other in found):
                found.append(follow)
                if len(found) == max_branches:
                    break
        if found:
            return found
    return []


class PromptLookupProposer(Proposer):
    name = "pld"
    provides_probabilities = False

    def __init__(self, num_tokens: int = 10, max_ngram_size: int = 2, max_branches: int = 1):
        if num_tokens < 1 or max_ngram_size < 1 or max_branches < 1:
            raise ValueError("num_tokens, max_ngram_size and max_branches must be >= 1")
        self.num_tokens, self.max_ngram_size, self.max_branches = num_tokens, max_ngram_size, max_branches

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        trees = []
        for request in requests:
            root = request.token_ids[-1]
            depth = min(self.num_tokens, request.num_speculative_tokens)
            if depth == 0 or request.max_nodes == 0:
                trees.append(DraftTree.root_only(root))
                continue
            paths = find_continuations(request.token_ids, self.max_ngram_size, depth, self.max_branches)
            tree = DraftTree.from_paths(root, paths)
            if tree.num_drafted > request.max_nodes:  # keep the earliest nodes: whole prefixes of paths
                keep = request.max_nodes + 1
                tree = DraftTree(tree.token_ids[:keep], tree.parents[:keep])
            trees.append(tree)
        return trees
