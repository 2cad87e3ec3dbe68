"""`loop.stream`: step events reach asyncio in one hand-over a turn, a deadline aborts, and requests
whose asyncio loop closed under them are aborted."""
from __future__ import annotations

import asyncio
import time

from cluster.engine.build import local_engine
from cluster.engine.loop import EngineLoop, stream
from cluster.engine.request import GenerationRequest
from speculators.proposers.prompt_lookup import PromptLookupProposer
from tests.cluster.engine.test_engine_faults import CONFIG, PROMPTS, plain, requests  # noqa: F401  (fixture)
from tests.conftest import IdTokenizer, wait_until_loop_idle


def long_requests(prefix: str) -> list[GenerationRequest]:
    """Requests that would decode for longer than any of these tests lets them."""
    return [GenerationRequest(f"{prefix}{i}", prompt, max_new_tokens=200) for i, prompt in enumerate(PROMPTS)]


def engine_loop(tiny_model, name: str) -> EngineLoop:
    return EngineLoop(local_engine(tiny_model[0], IdTokenizer(), PromptLookupProposer(), CONFIG), name)


def test_a_turns_events_reach_asyncio_in_one_hand_over(tiny_model, plain):
    loop = engine_loop(tiny_model, "handoff-test")
    steps, real_step = [0], loop.engine.step

    def counted_step():
        steps[0] += 1
        return real_step()

    loop.engine.step = counted_step
    wakes = [0]

    async def run() -> list[list[int]]:
        running = asyncio.get_running_loop()
        real_call = running.call_soon_threadsafe

        def counted_call(*args, **kwargs):
            wakes[0] += 1
            return real_call(*args, **kwargs)

        running.call_soon_threadsafe = counted_call

        async def one(request: GenerationRequest) -> list[int]:
            return [event async for event in stream(loop, request)][-1].finished.token_ids

        return await asyncio.gather(*(one(r) for r in requests("s")))

    try:
        assert asyncio.run(run()) == plain
        assert 0 < wakes[0] <= steps[0] + len(PROMPTS)  # one a turn (a turn without a step: admissions)
        assert steps[0] < sum(len(tokens) for tokens in plain)  # fewer turns than events
    finally:
        loop.stop()


def test_a_stream_past_its_timeout_raises_and_aborts_the_request(tiny_model):
    loop = engine_loop(tiny_model, "timeout-test")
    real_step = loop.engine.step

    def slow_step():
        time.sleep(0.05)
        return real_step()

    loop.engine.step = slow_step

    async def run() -> int:
        events = 0
        try:
            async for _ in stream(loop, long_requests("t")[0], timeout_s=0.2):
                events += 1
        except TimeoutError:
            return events
        raise AssertionError("the stream ended before its timeout")

    try:
        assert asyncio.run(run()) < 200
        wait_until_loop_idle(loop)
        assert loop.load == 0 and not loop.engine.has_work
    finally:
        loop.stop()


def test_requests_whose_asyncio_loop_closed_are_aborted(tiny_model):
    loop = engine_loop(tiny_model, "closed-loop-test")
    running = asyncio.new_event_loop()
    streams = [stream(loop, request) for request in long_requests("c")]
    for events in streams:  # each request in the engine, its listener left suspended
        running.run_until_complete(anext(events))
    running.close()  # without finishing the streams: no abort reaches the engine from them
    try:
        wait_until_loop_idle(loop)
        assert loop.load == 0 and not loop.engine.has_work and loop.alive
    finally:
        loop.stop()
