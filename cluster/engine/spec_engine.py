"""The speculative decoding engine: admit, draft, verify in one batched pass, commit, stream.

Requests join and leave between steps (continuous batching). A step drafts a tree for each active
request of one micro-batch, verifies all of them in a single packed forward of the target worker
(group), and commits each request's accepted tokens. With `pipeline` on, active requests are split
into two micro-batches bound to their own drafter: while the target verifies one, the other is
drafted, so a step costs about max(draft, verify) instead of their sum.

Workers are reached through `submit(method, *args) -> Future` (actors/worker.py), so the same
code drives in-process workers and Ray actors. A drafter that fails, hangs or returns a bad tree
costs one plain step; a request whose verification raises fails alone; a target that fails or hangs
ends the requests it held with a retryable error and is rebuilt.

Other jobs live beside this module: how much each request drafts and what of it is verified
(speculation.py), how one request's output grows and ends (sequence.py, text.py) and what is counted
(stats.py).
"""
from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, replace

from actors.target_worker import Admission, Preempted, PrefillChunk, RequestFailed
from actors.worker import Worker
from cluster.engine.config import SchedulerConfig
from cluster.engine.constraints import RequestRules
from cluster.engine.cost import CostCurve
from cluster.engine.drafting import SentTokens
from cluster.engine.request import GenerationOutput, GenerationRequest
from cluster.engine.sequence import ActiveRequest
from cluster.engine.speculation import SpeculationController
from cluster.engine.stalls import StalledWorkers, WorkerTimeout, result_within
from cluster.engine.stats import EngineCounters
from cluster.engine.text import OutputText
from cluster.engine.tree_check import tree_problem
from speculators.hidden import PendingHidden
from speculators.logprobs import TokenLogprob
from speculators.tree import DraftTree
from speculators.verify import VerifyResult

log = logging.getLogger(__name__)

TARGET_FAILED = "the target worker group failed while decoding this request; retry it"
TARGET_UNAVAILABLE = "the target worker group is down and could not be rebuilt yet; retry later"


@dataclass
class _PendingDraft:
    future: Future
    drafter: int
    request_ids: list[str]
    submitted: float
    """When the draft was asked for: its wall time (overlapping a verify when pipelined) is shared
    by its requests as their draft time."""
    rows: int
    """Tokens the drafter catches up on in this call (what it had not seen of each request)."""


@dataclass
class StepEvent:
    request_id: str
    new_token_ids: list[int]
    finished: GenerationOutput | None = None
    text: str = ""
    """Output text now safe to send (held back while it could still become a stop string)."""
    logprobs: list[TokenLogprob] | None = None
    """The new tokens' log-probabilities, when the request asked for them."""


