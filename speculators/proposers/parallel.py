"""Parallel drafting with a DFlash block drafter: every depth of the draft from one forward pass.

Per request the proposer keeps the drafter's context keys and values of committed tokens (one
pair per layer), extended each call by the target's hidden states that came with it
(`DraftRequest.hidden`); nothing drafted is ever written there, so nothing needs rolling back but
the rows past a shorter sequence (`on_accept`). Rows whose hidden states never arrived (a drafter
restart, a lost call) leave a gap; the context then starts over from the next rows it gets, and
the request drafts nothing until its rows reach the root.

One call runs the blocks of all ready requests as one batch of rows (projections and MLPs
batched; attention per request, over its own context and block) and scores only the depths some
request may draft. The per-depth distributions fill the drafter's static tree (a chain unless its
checkpoint names one) as Medusa heads' do (speculators/proposers/static_tree.py), sampled
requests included.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from speculators.heads.dflash import DFlashDrafter
from speculators.hidden import CommittedRows
from speculators.proposers.base import DraftRequest, Proposer
from speculators.proposers.static_tree import StaticTree, chain_choices, fill
from speculators.tree import DraftTree


@dataclass
class _Context:
    """One request's context keys and values per layer [1, kv_heads, rows, d]: positions first .. end - 1."""

    first: int = 0
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.first + (self.keys[0].shape[2] if self.keys else 0)

    def cut(self, end: int) -> None:
        if end >= self.end:
            return
        keep = max(0, end - self.first)
        self.keys = [k[:, :, :keep] for k in self.keys] if keep else []
        self.values = [v[:, :, :keep] for v in self.values] if keep else []

    def extend(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not self.keys:
            self.keys, self.values = [k for k, _ in layers], [v for _, v in layers]
            return
        self.keys = [torch.cat([old, new], dim=2) for old, (new, _) in zip(self.keys, layers)]
        self.values = [torch.cat([old, new], dim=2) for old, (_, new) in zip(self.values, layers)]


class ParallelProposer(Proposer):
    name = "parallel"
    provides_probabilities = True
    runs_a_model = True

    def __init__(self, drafter: DFlashDrafter, choices: Sequence[Sequence[int]] | None = None):
        self.drafter = drafter
        depth = drafter.block_size - 1
        self.tree = StaticTree.from_choices(choices or drafter.tree_choices or chain_choices(depth))
        if self.tree.depth > depth:
            raise ValueError(f"the tree is {self.tree.depth} deep but a block of {drafter.block_size} drafts {depth}")
        self.hidden_layers = drafter.hidden_layers
        self.hidden_dtype = drafter.fc.weight.dtype
        self._token_map = drafter.draft_to_target
        self._contexts: CommittedRows[_Context] = CommittedRows(lambda first: _Context(first=first))

    def on_accept(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._contexts.on_accept(request_id, token_ids)

    def release(self, request_id: str) -> None:
        self._contexts.release(request_id)

    @torch.inference_mode()
    def _catch_up(self, requests: Sequence[DraftRequest]) -> None:
        """Every request's new target rows into its context (one batched projection for all)."""
        runs = [(context, rows) for _, context, rows in self._contexts.new_rows(requests)]
        if not runs:
            return
        states = torch.cat([rows.states.to(self.hidden_dtype) for _, rows in runs])
        positions = torch.cat([torch.arange(rows.start, rows.end) for _, rows in runs])
        layers = self.drafter.context(states, positions.to(states.device))
        offset = 0
        for context, rows in runs:
            span = slice(offset, offset + rows.states.shape[0])
            context.extend([(k[:, :, span], v[:, :, span]) for k, v in layers])
            offset = span.stop

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        if not requests:
            return []
        self._catch_up(requests)
        ready = [r for r in requests if r.num_speculative_tokens > 0 and r.max_nodes > 0
                 and self._contexts[r.request_id].keys and self._contexts[r.request_id].end == len(r.token_ids) - 1]
        logits = dict(zip([r.request_id for r in ready], self._draft(ready))) if ready else {}
        vocab = self.drafter.config.vocab_size
        return [fill(self.tree, r, logits[r.request_id], self._token_map, vocab) if r.request_id in logits
                else DraftTree.root_only(r.token_ids[-1]) for r in requests]

    @torch.inference_mode()
    def _draft(self, requests: list[DraftRequest]) -> list[torch.Tensor]:
        """Per request, logits [depth, V] of the depths its tree may reach."""
        drafter, size = self.drafter, self.drafter.block_size
        device = drafter.fc.weight.device
        roots = torch.tensor([r.token_ids[-1] for r in requests], device=device)
        starts = torch.tensor([len(r.token_ids) - 1 for r in requests], device=device)
        positions = (starts[:, None] + torch.arange(size, device=device)).flatten()
        contexts = [self._contexts[r.request_id] for r in requests]

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            outputs = []
            for index, context in enumerate(contexts):
                span = slice(index * size, (index + 1) * size)
                keys = torch.cat([context.keys[layer], k[:, :, span]], dim=2)
                values = torch.cat([context.values[layer], v[:, :, span]], dim=2)
                outputs.append(F.scaled_dot_product_attention(q[:, :, span], keys, values,
                                                              enable_gqa=q.shape[1] != keys.shape[1]))
            return torch.cat(outputs, dim=2)

        hidden = drafter.run_block(drafter.block_tokens(roots), positions, attention).view(len(requests), size, -1)
        depth = min(size - 1, self.tree.depth, max(r.num_speculative_tokens for r in requests))
        logits = drafter.logits(hidden[:, 1:depth + 1].reshape(len(requests) * depth, -1)).float()
        return list(logits.view(len(requests), depth, -1))
