"""The speculative decoding engine: admit, draft, verify in one batched pass, commit, stream.

Requests join and leave between steps (continuous batching). A step drafts a tree for each active
request of one micro-batch, verifies all of them in a single packed forward of the target worker
(group), and commits each request's accepted tokens. With `pipeline` on, active requests are split
into two micro-batches bound to their own drafter: while the target verifies one, the other is
drafted, so a step costs about max(draft, verify) instead of their sum.

Workers are reached through `submit(method, *args) -> Future` (cluster/workers.py), so the same
code drives in-process workers and Ray actors. A drafter that fails costs its micro-batch one plain
step; a target that fails ends the requests it held with a retryable error and is rebuilt.
"""
from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from cluster.config import SchedulerConfig
from cluster.request import GenerationOutput, GenerationRequest, RequestStats
from cluster.workers import Worker
from speculators.lookahead import LookaheadPolicy, make_policy
from speculators.proposers.base import DraftRequest
from speculators.tree import DraftTree
from speculators.verify import VerifyResult

log = logging.getLogger(__name__)

TARGET_FAILED = "the target worker group failed while decoding this request; retry it"


@dataclass
class SpeculationGate:
    """Switches speculation off for a request whose drafts keep being rejected, then retries.

    Tracks an exponential average of the fraction of drafted depth the target accepted.
    """

    min_acceptance: float
    warmup_steps: int
    cooloff_steps: int
    average: float = 1.0
    drafted_steps: int = 0
    off_for: int = 0

    def open(self) -> bool:
        if self.off_for > 0:
            self.off_for -= 1
            return False
        return True

    def observe(self, drafted_depth: int, accepted: int) -> None:
        if drafted_depth == 0:
            return
        self.drafted_steps += 1
        self.average = 0.7 * self.average + 0.3 * (accepted / drafted_depth)
        if self.drafted_steps >= self.warmup_steps and self.average < self.min_acceptance:
            self.off_for = self.cooloff_steps
            self.average, self.drafted_steps = 1.0, 0


@dataclass
class _Active:
    request: GenerationRequest
    policy: LookaheadPolicy
    gate: SpeculationGate
    tokens: list[int]
    group: int
    output: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    started: float = field(default_factory=time.perf_counter)
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""


@dataclass
class _PendingDraft:
    future: Future
    request_ids: list[str]
    submitted: float
    """When the draft was asked for: its wall time (overlapping a verify when pipelined) is shared
    by its requests as their draft time."""


@dataclass
class StepEvent:
    request_id: str
    new_token_ids: list[int]
    finished: GenerationOutput | None = None


