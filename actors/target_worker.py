"""The target side of speculative decoding: prefill, batched tree verification, KV compaction.

`TargetWorker` holds one copy (or one tensor-parallel shard) of the target model and the KV cache
of every sequence it serves. `verify` runs every request's draft tree in one packed forward pass,
applies the lossless acceptance rule per request and compacts the accepted nodes' K/V, so only
the small VerifyResults leave the worker. On Ray it runs inside a TargetShard (target_group.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from actors.model.llama import LlamaDecoder
from actors.model.runner import ModelRunner
from actors.model.timing import time_passes
from speculators.logprobs import committed_logprobs
from speculators.proposers.base import TreeInput
from speculators.sampling import SamplingParams
from speculators.shaping import Shaping
from speculators.tree import DraftTree, chain_parents
from speculators.verify import VerifyResult, verify, verify_greedy

VERIFY_SALT = 0


@dataclass
class RequestFailed:
    """In place of a VerifyResult: this request's verification raised. It ends with this error; the
    other requests of the batch keep their results."""

    reason: str


class TargetWorker:
    def __init__(self, model: LlamaDecoder, max_sequences: int = 8, max_len: int = 2048, cuda_graphs: bool = False,
                 hidden_layers: Sequence[int] = (), hidden_dtype: torch.dtype = torch.float32):
        """`hidden_layers` (a trained head's `Proposer.hidden_layers`): the hidden states that prefill
        and verification return for committed tokens, in `hidden_dtype`, from rank 0 only."""
        self.model = model
        self.runner = ModelRunner(model, max_sequences, max_len, cuda_graphs)
        self._sampling: dict[str, tuple[SamplingParams, torch.Generator | None]] = {}
        self.hidden_layers, self.hidden_dtype = tuple(hidden_layers), hidden_dtype

    @property
    def max_len(self) -> int:
        return self.runner.max_len

    def start(self, requests: Sequence[tuple[str, Sequence[int], SamplingParams]]) -> dict[str, torch.Tensor] | None:
        """Admit requests and prefill every prompt token but the last (the first tree's root).

        Requests admitted together with the same prompt (the `n` samples of one call) share one
        prefill: the first is run, the others get a copy of its K/V. Returns the prefilled tokens'
        hidden states per request when `hidden_layers` asks for them."""
        for seq_id, prompt, sampling in requests:
            if not prompt:
                raise ValueError(f"request {seq_id!r} has an empty prompt")
            if len(prompt) >= self.max_len:
                raise ValueError(f"request {seq_id!r}: prompt of {len(prompt)} tokens exceeds {self.max_len - 1}")
            self.runner.add(seq_id)
            generator = None if sampling.greedy or sampling.keyed else sampling.generator(VERIFY_SALT, self.model.device)
            self._sampling[seq_id] = (sampling, generator)
        first_of: dict[tuple[int, ...], str] = {}
        for seq_id, prompt, _ in requests:
            first_of.setdefault(tuple(prompt), seq_id)
        inputs = [TreeInput(s, list(p[:-1]), chain_parents(len(p) - 1), logits="none")
                  for s, p, _ in requests if first_of[tuple(p)] == s]
        _, hidden = self.runner.forward_capturing(inputs, self.hidden_layers)
        for item in inputs:
            self.runner.commit(item.seq_id, range(len(item.token_ids)))
        for seq_id, prompt, _ in requests:
            if first_of[tuple(prompt)] != seq_id:
                self.runner.copy_sequence(first_of[tuple(prompt)], seq_id)
        if not self._sends_hidden:
            return None
        rows_of = {item.seq_id: rows.to(self.hidden_dtype) for item, rows in zip(inputs, hidden) if rows is not None}
        return {seq_id: rows_of[first_of[tuple(prompt)]] for seq_id, prompt, _ in requests
                if first_of[tuple(prompt)] in rows_of}

    @property
    def _sends_hidden(self) -> bool:
        return bool(self.hidden_layers) and self.model.comm.rank == 0

    def verify(self, batch: Sequence[tuple[str, DraftTree] | tuple[str, DraftTree, Shaping | None]]
               ) -> list[VerifyResult | RequestFailed]:
        """Each item is (request id, tree) or (request id, tree, Shaping): a request's penalties,
        grammar mask and logprobs for this pass."""
        items = [(item[0], item[1], item[2] if len(item) > 2 else None) for item in batch]
        inputs = [TreeInput(seq_id, tree.token_ids, tree.parents, self._wanted(seq_id, shaping))
                  for seq_id, tree, shaping in items]
        all_logits, all_hidden = self.runner.forward_capturing(inputs, self.hidden_layers)
        results = self._decide(items, all_logits)
        for (seq_id, _, _), result, rows in zip(items, results, all_hidden):
            if isinstance(result, RequestFailed):  # keep what it had committed, drop its tree
                self.runner.truncate(seq_id, self.runner.committed_length(seq_id))
                continue
            self.runner.commit(seq_id, result.accepted_nodes)
            if self._sends_hidden:
                result.hidden = rows[result.accepted_nodes].to(self.hidden_dtype)
        return results

    def _wanted(self, seq_id: str, shaping: Shaping | None) -> str:
        """A plain greedy request needs only the target's choice at each node; a sampled one, or one
        whose distribution is shaped or whose logprobs are wanted, its logits."""
        return "argmax" if self._sampling[seq_id][0].greedy and shaping is None else "all"

    def _verify_one(self, seq_id: str, tree: DraftTree, scores: torch.Tensor,
                    shaping: Shaping | None) -> VerifyResult | RequestFailed:
        """One request's decision; what it raises fails that request alone, not its neighbours."""
        try:
            if self._wanted(seq_id, shaping) == "argmax":
                return verify_greedy(tree, scores.tolist())
            sampling, generator = self._sampling[seq_id]
            shaped = scores if shaping is None else shaping.apply(tree, scores)
            result = verify(tree, shaped, sampling, generator, position=self.runner.committed_length(seq_id) + 1)
            if shaping is not None and shaping.logprobs is not None:
                result.logprobs = committed_logprobs(scores, result.accepted_nodes, result.new_tokens, shaping.logprobs)
            return result
        except Exception as error:
            return RequestFailed(f"verification failed: {type(error).__name__}: {error}")

    def _decide(self, batch: Sequence[tuple[str, DraftTree, Shaping | None]],
                all_logits: list[torch.Tensor]) -> list[VerifyResult | RequestFailed]:
        """Run the verifier on rank 0 only and give its results to every rank.

        Tensor-parallel ranks hold the same logits, but sampling draws random numbers (and an argmax
        tie could break differently on other hardware): one decision, broadcast, keeps every rank's
        KV cache identical. A verifier error is broadcast too, so the other ranks raise instead of
        waiting forever for a broadcast that never comes.
        """
        comm = self.model.comm
        outcome: list[VerifyResult] | str | None = None
        if comm.rank == 0:
            try:
                outcome = [self._verify_one(seq_id, tree, logits, shaping)
                           for (seq_id, tree, shaping), logits in zip(batch, all_logits)]
            except Exception as error:
                comm.broadcast_object(f"rank 0 failed to verify: {type(error).__name__}: {error}")
                raise
        outcome = comm.broadcast_object(outcome)
        if isinstance(outcome, str):
            raise RuntimeError(outcome)
        return outcome

    def finish(self, seq_id: str) -> None:
        self.runner.remove(seq_id)
        self._sampling.pop(seq_id, None)

    def time_passes(self, shapes: Sequence[tuple[int, int]], context: int, repeats: int) -> list[float]:
        """The cost curve: the fastest of `repeats` verification passes of each (tokens, sequences) shape."""
        return time_passes(self.runner, shapes, context, repeats, aggregate=min)
