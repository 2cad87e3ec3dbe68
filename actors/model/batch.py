"""The layout of one packed forward pass, built once and shared by every layer.

A pass runs the new tokens of several sequences laid end to end (no padding in the projections).
Attention sees them one of two ways:
- per sequence (`sequences`): each sequence's queries against views of its own cache blocks (one
  view per run of adjacent blocks, usually one), under its own mask: no copy of any cache and no
  padding. This is the CPU path: for many long sequences, gathering their caches into one padded
  block cost several times the whole loop a layer (figures: docs/benchmarks.md,
  "Measurements behind the code").
- padded (`queries`, `read`, `mask`, `outputs`): the batch regrouped into one [sequences, new
  tokens, positions] block, so every layer makes one cache read and one attention call (a GPU,
  where a kernel launch per sequence is the dearer part). Built on first use only.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from actors.model.kv_cache import KVCache


@dataclass
class Segment:
    """The new tokens of one sequence inside a packed forward pass.

    They are written to the sequence's positions [start, start + num_tokens), stored in the cache
    blocks `blocks` lists (its block table), and attend to positions [0, start + num_tokens) under
    `mask` ([num_tokens, start + num_tokens], True = may attend), or to all of them when mask is None.
    """

    blocks: Sequence[int]
    start: int
    num_tokens: int
    mask: torch.Tensor | None = None
    prefix: int = 0
    """Leading positions every new token attends (the committed context), which the split
    attention backend reads without a mask; 0 leaves the whole span to the mask."""
    prompt: bool = False
    """Prompt tokens (prefill: no token's logits wanted but the last), which a CPU in float32 attends
    with torch's kernel rather than ours (cpu_attention.py)."""

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class SequenceView:
    """One sequence's part of a pass, for attention: its packed rows and where its positions are
    stored, as runs of adjacent storage (logical start, physical start, length)."""

    rows: slice
    blocks: Sequence[int]
    runs: list[tuple[int, int, int]]
    end: int
    mask: torch.Tensor | None  # the segment's: [its new tokens, end]
    prefix: int
    prompt: bool
    for_every_layer: dict = field(default_factory=dict)
    """What attention derives from the view once and reuses in every layer of the pass."""


class PackedBatch:
    def __init__(self, segments: Sequence[Segment], device: torch.device, cache: KVCache):
        self.segments = list(segments)
        self.device = torch.device(device)
        self.cache = cache
        self.single = len(self.segments) == 1
        self.per_sequence = self.single or self.device.type == "cpu"
        """Whether attention runs sequence by sequence over cache views (see the module doc)."""
        self.for_every_layer: dict = {}
        """What an attention backend derives from the pass once and reuses in every layer."""
        counts = [s.num_tokens for s in self.segments]
        self.num_tokens = sum(counts)
        self.max_new, self.max_end = max(counts), max(s.end for s in self.segments)
        stored = []
        for segment in self.segments:
            stored += cache.physical(segment.blocks, segment.start, segment.end)
        self.token_storage = torch.tensor(stored, device=self.device)
        """Where each new token's K/V is written."""

    @cached_property
    def sequences(self) -> list[SequenceView]:
        views, offset = [], 0
        for segment in self.segments:
            views.append(SequenceView(rows=slice(offset, offset + segment.num_tokens), blocks=segment.blocks,
                                      runs=self.cache.runs(segment.blocks, segment.end), end=segment.end,
                                      mask=segment.mask, prefix=segment.prefix, prompt=segment.prompt))
            offset += segment.num_tokens
        return views

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """[B, max_new, max_end] bool; None when every token may attend everything before it."""
        if self.single and self.segments[0].mask is None:
            return None
        mask = torch.zeros(len(self.segments), self.max_new, self.max_end, dtype=torch.bool, device=self.device)
        for index, segment in enumerate(self.segments):
            given = segment.mask
            mask[index, : segment.num_tokens, : segment.end] = True if given is None else given
            mask[index, segment.num_tokens:, 0] = True  # pad rows attend somewhere (no NaN), then are dropped
        return mask

    @cached_property
    def _padded_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed row of each (sequence, new-token) cell (num_tokens: a zero pad row), and the
        cells that hold a real token."""
        rows = torch.full((len(self.segments), self.max_new), self.num_tokens, dtype=torch.long)
        offset = 0
        for index, segment in enumerate(self.segments):
            rows[index, : segment.num_tokens] = torch.arange(offset, offset + segment.num_tokens)
            offset += segment.num_tokens
        rows = rows.flatten().to(self.device)
        return rows, (rows < self.num_tokens).nonzero().squeeze(1)

    @cached_property
    def storage(self) -> torch.Tensor:
        """[B, max_end]: where each sequence's positions are stored (past its end: the pad position)."""
        return torch.stack([self.cache.index(s.blocks, s.end, self.max_end) for s in self.segments]).to(self.device)

    def write(self, cache: KVCache, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the new tokens' K/V ([tokens, kv_heads, head_dim]) at their positions."""
        cache.keys[layer][:, self.token_storage] = keys.transpose(0, 1)
        cache.values[layer][:, self.token_storage] = values.transpose(0, 1)

    def read(self, cache: KVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sequence's K/V up to its end: [B, kv_heads, max_end, head_dim]."""
        return gather(cache.keys[layer], self.storage), gather(cache.values[layer], self.storage)

    def queries(self, packed: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, d] packed -> [B, heads, max_new, d]."""
        if self.single:
            return packed.transpose(0, 1).unsqueeze(0)
        padded = torch.cat([packed, packed.new_zeros(1, *packed.shape[1:])]).index_select(0, self._padded_rows[0])
        return padded.view(len(self.segments), self.max_new, *packed.shape[1:]).transpose(1, 2)

    def outputs(self, attended: torch.Tensor) -> torch.Tensor:
        """[B, heads, max_new, d] -> packed [tokens, heads * d]."""
        flat = attended.transpose(1, 2).reshape(-1, attended.shape[1] * attended.shape[3])
        return flat if self.single else flat.index_select(0, self._padded_rows[1])


def gather(store: torch.Tensor, storage: torch.Tensor) -> torch.Tensor:
    """One layer's [kv_heads, positions, d] store at `storage` ([B, n] positions) -> [B, kv_heads, n, d]."""
    return store[:, storage].transpose(0, 1)