@dataclass
class EngineCounters:
    steps: int = 0
    verify_seconds: float = 0.0
    draft_wait_seconds: float = 0.0
    draft_failures: int = 0
    target_failures: int = 0
    tokens: int = 0


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
    ):
        self.target, self.tokenizer, self.config = target, tokenizer, config
        self.vocab_size = vocab_size
        self.drafters = list(drafters)
        self.rebuild_target = rebuild_target
        eos = set(eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.waiting: deque[GenerationRequest] = deque()
        self.active: dict[str, _Active] = {}
        self.counters = EngineCounters()
        self._pending_drafts: dict[int, _PendingDraft] = {}
        self._pending_starts: list[tuple[Future, list[str]]] = []
        self._next_group = 0

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
        return bool(self.waiting or self.active)

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    def abort(self, request_id: str) -> GenerationOutput | None:
        """Drop a request wherever it is, freeing its caches (a cancelled client)."""
        self.waiting = deque(r for r in self.waiting if r.request_id != request_id)
        state = self.active.get(request_id)
        if state is None:
            return None
        state.finish_reason = "abort"
        return self._finish(state)

    # ---- scheduling ---------------------------------------------------------------------------

    @property
    def _num_groups(self) -> int:
        return 2 if self.config.pipeline else 1

    def _admit(self) -> None:
        admitted = []
        while self.waiting and len(self.active) + len(admitted) < self.config.max_sequences:
            admitted.append(self.waiting.popleft())
        if not admitted:
            return
        now = time.perf_counter()
        # no wait: the worker runs calls in order, so the prefill lands before the next verify
        start = self.target.submit("start", [(r.request_id, r.prompt_ids, r.sampling) for r in admitted])
        self._pending_starts.append((start, [r.request_id for r in admitted]))
        for request in admitted:
            sizes = [sum(1 for s in self.active.values() if s.group == g) for g in range(self._num_groups)]
            gate = SpeculationGate(self.config.min_acceptance, self.config.gate_warmup_steps, self.config.gate_cooloff_steps)
            state = _Active(request, make_policy(request.lookahead or self.config.lookahead), gate, list(request.prompt_ids),
                            sizes.index(min(sizes)), started=now)
            state.stats.queue_seconds = now - request.arrival_time
            self.active[request.request_id] = state

    def _draft_requests(self, states: list[_Active]) -> list[DraftRequest]:
        """What each speculating request may draft this step, within the step's token budget."""
        speculating = [s for s in states if s.request.speculate and s.gate.open()]
        if not speculating:
            return []
        share = self.config.step_token_budget // len(speculating)
        drafts = []
        for state in speculating:
            request = state.request
            remaining = request.max_new_tokens - len(state.output)
            room = self.config.max_len - len(state.tokens) - 1  # cache positions left after the root
            depth = max(0, min(state.policy.depth(), remaining - 1, room))
            nodes = max(0, min(self.config.max_tree_nodes, share, room))
            if depth and nodes:
                drafts.append(DraftRequest(request.request_id, list(state.tokens), depth, nodes,
                                           state.policy.threshold, request.sampling))
        return drafts

    def _submit_draft(self, group: int, states: list[_Active]) -> _PendingDraft | None:
        if not self.drafters:
            return None
        requests = self._draft_requests(states)
        if not requests:
            return None
        drafter = self.drafters[group % len(self.drafters)]
        return _PendingDraft(drafter.submit("propose", requests), [r.request_id for r in requests], time.perf_counter())

    def _collect_draft(self, pending: _PendingDraft | None) -> dict[str, DraftTree]:
        if pending is None:
            return {}
        began = time.perf_counter()
        try:
            trees = pending.future.result()
        except Exception as error:  # a dead or restarting draft actor: decode plainly this step
            self.counters.draft_failures += 1
            log.warning("drafter failed (%s); %d requests decode without speculation this step",
                        error, len(pending.request_ids))
            return {}
        finally:
            done = time.perf_counter()
            self.counters.draft_wait_seconds += done - began
        share = (done - pending.submitted) / len(pending.request_ids)
        for request_id in pending.request_ids:
            if request_id in self.active:
                self.active[request_id].stats.draft_seconds += share
        return dict(zip(pending.request_ids, trees))

    def _check_starts(self) -> list[StepEvent]:
        """Prefills run without a wait; a batch whose prefill failed ends here, before any verify."""
        events = []
        for future, request_ids in self._pending_starts:
            try:
                future.result()
            except Exception as error:
                log.error("prefill failed: %s", error)
                for request_id in request_ids:
                    state = self.active[request_id]
                    state.finish_reason, state.error = "error", f"prefill failed: {error}"
                    events.append(StepEvent(request_id, [], self._finish(state)))
        self._pending_starts.clear()
        return events

    def step(self) -> list[StepEvent]:
        """Verify one micro-batch (all active requests when pipelining is off)."""
        self._admit()
        failed = self._check_starts()
        if failed or not self.active:
            return failed
        group = self._next_group
        self._next_group = (group + 1) % self._num_groups
        states = [s for s in self.active.values() if s.group == group]
        if not states:
            return []
        pending = self._pending_drafts.pop(group, None) or self._submit_draft(group, states)
        trees_by_id = self._collect_draft(pending)
        trees = [trees_by_id.get(s.request.request_id) or DraftTree.root_only(s.tokens[-1]) for s in states]
        began = time.perf_counter()
        verify = self.target.submit("verify", [(s.request.request_id, t) for s, t in zip(states, trees)])
        if self.config.pipeline:
            other = (group + 1) % self._num_groups
            others = [s for s in self.active.values() if s.group == other]
            if others:
                drafted = self._submit_draft(other, others)
                if drafted:
                    self._pending_drafts[other] = drafted
        try:
            results = verify.result()
        except Exception as error:
            return self._target_failed(error)
        seconds = time.perf_counter() - began
        self.counters.steps += 1
        self.counters.verify_seconds += seconds
        return [self._apply(state, tree, result, seconds / len(states)) for state, tree, result in zip(states, trees, results)]

    def _apply(self, state: _Active, tree: DraftTree, result: VerifyResult, verify_seconds: float) -> StepEvent:
        stats = state.stats
        stats.verify_seconds += verify_seconds
        accepted = len(result.accepted_tokens)
        stats.record(tree.max_depth, tree.num_drafted, accepted)
        state.policy.observe(tree.max_depth, accepted)
        state.gate.observe(tree.max_depth, accepted)
        new = self._append(state, result.new_tokens)
        self.counters.tokens += len(new)
        finished = self._finish(state) if state.finish_reason else None
        return StepEvent(state.request.request_id, new, finished)

    def _target_failed(self, error: Exception) -> list[StepEvent]:
        """Every active request lived in the failed group's caches: end them, rebuild the group."""
        log.error("target worker failed: %s", error)
        self.counters.target_failures += 1
        # a group about to be rebuilt is not told anything; one that stays must free the slots
        events = self.fail_all(f"{TARGET_FAILED} ({type(error).__name__})", notify_target=self.rebuild_target is None)
        if self.rebuild_target is not None:
            self.target = self.rebuild_target()
        return events

    def fail_all(self, reason: str, notify_target: bool = True) -> list[StepEvent]:
        """End every active request with a retryable error (waiting requests stay queued)."""
        self._pending_drafts.clear()
        self._pending_starts.clear()
        events = []
        for state in list(self.active.values()):
            state.finish_reason, state.error = "error", reason
            events.append(StepEvent(state.request.request_id, [], self._finish(state, notify_target)))
        return events

    # ---- output -------------------------------------------------------------------------------

    def _append(self, state: _Active, tokens: list[int]) -> list[int]:
        """Add accepted tokens up to EOS, max_new_tokens, the context window or a stop string."""
        request = state.request
        if state.stats.time_to_first_token is None:
            state.stats.time_to_first_token = time.perf_counter() - request.arrival_time
        new = []
        for token in tokens:
            new.append(token)
            if token in self.eos_token_ids:
                state.finish_reason = "stop"
                break
            if len(state.output) + len(new) >= request.max_new_tokens:
                state.finish_reason = "length"
                break
        state.output.extend(new)
        state.tokens.extend(new)
        if state.finish_reason is None and len(state.tokens) >= self.config.max_len:
            state.finish_reason = "length"
        if request.stop:
            new = self._apply_stop_strings(state, new)
        return new

    def _apply_stop_strings(self, state: _Active, new: list[int]) -> list[int]:
        text = self.tokenizer.decode(state.output, skip_special_tokens=True)
        hits = [text.find(stop) for stop in state.request.stop if stop and stop in text]
        if not hits:
            return new
        cut = min(hits)
        keep = len(state.output)
        while keep > 0 and len(self.tokenizer.decode(state.output[: keep - 1], skip_special_tokens=True)) >= cut:
            keep -= 1
        dropped = len(state.output) - keep
        del state.output[keep:]
        del state.tokens[len(state.tokens) - dropped:]
        state.finish_reason = "stop"
        state.text = text[:cut]
        return new[: max(0, len(new) - dropped)]

    def _finish(self, state: _Active, notify_target: bool = True) -> GenerationOutput:
        request_id = state.request.request_id
        self.active.pop(request_id)
        if notify_target:
            self.target.submit("finish", request_id)
        for drafter in self.drafters:
            drafter.submit("release", [request_id])
        text = state.text or self.tokenizer.decode(state.output, skip_special_tokens=True)
        seconds = time.perf_counter() - state.started
        return GenerationOutput(request_id, state.output, text, state.finish_reason, state.stats, seconds, state.error)

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
