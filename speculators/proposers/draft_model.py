"""Drafting with a smaller model that shares the target's tokenizer.

The draft model keeps its own KV cache through a TreeModel. Each step it first catches up on the
tokens the target committed since last time (reusing the K/V of drafted tokens the target
accepted), then drafts depth by depth, all requests in one batched forward per depth. The tree is
`width` branches from the root: the drafter's top-`width` first tokens (greedy requests) or
`width` first tokens sampled without replacement (sampled requests), each continued by its top or
sampled next token. The confidence rule ends a branch at a token whose draft probability is under
the request's threshold; the token itself stays, so the rule never depends on a sample it drops,
which keeps sampled output lossless.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from speculators.proposers.base import DraftRequest, Proposer, TreeInput, TreeModel
from speculators.sampling import SamplingParams, warp
from speculators.tree import DraftTree, chain_parents

DRAFT_SALT = 1
"""Salts of the drafter's random streams start here (the verifier's is 0). Each step draws from a
stream salted by the request's length, so a drafter restarted mid-request replays the numbers of a
position and never reuses one position's numbers at another."""


@dataclass
class _Branch:
    node: int  # tree index of the branch tip
    logits: torch.Tensor  # the draft's next-token logits after the tip


@dataclass
class _Draft:
    request: DraftRequest
    tree_tokens: list[int]
    tree_parents: list[int]
    probs_rows: list[torch.Tensor | None] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    open_branches: list[_Branch] = field(default_factory=list)
    scratch_of: dict[int, int] = field(default_factory=lambda: {0: -1})
    """Tree node -> its index in the draft model's scratch (TreeInput parents), for the nodes the
    draft has run. The root is already committed in the draft model, which TreeInput calls -1."""
    generator: torch.Generator | None = None
    """This step's random stream (sampled requests)."""

    def run(self, nodes: list[int], scratch_start: int) -> TreeInput:
        """The input that runs `nodes` (children of nodes already run) after `scratch_start` scratch tokens."""
        parents = [self.scratch_of[self.tree_parents[n]] for n in nodes]
        self.scratch_of.update((node, scratch_start + i) for i, node in enumerate(nodes))
        return TreeInput(self.request.request_id, [self.tree_tokens[n] for n in nodes], parents, logits="all")


class DraftModelProposer(Proposer):
    name = "draft"
    provides_probabilities = True
    runs_a_model = True

    def __init__(self, model: TreeModel, width: int = 1):
        if width < 1:
            raise ValueError("width must be >= 1")
        self.model, self.width = model, width
        self._last_drafts: dict[str, tuple[DraftTree, dict[int, int]]] = {}
        """request id -> its last tree and that tree's scratch_of, to keep the accepted path's K/V."""

    def _catch_up(self, requests: Sequence[DraftRequest]) -> list[torch.Tensor]:
        """Feed each request's not-yet-seen committed tokens; return the logits after its root."""
        inputs = []
        for request in requests:
            if not self.model.has(request.request_id):
                self.model.add(request.request_id)
            seen = self.model.committed_length(request.request_id)
            fresh = list(request.token_ids[seen:])
            inputs.append(TreeInput(request.request_id, fresh, chain_parents(len(fresh)), logits="last"))
        logits = self.model.forward(inputs)
        for item in inputs:
            self.model.commit(item.seq_id, range(len(item.token_ids)))
        return [row[-1] for row in logits]

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        if not requests:
            return []
        root_logits = self._catch_up(requests)
        drafts = []
        for request, logits in zip(requests, root_logits):
            sampling = request.sampling
            generator = None if sampling.greedy else sampling.generator(DRAFT_SALT + len(request.token_ids))
            draft = _Draft(request, [request.token_ids[-1]], [-1], [None], [1.0], generator=generator)
            if request.num_speculative_tokens > 0 and request.max_nodes > 0:
                draft.open_branches = [_Branch(0, logits)]
            drafts.append(draft)
        depth = 0
        while any(d.open_branches for d in drafts):
            depth += 1
            inputs = []
            for draft in drafts:
                new_nodes = self._grow(draft, depth)
                if new_nodes:
                    inputs.append((draft, new_nodes))
            if not inputs:
                break
            extend = [(d, nodes) for d, nodes in inputs if d.open_branches]
            logits = self.model.forward([
                d.run(nodes, self.model.scratch_size(d.request.request_id)) for d, nodes in extend
            ])
            for (draft, nodes), rows in zip(extend, logits):
                tips = {branch.node for branch in draft.open_branches}
                draft.open_branches = [_Branch(n, rows[i]) for i, n in enumerate(nodes) if n in tips]
        trees = [self._tree(d) for d in drafts]
        for draft, tree in zip(drafts, trees):
            self._last_drafts[draft.request.request_id] = (tree, draft.scratch_of)
        return trees

    def _grow(self, draft: _Draft, depth: int) -> list[int]:
        """Add the next token of every open branch (the root opens `width` branches)."""
        request = draft.request
        generator = draft.generator
        new_nodes, still_open = [], []
        for branch in draft.open_branches:
            room = request.max_nodes - (len(draft.tree_tokens) - 1)
            count = min(self.width if branch.node == 0 else 1, room)
            if count <= 0:
                break
            raw = branch.logits.float().softmax(-1)
            q = None if request.sampling.greedy else warp(branch.logits, request.sampling)
            if q is None:
                tokens = torch.topk(raw, count).indices.tolist()
            else:
                count = min(count, int((q > 0).sum()))
                tokens = torch.multinomial(q, count, replacement=False, generator=generator).tolist()
            for token in tokens:
                node = len(draft.tree_tokens)
                draft.tree_tokens.append(token)
                draft.tree_parents.append(branch.node)
                draft.probs_rows.append(q)
                own = float(raw[token] if q is None else q[token])
                draft.confidence.append(own)
                new_nodes.append(node)
                if own >= request.confidence_threshold and depth < request.num_speculative_tokens:
                    still_open.append(_Branch(node, branch.logits))
        draft.open_branches = still_open
        return new_nodes

    @staticmethod
    def _tree(draft: _Draft) -> DraftTree:
        probs = None
        if not draft.request.sampling.greedy and len(draft.tree_tokens) > 1:
            probs = torch.stack([torch.zeros_like(draft.probs_rows[1]), *draft.probs_rows[1:]])
        return DraftTree(draft.tree_tokens, draft.tree_parents, probs, draft.confidence)

    def on_accept(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Keep the drafted K/V on the accepted path; the rest of the draft's scratch is dropped."""
        if not self.model.has(request_id):
            return
        seen = self.model.committed_length(request_id)
        if len(token_ids) <= seen:
            self.model.truncate(request_id, len(token_ids))
            return
        # the target's new tokens past the root, minus the last (the bonus / recovered token,
        # which the draft has not run yet)
        accepted = list(token_ids[seen:])[:-1]
        self.model.commit(request_id, self._scratch_path(request_id, accepted))

    def _scratch_path(self, request_id: str, accepted: list[int]) -> list[int]:
        """Scratch indices of the accepted drafted tokens that the draft has run (the deepest layer
        of a tree is never run)."""
        tree, scratch_of = self._last_drafts.get(request_id, (None, {}))
        if tree is None:
            return []
        path, node = [], 0
        for token in accepted:
            match = next((k for k in tree.children[node] if tree.token_ids[k] == token), None)
            if match is None or match not in scratch_of:
                break
            path.append(scratch_of[match])
            node = match
        return path

    def release(self, request_id: str) -> None:
        if self.model.has(request_id):
            self.model.remove(request_id)
        self._last_drafts.pop(request_id, None)
