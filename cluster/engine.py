"""The speculative decoding engine: admit requests, draft, verify in one batched pass, commit.

Requests join and leave between steps (continuous batching). One step drafts a tree for every
active request that speculates, verifies all trees in a single packed forward of the target,
commits each request's accepted tokens and tells the drafter what was kept.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from actors.target_worker import TargetWorker
from cluster.request import GenerationOutput, GenerationRequest, RequestStats
from speculators.lookahead import LookaheadPolicy, make_policy
from speculators.proposers.base import DraftRequest, Proposer
from speculators.tree import DraftTree


@dataclass
class _Active:
    request: GenerationRequest
    policy: LookaheadPolicy
    tokens: list[int]
    output: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    started: float = field(default_factory=time.perf_counter)
    finish_reason: str | None = None
    text: str = ""


@dataclass
class StepEvent:
    request_id: str
    new_token_ids: list[int]
    finished: GenerationOutput | None = None


class SpecEngine:
    def __init__(
        self,
        target: TargetWorker,
        tokenizer: PreTrainedTokenizerBase,
        proposer: Proposer | None = None,
        max_tree_nodes: int = 32,
        eos_token_ids: Iterable[int] = (),
    ):
        self.target, self.tokenizer, self.proposer = target, tokenizer, proposer
        self.max_tree_nodes = max_tree_nodes
        eos = set(eos_token_ids) | set(target.model.config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.waiting: deque[GenerationRequest] = deque()
        self.active: dict[str, _Active] = {}

    def add(self, request: GenerationRequest) -> None:
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if request.request_id in self.active or any(r.request_id == request.request_id for r in self.waiting):
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.active)

    def _admit(self) -> None:
        admitted = []
        while self.waiting and self.target.free_sequences > len(admitted):
            admitted.append(self.waiting.popleft())
        if not admitted:
            return
        self.target.start([(r.request_id, r.prompt_ids, r.sampling) for r in admitted])
        now = time.perf_counter()
        for request in admitted:
            state = _Active(request, make_policy(request.lookahead), list(request.prompt_ids))
            state.stats.queue_seconds = now - request.arrival_time
            self.active[request.request_id] = state

    def _draft_request(self, state: _Active) -> DraftRequest | None:
        request = state.request
        if not (request.speculate and self.proposer):
            return None
        remaining = request.max_new_tokens - len(state.output)
        room = self.target.room(request.request_id) - 1
        depth = max(0, min(state.policy.depth(), remaining - 1, room - 1))
        nodes = max(0, min(self.max_tree_nodes, room - 1))
        return DraftRequest(request.request_id, state.tokens, depth, nodes, state.policy.threshold, request.sampling)

    def step(self) -> list[StepEvent]:
        self._admit()
        if not self.active:
            return []
        states = list(self.active.values())
        wanted = [(s, self._draft_request(s)) for s in states]
        drafting = [d for _, d in wanted if d is not None]
        began = time.perf_counter()
        proposed = dict(zip((d.request_id for d in drafting), self.proposer.propose(drafting))) if drafting else {}
        drafted = time.perf_counter()
        trees = [proposed.get(s.request.request_id) or DraftTree.root_only(s.tokens[-1]) for s in states]
        results = self.target.verify([(s.request.request_id, t) for s, t in zip(states, trees)])
        verified = time.perf_counter()
        events = []
        for state, tree, result in zip(states, trees, results):
            stats = state.stats
            stats.draft_seconds += (drafted - began) / len(states)
            stats.verify_seconds += (verified - drafted) / len(states)
            stats.record(tree.max_depth, tree.num_drafted, len(result.accepted_tokens))
            state.policy.observe(tree.max_depth, len(result.accepted_tokens))
            new = self._append(state, result.new_tokens)
            if self.proposer and state.request.speculate:
                self.proposer.on_accept(state.request.request_id, state.tokens)
            events.append(StepEvent(state.request.request_id, new, self._finish(state) if state.finish_reason else None))
        return events

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
        if state.finish_reason is None and self.target.room(request.request_id) <= 1:
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

    def _finish(self, state: _Active) -> GenerationOutput:
        request_id = state.request.request_id
        self.active.pop(request_id)
        self.target.finish(request_id)
        if self.proposer:
            self.proposer.release(request_id)
        text = state.text or self.tokenizer.decode(state.output, skip_special_tokens=True)
        seconds = time.perf_counter() - state.started
        return GenerationOutput(request_id, state.output, text, state.finish_reason, state.stats, seconds)

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is, freeing its caches (a cancelled client)."""
        self.waiting = deque(r for r in self.waiting if r.request_id != request_id)
        state = self.active.get(request_id)
        if state is not None:
            state.finish_reason = "abort"
            self._finish(state)

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
