"""Drafting with an EAGLE head (EAGLE-3, or an EAGLE-1/2 checkpoint): chains and dynamic trees.

Per request the proposer keeps the head's K/V for committed tokens only: each propose call first
runs the target's hidden states that came with it (`DraftRequest.hidden`, the tokens committed
since the last call), so drafted rows never need rolling back: they live in a scratch area for
the length of one call. Rows whose hidden states never arrived (a drafter restart, a lost call)
leave a gap; the head then starts over from the next rows it gets, and drafts nothing until its
rows reach the request's root.

Shapes, all requests of a call batched per depth:
- `width` 1: a chain, each token the head's most likely one (greedy requests) or a sample of its
  distribution (sampled requests).
- `width` k > 1, greedy requests: EAGLE-2's dynamic tree. At each depth the k nodes with the highest
  path probability (the product of the head's probabilities from the root) are expanded with their
  k most likely tokens; at the end the `max_nodes` best nodes of all drafted are kept (a node's path
  probability never exceeds its parent's, so the kept set is a tree).
- `width` k > 1, sampled requests: k distinct samples at the root, each continued by one sample per
  depth. Every sampled tree is verified whole with the distributions it was drawn from (mapped from
  the draft vocabulary to the target's: tokens outside it have probability 0), which keeps sampled
  output lossless; re-ranking by sampled values would not.
Every node carries the head's own probability of it as its confidence; the confidence rule ends a
branch at a token below the request's threshold (the token stays).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from speculators.heads.eagle import EagleHead, attend
from speculators.hidden import CommittedRows
from speculators.proposers.base import DraftRequest, Proposer
from speculators.sampling import DraftNoise, mapped_warp, tree_draft_probs
from speculators.tree import DraftTree


@dataclass
class _Committed:
    """The head's K/V of one request's committed rows: positions first .. end - 1."""

    first: int = 0
    keys: torch.Tensor | None = None  # [1, kv_heads, rows, d]
    values: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None  # head output of the last row
    last_logits: torch.Tensor | None = None  # its draft-vocabulary logits

    @property
    def end(self) -> int:
        return self.first + (0 if self.keys is None else self.keys.shape[2])

    def cut(self, end: int) -> None:
        """Keep positions before `end` (all of them: nothing to do); the last row's outputs go."""
        if end >= self.end:
            return
        if end <= self.first:
            self.keys = self.values = None
        else:
            self.keys, self.values = self.keys[:, :, : end - self.first], self.values[:, :, : end - self.first]
        self.last_hidden = self.last_logits = None


@dataclass
class _Node:
    token: int
    parent: int
    depth: int
    value: float  # path probability
    own: float  # the head's probability of this token
    q: torch.Tensor | None = None  # sampled: the distribution it was drawn from


@dataclass
class _Draft:
    request: DraftRequest
    root_position: int
    nodes: list[_Node]
    frontier: list[int] = field(default_factory=list)
    out: dict[int, torch.Tensor] = field(default_factory=dict)  # node -> head output of its row
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # node -> logits after it
    scratch_nodes: list[int] = field(default_factory=list)
    scratch_keys: list[torch.Tensor] = field(default_factory=list)
    scratch_values: list[torch.Tensor] = field(default_factory=list)
    noise: DraftNoise | None = None
    """This step's random draws (sampled requests)."""

    @property
    def sampled(self) -> bool:
        return not self.request.sampling.greedy

    def room(self) -> int:
        return self.request.max_nodes - (len(self.nodes) - 1)

    def ancestors(self, node: int) -> set[int]:
        found = set()
        while node > 0:
            found.add(node)
            node = self.nodes[node].parent
        return found


