"""CUDA graphs for one-sequence passes at bucketed sizes (ModelRunner's `cuda_graphs` flag).

At batch 1 a decode step, a small verification pass or a draft step on a GPU costs mostly the
launching of a few hundred small kernels from Python. A CUDA graph replays a captured pass with one
launch, but it needs fixed shapes and fixed memory. So each bucket (1, 2, 4, ... 64 new tokens) is
captured once, when the runner is made and its KV cache is still empty (the warm-up runs before
capture write into that empty cache and harm nothing), over static input buffers. A call pads its
tokens to the next bucket (pad tokens write K/V into the cache's pad block, which nothing reads)
and attends `max_len` positions gathered through its block table under its mask, so no shape
depends on the sequence. Calls no bucket takes run eagerly: several sequences, more tokens than the largest
bucket, no logits wanted (a prefill), a tensor-parallel shard, or an attention backend other than
sdpa (the split backend lays out its blocks on the host).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from actors.model.batch import PackedBatch, Segment
from actors.model.kv_cache import KVCache
from actors.model.llama import LlamaDecoder

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class StaticBatch(PackedBatch):
    """The layout of one sequence's `tokens` new tokens over `max_len` positions, in fixed buffers
    that each call refills: where its positions are stored is a tensor too, not Python indices."""

    def __init__(self, tokens: int, cache: KVCache, device: torch.device):
        pad_table = [cache.pad_position // cache.block_size] * cache.blocks_for(cache.max_len)
        mask = torch.ones(tokens, cache.max_len, dtype=torch.bool)
        super().__init__([Segment(blocks=pad_table, start=cache.max_len - tokens, num_tokens=tokens, mask=mask)], device, cache)
        self.per_sequence = False  # a graph replays the padded call over the buffers below
        self.storage  # built now: a buffer the graph reads

    def load(self, segment: Segment) -> None:
        """Lay out `segment` (at most this batch's tokens) in the buffers; pad rows attend position 0
        and write to the cache's pad block."""
        tokens, max_len = self.num_tokens, self.mask.shape[-1]
        mask = torch.zeros(1, tokens, max_len, dtype=torch.bool)
        mask[0, : segment.num_tokens, : segment.end] = True if segment.mask is None else segment.mask
        mask[0, segment.num_tokens:, 0] = True
        self.mask.copy_(mask)
        self.storage.copy_(self.cache.index(segment.blocks, segment.end, max_len)[None])
        written = self.cache.physical(segment.blocks, segment.start, segment.end)
        self.token_storage.copy_(torch.tensor(written + [self.cache.pad_position] * (tokens - len(written))))


class _Bucket:
    """Static inputs, layout and output of one captured size."""

    def __init__(self, model: LlamaDecoder, tokens: int, cache: KVCache):
        device = model.device
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=device)
        self.rows = torch.arange(tokens, device=device)
        self.batch = StaticBatch(tokens, cache, device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, segment: Segment) -> None:
        count = segment.num_tokens
        self.input_ids[:count].copy_(input_ids)
        self.input_ids[count:].zero_()
        self.positions[:count].copy_(positions)
        self.positions[count:].copy_(positions[-1:].expand(len(self.positions) - count))
        self.batch.load(segment)


class GraphedForward:
    """Called like LlamaDecoder.forward; one-sequence calls that fit a bucket replay its graph.

    `capture=False` runs the same padded, fixed-shape pass eagerly: how the CPU suite checks that
    the bucketed layout computes what the plain pass computes.
    """

    def __init__(self, model: LlamaDecoder, cache: KVCache, buckets: Sequence[int] = BUCKETS, capture: bool = True):
        self.model, self.cache = model, cache
        self.capture = capture
        fits = model.comm.world_size == 1 and model.backend.name == "sdpa"
        self.buckets = {size: _Bucket(model, size, cache) for size in buckets if size <= cache.max_len} if fits else {}
        if capture:
            for bucket in self.buckets.values():
                self._capture(bucket)

    def _capture(self, bucket: _Bucket) -> None:
        """Each graph gets its own memory pool: graphs that share one are safe only when replayed
        in the order they were captured, and calls come in any order."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture, as CUDA graphs require
            for _ in range(2):
                self._run(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        bucket.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(bucket.graph):
            bucket.output = self._run(bucket)

    def _run(self, bucket: _Bucket) -> torch.Tensor:
        return self.model.run(bucket.input_ids, bucket.positions, bucket.batch, self.cache, bucket.rows)

    def _bucket_for(self, segments: Sequence[Segment], logit_rows: torch.Tensor | None) -> _Bucket | None:
        if len(segments) != 1 or logit_rows is None:
            return None
        segment = segments[0]
        size = next((s for s in sorted(self.buckets) if s >= segment.num_tokens), None)
        if size is None or segment.start + size > self.cache.max_len:
            return None
        return self.buckets[size]

    def __call__(self, input_ids, positions, segments, cache, logit_rows=None):
        bucket = self._bucket_for(segments, logit_rows)
        if bucket is None:
            return self.model(input_ids, positions, segments, cache, logit_rows)
        cache.check_room(segments[0].end)
        bucket.load(input_ids, positions, segments[0])
        if bucket.graph is None:
            output = self._run(bucket)
        else:
            bucket.graph.replay()
            output = bucket.output
        return output.index_select(0, logit_rows)  # a copy: the next replay overwrites the output
