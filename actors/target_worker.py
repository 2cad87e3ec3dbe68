"""The target side of speculative decoding: admission, prefill, batched tree verification, KV compaction.

`TargetWorker` holds one copy (or one tensor-parallel shard) of the target model and the paged KV
cache of every sequence it serves. `verify` runs every request's draft tree in one packed forward
pass, applies the lossless acceptance rule per request and compacts the accepted nodes' K/V, so only
the small VerifyResults leave the worker. On Ray it runs inside a TargetShard (target_group.py).

The worker owns the KV blocks, so it decides what fits (its policy: block_fit.py): `start` admits
requests in order while their prompts fit (a prompt prefix cached under the request's scope costs
no blocks and no compute), and `verify` preempts the newest requests it holds, in the call or not
(the other micro-batch's, prompts still prefilling), when the trees do not fit.
What the calls take and give back is typed in messages.py.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from actors.block_fit import BlockFit
from actors.messages import (
    Admission,
    AdmissionRefused,
    AdmitItem,
    Preempted,
    PrefillChunk,
    RequestFailed,
    VerifyItem,
    VerifyReply,
    Waiting,
)
from actors.model.kv_cache import DEFAULT_BLOCK_SIZE
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
class CacheOptions:
    """How a worker's KV cache is laid out (ModelRunner's arguments)."""

    blocks: int | None = None
    """Blocks in the pool; None: room for max_sequences sequences of max_len."""
    block_size: int = DEFAULT_BLOCK_SIZE
    prefix_caching: bool = False


class TargetWorker:
    def __init__(self, model: LlamaDecoder, max_sequences: int = 8, max_len: int = 2048, cuda_graphs: bool = False,
                 hidden_layers: Sequence[int] = (), hidden_dtype: torch.dtype = torch.float32,
                 cache: CacheOptions = CacheOptions()):
        """`hidden_layers` (a trained head's `Proposer.hidden_layers`): the hidden states that prefill
        and verification return for committed tokens, in `hidden_dtype`, from rank 0 only. A head
        needs the hidden state of every prompt token, so prefix caching is off with one."""
        self.model = model
        self.runner = ModelRunner(model, max_sequences, max_len, cuda_graphs, kv_blocks=cache.blocks,
                                  block_size=cache.block_size, prefix_caching=cache.prefix_caching and not hidden_layers)
        self._sampling: dict[str, tuple[SamplingParams, torch.Generator | None]] = {}
        """Every admitted request's sampling, in admission order (the order preemption reads)."""
        self._prompts: dict[str, list[int]] = {}
        """Prompts admitted without their prefill (chunked prefill), until their last chunk is in."""
        self.hidden_layers, self.hidden_dtype = tuple(hidden_layers), hidden_dtype
        self.fit = BlockFit(self.runner.pool)

    @property
    def max_len(self) -> int:
        return self.runner.max_len

    def start(self, requests: Sequence[AdmitItem], prefill: bool = True) -> Admission:
        """Admit requests in order while they fit (BlockFit), and prefill every prompt token but
        the last (the first tree's root) that the prefix cache does not hold, all in one pass; or,
        without `prefill`, keep the prompts for `verify` to prefill chunk by chunk (chunked prefill).
        A prompt's blocks are taken at admission; they become findable by later prompts as they are
        filled. The first request that does not fit and every later one are refused; a batch holding
        one that can never be served raises AdmissionRefused."""
        for item in requests:
            if not item.tokens:
                raise AdmissionRefused(f"request {item.request_id!r} has an empty prompt")
            if len(item.tokens) >= self.max_len:
                raise AdmissionRefused(f"request {item.request_id!r}: prompt of {len(item.tokens)} tokens exceeds "
                                       f"{self.max_len - 1}")
        cached, refused = {}, []
        for item in requests:
            if refused or not self._admit(item):
                refused.append(item.request_id)
                continue
            # salted by where the request starts: one resumed after preemption (its tokens so far as the
            # prompt) must not draw again the numbers it drew before (the drafter's salts are positive)
            sampling = item.sampling
            generator = (None if sampling.greedy or sampling.keyed
                         else sampling.generator(VERIFY_SALT - len(item.tokens), self.model.device))
            self._sampling[item.request_id] = (sampling, generator)
            cached[item.request_id] = self.runner.committed_length(item.request_id)
        admitted = [item for item in requests if item.request_id in cached]
        if not prefill:
            self._prompts.update((item.request_id, list(item.tokens[:-1])) for item in admitted)
            return Admission(cached, refused, free_blocks=self.runner.pool.available, total_blocks=self.runner.pool.num_blocks)
        inputs = [TreeInput(item.request_id, list(item.tokens[cached[item.request_id]:-1]),
                            chain_parents(len(item.tokens) - 1 - cached[item.request_id]), logits="none")
                  for item in admitted]
        _, hidden = self.runner.forward_capturing(inputs, self.hidden_layers)
        for tree_input in inputs:
            self.runner.commit(tree_input.seq_id, range(len(tree_input.token_ids)))
        admission = Admission(cached, refused, free_blocks=self.runner.pool.available,
                              total_blocks=self.runner.pool.num_blocks)
        if self._sends_hidden:
            admission.hidden = {tree_input.seq_id: rows.to(self.hidden_dtype) for tree_input, rows in zip(inputs, hidden)
                                if rows is not None}
        return admission

    def _admit(self, item: AdmitItem) -> bool:
        """Add the request's sequence with the prompt prefix the cache holds and take the blocks of
        the rest, if they fit."""
        runner, seq_id, prompt = self.runner, item.request_id, item.tokens
        if not self.fit.ever_fits(runner.cache.blocks_for(len(prompt) - 1)):
            raise AdmissionRefused(f"request {seq_id!r}: a prompt of {len(prompt)} tokens does not fit in the whole KV "
                                   f"cache ({runner.pool.num_blocks} blocks of {runner.cache.block_size})")
        runner.add(seq_id, item.cache_scope)
        alone = not self._sampling
        # a cached prefix is copied (on a CPU) when the prompt would fit even without it
        room = self.fit.admits(runner.cache.blocks_for(len(prompt) - 1), alone=alone)
        cached = runner.reuse_prefix(seq_id, prompt[:-1], room_to_copy=room)
        if not self.fit.admits(runner.blocks_to_grow(seq_id, len(prompt) - 1 - cached), alone=alone):
            runner.remove(seq_id)
            return False
        runner.reserve(seq_id, len(prompt) - 1)
        return True

    @property
    def _sends_hidden(self) -> bool:
        return bool(self.hidden_layers) and self.model.comm.rank == 0

    def verify(self, batch: Sequence[VerifyItem], prefill: Sequence[tuple[str, int]] = ()) -> VerifyReply:
        """Verify each item's tree (with its Shaping: penalties, grammar mask and logprobs for this
        pass), and run `prefill`'s (request id, tokens) chunks of prompts admitted without prefill in
        the same pass. Requests the trees leave no room for are preempted (BlockFit), whether items
        of the call or not: calls run one at a time, so no other request is in a pass now."""
        preempted = self._make_room(batch)
        items = [item for item in batch if item.request_id not in preempted]
        starting = {item.request_id for item in items if self._prompt_left(item.request_id)}
        chunks, cached, filling = [], [], set()
        for seq_id, count in prefill:
            if seq_id not in preempted and count:
                chunk, found = self._chunk(seq_id, count, filling, finishes=seq_id in starting)
                chunks.append(chunk)
                cached.append(found)
        missing = starting - {chunk.seq_id for chunk in chunks}
        if missing:
            raise ValueError(f"requests {sorted(missing)} are verified before their prompts' last chunk")
        # a starting request's tree follows its prompt's last chunk in one scratch tree: its root attends
        # to the chunk's rows, written earlier in the same pass; one whose chunk waited is not verified yet
        leading = {chunk.seq_id: len(chunk.token_ids) for chunk in chunks if chunk.seq_id in starting
                   and self.runner.committed_length(chunk.seq_id) + len(chunk.token_ids) == len(self._prompts[chunk.seq_id])}
        waiting = starting - set(leading)
        items = [item for item in items if item.request_id not in waiting]
        inputs = [TreeInput(seq_id=item.request_id, token_ids=item.tree.token_ids,
                            parents=after(leading.get(item.request_id, 0), item.tree.parents),
                            logits=self._wanted(item.request_id, item.shaping))
                  for item in items]
        all_logits, all_hidden = self.runner.forward_capturing(chunks + inputs, self.hidden_layers)
        done = self._commit_chunks(chunks, cached, all_hidden[:len(chunks)], leading)
        results = self._decide(items, all_logits[len(chunks):], leading)
        for item, result, rows in zip(items, results, all_hidden[len(chunks):]):
            lead = range(leading.get(item.request_id, 0))
            if isinstance(result, RequestFailed):  # keep what it had committed (and its prompt), drop its tree
                self.runner.commit(item.request_id, lead)
                continue
            self.runner.commit(item.request_id, [*lead, *(len(lead) + node for node in result.accepted_nodes)])
            if self._sends_hidden:
                result.hidden = rows[result.accepted_nodes].to(self.hidden_dtype)
        decided, in_batch = iter(results), {item.request_id for item in batch}
        return VerifyReply([Preempted(item.request_id) if item.request_id in preempted
                            else Waiting(item.request_id) if item.request_id in waiting else next(decided) for item in batch],
                           done, [seq_id for seq_id in preempted if seq_id not in in_batch])

    def _chunk(self, seq_id: str, count: int, filling: set[bytes], finishes: bool = False) -> tuple[TreeInput, int]:
        """The next `count` tokens of a prompt still to prefill (at most what is left), after those
        the prefix cache has gained since its admission (taken over, not run); and how many those are.

        A chunk whose next block an earlier chunk of the pass fills (`filling`: their blocks' keys)
        waits instead (no tokens): next pass it takes that block from the cache. Prompts with a
        common prefix admitted together thus compute it once. A chunk that `finishes` its prompt
        (its request's first root follows it in the pass) must reach the end unless it waits."""
        runner = self.runner
        start, prompt = runner.committed_length(seq_id), self._prompts.get(seq_id, ())
        if count > len(prompt) - start:
            raise ValueError(f"request {seq_id!r} has {max(0, len(prompt) - start)} prompt tokens left, not {count}")
        cached = runner.reuse_prefix(seq_id, prompt)
        start += cached
        keys = runner.block_keys(seq_id, prompt, start + count)
        if keys and keys[0] in filling and start % runner.cache.block_size == 0:
            count = 0
        filling.update(keys)
        tokens = prompt[start: start + count]
        if finishes and tokens and start + len(tokens) != len(prompt):
            raise ValueError(f"request {seq_id!r} is verified, but its prompt's chunk of {count} tokens leaves "
                             f"{len(prompt) - start - len(tokens)} to prefill")
        return TreeInput(seq_id, tokens, chain_parents(len(tokens)), logits="none"), cached

    def _commit_chunks(self, chunks: Sequence[TreeInput], cached: Sequence[int],
                       hidden: Sequence[torch.Tensor | None], leading: dict[str, int]) -> list[PrefillChunk]:
        """Commit the chunks run, but those `leading` a tree (committed with its accepted path)."""
        done = []
        for chunk, found, rows in zip(chunks, cached, hidden):
            start = self.runner.committed_length(chunk.seq_id)
            if chunk.seq_id not in leading:
                self.runner.commit(chunk.seq_id, range(len(chunk.token_ids)))
            if start + len(chunk.token_ids) == len(self._prompts[chunk.seq_id]):
                del self._prompts[chunk.seq_id]
            done.append(PrefillChunk(seq_id=chunk.seq_id, start=start, tokens=len(chunk.token_ids), cached=found,
                                     hidden=rows.to(self.hidden_dtype) if self._sends_hidden and rows is not None else None))
        return done

    def _make_room(self, items: Sequence[VerifyItem]) -> list[str]:
        """The requests BlockFit preempts (their blocks freed) so the call's trees fit, newest first:
        any request admitted, in admission order, since the blocks the trees lack may be held by
        requests outside the call (with pipelining, the other micro-batch's)."""
        grow = self.runner.blocks_to_grow
        needed = {item.request_id: grow(item.request_id, self._prompt_left(item.request_id) + item.tree.size) for item in items}
        return self.fit.make_room(needed, list(self._sampling), self.finish)

    def _prompt_left(self, seq_id: str) -> int:
        """Prompt tokens of the request still to prefill (before what the prefix cache may give)."""
        return max(0, len(self._prompts[seq_id]) - self.runner.committed_length(seq_id)) if seq_id in self._prompts else 0

    def _wanted(self, seq_id: str, shaping: Shaping | None) -> str:
        """A plain greedy request needs only the target's choice at each node; a sampled one, or one
        whose distribution is shaped or whose logprobs are wanted, its logits."""
        return "argmax" if self._sampling[seq_id][0].greedy and shaping is None else "all"

    def _verify_one(self, seq_id: str, tree: DraftTree, scores: torch.Tensor,
                    shaping: Shaping | None, root: int, predictions: bool = False) -> VerifyResult | RequestFailed:
        """One request's decision (`root`: its root's position; `predictions`: with the target's
        choice after every node); what it raises fails that request alone, not its neighbours."""
        try:
            if self._wanted(seq_id, shaping) == "argmax":
                best = scores.tolist()
                return replace(verify_greedy(tree, best), predictions=best if predictions else None)
            sampling, generator = self._sampling[seq_id]
            shaped = scores if shaping is None else shaping.apply(tree, scores)
            result = verify(tree, shaped, sampling, generator, position=root + 1)
            if shaping is not None and shaping.logprobs is not None:
                result.logprobs = committed_logprobs(scores, result.accepted_nodes, result.new_tokens, shaping.logprobs)
            if predictions:
                result.predictions = scores.argmax(-1).tolist()
            return result
        except Exception as error:
            return RequestFailed(f"verification failed: {type(error).__name__}: {error}")

    def _decide(self, batch: Sequence[VerifyItem], all_logits: list[torch.Tensor],
                leading: dict[str, int]) -> list[VerifyResult | RequestFailed]:
        """Run the verifier on rank 0 only and give its results to every rank (`leading`: the prompt
        rows before a starting request's root, not committed yet).

        Tensor-parallel ranks hold the same logits, but sampling draws random numbers (and an argmax
        tie could break differently on other hardware): one decision, broadcast, keeps every rank's
        KV cache identical. A verifier error is broadcast too, so the other ranks raise instead of
        waiting forever for a broadcast that never comes.
        """
        comm = self.model.comm
        outcome: list[VerifyResult] | str | None = None
        if comm.rank == 0:
            try:
                outcome = [self._verify_one(item.request_id, item.tree, logits, item.shaping,
                                            self.runner.committed_length(item.request_id) + leading.get(item.request_id, 0),
                                            item.predictions)
                           for item, logits in zip(batch, all_logits)]
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
        self._prompts.pop(seq_id, None)

    def time_passes(self, shapes: Sequence[tuple[int, int]], context: int, repeats: int) -> list[float]:
        """The cost curve: the fastest of `repeats` verification passes of each (tokens, sequences) shape."""
        return time_passes(self.runner, shapes, context, repeats, aggregate=min)


def after(lead: int, parents: Sequence[int]) -> list[int]:
    """A tree's parents once it follows `lead` chained rows in one scratch tree: its root hangs from the last."""
    return [lead + parent if parent >= 0 else lead - 1 for parent in parents]
