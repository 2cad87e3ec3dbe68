"""ModelRunner: a LlamaDecoder plus a KV cache, driven one batch of token trees at a time.

Implements speculators' TreeModel. Per sequence it tracks the committed length and the scratch
tree (tokens written past it since the last commit), builds each new token's position
(committed length + depth) and attention mask (committed prefix + its scratch ancestors), and packs
every sequence of a call into one forward pass.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from actors.model.kv_cache import CacheFullError, KVCache
from actors.model.batch import Segment
from actors.model.cuda_graphs import GraphedForward
from actors.model.llama import LlamaDecoder
from actors.model.threads import follow_load
from speculators.proposers.base import TreeInput
from speculators.tree import extend_ancestors


@dataclass
class _SequenceState:
    slot: int
    length: int = 0
    scratch_parents: list[int] = field(default_factory=list)
    scratch_depths: list[int] = field(default_factory=list)
    scratch_mask: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.bool))


class ModelRunner:
    def __init__(self, model: LlamaDecoder, max_sequences: int, max_len: int, cuda_graphs: bool = False):
        """`cuda_graphs`: replay captured graphs for one-sequence passes on a GPU (cuda_graphs.py);
        ignored on a CPU."""
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.cache: KVCache = model.new_cache(max_sequences, max_len)
        self._sequences: dict[str, _SequenceState] = {}
        self._pass = GraphedForward(model, self.cache) if cuda_graphs and model.device.type == "cuda" else model

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    @property
    def graphed_sizes(self) -> list[int]:
        """New-token counts whose one-sequence passes replay a CUDA graph (none when off)."""
        return sorted(self._pass.buckets) if isinstance(self._pass, GraphedForward) else []

    def add(self, seq_id: str) -> None:
        if seq_id in self._sequences:
            raise ValueError(f"sequence {seq_id!r} is already in the cache")
        self._sequences[seq_id] = _SequenceState(self.cache.allocate())

    def remove(self, seq_id: str) -> None:
        state = self._sequences.pop(seq_id, None)
        if state is not None:
            self.cache.free(state.slot)

    def has(self, seq_id: str) -> bool:
        return seq_id in self._sequences

    def committed_length(self, seq_id: str) -> int:
        return self._sequences[seq_id].length

    def scratch_size(self, seq_id: str) -> int:
        return len(self._sequences[seq_id].scratch_parents)

    @staticmethod
    def _extend_scratch(state: _SequenceState, parents: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        """Append new nodes to the scratch tree; return their mask rows over the scratch and depths."""
        old = len(state.scratch_parents)
        state.scratch_mask, state.scratch_depths = extend_ancestors(state.scratch_mask, state.scratch_depths, parents)
        state.scratch_parents = state.scratch_parents + list(parents)
        return state.scratch_mask[old:], state.scratch_depths[old:]

    def forward(self, inputs: Sequence[TreeInput]) -> list[torch.Tensor | None]:
        return self.forward_capturing(inputs)[0]

    def forward_capturing(
        self, inputs: Sequence[TreeInput], capture: Sequence[int] = ()
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """`forward`, plus each input's captured hidden states ([its tokens, len(capture) x hidden],
        see `LlamaDecoder.forward_capturing`; None for inputs without tokens or when nothing is captured)."""
        follow_load(self.model.device)
        for item in inputs:  # refuse the whole call before any sequence's scratch changes
            state = self._sequences[item.seq_id]
            if len(item.parents) != len(item.token_ids):
                raise ValueError(f"{item.seq_id!r}: {len(item.token_ids)} tokens but {len(item.parents)} parents")
            self.cache.check_room(state.length + len(state.scratch_parents) + len(item.token_ids))
        ids, positions, segments, rows, spans, token_spans = [], [], [], [], [], []
        offset = 0
        for item in inputs:
            state = self._sequences[item.seq_id]
            count = len(item.token_ids)
            token_spans.append((offset, offset + count) if count else None)
            if count == 0:
                spans.append(None)
                continue
            start = state.length + len(state.scratch_parents)
            scratch_rows, depths = self._extend_scratch(state, item.parents)
            ids.extend(item.token_ids)
            positions.extend(state.length + d for d in depths)
            mask = None
            if not bool(scratch_rows.all()):
                prefix = torch.ones(count, state.length, dtype=torch.bool)
                mask = torch.cat([prefix, scratch_rows], dim=1).to(self.model.device)
            segments.append(Segment(state.slot, start, count, mask, prefix=state.length))
            wanted = {"all": range(offset, offset + count), "argmax": range(offset, offset + count),
                      "last": [offset + count - 1]}.get(item.logits, [])
            spans.append((len(rows), len(rows) + len(wanted)) if wanted else None)
            rows.extend(wanted)
            offset += count
        if not segments:
            return [None] * len(inputs), [None] * len(inputs)
        device = self.model.device
        args = (torch.tensor(ids, device=device), torch.tensor(positions, device=device), segments, self.cache,
                torch.tensor(rows, device=device) if rows else None)
        if capture:  # CUDA graphs replay logits rows only; capturing passes run eagerly
            hidden, captured = self.model.forward_capturing(*args, capture)
        else:
            hidden, captured = self._pass(*args), None
        return (self._outputs(hidden, spans, [item.logits for item in inputs]),
                [None if span is None or captured is None else captured[span[0]:span[1]] for span in token_spans])

    def _outputs(self, hidden: torch.Tensor | None, spans: list[tuple[int, int] | None],
                 kinds: list[str]) -> list[torch.Tensor | None]:
        """Each input's rows of `hidden` as logits, or as argmax tokens: one LM-head product per kind."""
        outputs: list[torch.Tensor | None] = [None] * len(spans)
        for argmax, compute in ((True, self.model.likeliest), (False, lambda h: self.model.logits(h).float())):
            chosen = [i for i, span in enumerate(spans) if span is not None and (kinds[i] == "argmax") is argmax]
            if not chosen:
                continue
            rows = torch.cat([torch.arange(*spans[i]) for i in chosen]).to(hidden.device)
            computed, offset = compute(hidden.index_select(0, rows)), 0
            for i in chosen:
                count = spans[i][1] - spans[i][0]
                outputs[i], offset = computed[offset:offset + count], offset + count
        return outputs

    def commit(self, seq_id: str, scratch_nodes: Sequence[int]) -> None:
        state = self._sequences[seq_id]
        nodes = list(scratch_nodes)
        for depth, node in enumerate(nodes):
            if not 0 <= node < len(state.scratch_parents) or state.scratch_depths[node] != depth:
                raise ValueError(f"scratch nodes {nodes} are not a path from the committed context")
            if depth and state.scratch_parents[node] != nodes[depth - 1]:
                raise ValueError(f"scratch nodes {nodes} are not a path from the committed context")
        self.cache.compact(state.slot, state.length, nodes)
        state.length += len(nodes)
        self._clear_scratch(state)

    def copy_sequence(self, source: str, destination: str) -> None:
        """Give `destination` (added, empty) a copy of `source`'s committed K/V: a shared prefill."""
        state, copied = self._sequences[source], self._sequences[destination]
        if copied.length or copied.scratch_parents:
            raise ValueError(f"sequence {destination!r} is not empty")
        self.cache.copy(state.slot, copied.slot, state.length)
        copied.length = state.length

    def truncate(self, seq_id: str, length: int) -> None:
        state = self._sequences[seq_id]
        if not 0 <= length <= state.length:
            raise ValueError(f"cannot roll {seq_id!r} back from {state.length} to {length} tokens")
        state.length = length
        self._clear_scratch(state)

    @staticmethod
    def _clear_scratch(state: _SequenceState) -> None:
        state.scratch_parents, state.scratch_depths = [], []
        state.scratch_mask = torch.zeros(0, 0, dtype=torch.bool)


__all__ = ["ModelRunner", "CacheFullError"]
