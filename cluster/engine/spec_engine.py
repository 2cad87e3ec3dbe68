"""The speculative decoding engine: admit, draft, verify in one batched pass, commit, stream.

Requests join and leave between steps (continuous batching; which run and what each pass prefills
is the Scheduler's, scheduler.py). A step drafts a tree for each active request of one micro-batch,
verifies all of them in a single packed forward of the target worker (group), and commits each
request's accepted tokens. With `pipeline` on, active requests are split into two micro-batches
bound to their own drafter: while the target verifies one, the other is drafted, so a step costs
about max(draft, verify) instead of their sum.

Workers are reached through `submit(method, *args, **kwargs) -> Future` (actors/worker.py), so the
same code drives in-process workers and Ray actors; a target's calls carry the typed messages of
actors/messages.py. A drafter that fails, hangs or returns a bad tree costs one plain step; a
request whose verification raises fails alone; a target that fails or hangs ends the requests it
held with a retryable error and is rebuilt; a batch the target refuses (AdmissionRefused) fails alone.

Other jobs live beside this module: how much each request drafts and what of it is verified
(speculation.py), how one request's output grows and ends (sequence.py, text.py) and what is counted
(stats.py).
"""
from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace

from actors.messages import (
    Admission,
    AdmissionRefused,
    AdmitItem,
    Preempted,
    RequestFailed,
    VerifyItem,
    VerifyReply,
    Waiting,
)
from actors.worker import Worker, tell
from cluster.engine.config import SchedulerConfig
from cluster.engine.constraints import RequestRules
from cluster.engine.cost import CostCurve
from cluster.engine.drafting import PendingDraft, SentTokens
from cluster.engine.recovery import TargetRecovery
from cluster.engine.request import GenerationOutput, GenerationRequest
from cluster.engine.scheduler import Scheduler
from cluster.engine.sequence import ActiveRequest
from cluster.engine.speculation import SpeculationController, speculates
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
        self.counters = EngineCounters()
        self.speculation = SpeculationController(config, cost, costly_drafter, self.counters)
        self.vocab_size = vocab_size
        self.drafters = list(drafters)
        self._sent = [SentTokens() for _ in self.drafters]
        eos = set(eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.scheduler = Scheduler(config, self.counters, vocab_size, release=self._forget_drafts, cost=cost)
        self._pending_drafts: dict[int, PendingDraft] = {}
        self._pending_starts: list[tuple[Future, list[str]]] = []
        self._hidden = PendingHidden()
        """The target's hidden states of committed tokens, until the request's next draft call."""
        self._drafts_prompts = not self.drafters or not self.drafters[0].submit("hidden_spec").result()[0]
        self._reads_verified = bool(self.drafters) and self.drafters[0].submit("reads_verified").result()
        self._stalled = StalledWorkers()
        self.recovery = TargetRecovery(rebuild_target, config.rebuild_retry_s)

    # ---- requests in and out ------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        """Refuse a request the engine cannot serve, with a message naming the field."""
        self.scheduler.validate(request)

    def add(self, request: GenerationRequest) -> None:
        self.scheduler.add(request)
        sampling = request.sampling
        if not sampling.greedy and sampling.seed is None:
            # every tensor-parallel rank and every restarted drafter must draw the same numbers
            rule = self.config.sampling_rule if sampling.rule == "auto" else sampling.rule
            request.sampling = replace(sampling, seed=random.getrandbits(62), rule=rule)

    @property
    def active(self) -> dict[str, ActiveRequest]:
        return self.scheduler.active

    @property
    def waiting(self) -> deque[GenerationRequest]:
        return self.scheduler.waiting

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def queue_depth(self) -> int:
        return self.scheduler.queue_depth

    @property
    def kv_cache_usage(self) -> float | None:
        """Fraction of the target's KV blocks held, as its last admission reported (None before one)."""
        return self.scheduler.kv_cache_usage

    def abort(self, request_id: str) -> GenerationOutput | None:
        """Drop a request wherever it is, freeing its caches (a cancelled client)."""
        resumable = self.scheduler.withdraw(request_id)
        if resumable is not None:
            resumable.finish_reason = "abort"
            return resumable.final_output()
        state = self.active.get(request_id)
        if state is None:
            return None
        state.finish_reason = "abort"
        return self._finish(state)

    # ---- scheduling ---------------------------------------------------------------------------

    def _admit(self) -> list[StepEvent]:
        """Offer the target the requests the scheduler lets start (set-back ones first); it admits
        those its KV cache has room for and gives the rest back (`_check_starts`)."""
        resumed, admitted = self.scheduler.offer()
        if not admitted and not resumed:
            return []
        now = time.perf_counter()
        offered = [_admit_item(s.request, list(s.tokens)) for s in resumed]
        offered += [_admit_item(r, r.prompt_ids) for r in admitted]
        # no wait: the worker runs calls in order, so the prefill lands before the next verify
        try:
            start = self.target.submit("start", offered, prefill=not self.scheduler.chunked)
        except Exception as error:  # a dead target: the requests become active below, then fail with it
            start, refused = None, error
        else:
            self._pending_starts.append((start, [item.request_id for item in offered]))
        for request in admitted:
            state = ActiveRequest(request=request, speculation=self.speculation.for_request(request), group=0,
                                  text=OutputText(self.tokenizer, request.stop), tokens=list(request.prompt_ids), started=now)
            state.stats.queue_seconds = now - request.arrival_time
            state.rules = RequestRules.of(request)
            resumed.append(state)
        self.scheduler.run(resumed)
        return [] if start is not None else self._target_failed(refused)

    def _forget_drafts(self, state: ActiveRequest, completed: Sequence[list[int]] = (), scopes: Sequence[str] = ()) -> None:
        """Its hidden states are dropped; its drafters forget it, told the output it `completed` in each of `scopes`."""
        self._hidden.drop(state.request_id)
        for drafter, sent in zip(self.drafters, self._sent):
            tell(drafter, "release", [state.request_id], list(completed), list(scopes))
            sent.forget([state.request_id])

    def _submit_draft(self, group: int, states: list[ActiveRequest]) -> PendingDraft | None:
        if not self.drafters:
            return None
        building = time.perf_counter()
        requests = self.speculation.drafts(states)
        self._hidden.idle({s.request_id for s in states} - {r.request_id for r in requests})
        if not requests:
            return None
        count = len(self.drafters)
        index = next((i for i in ((group + k) % count for k in range(count))
                      if not self._stalled.is_stalled(self.drafters[i])), None)
        if index is None:  # every drafter is stuck in an earlier call: decode plainly
            return None
        taken = {r.request_id: self._hidden.take(r.request_id) for r in requests}
        outgoing = self._sent[index].outgoing([replace(r, hidden=taken[r.request_id]) for r in requests])
        submitted = time.perf_counter()  # before submit: a worker in this process drafts inside it
        future = self.drafters[index].submit("propose", outgoing)
        return PendingDraft(future=future, drafter=index, submitted=submitted, request_ids=list(taken),
                            rows=sum(len(r.token_ids) for r in outgoing), hidden=taken,
                            engine_seconds=time.perf_counter() - building)

    def _collect_draft(self, pending: PendingDraft | None) -> dict[str, DraftTree]:
        if pending is None:
            return {}
        began = time.perf_counter()
        try:
            reply = result_within(pending.future, self.config.draft_timeout_s, "the drafter")
            if len(reply.trees) != len(pending.request_ids):
                raise ValueError(f"{len(reply.trees)} trees for {len(pending.request_ids)} requests")
        except Exception as error:  # a dead, hung or restarting draft actor: decode plainly this step
            self._sent[pending.drafter].forget()
            pending.give_back(self._hidden, pending.request_ids, self.active)
            if isinstance(error, WorkerTimeout):
                self._stalled.add(self.drafters[pending.drafter], pending.future)
            self.counters.draft_failures += 1
            pending.engine_seconds = None  # a failed call says nothing of what calls save
            log.warning("drafter failed (%s); %d requests decode without speculation this step",
                        error, len(pending.request_ids))
            return {}
        finally:
            done = time.perf_counter()
            self.counters.draft_wait_seconds += done - began
            if pending.engine_seconds is not None:
                pending.engine_seconds += done - began
        trees = reply.trees
        self._sent[pending.drafter].forget(reply.unknown)
        pending.give_back(self._hidden, reply.unknown, self.active)
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

    def _check_starts(self) -> list[StepEvent]:
        """Prefills run without a wait; a batch whose prefill failed ends here, before any verify."""
        events = []
        for future, request_ids in list(self._pending_starts):
            try:
                admission: Admission = result_within(future, self.config.target_timeout_s, "the target's prefill")
            except AdmissionRefused as error:  # requests it can never serve: they fail, the target serves on
                log.error("prefill failed: %s", error)
                for request_id in request_ids:
                    state = self.active[request_id]
                    state.fail(f"prefill failed: {error}")
                    events.append(self._finished_event(state))
                continue
            except Exception as error:  # dead or hung, not a refusal: every request goes with it
                return events + self._target_failed(error)
            for request_id, rows in (admission.hidden or {}).items():
                self._hidden.add(request_id, 0, rows)
            self.scheduler.admitted(admission)
        self._pending_starts.clear()
        return events

    def step(self) -> list[StepEvent]:
        """Verify one micro-batch (all active requests when pipelining is off)."""
        if self.recovery.unavailable is not None and not self._rebuilt():
            return self._refuse_waiting()
        failed = self._admit() + self._check_starts()
        if failed or not self.active:
            return failed
        plan = self.scheduler.plan()
        group, chunks, starting = plan.group, plan.chunks, self.scheduler.finishing(plan.chunks)
        # a prompt the pass finishes has its first root verified in it (drafted, unless the drafter reads hidden
        # states, which come with the pass; its tree priced as in a pass of its own): the first token a pass sooner
        states, decoding = plan.decoding + starting, len(plan.decoding)
        if not states and not chunks:
            return []
        drafting = states if self._drafts_prompts else plan.decoding
        pending = self._pending_drafts.pop(group, None) or self._submit_draft(group, drafting)
        trees_by_id = self._collect_draft(pending)
        drafted = [trees_by_id.get(s.request_id) or DraftTree.root_only(s.tokens[-1]) for s in states]
        pruned = [s.pruned(t) for s, t in zip(states, drafted)]
        trees = self.speculation.trim([(plan.decoding, pruned[:decoding], chunks), (starting, pruned[decoding:], [])],
                                      None if pending is None else pending.engine_seconds)
        began = time.perf_counter()
        items = [_verify_item(s, t, i >= decoding and speculates(s), self._reads_verified and t.num_drafted > 0)
                 for i, (s, t) in enumerate(zip(states, trees))]
        verify = self.target.submit("verify", items, chunks)
        if self.config.pipeline:
            other = (group + 1) % self.scheduler.groups
            others = self.scheduler.decoding_in(other)
            if others:
                drafted = self._submit_draft(other, others)
                if drafted:
                    self._pending_drafts[other] = drafted
        try:
            reply: VerifyReply = result_within(verify, self.config.target_timeout_s, "the target's verification")
        except Exception as error:
            return self._target_failed(error)
        seconds = time.perf_counter() - began
        self.counters.steps += 1
        self.counters.verify_seconds += seconds
        for chunk in reply.prefill:  # a head drafts from the prompt's hidden states
            if chunk.hidden is not None and chunk.seq_id in self.active:
                self._hidden.add(chunk.seq_id, chunk.start, chunk.hidden)
        self._hidden.idle([s.request_id for s in starting if not speculates(s)])  # as a draft call would
        self.scheduler.prefilled(reply.prefill, reply.preempted, decoded_tokens=sum(tree.size for tree in trees))
        events = [self._apply(state, tree, result, seconds / len(states))
                  for state, tree, result in zip(states, trees, reply.results)]
        self.speculation.observe_step(states, trees, chunks, time.perf_counter() - began)
        return [event for event in events if event is not None]

    def _apply(self, state: ActiveRequest, tree: DraftTree, result: VerifyResult | RequestFailed | Preempted | Waiting,
               verify_seconds: float) -> StepEvent | None:
        state.stats.verify_seconds += verify_seconds
        if isinstance(result, RequestFailed):  # this request alone; its neighbours keep their output
            state.fail(result.reason)
            return self._finished_event(state)
        if isinstance(result, Preempted):
            self.scheduler.preempt(state)
            return None
        if isinstance(result, Waiting):  # its prompt's last chunk waited: verified once the prompt is in
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
        events = self.fail_all(f"{TARGET_FAILED} ({type(error).__name__})", notify_target=self.recovery.rebuild is None)
        if self.recovery.rebuild is not None:
            self.recovery.down(error)
            self._rebuilt()
        return events

    def _rebuilt(self) -> bool:
        """Try to rebuild the failed target (recovery.py); whether it now serves."""
        target = self.recovery.try_rebuild()
        if target is not None:
            self.target = target
        return target is not None

    def _refuse_waiting(self) -> list[StepEvent]:
        """While the target is down, waiting requests end at once with a retryable error."""
        reason = f"{TARGET_UNAVAILABLE} ({self.recovery.unavailable})"
        waiting, preempted = self.scheduler.drain()
        refused = [StepEvent(r.request_id, [], GenerationOutput.refused(r, reason)) for r in waiting]
        for state in preempted:
            state.fail(reason)
            refused.append(StepEvent(state.request_id, [], state.final_output(), state.text.finish()))
        return refused

    @property
    def healthy(self) -> bool:
        """False once a rebuild of the target failed (Serve then replaces the replica); a rebuild under way is not."""
        return not self.recovery.failed

    @property
    def ready(self) -> bool:
        """Whether the target serves now: False while it is down or being rebuilt."""
        return self.recovery.unavailable is None

    def fail_all(self, reason: str, notify_target: bool = True) -> list[StepEvent]:
        """End every active request with a retryable error (waiting requests stay queued)."""
        self._pending_drafts.clear()
        self._pending_starts.clear()
        events = []
        for state in list(self.active.values()):
            state.fail(reason)
            events.append(self._finished_event(state, notify_target=notify_target))
        return events

    # ---- output -------------------------------------------------------------------------------

    def _finished_event(self, state: ActiveRequest, new: list[int] = (), text: str = "",
                        notify_target: bool = True) -> StepEvent:
        output = self._finish(state, notify_target)
        return StepEvent(request_id=state.request_id, new_token_ids=list(new), finished=output, text=text + state.text.finish())

    def _finish(self, state: ActiveRequest, notify_target: bool = True) -> GenerationOutput:
        """Free the request's caches everywhere and build its output."""
        self.scheduler.finished(state)
        if notify_target:
            tell(self.target, "finish", state.request_id)
        scope = state.request.cache_scope
        completed = [state.output] if state.finish_reason in ("stop", "length") and state.output \
            and scope is not None else []
        self._forget_drafts(state, completed, [scope] * len(completed))
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


def _admit_item(request: GenerationRequest, tokens: list[int]) -> AdmitItem:
    """What the target admits for one request: its tokens so far (a prompt, or a resumed request's)."""
    return AdmitItem(request.request_id, tokens, request.sampling, request.cache_scope)


def _verify_item(state: ActiveRequest, tree: DraftTree, keep_rows: bool, predictions: bool) -> VerifyItem:
    """What the target verifies for one request: its tree, and the step's Shaping when it has rules."""
    return VerifyItem(state.request_id, tree, None if state.rules is None else state.rules.shaping(tree, state.tokens),
                      keep_rows, predictions)


