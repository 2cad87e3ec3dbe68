"""ModelRunner: a LlamaDecoder driven one batch of token trees at a time over a paged KV cache.

Implements speculators' TreeModel. Per sequence it keeps the scratch tree (tokens written past the
committed length since the last commit), builds each new token's position (committed length +
depth) and attention mask (committed prefix + its scratch ancestors), and packs every sequence of
a call into one forward pass. Which blocks a sequence holds (allocation, prefix reuse, commit and
rollback) is the KVCacheManager's to decide (kv_manager.py); the runner asks it for blocks.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from actors.model.batch import Segment
from actors.model.block_pool import BlockPool
from actors.model.cuda_graphs import GraphedForward
from actors.model.kv_cache import DEFAULT_BLOCK_SIZE, CacheFullError, KVCache
from actors.model.kv_manager import KVCacheManager
from actors.model.llama import LlamaDecoder
from actors.model.threads import follow_load
from speculators.proposers.base import TreeInput
from speculators.tree import extend_ancestors


@dataclass
class _Scratch:
    """A sequence's tree of tokens written past its committed length since the last commit."""
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    mask: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.bool))


class ModelRunner:
    def __init__(self, model: LlamaDecoder, max_sequences: int, max_len: int, cuda_graphs: bool = False, *,
                 kv_blocks: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE, prefix_caching: bool = False):
        """`kv_blocks` blocks of `block_size` positions (default: room for `max_sequences` sequences
        of `max_len`); a sequence holds at most `max_len` positions. `cuda_graphs`: replay captured
        graphs for one-sequence passes on a GPU (cuda_graphs.py); ignored on a CPU."""
        self.model = model
        self.vocab_size = model.config.vocab_size
        blocks = kv_blocks if kv_blocks is not None else -(-max_sequences * max_len // block_size)
        self.cache: KVCache = model.new_cache(blocks, max_len, block_size)
        self.kv_manager = KVCacheManager(self.cache, prefix_caching, keep_runs=model.device.type == "cpu")
        self._scratch: dict[str, _Scratch] = {}
        self._pass = GraphedForward(model, self.cache) if cuda_graphs and model.device.type == "cuda" else model

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    @property
    def pool(self) -> BlockPool:
        return self.cache.pool

    @property
    def available_blocks(self) -> int:
        return self.pool.available

    @property
    def graphed_sizes(self) -> list[int]:
        """New-token counts whose one-sequence passes replay a CUDA graph (none when off)."""
        return sorted(self._pass.buckets) if isinstance(self._pass, GraphedForward) else []

    def add(self, seq_id: str, cache_scope: str | None = None) -> None:
        """A new, empty sequence. Its full blocks are registered for reuse under `cache_scope` when
        the runner caches prefixes (None: under a scope of its own, found only by itself)."""
        self.kv_manager.add(seq_id, cache_scope)
        self._scratch[seq_id] = _Scratch()

    def remove(self, seq_id: str) -> None:
        self._scratch.pop(seq_id, None)
        self.kv_manager.remove(seq_id)

    def reuse_prefix(self, seq_id: str, tokens: Sequence[int], room_to_copy: bool = False) -> int:
        """Give the sequence the cached blocks of the longest registered prefix of `tokens` past its
        committed length (KVCacheManager.reuse_prefix: on a CPU copied into its own blocks, where
        `room_to_copy` allows); returns how many tokens it gained."""
        if self._scratch[seq_id].parents:
            raise ValueError(f"sequence {seq_id!r} has uncommitted tokens")
        return self.kv_manager.reuse_prefix(seq_id, tokens, room_to_copy)

    def block_keys(self, seq_id: str, tokens: Sequence[int], end: int) -> list[bytes]:
        """The keys its next blocks will be registered under once `tokens` are committed up to `end`."""
        return self.kv_manager.block_keys(seq_id, tokens, end)

    def block_tables(self) -> dict[str, list[int]]:
        """Every sequence's blocks, in order (what the ranks of a group must agree on)."""
        return self.kv_manager.block_tables()

    def has(self, seq_id: str) -> bool:
        return self.kv_manager.has(seq_id)

    def committed_length(self, seq_id: str) -> int:
        return self.kv_manager.committed_length(seq_id)

    def blocks_to_grow(self, seq_id: str, new_tokens: int) -> int:
        """Blocks a call writing `new_tokens` more tokens to the sequence would take."""
        return self.kv_manager.blocks_to_reach(seq_id, self._written(seq_id) + new_tokens)

    def scratch_size(self, seq_id: str) -> int:
        return len(self._scratch[seq_id].parents)

    def _written(self, seq_id: str) -> int:
        """Positions the sequence has written: its committed length and its scratch tree."""
        return self.kv_manager.committed_length(seq_id) + len(self._scratch[seq_id].parents)

    @staticmethod
    def _extend_scratch(scratch: _Scratch, parents: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        """Append new nodes to the scratch tree; return their mask rows over the scratch and depths."""
        old = len(scratch.parents)
        scratch.mask, scratch.depths = extend_ancestors(scratch.mask, scratch.depths, parents)
        scratch.parents = scratch.parents + list(parents)
        return scratch.mask[old:], scratch.depths[old:]

    def forward(self, inputs: Sequence[TreeInput]) -> list[torch.Tensor | None]:
        """TreeModel.forward: per input, float32 logits [n, vocab] ("all"; [1, vocab] for "last"),
        token ids [n] ("argmax"), or None."""
        return self.forward_capturing(inputs)[0]

    def forward_capturing(
        self, inputs: Sequence[TreeInput], capture: Sequence[int] = ()
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """`forward`, plus each input's captured hidden states ([its tokens, len(capture) x hidden],
        see `LlamaDecoder.forward_capturing`; None for inputs without tokens or when nothing is captured)."""
        follow_load(self.model.device)
        needed = 0
        for item in inputs:  # refuse the whole call before any sequence's scratch changes
            written = self._written(item.seq_id)
            if len(item.parents) != len(item.token_ids):
                raise ValueError(f"{item.seq_id!r}: {len(item.token_ids)} tokens but {len(item.parents)} parents")
            end = written + len(item.token_ids)
            self.cache.check_room(end)
            needed += self.kv_manager.blocks_to_reach(item.seq_id, end)
        if needed > self.pool.available:
            raise CacheFullError(f"the call needs {needed} more KV cache blocks; {self.pool.available} are free")
        ids, positions, segments, rows, spans, token_spans = [], [], [], [], [], []
        offset = 0
        for item in inputs:
            scratch, committed = self._scratch[item.seq_id], self.kv_manager.committed_length(item.seq_id)
            count = len(item.token_ids)
            token_spans.append((offset, offset + count) if count else None)
            if count == 0:
                spans.append(None)
                continue
            start = committed + len(scratch.parents)
            self.kv_manager.allocate(item.seq_id, start + count)
            scratch.tokens = scratch.tokens + list(item.token_ids)
            scratch_rows, depths = self._extend_scratch(scratch, item.parents)
            ids.extend(item.token_ids)
            positions.extend(committed + d for d in depths)
            mask = None
            if not bool(scratch_rows.all()):
                prefix = torch.ones(count, committed, dtype=torch.bool)
                mask = torch.cat([prefix, scratch_rows], dim=1).to(self.model.device)
            segments.append(Segment(blocks=self.kv_manager.block_table(item.seq_id), start=start, num_tokens=count,
                                    mask=mask, prefix=committed, prompt=item.logits in ("none", "last")))
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
        scratch = self._scratch[seq_id]
        nodes = list(scratch_nodes)
        for depth, node in enumerate(nodes):
            if not 0 <= node < len(scratch.parents) or scratch.depths[node] != depth:
                raise ValueError(f"scratch nodes {nodes} are not a path from the committed context")
            if depth and scratch.parents[node] != nodes[depth - 1]:
                raise ValueError(f"scratch nodes {nodes} are not a path from the committed context")
        self.cache.compact(self.kv_manager.block_table(seq_id), self.kv_manager.committed_length(seq_id), nodes)
        self.kv_manager.commit(seq_id, [scratch.tokens[node] for node in nodes])
        self._scratch[seq_id] = _Scratch()

    def reserve(self, seq_id: str, positions: int) -> None:
        """Take the blocks of the sequence's first `positions` positions now and keep them until they
        are committed (a prompt prefilled over several passes)."""
        self.kv_manager.reserve(seq_id, positions)

    def truncate(self, seq_id: str, length: int) -> None:
        self.kv_manager.truncate(seq_id, length)
        self._scratch[seq_id] = _Scratch()


__all__ = ["ModelRunner", "CacheFullError"]
