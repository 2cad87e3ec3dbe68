"""The draft worker's background learner: outputs are learned off the path of the next `propose`,
which waits for one step of learning at most, and `flush` waits until all of them are learned."""
from __future__ import annotations

import threading
import time

from actors.draft_worker import DraftWorker
from speculators.proposers.base import DraftRequest, Proposer
from speculators.tree import DraftTree

STEPS, STEP_S = 50, 0.02
"""A slow learner: one second per output, in steps of 20 ms."""


class SlowLearner(Proposer):
    def __init__(self):
        self.log: list[str] = []
        self.started = threading.Event()

    def propose(self, requests):
        self.log.append("propose")
        return [DraftTree.root_only(r.token_ids[-1]) for r in requests]

    def learn_steps(self, output_ids, scope=""):
        for step in range(STEPS):
            self.started.set()
            time.sleep(STEP_S)
            self.log.append(f"{scope}:{step}")
            yield


def test_a_propose_waits_for_one_step_of_learning_not_for_all_of_it():
    worker = DraftWorker(SlowLearner, learn_in_background=True)
    worker.release(["done"], [[1, 2, 3]], ["tenant:a"])
    assert worker.proposer.started.wait(10)
    began = time.perf_counter()
    worker.propose([DraftRequest("r", [1, 2], 4, 8)])
    waited = time.perf_counter() - began
    assert waited < STEPS * STEP_S / 2  # in release, it would have waited the whole second
    assert worker.flush(timeout=30)
    log = worker.proposer.log
    assert log.index("propose") < STEPS and len(log) == STEPS + 1  # between steps, and every step taken
    assert log[-1] == f"tenant:a:{STEPS - 1}"


def test_without_a_background_learner_outputs_are_learned_in_release():
    worker = DraftWorker(SlowLearner)
    worker.release(["done"], [[1, 2, 3], [4]], ["tenant:a", None])  # a None scope is not learned
    assert len(worker.proposer.log) == STEPS and worker.flush()
