"""Drafting with a smaller model that shares the target's tokenizer.

The draft model keeps its own KV cache through a TreeModel. Each step it first catches up on the
tokens the target committed since last time (reusing the K/V of drafted tokens the target
accepted), then drafts depth by depth, all requests in one batched forward per depth. The tree is
`width` branches from the root: the drafter's top-`width` first tokens (greedy requests) or
`width` first tokens sampled without replacement (sampled requests), each continued by its top or
sampled next token. The confidence rule ends a branch at a token whose draft probability is under
the request's threshold; the token itself stays, so the rule never depends on a sample it drops,
which keeps sampled output lossless.

On a GPU the draft's logits stay on the device: every branch's next tokens and their draft
probabilities are chosen there, and one transfer per depth (for the whole batch) brings the chosen
token ids to the host, which needs them to lay out the next depth's tree. The tree's draft
probabilities cross to the CPU once, when the tree is handed back (it goes to another actor).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from speculators.penalties import PenaltyContext, penalize
from speculators.proposers.base import DraftRequest, Proposer, TreeInput, TreeModel
from speculators.sampling import DraftNoise, tree_draft_probs, warp
from speculators.tree import DraftTree, chain_parents


@dataclass
class _Branch:
    node: int  # tree index of the branch tip
    logits: torch.Tensor  # the draft's next-token logits after the tip


@dataclass
class _Choice:
    """The next tokens of one branch, chosen on the logits' device (no host sync yet)."""

    branch: _Branch
    tokens: torch.Tensor  # [count] token ids
    confidence: torch.Tensor  # [count] the draft's probability of each (q when sampled, else softmax)
    q: torch.Tensor | None  # the warped distribution they were sampled from (sampled requests)


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
    noise: DraftNoise | None = None
    """This step's random draws (sampled requests)."""

    def penalized(self, branch: _Branch) -> torch.Tensor:
        """The branch's next-token logits under the request's penalties, counting the drafted tokens on
        its path as the target will when it verifies the node."""
        penalties = self.request.penalties
        if penalties is None or not penalties.active:
            return branch.logits
        path, node = [], branch.node
        while node > 0:
            path.append(self.tree_tokens[node])
            node = self.tree_parents[node]
        context = PenaltyContext(penalties, self.request.token_ids, self.request.prompt_length)
        return penalize(branch.logits.unsqueeze(0), context, [path[::-1]])[0]

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
        self._recent: dict[str, None] = {}
        """Requests with a sequence in the draft's cache, least recently drafted first."""

    def _fit(self, requests: Sequence[DraftRequest]) -> list[DraftRequest]:
        """The requests whose catch-up and whole tree fit in the draft's KV cache now.

        The draft's cache is only a cache (the worker keeps every request's tokens): room is made by
        dropping the sequences of requests not in this call, least recently drafted first, which
        catch up again when they return (from the prefix cache where it still holds their blocks).
        A request that still does not fit drafts nothing this step instead of failing the call.
        """
        calling = {request.request_id for request in requests}
        fitting, needed = [], 0
        for request in requests:
            request_id = request.request_id
            if not self.model.has(request_id):
                self.model.add(request_id, request.cache_scope)
                self.model.reuse_prefix(request_id, request.token_ids[:-1])  # the root is always fed
            elif self.model.committed_length(request_id) >= len(request.token_ids):
                # back without a new token (the target did not verify it last step): feed the root again
                self.model.truncate(request_id, len(request.token_ids) - 1)
            self._recent.pop(request_id, None)
            self._recent[request_id] = None
            fresh = len(request.token_ids) - self.model.committed_length(request_id)
            need = self.model.blocks_to_grow(request_id, fresh + request.max_nodes)
            while needed + need > self.model.available_blocks:
                idle = next((other for other in self._recent if other not in calling), None)
                if idle is None:
                    break
                self.release(idle)
            if needed + need <= self.model.available_blocks:
                fitting.append(request)
                needed += need
        return fitting

    def _catch_up(self, requests: Sequence[DraftRequest]) -> list[torch.Tensor]:
        """Feed each request's not-yet-seen committed tokens; return the logits after its root."""
        inputs = []
        for request in requests:
            seen = self.model.committed_length(request.request_id)
            fresh = list(request.token_ids[seen:])
            inputs.append(TreeInput(request.request_id, fresh, chain_parents(len(fresh)), logits="last"))
        logits = self.model.forward(inputs)
        for item in inputs:
            self.model.commit(item.seq_id, range(len(item.token_ids)))
        return [row[-1] for row in logits]

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        fitting = self._fit(requests)
        drafted = dict(zip([r.request_id for r in fitting], self._draft(fitting)))
        return [drafted[r.request_id] if r.request_id in drafted else DraftTree.root_only(r.token_ids[-1])
                for r in requests]

    def _draft(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        if not requests:
            return []
        root_logits = self._catch_up(requests)
        drafts = []
        for request, logits in zip(requests, root_logits):
            noise = DraftNoise(request.sampling, len(request.token_ids), logits.device)
            draft = _Draft(request=request, tree_tokens=[request.token_ids[-1]], tree_parents=[-1], probs_rows=[None],
                           confidence=[1.0], noise=noise)
            if request.num_speculative_tokens > 0 and request.max_nodes > 0:
                draft.open_branches = [_Branch(0, logits)]
            drafts.append(draft)
        depth = 0
        while any(d.open_branches for d in drafts):
            depth += 1
            choices = [self._choose(draft, depth) for draft in drafts]
            chosen = _to_host([c for per_draft in choices for c in per_draft])
            inputs = []
            for draft, per_draft in zip(drafts, choices):
                new_nodes = self._grow(draft, depth, [next(chosen) for _ in per_draft])
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

    def _choose(self, draft: _Draft, depth: int) -> list[_Choice]:
        """The next tokens (at tree depth `depth`) of every open branch, on the logits' device (the
        root opens `width` branches): the draft's top tokens (greedy requests) or tokens sampled
        without replacement."""
        request = draft.request
        choices, room = [], request.max_nodes - (len(draft.tree_tokens) - 1)
        for branch in draft.open_branches:
            count = min(self.width if branch.node == 0 else 1, room)
            if count <= 0:
                break
            room -= count
            if request.sampling.greedy:
                confidence, tokens = torch.topk(draft.penalized(branch).float().softmax(-1), count)
                choices.append(_Choice(branch=branch, tokens=tokens, confidence=confidence, q=None))
                continue
            q = warp(draft.penalized(branch), request.sampling)
            tokens = draft.noise.draw(q, count, depth)
            choices.append(_Choice(branch=branch, tokens=tokens, confidence=q[tokens], q=q))
        return choices

    def _grow(self, draft: _Draft, depth: int, chosen: list[tuple[_Choice, list[int], list[float]]]) -> list[int]:
        """Add the chosen tokens to the tree; a branch stays open while its tip is confident enough."""
        request = draft.request
        new_nodes, still_open = [], []
        for choice, tokens, confidences in chosen:
            for token, own in zip(tokens, confidences):
                if choice.q is not None and own <= 0:
                    continue  # drawn past the end of q's support: fewer tokens than asked exist
                node = len(draft.tree_tokens)
                draft.tree_tokens.append(token)
                draft.tree_parents.append(choice.branch.node)
                draft.probs_rows.append(choice.q)
                draft.confidence.append(own)
                new_nodes.append(node)
                if own >= request.confidence_threshold and depth < request.num_speculative_tokens:
                    still_open.append(_Branch(node, choice.branch.logits))
        draft.open_branches = still_open
        return new_nodes

    @staticmethod
    def _tree(draft: _Draft) -> DraftTree:
        probs = None
        if draft.request.sampling.rejection and len(draft.tree_tokens) > 1:
            probs = tree_draft_probs(draft.probs_rows[1:])
        return DraftTree(token_ids=draft.tree_tokens, parents=draft.tree_parents, draft_probs=probs, confidence=draft.confidence)

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
        self._recent.pop(request_id, None)


def _to_host(choices: list[_Choice]):
    """Each choice with its token ids and confidences as Python lists, in one device-to-host transfer."""
    if not choices:
        return iter(())
    packed = torch.cat([torch.stack([c.tokens.double(), c.confidence.double()]) for c in choices], dim=1).tolist()
    tokens, confidences = [int(t) for t in packed[0]], packed[1]
    offset, out = 0, []
    for choice in choices:
        count = len(choice.tokens)
        out.append((choice, tokens[offset: offset + count], confidences[offset: offset + count]))
        offset += count
    return iter(out)
