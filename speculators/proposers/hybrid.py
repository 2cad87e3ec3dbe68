"""Suffix decoding where the text repeats, a trained head everywhere else (Arctic Inference's hybrid).

Suffix decoding drafts long runs at no cost where the output repeats the prompt or earlier outputs
(summaries, retrieval answers, code edits), and nothing useful where it does not; a head drafts a
few tokens anywhere, at the cost of running a network. Per request and step the suffix tree is
used when its expected accepted length (the sum of its nodes' path probabilities, as estimated from
its counts) reaches `min_suffix_score`; otherwise the head's tree. The choice depends on the
context alone, never on what the head drafted or sampled, so sampled output stays lossless.

The head runs only for the requests suffix decoding leaves to it: the hidden states of steps the
suffix tree won wait here and reach the head with its next draft for that request, as one longer
catch-up. A call costs a fixed part besides its rows, so a step that suffix decoding serves alone
costs no head call at all (on translation the hybrid kept pace with suffix decoding's tokens a pass
but paid for head calls that drafted nothing; figures: docs/benchmarks.md,
"Measurements behind the code").
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

from speculators.hidden import PendingHidden
from speculators.proposers.base import DraftRequest, Proposer
from speculators.proposers.suffix import SuffixProposer
from speculators.tree import DraftTree

MIN_SUFFIX_SCORE = 1.0
"""Expected accepted tokens of a suffix tree at which it wins over the head's."""


def expected_accepted(tree: DraftTree) -> float:
    """Sum over drafted nodes of the product of confidences from the root: the expected accepted
    length when confidences are acceptance probabilities and siblings exclude each other."""
    path = [1.0] * tree.size
    for node in range(1, tree.size):
        path[node] = path[tree.parents[node]] * tree.confidence[node]
    return sum(path[1:])


class HybridProposer(Proposer):
    provides_probabilities = True
    runs_a_model = False
    """Not a depth-sized drafter: a depth chosen for the head would cut suffix decoding's long runs.
    The head's branches end at the confidence threshold, and the planner trims what does not pay."""

    def __init__(self, suffix: SuffixProposer, head: Proposer, min_suffix_score: float = MIN_SUFFIX_SCORE):
        self.suffix, self.head, self.min_suffix_score = suffix, head, min_suffix_score
        self.name = f"suffix+{head.name}"
        self.hidden_layers, self.hidden_dtype = head.hidden_layers, head.hidden_dtype
        self._waiting = PendingHidden()

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        trees = self.suffix.propose(requests)
        for_head = []
        for index, (request, tree) in enumerate(zip(requests, trees)):
            if request.hidden is not None:
                self._waiting.add(request.request_id, request.hidden.start, request.hidden.states)
            if expected_accepted(tree) < self.min_suffix_score:
                for_head.append(index)
        if for_head:
            head_trees = self.head.propose([
                replace(requests[i], hidden=self._waiting.take(requests[i].request_id)) for i in for_head
            ])
            for index, tree in zip(for_head, head_trees):
                trees[index] = tree
        return trees

    def on_accept(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.suffix.on_accept(request_id, token_ids)
        self.head.on_accept(request_id, token_ids)

    def release(self, request_id: str) -> None:
        self.suffix.release(request_id)
        self.head.release(request_id)
        self._waiting.take(request_id)

    def learn(self, output_ids: Sequence[int], scope: str | None = "") -> None:
        self.suffix.learn(output_ids, scope)
        self.head.learn(output_ids, scope)

    def learn_steps(self, output_ids: Sequence[int], scope: str | None = "") -> Iterator[None]:
        yield from self.suffix.learn_steps(output_ids, scope)
        yield from self.head.learn_steps(output_ids, scope)
