"""The target side of speculative decoding: prefill, batched tree verification, KV compaction.

`TargetWorker` holds one copy (or one tensor-parallel shard) of the target model and the KV cache
of every sequence it serves. `verify` runs every request's draft tree in one packed forward pass,
applies the lossless acceptance rule per request and compacts the accepted nodes' K/V, so only
the small VerifyResults leave the worker.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from actors.model.llama import LlamaDecoder
from actors.model.runner import ModelRunner
from speculators.proposers.base import TreeInput
from speculators.sampling import SamplingParams
from speculators.tree import DraftTree, chain_parents
from speculators.verify import VerifyResult, verify

VERIFY_SALT = 0


class TargetWorker:
    def __init__(self, model: LlamaDecoder, max_sequences: int = 8, max_len: int = 2048):
        self.model = model
        self.runner = ModelRunner(model, max_sequences, max_len)
        self._sampling: dict[str, tuple[SamplingParams, torch.Generator | None]] = {}

    @property
    def max_len(self) -> int:
        return self.runner.max_len

    @property
    def free_sequences(self) -> int:
        return self.runner.free_sequences

    def start(self, requests: Sequence[tuple[str, Sequence[int], SamplingParams]]) -> None:
        """Admit requests and prefill every prompt token but the last (the first tree's root)."""
        for seq_id, prompt, sampling in requests:
            if not prompt:
                raise ValueError(f"request {seq_id!r} has an empty prompt")
            if len(prompt) >= self.max_len:
                raise ValueError(f"request {seq_id!r}: prompt of {len(prompt)} tokens exceeds {self.max_len - 1}")
            self.runner.add(seq_id)
            generator = None if sampling.greedy else sampling.generator(VERIFY_SALT)
            self._sampling[seq_id] = (sampling, generator)
        inputs = [TreeInput(s, list(p[:-1]), chain_parents(len(p) - 1), logits="none") for s, p, _ in requests]
        self.runner.forward(inputs)
        for item in inputs:
            self.runner.commit(item.seq_id, range(len(item.token_ids)))

    def verify(self, batch: Sequence[tuple[str, DraftTree]]) -> list[VerifyResult]:
        inputs = [TreeInput(seq_id, tree.token_ids, tree.parents) for seq_id, tree in batch]
        all_logits = self.runner.forward(inputs)
        results = []
        for (seq_id, tree), logits in zip(batch, all_logits):
            sampling, generator = self._sampling[seq_id]
            result = verify(tree, logits, sampling, generator)
            self.runner.commit(seq_id, result.accepted_nodes)
            results.append(result)
        return results

    def room(self, seq_id: str) -> int:
        """How many more tokens fit in this sequence's cache."""
        return self.max_len - self.runner.committed_length(seq_id)

    def finish(self, seq_id: str) -> None:
        self.runner.remove(seq_id)
        self._sampling.pop(seq_id, None)