class EagleProposer(Proposer):
    name = "eagle"
    provides_probabilities = True
    runs_a_model = True

    def __init__(self, head: EagleHead, width: int = 1):
        if width < 1:
            raise ValueError("width must be >= 1")
        self.head, self.width = head, width
        self.hidden_layers = head.aux_layers
        self.hidden_dtype = head.fc.weight.dtype
        self._draft_to_target = head.draft_to_target.tolist()
        self._target_index = head.draft_to_target
        self._vocab_size = head.config.vocab_size
        self._committed: CommittedRows[_Committed] = CommittedRows(lambda first: _Committed(first=first))

    # ---- per-request state ---------------------------------------------------------------------

    def on_accept(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._committed.on_accept(request_id, token_ids)

    def release(self, request_id: str) -> None:
        self._committed.release(request_id)

    # ---- catching up on committed tokens --------------------------------------------------------

    @torch.inference_mode()
    def _catch_up(self, requests: Sequence[DraftRequest]) -> None:
        """Run the head over each request's new target rows (one batched pass for all requests)."""
        runs = [(state, rows, torch.tensor(request.token_ids[rows.start + 1: rows.end + 1]))
                for request, state, rows in self._committed.new_rows(requests)]
        if not runs:
            return
        dtype = self.hidden_dtype
        features = self.head.fuse(torch.cat([rows.states.to(dtype) for _, rows, _ in runs]))
        tokens = torch.cat([ids for _, _, ids in runs])
        positions = torch.cat([torch.arange(rows.start, rows.end) for _, rows, _ in runs])
        q, k, v, residual = self.head.project(features, tokens, positions)
        outputs, offset = [], 0
        for state, rows, _ in runs:
            count = rows.states.shape[0]
            span = slice(offset, offset + count)
            old = 0 if state.keys is None else state.keys.shape[2]
            keys = k[:, :, span] if state.keys is None else torch.cat([state.keys, k[:, :, span]], dim=2)
            values = v[:, :, span] if state.values is None else torch.cat([state.values, v[:, :, span]], dim=2)
            mask = None
            if count > 1:
                mask = torch.ones(count, old + count, dtype=torch.bool).tril(old)
            outputs.append(attend(q[:, :, span], keys, values, mask))
            state.keys, state.values = keys, values
            offset += count
        hidden = self.head.finish(torch.cat(outputs, dim=2), residual)
        ends = torch.tensor([0, *(rows.states.shape[0] for _, rows, _ in runs)]).cumsum(0)[1:] - 1
        logits = self.head.logits(hidden[ends]).float()
        for index, (state, _, _) in enumerate(runs):
            state.last_hidden, state.last_logits = hidden[ends[index]], logits[index]

    # ---- drafting -------------------------------------------------------------------------------

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        if not requests:
            return []
        self._catch_up(requests)
        drafts = []
        for request in requests:
            state = self._committed[request.request_id]
            root = request.token_ids[-1]
            noise = DraftNoise(request.sampling, len(request.token_ids), self.head.fc.weight.device)
            root_node = _Node(token=root, parent=-1, depth=0, value=1.0, own=1.0)
            draft = _Draft(request, len(request.token_ids) - 2, [root_node], noise=noise)
            ready = state.last_logits is not None and state.end == len(request.token_ids) - 1
            if ready and request.num_speculative_tokens > 0 and request.max_nodes > 0:
                draft.out[0], draft.logits[0] = state.last_hidden, state.last_logits
                draft.frontier = [0]
            drafts.append(draft)
        with torch.inference_mode():
            depth = 0
            while any(d.frontier for d in drafts):
                depth += 1
                self._run_frontier([d for d in drafts if d.frontier])
                for draft in drafts:
                    if draft.frontier:
                        self._grow(draft, depth)
        return [self._tree(d) for d in drafts]

    def _run_frontier(self, drafts: list[_Draft]) -> None:
        """Give every frontier node its logits, running the head on the nodes that lack them."""
        runs = [(d, [n for n in d.frontier if n not in d.logits]) for d in drafts]
        runs = [(d, nodes) for d, nodes in runs if nodes]
        if not runs:
            return
        features = torch.stack([d.out[d.nodes[n].parent] for d, nodes in runs for n in nodes])
        tokens = torch.tensor([d.nodes[n].token for d, nodes in runs for n in nodes])
        positions = torch.tensor([d.root_position + d.nodes[n].depth for d, nodes in runs for n in nodes])
        q, k, v, residual = self.head.project(features, tokens, positions)
        outputs, offset = [], 0
        for draft, nodes in runs:
            state = self._committed[draft.request.request_id]
            span = slice(offset, offset + len(nodes))
            keys = torch.cat([state.keys, *draft.scratch_keys, k[:, :, span]], dim=2)
            values = torch.cat([state.values, *draft.scratch_values, v[:, :, span]], dim=2)
            mask = torch.ones(len(nodes), keys.shape[2], dtype=torch.bool)
            scratch = len(draft.scratch_nodes)
            for row, node in enumerate(nodes):
                line = draft.ancestors(node)
                base = state.keys.shape[2]
                mask[row, base: base + scratch] = torch.tensor([s in line for s in draft.scratch_nodes], dtype=torch.bool)
                mask[row, base + scratch:] = False
                mask[row, base + scratch + row] = True
            outputs.append(attend(q[:, :, span], keys, values, mask))
            draft.scratch_keys.append(k[:, :, span])
            draft.scratch_values.append(v[:, :, span])
            draft.scratch_nodes.extend(nodes)
            offset += len(nodes)
        hidden = self.head.finish(torch.cat(outputs, dim=2), residual)
        logits = self.head.logits(hidden).float()
        row = 0
        for draft, nodes in runs:
            for node in nodes:
                draft.out[node], draft.logits[node] = hidden[row], logits[row]
                row += 1

    def _grow(self, draft: _Draft, depth: int) -> None:
        """Children of the frontier nodes, and the next frontier."""
        request = draft.request
        dynamic = self.width > 1 and not draft.sampled  # EAGLE-2: re-ranked to max_nodes at the end
        new = []
        for parent in draft.frontier:
            count = self.width if dynamic or parent == 0 else 1
            if not dynamic:
                count = min(count, draft.room())
            if count <= 0:
                break
            for token, own, q in self._choose(draft, draft.logits[parent], count, depth):
                draft.nodes.append(_Node(token=token, parent=parent, depth=depth, value=draft.nodes[parent].value * own, own=own,
                                         q=q))
                new.append(len(draft.nodes) - 1)
        more = depth < request.num_speculative_tokens
        open_nodes = [n for n in new if more and draft.nodes[n].own >= request.confidence_threshold]
        if dynamic:  # expand the best `width` nodes of this depth
            draft.frontier = sorted(open_nodes, key=lambda n: -draft.nodes[n].value)[: self.width]
        else:
            draft.frontier = open_nodes if draft.room() > 0 else []

    def _choose(self, draft: _Draft, logits: torch.Tensor, count: int, depth: int):
        """(target token, the head's probability of it, q or None) of `count` children at tree depth `depth`."""
        if not draft.sampled:
            probs = logits.softmax(-1)
            top = torch.topk(probs, count)
            return [(self._draft_to_target[i], float(p), None) for p, i in zip(top.values, top.indices.tolist())]
        request = draft.request
        q = mapped_warp(logits, self._target_index, self._vocab_size, request.sampling)
        count = min(count, int((q > 0).sum()))
        tokens = draft.noise.draw(q, count, depth).tolist()
        return [(token, float(q[token]), q) for token in tokens]

    def _tree(self, draft: _Draft) -> DraftTree:
        keep = range(len(draft.nodes))
        if not draft.sampled and self.width > 1 and draft.room() < 0:
            best = sorted(range(1, len(draft.nodes)), key=lambda n: (-draft.nodes[n].value, n))
            keep = [0, *sorted(best[: draft.request.max_nodes])]
        index = {node: i for i, node in enumerate(keep)}
        nodes = [draft.nodes[n] for n in keep]
        probs = None
        if draft.request.sampling.rejection and len(nodes) > 1:
            probs = tree_draft_probs([n.q for n in nodes[1:]])
        return DraftTree(token_ids=[n.token for n in nodes], parents=[-1, *(index[n.parent] for n in nodes[1:])],
                         draft_probs=probs, confidence=[n.own for n in nodes])
