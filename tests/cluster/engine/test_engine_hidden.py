"""The target's hidden states the engine (or a target shard with its head co-located) holds for a
head drafter: bounded for requests that do not draft (speculation off, gate closed), and put back
when a draft call did not use them."""
from __future__ import annotations

import pytest
import torch

from actors.draft_worker import DraftWorker
from actors.model.loader import load_model
from actors.target_group import TargetShard
from actors.target_worker import TargetWorker
from actors.worker import LocalWorker
from cluster.engine.build import local_engine
from cluster.engine.config import SchedulerConfig
from cluster.engine.request import GenerationRequest
from cluster.engine.spec_engine import SpecEngine
from cluster.runtime.spec_cluster import ColocatedWorker
from speculators.hidden import IDLE_ROWS
from speculators.lookahead import LookaheadConfig
from tests.cluster.engine.test_engine_heads import head_proposer
from tests.conftest import IdTokenizer

FIXED = LookaheadConfig(policy="fixed", num_speculative_tokens=3)


def pending_rows(pending, request_id: str) -> tuple[int, int | None]:
    """How many rows `pending` (a PendingHidden) holds for the request, and the position after the last one."""
    pieces = pending._pieces.get(request_id, [])
    return sum(piece.states.shape[0] for piece in pieces), pieces[-1].end if pieces else None


def plain(model, requests: list[GenerationRequest], config: SchedulerConfig) -> list[list[int]]:
    engine = local_engine(model, IdTokenizer(), None, config)
    return [o.token_ids for o in engine.generate([GenerationRequest(r.request_id, r.prompt_ids, max_new_tokens=r.max_new_tokens)
                                                  for r in requests])]


def colocated_engine(model, config: SchedulerConfig, build_drafter) -> tuple[SpecEngine, TargetShard]:
    """An engine over a one-rank target shard in this process whose drafter (`build_drafter(decoder)`)
    lives in the shard, as with colocate_drafter: the shard keeps the rows, the engine holds none."""
    shard = TargetShard(model, 0, 1, config.max_sequences, config.max_len, build_drafter=build_drafter,
                        cpu_threads=torch.get_num_threads())
    shard.join("127.0.0.1", 0)
    target = LocalWorker(shard)
    return SpecEngine(target, IdTokenizer(), [ColocatedWorker(lambda: target)], config, vocab_size=64), shard


@pytest.mark.parametrize("where", ["engine", "colocated"])
def test_a_long_request_that_does_not_draft_holds_a_bounded_number_of_rows(tiny_model, tiny_model_dir, where):
    """One request has speculation off, one a gate that closes (every draft of a random head falls
    short of min_acceptance 1) and opens again after 120 steps: each holds at most 2 x IDLE_ROWS
    rows and one step's while it does not draft, ending where the head drafts from next; in the
    engine, or in the target shard of a co-located head."""
    config = SchedulerConfig(max_sequences=2, max_len=512, min_acceptance=1.0, gate_cooloff_steps=120)
    if where == "engine":
        model, _ = tiny_model
        engine = local_engine(model, IdTokenizer(), head_proposer("eagle3", model), config)
        pending = engine._hidden
    else:
        model = load_model(tiny_model_dir)
        engine, shard = colocated_engine(str(tiny_model_dir), config, lambda decoder: head_proposer("eagle3", decoder))
        pending = shard.drafter.pending
    prompt = [i % 60 + 1 for i in range(150)]
    requests = [GenerationRequest("off", prompt, max_new_tokens=300, speculate=False),
                GenerationRequest("gated", prompt[::-1], max_new_tokens=300, lookahead=FIXED)]
    for request in requests:
        engine.add(request)
    peaks, done = {"off": 0, "gated": 0}, {}
    while engine.has_work:
        for event in engine.step():
            if event.finished:
                done[event.request_id] = event.finished
        for request_id, state in engine.active.items():
            drafting = state.request.speculate and state.speculation.gate.is_open
            if state.output and not drafting:
                rows, end = pending_rows(pending, request_id)
                peaks[request_id] = max(peaks[request_id], rows)
                assert end == len(state.tokens) - 1  # every row up to the next root's parent
    assert 0 < peaks["off"] <= 2 * IDLE_ROWS + 1 and 0 < peaks["gated"] <= 2 * IDLE_ROWS + 1
    assert done["gated"].stats.drafted_per_position[0] > config.gate_warmup_steps  # it drafted again after the cut
    assert [done[r.request_id].token_ids for r in requests] == plain(model, requests, config)
    assert not pending._pieces  # finished requests leave nothing behind


class FlakyDrafter:
    """A draft worker whose third propose call raises and which loses every request's state before its
    sixth (a restarted actor: it names them unknown); it records the rows each request's calls carried
    and whether the drafter used them."""

    def __init__(self, worker: DraftWorker):
        self.worker, self.calls = worker, []

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def propose(self, requests):
        call = {r.request_id: [r.hidden, True] for r in requests}
        self.calls.append(call)
        if len(self.calls) == 3:
            for carried in call.values():
                carried[1] = False
            raise RuntimeError("injected draft failure")
        if len(self.calls) == 6:
            self.worker._sequences.clear()
        reply = self.worker.propose(requests)
        for request_id in reply.unknown:
            call[request_id][1] = False
        return reply


@pytest.mark.parametrize("where", ["engine", "colocated"])
def test_rows_a_draft_call_did_not_use_reach_the_head_with_the_next_call(tiny_model, tiny_model_dir, where):
    """A failed call and a call to a drafter that lost its requests: their rows come back with the
    next call, so the head sees every row once and in order; it drafts on, output identical; with
    the rows held by the engine, or by the target shard of a co-located head."""
    config = SchedulerConfig(max_sequences=4, max_len=256, min_acceptance=0)
    if where == "engine":
        model, _ = tiny_model
        proposer = head_proposer("eagle3", model)
        target = TargetWorker(model, 4, 256, hidden_layers=proposer.hidden_layers, hidden_dtype=proposer.hidden_dtype)
        drafter = FlakyDrafter(DraftWorker(lambda: proposer))
        engine = SpecEngine(LocalWorker(target), IdTokenizer(), [LocalWorker(drafter)], config, vocab_size=64)
    else:
        model = load_model(tiny_model_dir)
        engine, shard = colocated_engine(str(tiny_model_dir), config, lambda decoder: head_proposer("eagle3", decoder))
        drafter = shard.drafter.worker = FlakyDrafter(shard.drafter.worker)
    requests = [GenerationRequest(f"r{i}", p, max_new_tokens=24, lookahead=FIXED)
                for i, p in enumerate([[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], list(range(10, 40))])]
    outputs = engine.generate(requests)
    assert [o.token_ids for o in outputs] == plain(model, requests, config)
    assert engine.counters.draft_failures == 1 and len(drafter.calls) > 7
    unused = 0
    for request in requests:
        seen = 0
        for call in drafter.calls:
            if request.request_id not in call:
                continue
            hidden, used = call[request.request_id]
            start = None if hidden is None else hidden.start
            assert start == seen, f"{request.request_id}: a call carried rows from {start}; the head has {seen}"
            seen, unused = (hidden.end, unused) if used else (seen, unused + 1)
    assert unused == 2 * len(requests)  # each request's rows went unused twice: the failure, the lost state
    assert sum(o.stats.drafted for o in outputs) > 0