class SpecEngine:
    def __init__(
        self,
        target: Worker,
        tokenizer,
        drafters: Iterable[Worker] = (),
        config: SchedulerConfig = SchedulerConfig(),
        eos_token_ids: Iterable[int] = (),
        rebuild_target: Callable[[], Worker] | None = None,
        vocab_size: int | None = None,
        cost: CostCurve | None = None,
        costly_drafter: bool = False,
    ):
        """`cost` (the target's measured cost curve) turns on goodput-based draft sizing; without it
        every request drafts what its lookahead allows. A `costly_drafter` (a draft model, which pays
        a forward pass per drafted depth) is also told how deep to draft before it runs."""
        self.target, self.tokenizer, self.config = target, tokenizer, config
        self.speculation = SpeculationController(config, cost, costly_drafter)
        self.vocab_size = vocab_size
        self.drafters = list(drafters)
        self._sent = [SentTokens() for _ in self.drafters]
        self.rebuild_target = rebuild_target
        eos = set(eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.waiting: deque[GenerationRequest] = deque()
        self.preempted: deque[ActiveRequest] = deque()
        """Requests the KV cache ran out for, resumed before any waiting one, oldest first."""
        self._room_after_refusal = False
        """The target refused an admission for want of KV blocks: offer no more until blocks are freed."""
        self._prefilling: dict[str, None] = {}
        """Admitted requests whose prompts are still being prefilled chunk by chunk, in admission order."""
        self.kv_cache_usage: float | None = None
        """Fraction of the target's KV blocks held, as its last admission reported (None before one)."""
        self.active: dict[str, ActiveRequest] = {}
        self.counters = EngineCounters()
        self._pending_drafts: dict[int, _PendingDraft] = {}
        self._pending_starts: list[tuple[Future, list[str]]] = []
        self._next_group = 0
        self._hidden = PendingHidden()
        """The target's hidden states of committed tokens, until the request's next draft call."""
        self._stalled = StalledWorkers()
        self.unavailable: str | None = None
        """Why the target is down (its rebuild failed); None while it serves."""
        self._next_rebuild = 0.0

    # ---- requests in and out ------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        """Refuse a request the engine cannot serve, with a message naming the field."""
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
        if request.request_id in self.active or any(r.request_id == request.request_id for r in self.waiting):
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if not request.sampling.greedy and request.sampling.seed is None:
            # every tensor-parallel rank and every restarted drafter must draw the same numbers
            request.sampling = replace(request.sampling, seed=random.getrandbits(62))
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.preempted or self.active)

    @property
    def decoding(self) -> int:
        """Requests running past their prefill."""
        return len(self.active) - len(self._prefilling)

    @property
    def queue_depth(self) -> int:
        return len(self.waiting) + len(self.preempted)

    def abort(self, request_id: str) -> GenerationOutput | None:
        """Drop a request wherever it is, freeing its caches (a cancelled client)."""
        self.waiting = deque(r for r in self.waiting if r.request_id != request_id)
        resumable = next((s for s in self.preempted if s.request_id == request_id), None)
        if resumable is not None:
            self.preempted.remove(resumable)
            resumable.finish_reason = "abort"
            return resumable.final_output()
        state = self.active.get(request_id)
        if state is None:
            return None
        state.finish_reason = "abort"
        return self._finish(state)

    # ---- scheduling ---------------------------------------------------------------------------

    @property
    def _num_groups(self) -> int:
        return 2 if self.config.pipeline else 1

    def _admit(self) -> list[StepEvent]:
        """Offer the target the requests that may start (set-back ones first); it admits those its KV
        cache has room for and gives the rest back (`_check_starts`)."""
        if self._room_after_refusal:
            return []
        resumed, admitted = [], []
        while self.preempted and len(self.active) + len(resumed) < self.config.max_sequences:
            resumed.append(self.preempted.popleft())
        while self.waiting and len(self.active) + len(resumed) + len(admitted) < self.config.max_sequences:
            admitted.append(self.waiting.popleft())
        if not admitted and not resumed:
            return []
        now = time.perf_counter()
        offered = [(s.request_id, list(s.tokens), s.request.sampling, s.request.cache_scope) for s in resumed]
        offered += [(r.request_id, r.prompt_ids, r.sampling, r.cache_scope) for r in admitted]
        # no wait: the worker runs calls in order, so the prefill lands before the next verify
        try:
            start = self.target.submit("start", offered, *(() if self._chunk_tokens is None else (False,)))
        except Exception as error:  # a dead target: the requests become active below, then fail with it
            start, refused = None, error
        else:
            self._pending_starts.append((start, [request_id for request_id, *_ in offered]))
        for request in admitted:
            state = ActiveRequest(request=request, speculation=self.speculation.for_request(request), group=0,
                                  text=OutputText(self.tokenizer, request.stop), tokens=list(request.prompt_ids), started=now)
            state.stats.queue_seconds = now - request.arrival_time
            state.rules = RequestRules.of(request)
            resumed.append(state)
        for state in resumed:
            sizes = [sum(1 for s in self.active.values() if s.group == g) for g in range(self._num_groups)]
            state.group = sizes.index(min(sizes))
            self.active[state.request_id] = state
        return [] if start is not None else self._target_failed(refused)

    @property
    def _chunk_tokens(self) -> int | None:
        return self.config.prefill_chunk_tokens

    def _set_back(self, state: ActiveRequest) -> None:
        """Return an active request to the queues: its drafters forget it, its tokens so far stay."""
        self.active.pop(state.request_id)
        self._forget_prefill(state)
        self._hidden.drop(state.request_id)
        for drafter, sent in zip(self.drafters, self._sent):
            _tell(drafter, "release", [state.request_id], [], [])
            sent.forget([state.request_id])
        if state.output:
            self.preempted.append(state)
            self.preempted = deque(sorted(self.preempted, key=lambda s: s.started))
        else:
            self.waiting.appendleft(state.request)

    def _submit_draft(self, group: int, states: list[ActiveRequest]) -> _PendingDraft | None:
        if not self.drafters:
            return None
        requests = self.speculation.drafts(states)
        if not requests:
            return None
        count = len(self.drafters)
        index = next((i for i in ((group + k) % count for k in range(count))
                      if not self._stalled.is_stalled(self.drafters[i])), None)
        if index is None:  # every drafter is stuck in an earlier call: decode plainly
            return None
        requests = [replace(r, hidden=self._hidden.take(r.request_id)) for r in requests]
        outgoing = self._sent[index].outgoing(requests)
        submitted = time.perf_counter()  # before submit: a worker in this process drafts inside it
        future = self.drafters[index].submit("propose", outgoing)
        return _PendingDraft(future, index, [r.request_id for r in requests], submitted, sum(len(r.token_ids) for r in outgoing))

    def _collect_draft(self, pending: _PendingDraft | None) -> dict[str, DraftTree]:
        if pending is None:
            return {}
        began = time.perf_counter()
        try:
            reply = result_within(pending.future, self.config.draft_timeout_s, "the drafter")
            if len(reply.trees) != len(pending.request_ids):
                raise ValueError(f"{len(reply.trees)} trees for {len(pending.request_ids)} requests")
        except Exception as error:  # a dead, hung or restarting draft actor: decode plainly this step
            self._sent[pending.drafter].forget()
            if isinstance(error, WorkerTimeout):
                self._stalled.add(self.drafters[pending.drafter], pending.future)
            self.counters.draft_failures += 1
            log.warning("drafter failed (%s); %d requests decode without speculation this step",
                        error, len(pending.request_ids))
            return {}
        finally:
            done = time.perf_counter()
            self.counters.draft_wait_seconds += done - began
        trees = reply.trees
        self._sent[pending.drafter].forget(reply.unknown)
        share = (done - pending.submitted) / len(pending.request_ids)
        for request_id in pending.request_ids:
            if request_id in self.active:
                self.active[request_id].stats.draft_seconds += share
        usable = {request_id: tree for request_id, tree in zip(pending.request_ids, trees) if self._usable(request_id, tree)}
        self.speculation.observe_drafter(pending.rows, usable.values(), done - pending.submitted)
        return usable

    def _usable(self, request_id: str, tree: object) -> bool:
        """Whether a drafted tree may be verified; a bad one costs only its request's proposals."""
        state = self.active.get(request_id)
        if state is None:
            return False
        problem = tree_problem(tree, state.tokens, self.vocab_size, self.config.max_tree_nodes, self.config.max_len)
        if problem:
            self.counters.bad_trees += 1
            log.warning("drafter returned a bad tree for %s (%s); it decodes without speculation this step",
                        request_id, problem)
        return problem is None

    @staticmethod
    def _pruned(state: ActiveRequest, tree: DraftTree) -> DraftTree:
        """The tree without drafted tokens the request's grammar rules out (counted in its stats)."""
        if state.rules is None:
            return tree
        tree, pruned = state.rules.prune(tree)
        state.stats.grammar_pruned += pruned
        return tree

    def _check_starts(self) -> list[StepEvent]:
        """Prefills run without a wait; a batch whose prefill failed ends here, before any verify."""
        events = []
        for future, request_ids in list(self._pending_starts):
            try:
                admission: Admission = result_within(future, self.config.target_timeout_s, "the target's prefill")
                for request_id, rows in (admission.hidden or {}).items():
                    self._hidden.add(request_id, 0, rows)
            except Exception as error:
                if not isinstance(error, ValueError):  # dead or hung, not a refusal: every request goes with it
                    return events + self._target_failed(error)
                log.error("prefill failed: %s", error)
                for request_id in request_ids:
                    state = self.active[request_id]
                    state.fail(f"prefill failed: {error}")
                    events.append(self._finished_event(state))
                continue
            for request_id, cached in admission.cached_tokens.items():
                state = self.active[request_id]
                self.counters.prompt_tokens += len(state.tokens)
                self.counters.cached_prompt_tokens += cached
                if not state.output:
                    state.stats.cached_prompt_tokens = cached
                if self._chunk_tokens is not None:
                    state.prefill_left = len(state.tokens) - 1 - cached
                    self._prefilling[request_id] = None
            if admission.total_blocks:
                self.kv_cache_usage = 1 - admission.free_blocks / admission.total_blocks
            for request_id in reversed(admission.refused):
                self._set_back(self.active[request_id])
            self._room_after_refusal = bool(admission.refused)
        self._pending_starts.clear()
        return events

    def step(self) -> list[StepEvent]:
        """Verify one micro-batch (all active requests when pipelining is off)."""
        if self.unavailable is not None and not self._rebuilt():
            return self._refuse_waiting()
        failed = self._admit() + self._check_starts()
        if failed or not self.active:
            return failed
        group = self._next_group
        self._next_group = (group + 1) % self._num_groups
        chunks = self._next_chunks()
        if not chunks:  # prompts with nothing left to prefill (one token, or all cached) need no pass
            self._prefill_done([])
        states = self._decoding(group)
        if not states and not chunks:
            return []
        pending = self._pending_drafts.pop(group, None) or self._submit_draft(group, states)
        trees_by_id = self._collect_draft(pending)
        drafted = [trees_by_id.get(s.request_id) or DraftTree.root_only(s.tokens[-1]) for s in states]
        trees = self.speculation.trim(states, [self._pruned(s, t) for s, t in zip(states, drafted)], chunks)
        began = time.perf_counter()
        items = [_verify_item(s, t) for s, t in zip(states, trees)]
        verify = self.target.submit("verify", items, *((chunks,) if chunks else ()))
        if self.config.pipeline:
            other = (group + 1) % self._num_groups
            others = self._decoding(other)
            if others:
                drafted = self._submit_draft(other, others)
                if drafted:
                    self._pending_drafts[other] = drafted
        try:
            results = result_within(verify, self.config.target_timeout_s, "the target's verification")
        except Exception as error:
            return self._target_failed(error)
        seconds = time.perf_counter() - began
        self.counters.steps += 1
        self.counters.verify_seconds += seconds
        self._prefill_done(results[len(items):])
        events = [self._apply(state, tree, result, seconds / len(states)) for state, tree, result in zip(states, trees, results)]
        return [event for event in events if event is not None]

    def _decoding(self, group: int) -> list[ActiveRequest]:
        """The micro-batch's requests whose prompts are in the cache."""
        return [s for s in self.active.values() if s.group == group and s.request_id not in self._prefilling]

    def _next_chunks(self) -> list[tuple[str, int]]:
        """This pass's prompt chunks in admission order: at most `prefill_chunk_tokens` in all while
        any request decodes (a pass that holds up streams stays short), every prompt waiting when
        none does (nobody to hold up)."""
        budget = self._chunk_tokens if self.decoding else sum(self.active[r].prefill_left for r in self._prefilling)
        chunks = []
        for request_id in self._prefilling:
            state = self.active[request_id]
            count = min(state.prefill_left, budget)
            if count:
                chunks.append((request_id, count))
                budget -= count
            if count < state.prefill_left:
                break
        return chunks

    def _prefill_done(self, replies: list[PrefillChunk | Preempted]) -> None:
        """Chunks run (the rest of their prompts counted down, by what the prefix cache gave them
        too) and prompts the target preempted; prompts with nothing left start decoding."""
        for reply in replies:
            state = self.active.get(reply.seq_id)
            if state is None:
                continue
            if isinstance(reply, Preempted):
                self._preempted(state)
                continue
            state.prefill_left -= reply.cached + reply.tokens
            self.counters.cached_prompt_tokens += reply.cached
            if not state.output:
                state.stats.cached_prompt_tokens += reply.cached
            if reply.hidden is not None:
                self._hidden.add(reply.seq_id, reply.start, reply.hidden)
        for request_id in [r for r in self._prefilling if self.active[r].prefill_left <= 0]:
            self._prefilling.pop(request_id)

    def _preempted(self, state: ActiveRequest) -> None:
        """The KV cache was full: the target freed the request's blocks; it resumes once there is room."""
        self.counters.preemptions += 1
        state.stats.preemptions += 1
        self._set_back(state)
        self._room_after_refusal = False

    def _forget_prefill(self, state: ActiveRequest) -> None:
        self._prefilling.pop(state.request_id, None)

    def _apply(self, state: ActiveRequest, tree: DraftTree, result: VerifyResult | RequestFailed | Preempted,
               verify_seconds: float) -> StepEvent | None:
        state.stats.verify_seconds += verify_seconds
        if isinstance(result, RequestFailed):  # this request alone; its neighbours keep their output
            state.fail(result.reason)
            return self._finished_event(state)
        if isinstance(result, Preempted):
            self._preempted(state)
            return None
        self.counters.request_passes += 1
        state.stats.record(tree.depths[1:], len(result.accepted_tokens))
        self.speculation.observe(state, tree, result)
        if result.hidden is not None:
            self._hidden.add(state.request_id, len(state.tokens) - 1, result.hidden)
        new, text = state.append(result.new_tokens, self.eos_token_ids, self.config.max_len, result.logprobs)
        self.counters.tokens += len(new)
        if state.finish_reason:
            event = self._finished_event(state, new, text)
        else:
            if state.rules is not None:
                state.rules.commit(new)
            event = StepEvent(state.request_id, new, text=text)
        if state.request.logprobs is not None:
            event.logprobs = state.logprobs[len(state.logprobs) - len(new):]
        return event

    def _target_failed(self, error: Exception) -> list[StepEvent]:
        """Every active request lived in the failed group's caches: end them, rebuild the group."""
        log.error("target worker failed: %s", error)
        self.counters.target_failures += 1
        # a group about to be rebuilt is not told anything; one that stays must free the slots
        events = self.fail_all(f"{TARGET_FAILED} ({type(error).__name__})", notify_target=self.rebuild_target is None)
        if self.rebuild_target is not None:
            self.unavailable = f"{type(error).__name__}: {error}"
            self._rebuilt()
        return events

    def _rebuilt(self) -> bool:
        """Try to rebuild a failed target (at most once per rebuild_retry_s); whether it now serves."""
        if time.monotonic() < self._next_rebuild:
            return False
        try:
            self.target = self.rebuild_target()
        except Exception as error:
            log.error("rebuilding the target failed: %s; retrying in %g s", error, self.config.rebuild_retry_s)
            self.unavailable = f"rebuild failed: {type(error).__name__}: {error}"
            self._next_rebuild = time.monotonic() + self.config.rebuild_retry_s
            return False
        self.unavailable = None
        return True

    def _refuse_waiting(self) -> list[StepEvent]:
        """While the target is down, waiting requests end at once with a retryable error."""
        reason = f"{TARGET_UNAVAILABLE} ({self.unavailable})"
        refused = [StepEvent(r.request_id, [], GenerationOutput.refused(r, reason)) for r in self.waiting]
        for state in self.preempted:
            state.fail(reason)
            refused.append(StepEvent(state.request_id, [], state.final_output(), state.text.finish()))
        self.waiting.clear()
        self.preempted.clear()
        return refused

    @property
    def healthy(self) -> bool:
        """False while the target is down (a replica's health check then fails and Serve restarts it)."""
        return self.unavailable is None

    def fail_all(self, reason: str, notify_target: bool = True) -> list[StepEvent]:
        """End every active request with a retryable error (waiting requests stay queued)."""
        self._pending_drafts.clear()
        self._pending_starts.clear()
        self._prefilling.clear()
        events = []
        for state in list(self.active.values()):
            state.fail(reason)
            events.append(self._finished_event(state, notify_target=notify_target))
        return events

    # ---- output -------------------------------------------------------------------------------

    def _finished_event(self, state: ActiveRequest, new: list[int] = (), text: str = "",
                        notify_target: bool = True) -> StepEvent:
        output = self._finish(state, notify_target)
        return StepEvent(state.request_id, list(new), output, text + state.text.finish())

    def _finish(self, state: ActiveRequest, notify_target: bool = True) -> GenerationOutput:
        """Free the request's caches everywhere and build its output."""
        self.active.pop(state.request_id)
        self._forget_prefill(state)
        self._room_after_refusal = False
        self._hidden.drop(state.request_id)
        if notify_target:
            _tell(self.target, "finish", state.request_id)
        scope = state.request.cache_scope
        completed = [state.output] if state.finish_reason in ("stop", "length") and state.output \
            and scope is not None else []
        for drafter, sent in zip(self.drafters, self._sent):
            _tell(drafter, "release", [state.request_id], completed, [scope] * len(completed))
            sent.forget([state.request_id])
        return state.final_output()

    def generate(self, requests: Iterable[GenerationRequest]) -> list[GenerationOutput]:
        """Run requests to completion; outputs in the order given."""
        order = []
        for request in requests:
            self.add(request)
            order.append(request.request_id)
        done: dict[str, GenerationOutput] = {}
        while self.has_work:
            for event in self.step():
                if event.finished:
                    done[event.request_id] = event.finished
        return [done[request_id] for request_id in order]


def _verify_item(state: ActiveRequest, tree: DraftTree) -> tuple:
    """What the target verifies for one request: its tree, and the step's Shaping when it has rules."""
    if state.rules is None:
        return state.request_id, tree
    return state.request_id, tree, state.rules.shaping(tree, state.tokens)


def _tell(worker: Worker, method: str, *args) -> None:
    """A call whose answer nobody waits for; a dead worker must not stop the request from ending."""
    try:
        worker.submit(method, *args)
    except Exception as error:
        log.warning("could not send %s to a worker: %s", method, error)

