"""The draft side: one proposer and the per-request state it keeps, behind a small API.

A draft worker learns what the target accepted from the token ids of the next `propose` call, so
the engine never needs a separate round trip to roll it back. Only the tokens committed since the
previous call travel (`DraftRequest.start`); the worker keeps each request's sequence. It runs
in-process (the CLI) or as a Ray actor on its own GPU set (the cluster); a restarted actor, which
has lost the sequences, names the requests it does not know and the engine sends them whole next
time.

Finished outputs are learned (suffix decoding's index of earlier outputs) in `release`, or, with
`learn_in_background`, on a thread of the worker's own, in short steps taken only while no call of
the worker runs or waits: a `propose` waits for at most one short step instead of the whole learning
of the outputs released before it. A step pauses the learner briefly so that a call waiting for the
interpreter lock gets it (without the pause a call waited a whole switch interval behind the
learner; figures: docs/benchmarks.md, "Measurements behind the code"). `flush` waits until
everything released is learned (tests, benchmarks).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

from speculators.proposers.base import DraftRequest, Proposer
from speculators.tree import DraftTree

log = logging.getLogger(__name__)
MAX_PENDING_OUTPUTS = 1024
"""Outputs waiting to be learned; past this the oldest waiting one is dropped (learning fell behind)."""
LEARN_PAUSE_S = 50e-6
"""The learner's pause after each step, which lets a waiting call take the interpreter lock."""
_DONE = object()


@dataclass
class DraftReply:
    trees: list[DraftTree]
    unknown: list[str]
    """Requests sent in part whose earlier tokens this worker does not have (root-only trees)."""
    busy_s: float = 0.0
    """Seconds the worker spent on the call: its caller's round trip less this is the wait (queue,
    transfer) that a draft pool sizes itself on."""


class BackgroundLearner:
    """Learns outputs on a thread of its own, one step at a time (`Proposer.learn_steps`), while no
    call holds or waits for the proposer (`call`)."""

    def __init__(self, proposer: Proposer):
        self.proposer = proposer
        self._lock = threading.Lock()  # held by whoever uses the proposer
        self._state = threading.Condition()  # guards what follows
        self._calls = 0
        self._pending: deque[tuple[Sequence[int], str]] = deque()
        self._learning = False
        self.dropped = 0
        threading.Thread(target=self._run, name="draft-learner", daemon=True).start()

    @contextmanager
    def call(self) -> Iterator[None]:
        """Use the proposer; the learner takes no step until no call runs or waits."""
        with self._state:
            self._calls += 1
        try:
            with self._lock:
                yield
        finally:
            with self._state:
                self._calls -= 1
                self._state.notify_all()

    def put(self, output: Sequence[int], scope: str) -> None:
        with self._state:
            if len(self._pending) >= MAX_PENDING_OUTPUTS:
                self._pending.popleft()
                self.dropped += 1
                if self.dropped % 1000 == 1:
                    log.warning("learning finished outputs fell behind: %d dropped unlearned so far", self.dropped)
            self._pending.append((output, scope))
            self._state.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every output put is learned; False if `timeout` passed first."""
        with self._state:
            return self._state.wait_for(lambda: not self._pending and not self._learning, timeout)

    def _run(self) -> None:
        while True:
            with self._state:
                self._state.wait_for(lambda: self._pending)
                output, scope = self._pending.popleft()
                self._learning = True
            try:
                steps = self.proposer.learn_steps(output, scope)
                while True:
                    with self._state:
                        self._state.wait_for(lambda: not self._calls)
                    with self._lock:
                        if next(steps, _DONE) is _DONE:
                            break
                    time.sleep(LEARN_PAUSE_S)
            except Exception:  # a bad output must not stop learning for good
                log.exception("learning a finished output failed")
            finally:
                with self._state:
                    self._learning = False
                    self._state.notify_all()


class DraftWorker:
    def __init__(self, build_proposer: Callable[[], Proposer], learn_in_background: bool = False):
        """`build_proposer` runs where the worker lives, so a Ray actor loads its own draft model.
        `learn_in_background`: learn finished outputs on a thread (see the module's docstring);
        False learns them in `release`, so what a later request drafts does not depend on timing."""
        self.proposer = build_proposer()
        self._sequences: dict[str, list[int]] = {}
        self.learner = BackgroundLearner(self.proposer) if learn_in_background else None

    def _using(self):
        return nullcontext() if self.learner is None else self.learner.call()

    def propose(self, requests: Sequence[DraftRequest]) -> DraftReply:
        began = time.perf_counter()
        with self._using():
            reply = self._propose(requests)
        reply.busy_s = time.perf_counter() - began
        return reply

    def _propose(self, requests: Sequence[DraftRequest]) -> DraftReply:
        whole, unknown = [], []
        for request in requests:
            known = self._sequences.get(request.request_id, [])
            if request.start > len(known):
                unknown.append(request.request_id)
                continue
            tokens = known[: request.start] + list(request.token_ids)
            self._sequences[request.request_id] = tokens
            self.proposer.on_accept(request.request_id, tokens)
            whole.append(replace(request, token_ids=tokens, start=0))
        trees = iter(self.proposer.propose(whole))
        return DraftReply([DraftTree.root_only(r.token_ids[-1]) if r.request_id in unknown else next(trees)
                           for r in requests], unknown)

    def release(self, request_ids: Sequence[str], outputs: Sequence[Sequence[int]] = (),
                scopes: Sequence[str | None] = ()) -> None:
        """Free finished requests' state, and learn from the outputs of those that completed (every
        draft actor gets every output, whichever actor drafted for the request), each under its
        cache scope (`scopes[i]` of `outputs[i]`; "" where not given; None: not learned)."""
        with self._using():
            for request_id in request_ids:
                self._sequences.pop(request_id, None)
                self.proposer.release(request_id)
        for index, output in enumerate(outputs):
            scope = scopes[index] if index < len(scopes) else ""
            if scope is None:
                continue
            if self.learner is None:
                for _ in self.proposer.learn_steps(output, scope):
                    pass
            else:
                self.learner.put(output, scope)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every output released so far is learned (at once without a background learner)."""
        return True if self.learner is None else self.learner.flush(timeout)

    def runs_a_model(self) -> bool:
        return self.proposer.runs_a_model

    def reads_verified(self) -> bool:
        return self.proposer.reads_verified

    def hidden_spec(self) -> tuple[tuple[int, ...], str]:
        """The target hidden states the proposer reads, and their dtype's name (for the target)."""
        return tuple(self.proposer.hidden_layers), str(self.proposer.hidden_dtype).removeprefix("torch.")

    def ping(self) -> bool:
        return True
