"""The engine's side of what a request asks beyond its sampling warp: penalties, a grammar, logprobs.

Every step, before verification, a request with a grammar has its drafted tree pruned of tokens the
grammar rules out (the target would reject them: its distribution is masked there), and the step's
`Shaping` is built for the target: the penalties with the committed tokens they count, the tokens
the grammar allows after every node of the (pruned) tree, and the logprobs wanted. The grammar
matcher holds exactly the committed output: exploring a tree walks it down each path and rolls it
back, and only tokens the target committed are accepted for good, so rejected drafts never stay in it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from cluster.engine.request import GenerationRequest
from speculators.penalties import PenaltyContext
from speculators.shaping import Shaping
from speculators.tree import DraftTree

if TYPE_CHECKING:  # the grammar engine is imported only where grammars are compiled (the service)
    from cluster.engine.grammar import GrammarMatcher


class RequestRules:
    def __init__(self, request: GenerationRequest):
        self.request = request
        self.matcher: GrammarMatcher | None = None if request.grammar is None else request.grammar.matcher()
        self.penalties = request.penalties if request.penalties is not None and request.penalties.active else None

    @classmethod
    def of(cls, request: GenerationRequest) -> RequestRules | None:
        """The request's rules, or None when it asks for nothing beyond its warp (the fast path)."""
        rules = cls(request)
        if rules.matcher is None and rules.penalties is None and request.logprobs is None:
            return None
        return rules

    def prune(self, tree: DraftTree) -> tuple[DraftTree, int]:
        """`tree` without the drafted tokens the grammar rules out, and how many it lost.

        A deterministic tree loses each such node with its subtree. A sampled tree keeps the node and
        loses only its subtree: its later siblings were drawn without replacement after it, so the
        verifier must still meet it (and rejects it, since the masked target gives it no mass).
        """
        if self.matcher is None or tree.size == 1:
            return tree, 0
        allowed = self._walk(tree, lambda node: None)
        keep, kept = [0], {0}
        for node in range(1, tree.size):
            parent = tree.parents[node]
            if parent in kept and allowed[parent] and (allowed[node] or tree.draft_probs is not None):
                keep.append(node)
                kept.add(node)
        if len(keep) == tree.size:
            return tree, 0
        index = {node: i for i, node in enumerate(keep)}
        pruned = DraftTree(
            token_ids=[tree.token_ids[n] for n in keep], parents=[-1] + [index[tree.parents[n]] for n in keep[1:]],
            draft_probs=None if tree.draft_probs is None else tree.draft_probs[keep],
            confidence=None if tree.confidence is None else [tree.confidence[n] for n in keep])
        return pruned, tree.size - len(keep)

    def shaping(self, tree: DraftTree, tokens: list[int]) -> Shaping:
        """What the target applies to its logits at every node of `tree` this step."""
        penalties = None
        if self.penalties is not None:
            penalties = PenaltyContext(self.penalties, list(tokens), len(self.request.prompt_ids))
        allowed = None
        if self.matcher is not None:
            allowed = torch.full((tree.size, self.matcher.words), -1, dtype=torch.int32)  # a ruled-out node: any
            self._walk(tree, lambda node: self.matcher.fill(allowed, node))
        return Shaping(penalties, allowed, self.request.logprobs)

    def _walk(self, tree: DraftTree, visit: Callable[[int], None]) -> list[bool]:
        """Walk the matcher down every path of `tree` (depth first, rolling back on the way up),
        calling `visit(node)` where it stands after each node the grammar allows (but a stop token);
        return, per node, whether the grammar allows its token after its parent's path."""
        allowed = [True] + [False] * (tree.size - 1)

        def descend(node: int) -> None:
            if self.matcher.terminated:  # it took a stop token: the request ends there, nothing follows
                return
            visit(node)
            for kid in tree.children[node]:
                if self.matcher.accept(tree.token_ids[kid]):
                    allowed[kid] = True
                    descend(kid)
                    self.matcher.rollback(1)

        descend(0)
        return allowed

    def commit(self, tokens: list[int]) -> None:
        """The target committed `tokens`: the matcher takes them for good."""
        if self.matcher is None:
            return
        for token in tokens:
            if not self.matcher.accept(token):
                raise RuntimeError(f"committed token {token} breaks the grammar")
