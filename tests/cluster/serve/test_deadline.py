"""A request that runs past `limits.request_timeout_s` ends with a retryable error and leaves the engine."""
import asyncio
import time

import pytest

from actors.model.loader import load_tokenizer
from bench.fuzz import FUZZ_LIMITS, build_target
from cluster.engine.loop import EngineLoop
from cluster.engine.request import GenerationRequest
from cluster.serve.service import SpecService
from speculators.lookahead import LookaheadConfig
from tests.conftest import wait_until_loop_idle

pytestmark = pytest.mark.default_model


def test_a_request_past_its_deadline_is_aborted_with_a_retryable_error(default_model_path, monkeypatch):
    target = build_target(load_tokenizer(default_model_path))
    engine, real_step = target.engine, target.engine.step

    def slow_step():
        time.sleep(0.1)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    loop = EngineLoop(engine, "deadline-test")
    limits = FUZZ_LIMITS.model_copy(update={"request_timeout_s": 0.3})
    service = SpecService([loop], target.service.tokenizer, "tiny", "pld", LookaheadConfig(), limits)

    async def events():
        request = GenerationRequest("late", [1, 2, 3], max_new_tokens=8, speculate=False)
        return [event async for event in service.stream(request)]

    try:
        streamed = asyncio.run(events())
        output = streamed[-1].finished
        assert output.finish_reason == "error" and "past the server's 0.3 s limit" in output.error
        assert len([e for e in streamed if e.new_token_ids]) < 8  # cut short, not decoded to the end
        wait_until_loop_idle(loop)
        assert loop.load == 0 and not engine.has_work and service.in_flight == 0
    finally:
        loop.stop()
