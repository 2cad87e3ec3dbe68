"""The engine's schedule: which requests wait, which run, and what each verification pass carries.

The engine-side fit policy, in one place (the target owns the KV blocks and decides what fits in
them, actors/block_fit.py; this side only offers, sets back and resumes):
- At most `max_sequences` requests run. Requests set back with output resume before any waiting
  request, oldest first; waiting requests start in arrival order.
- Whole-prompt mode (`prefill_chunk_tokens: null`): an offer's prompts are prefilled in one pass,
  so an offer holds at most `max_num_batched_tokens` of them (every token to prefill counted, the
  target may find some cached); the rest wait for the next pass, in order. A prompt longer than the
  cap is offered alone (this mode never splits a prompt; chunked prefill bounds such passes).
- Once the target refuses an admission for want of KV blocks, nothing more is offered until blocks
  are freed (a request ends or is preempted).
- A request refused or preempted goes back to the queues with its tokens so far: to `preempted`
  once it has output, else to the front of `waiting`. The target may preempt any running request,
  with pipelining one of the micro-batch not being verified too (it answers which in `VerifyReply`).
- Chunked prefill (`prefill_chunk_tokens`): while as many requests decode as prompts wait, a pass
  carries at most that many prompt tokens, in admission order; "auto" sizes the chunk by the cost curve to cost
  `prefill_pass_ratio` times the pass's decoding, so prefill keeps that share of the target at any
  load (a fixed chunk gave prompts a shrinking share as passes grew with the batch and its trees,
  and their queue grew without bound). While prompts outnumber the requests that decode (none
  decodes, or a burst of arrivals), waiting prompts fill the pass. Every chunked pass holds at most
  `max_num_batched_tokens` prompt tokens and decoding requests.
- With `pipeline`, the running requests form two micro-batches (a new one joins the smaller),
  verified in turn.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from actors.messages import Admission, PrefillChunk
from cluster.engine.config import MIN_AUTO_CHUNK, SchedulerConfig
from cluster.engine.cost import CostCurve
from cluster.engine.request import GenerationRequest
from cluster.engine.sequence import ActiveRequest
from cluster.engine.stats import EngineCounters


@dataclass
class StepPlan:
    """One pass: its micro-batch, the requests of it that decode, and the prompt chunks it prefills."""

    group: int
    decoding: list[ActiveRequest]
    chunks: list[tuple[str, int]]
    """(request id, prompt tokens) in admission order."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, counters: EngineCounters, vocab_size: int | None,
                 release: Callable[[ActiveRequest], None], cost: CostCurve | None = None):
        """`release`: what else forgets a request set back to the queues (its drafters, its hidden
        states); `cost`: the target's cost curve, which sizes "auto" prompt chunks."""
        self.config, self.counters, self.vocab_size, self._release = config, counters, vocab_size, release
        self.cost = cost
        self._decoded_tokens = 0
        """Tokens the last pass verified for decoding requests (their trees): what its decoding cost."""
        self.waiting: deque[GenerationRequest] = deque()
        self.preempted: deque[ActiveRequest] = deque()
        """Requests the KV cache ran out for, resumed before any waiting one, oldest first."""
        self.active: dict[str, ActiveRequest] = {}
        self.prefilling: dict[str, None] = {}
        """Admitted requests whose prompts are still being prefilled chunk by chunk, in admission order."""
        self._room_after_refusal = False
        """The target refused an admission for want of KV blocks: offer no more until blocks are freed."""
        self.kv_cache_usage: float | None = None
        """Fraction of the target's KV blocks held, as its last admission reported (None before one)."""
        self._next_group = 0

    # ---- queues -------------------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        """Refuse a request that can never run, with a message naming the field."""
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not request.prompt_ids:
            raise ValueError("prompt is empty")
        if len(request.prompt_ids) >= self.config.max_len:
            raise ValueError(f"prompt has {len(request.prompt_ids)} tokens; the limit is {self.config.max_len - 1}")
        if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in request.prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")

    def add(self, request: GenerationRequest) -> None:
        self.validate(request)
        queued = (r.request_id for r in (*self.waiting, *self.preempted))
        if request.request_id in self.active or request.request_id in queued:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.preempted or self.active)

    @property
    def decoding(self) -> int:
        """Requests running past their prefill."""
        return len(self.active) - len(self.prefilling)

    @property
    def queue_depth(self) -> int:
        return len(self.waiting) + len(self.preempted)

    @property
    def groups(self) -> int:
        return 2 if self.config.pipeline else 1

    @property
    def chunked(self) -> bool:
        """Whether prompts are prefilled chunk by chunk in verification passes (else whole at admission)."""
        return self.config.prefill_chunk_tokens is not None

    def withdraw(self, request_id: str) -> ActiveRequest | None:
        """Take a request out of the queues (an abort); the set-back request it was, if one."""
        self.waiting = deque(r for r in self.waiting if r.request_id != request_id)
        resumable = next((s for s in self.preempted if s.request_id == request_id), None)
        if resumable is not None:
            self.preempted.remove(resumable)
        return resumable

    def drain(self) -> tuple[list[GenerationRequest], list[ActiveRequest]]:
        """Empty the queues (the target is down): the waiting requests and the set-back ones."""
        waiting, preempted = list(self.waiting), list(self.preempted)
        self.waiting.clear()
        self.preempted.clear()
        return waiting, preempted

    # ---- admission ----------------------------------------------------------------------------

    def offer(self) -> tuple[list[ActiveRequest], list[GenerationRequest]]:
        """The requests to offer the target now, taken off the queues in order: set-back ones, then
        waiting ones, while `_joins` lets one more in."""
        if self._room_after_refusal:
            return [], []
        resumed, admitted, tokens = [], [], 0
        while self.preempted or self.waiting:
            set_back = bool(self.preempted)
            prefill = len(self.preempted[0].tokens if set_back else self.waiting[0].prompt_ids) - 1
            if not self._joins(len(resumed) + len(admitted), tokens + prefill):
                break
            tokens += prefill
            if set_back:
                resumed.append(self.preempted.popleft())
            else:
                admitted.append(self.waiting.popleft())
        return resumed, admitted

    def _joins(self, offered: int, tokens: int) -> bool:
        """Whether one more request may join an offer of `offered`: a slot is free and, in whole-prompt
        mode (where the offer is one prefill pass), the pass's `tokens` with it stay within
        `max_num_batched_tokens`, unless it would be the only one."""
        if len(self.active) + offered >= self.config.max_sequences:
            return False
        return self.chunked or not offered or tokens <= self.config.max_num_batched_tokens

    def run(self, states: list[ActiveRequest]) -> None:
        """Offered requests run, each in the smaller micro-batch, until the target's answer says otherwise."""
        for state in states:
            sizes = [sum(1 for s in self.active.values() if s.group == g) for g in range(self.groups)]
            state.group = sizes.index(min(sizes))
            self.active[state.request_id] = state

    def admitted(self, admission: Admission) -> None:
        """The target's answer to an offer: the prompt tokens it held cached, what is left to
        prefill, and the requests it had no room for (set back, and no more offers until room)."""
        for request_id, cached in admission.cached_tokens.items():
            state = self.active[request_id]
            self.counters.prompt_tokens += len(state.tokens)
            self.counters.cached_prompt_tokens += cached
            if not state.output:
                state.stats.cached_prompt_tokens = cached
            if self.chunked:
                state.prefill_left = len(state.tokens) - 1 - cached
                self.prefilling[request_id] = None
        if admission.total_blocks:
            self.kv_cache_usage = 1 - admission.free_blocks / admission.total_blocks
        for request_id in reversed(admission.refused):
            self._set_back(self.active[request_id])
        self._room_after_refusal = bool(admission.refused)

    # ---- passes -------------------------------------------------------------------------------

    def plan(self) -> StepPlan:
        """The next micro-batch's pass: prompts with nothing left to prefill (one token, or all
        cached) start decoding without one."""
        group = self._next_group
        self._next_group = (group + 1) % self.groups
        chunks = self._next_chunks()
        if not chunks:
            self.prefilled([])
        return StepPlan(group, self.decoding_in(group), chunks)

    def decoding_in(self, group: int) -> list[ActiveRequest]:
        """The micro-batch's requests whose prompts are in the cache."""
        return [s for s in self.active.values() if s.group == group and s.request_id not in self.prefilling]

    def chunk_budget(self) -> int:
        """Prompt tokens the next pass may carry: all the room while prompts outnumber the requests
        that decode (a burst of arrivals is prefilled in full passes, as vLLM does, rather than
        one chunk a pass priced against the few already decoding), else the chunk."""
        room = max(1, self.config.max_num_batched_tokens - self.decoding)
        if len(self.prefilling) > self.decoding:
            return room
        chunk = self.config.prefill_chunk_tokens
        if chunk == "auto":
            chunk = MIN_AUTO_CHUNK if self.cost is None else max(MIN_AUTO_CHUNK, self._auto_chunk())
        return min(chunk, room)

    def _auto_chunk(self) -> int:
        """Prompt tokens costing `prefill_pass_ratio` times the decoding of a pass like the last one."""
        decoding = self.cost.seconds(max(self.decoding, self._decoded_tokens), self.decoding)
        return int(self.config.prefill_pass_ratio * decoding / self.cost.seconds_per_token())

    def _next_chunks(self) -> list[tuple[str, int]]:
        if not self.prefilling:  # whole-prompt mode never has any
            return []
        budget = self.chunk_budget()
        chunks = []
        for request_id in self.prefilling:
            left = self.active[request_id].prefill_left
            # a chunk that finishes its prompt carries the request's first root too: one token more
            count = left if left < budget else budget - 1 if left == budget else budget
            if count:
                chunks.append((request_id, count))
                budget -= count + (count == left)
            if count < left:
                break
        return chunks

    def finishing(self, chunks: Sequence[tuple[str, int]]) -> list[ActiveRequest]:
        """The requests whose prompts `chunks` finish (the worker may find more of a prompt cached,
        which finishes it all the same)."""
        return [self.active[request_id] for request_id, count in chunks if count >= self.active[request_id].prefill_left]

    def prefilled(self, chunks: list[PrefillChunk], preempted: Sequence[str] = (),
                  decoded_tokens: int | None = None) -> None:
        """Chunks run (the rest of their prompts counted down, by what the prefix cache gave them
        too), and the requests outside the pass's items the target `preempted` (prompts, the other
        micro-batch's); prompts with nothing left start decoding. The pass also verified
        `decoded_tokens` for decoding requests (the next auto chunk weighs them)."""
        if decoded_tokens is not None:
            self._decoded_tokens = decoded_tokens
        for request_id in preempted:
            if request_id in self.active:
                self.preempt(self.active[request_id])
        for chunk in chunks:
            state = self.active.get(chunk.seq_id)
            if state is None:
                continue
            state.prefill_left -= chunk.cached + chunk.tokens
            self.counters.cached_prompt_tokens += chunk.cached
            if not state.output:
                state.stats.cached_prompt_tokens += chunk.cached
        for request_id in [r for r in self.prefilling if self.active[r].prefill_left <= 0]:
            self.prefilling.pop(request_id)

    def preempt(self, state: ActiveRequest) -> None:
        """The KV cache was full: the target freed the request's blocks; it resumes once there is room."""
        self.counters.preemptions += 1
        state.stats.preemptions += 1
        self._set_back(state)
        self._room_after_refusal = False

    def finished(self, state: ActiveRequest) -> None:
        """The request ended: its blocks are freed, so offers may resume."""
        self.active.pop(state.request_id)
        self.prefilling.pop(state.request_id, None)
        self._room_after_refusal = False

    def _set_back(self, state: ActiveRequest) -> None:
        """Return a running request to the queues: what it holds elsewhere is released, its tokens so far stay."""
        self.active.pop(state.request_id)
        self.prefilling.pop(state.request_id, None)
        self._release(state)
        if state.output:
            self.preempted.append(state)
            self.preempted = deque(sorted(self.preempted, key=lambda s: s.started))
        else:
            self.waiting.appendleft(state.request)
