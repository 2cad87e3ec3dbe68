"""The engine's Scheduler on its own (queues, offers, chunk budgets, set-backs), the token cap of an
engine's passes, and the start contract: only AdmissionRefused is a refusal; any other error of
`start` is a target fault."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from actors.messages import Admission, AdmissionRefused, AdmitItem, PrefillChunk
from actors.target_worker import CacheOptions, TargetWorker
from actors.worker import LocalWorker
from cluster.engine.build import local_engine
from cluster.engine.config import MIN_AUTO_CHUNK, SchedulerConfig
from cluster.engine.cost import CostCurve, CostPoint
from cluster.engine.request import GenerationRequest
from cluster.engine.scheduler import Scheduler
from cluster.engine.spec_engine import TARGET_FAILED, SpecEngine
from cluster.engine.stats import EngineCounters, RequestStats
from speculators.proposers.suffix import SuffixProposer
from speculators.sampling import SamplingParams
from tests.conftest import IdTokenizer


@dataclass
class Running:
    """What the scheduler reads of an ActiveRequest."""

    request: GenerationRequest
    tokens: list[int]
    output: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    group: int = 0
    prefill_left: int = 0
    started: float = 0.0

    @property
    def request_id(self) -> str:
        return self.request.request_id


def state_of(request: GenerationRequest) -> Running:
    return Running(request, list(request.prompt_ids))


def test_set_back_requests_resume_first_and_a_refusal_stops_offers_until_a_request_ends():
    released = []
    scheduler = Scheduler(SchedulerConfig(max_sequences=2, max_len=64), EngineCounters(), None, released.append)
    for name in "abc":
        scheduler.add(GenerationRequest(name, [1, 2, 3]))
    resumed, admitted = scheduler.offer()
    assert resumed == [] and [r.request_id for r in admitted] == ["a", "b"]
    states = [state_of(r) for r in admitted]
    scheduler.run(states)
    scheduler.admitted(Admission({"a": 0}, ["b"], free_blocks=1, total_blocks=4))
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"] and released == [states[1]]
    assert scheduler.offer() == ([], []) and scheduler.kv_cache_usage == 0.75
    scheduler.finished(states[0])
    assert [r.request_id for r in scheduler.offer()[1]] == ["b", "c"]


def test_a_pass_carries_a_chunk_budget_while_requests_decode_and_every_prompt_when_none_does():
    scheduler = Scheduler(SchedulerConfig(max_sequences=4, max_len=256, prefill_chunk_tokens=8), EngineCounters(), None,
                          lambda state: None)
    requests = [GenerationRequest(name, list(range(1, 21))) for name in "ab"]
    scheduler.run([state_of(r) for r in requests])
    scheduler.admitted(Admission({"a": 0, "b": 4}, []))
    plan = scheduler.plan()
    assert plan.decoding == [] and plan.chunks == [("a", 19), ("b", 15)]  # nobody decodes: every prompt whole
    scheduler.prefilled([PrefillChunk("a", 0, 19), PrefillChunk("b", 4, 15)])
    assert scheduler.decoding == 2
    third = GenerationRequest("c", list(range(1, 31)))
    scheduler.run([state_of(third)])
    scheduler.admitted(Admission({"c": 0}, []))
    assert scheduler.plan().chunks == [("c", 8)]  # two decode: a short pass


def test_a_set_back_request_keeps_its_id():
    scheduler = Scheduler(SchedulerConfig(max_sequences=2, max_len=64), EngineCounters(), None, lambda state: None)
    state = state_of(GenerationRequest("a", [1, 2, 3]))
    scheduler.run([state])
    state.output.append(5)
    scheduler.preempt(state)  # set back with output: it waits in `preempted`
    with pytest.raises(ValueError, match="already in the engine"):
        scheduler.add(GenerationRequest("a", [1]))


def decoding_scheduler(config: SchedulerConfig, decoding: int, cost: CostCurve | None = None) -> Scheduler:
    """A scheduler with `decoding` requests past their prefill and a 2,000-token prompt left to prefill."""
    scheduler = Scheduler(config, EngineCounters(), None, lambda state: None, cost=cost)
    running = [state_of(GenerationRequest(f"d{i}", [1, 2])) for i in range(decoding)]
    prompt = state_of(GenerationRequest("long", list(range(1, 2001))))
    scheduler.run([*running, prompt])
    scheduler.admitted(Admission({state.request_id: 0 for state in [*running, prompt]}, []))
    scheduler.prefilled([PrefillChunk(state.request_id, 0, 1) for state in running])
    return scheduler


# a pass costs 40 ms plus 4 ms a token; one token of each of 16 sequences costs 160 ms
CURVE = CostCurve([CostPoint(n, 1, 0.040 + 0.004 * n) for n in (1, 16, 64)] + [CostPoint(16, 16, 0.160)])


def test_an_auto_chunk_costs_its_share_of_the_passs_decoding_at_every_load():
    config = SchedulerConfig(max_sequences=32, max_len=4096)
    assert config.prefill_chunk_tokens == "auto" and config.prefill_pass_ratio == 4.0
    one, sixteen = decoding_scheduler(config, 1, CURVE), decoding_scheduler(config, 16, CURVE)
    assert one.decoding == 1 and sixteen.decoding == 16
    assert one.plan().chunks == [("long", MIN_AUTO_CHUNK)]  # 4 x 44 ms of prompt is 44 tokens: the floor
    assert sixteen.plan().chunks == [("long", 160)]  # 4 x 160 ms of prompt at 4 ms a token
    assert decoding_scheduler(config, 16).plan().chunks == [("long", MIN_AUTO_CHUNK)]  # no curve: the floor
    sixteen.prefilled([], decoded_tokens=64)  # the last pass verified trees of 64 tokens in all: dearer
    assert sixteen.plan().chunks == [("long", int(4 * CURVE.seconds(64, 16) / CURVE.seconds_per_token()))]  # 352
    fixed = SchedulerConfig(max_sequences=32, max_len=4096, prefill_chunk_tokens=100)
    assert decoding_scheduler(fixed, 16, CURVE).plan().chunks == [("long", 100)]


def test_prompts_outnumbering_the_decoding_requests_fill_the_pass():
    """While as many requests decode as prompts wait, a pass carries the auto chunk; a burst of
    arrivals that outnumbers them is prefilled in full passes."""
    config = SchedulerConfig(max_sequences=32, max_len=4096, max_num_batched_tokens=300)
    scheduler = decoding_scheduler(config, 2, CURVE)
    assert scheduler.plan().chunks == [("long", MIN_AUTO_CHUNK)]  # one prompt, two decoding: the chunk
    burst = [state_of(GenerationRequest(name, list(range(1, 101)))) for name in "ab"]
    scheduler.run(burst)
    scheduler.admitted(Admission({state.request_id: 0 for state in burst}, []))
    assert scheduler.plan().chunks == [("long", 300 - 2)]  # three prompts, two decoding: all the room


def test_no_pass_carries_more_than_max_num_batched_tokens():
    config = SchedulerConfig(max_sequences=32, max_len=4096, max_num_batched_tokens=300, prefill_pass_ratio=50)
    assert decoding_scheduler(config, 16, CURVE).plan().chunks == [("long", 300 - 16)]
    idle = Scheduler(config, EngineCounters(), None, lambda state: None)
    prompts = [state_of(GenerationRequest(name, list(range(1, 201)))) for name in "ab"]
    idle.run(prompts)
    idle.admitted(Admission({"a": 0, "b": 0}, []))
    # nobody decodes: the prompts share the cap, with a's first root, verified in the pass its prompt ends
    assert idle.plan().chunks == [("a", 199), ("b", 100)]


def test_a_whole_prompt_offer_holds_at_most_max_num_batched_tokens():
    """Whole-prompt mode prefills an offer in one pass: prompts join it in order while their tokens
    to prefill fit the cap, a longer one goes alone, and a set-back request is never overtaken."""
    config = SchedulerConfig(max_sequences=8, max_len=256, max_num_batched_tokens=100, prefill_chunk_tokens=None)
    scheduler = Scheduler(config, EngineCounters(), None, lambda state: None)
    for name, length in (("a", 41), ("b", 60), ("c", 150), ("d", 10), ("e", 90)):
        scheduler.add(GenerationRequest(name, list(range(1, length + 1))))
    offers = []
    for _ in range(3):
        resumed, admitted = scheduler.offer()
        offers.append([r.request_id for r in resumed + admitted])
        scheduler.run([state_of(r) for r in admitted])
    assert offers == [["a", "b"], ["c"], ["d", "e"]]  # 40 + 59 tokens; 149 alone; 9 + 89
    setback = scheduler.active["c"]
    setback.output.append(7)
    scheduler.add(GenerationRequest("f", [1, 2]))
    scheduler.preempt(setback)
    assert scheduler.offer() == ([setback], [])  # 150 tokens to prefill: f waits behind it
    chunked = Scheduler(SchedulerConfig(max_sequences=8, max_len=256, max_num_batched_tokens=100), EngineCounters(),
                        None, lambda state: None)
    for name in "abc":
        chunked.add(GenerationRequest(name, list(range(1, 150))))
    assert len(chunked.offer()[1]) == 3  # chunked: admission prefills nothing, the chunks keep to the cap


def record_passes(worker: TargetWorker) -> list[list[int]]:
    """Every forward pass of the worker, as it runs: the tokens of each prompt (chunk) it prefills,
    and a 1 for each request it decodes (whatever its tree)."""
    passes, forward = [], worker.runner.forward_capturing

    def recorded(inputs, *args):
        passes.append([len(i.token_ids) if i.logits == "none" else 1 for i in inputs])
        return forward(inputs, *args)

    worker.runner.forward_capturing = recorded
    return passes


@pytest.mark.parametrize("chunk", [None, 16, "auto"], ids=["whole-prompt", "chunked", "auto-chunk"])
def test_a_burst_of_long_prompts_never_makes_a_pass_past_max_num_batched_tokens(tiny_model, chunk):
    """Twelve prompts of 40-62 tokens and one of 90 arrive at once at an engine whose passes may hold
    64 prompt tokens and decoding requests: no pass holds more, save the one prefilling the 90-token
    prompt alone in whole-prompt mode (which never splits a prompt); chunked, it is cut at the cap.
    Every output is what the request gets alone."""
    model, _ = tiny_model
    prompts = [[(7 * i + j) % 60 + 1 for j in range(40 + 2 * i)] for i in range(12)] + [[(5 * j) % 61 + 1 for j in range(90)]]
    config = SchedulerConfig(max_sequences=16, max_len=128, max_num_batched_tokens=64, prefill_chunk_tokens=chunk,
                             kv_cache_bytes=16 * 128 * model.kv_bytes_per_position())
    engine = local_engine(model, IdTokenizer(), SuffixProposer(), config)
    passes = record_passes(engine.target.target)
    outputs = engine.generate([GenerationRequest(f"r{i}", p, max_new_tokens=16) for i, p in enumerate(prompts)])
    alone = [local_engine(model, IdTokenizer(), None, SchedulerConfig(max_len=128, prefill_chunk_tokens=None))
             .generate([GenerationRequest("alone", p, max_new_tokens=16)])[0] for p in prompts]
    assert [o.token_ids for o in outputs] == [o.token_ids for o in alone]
    assert [p for p in passes if sum(p) > 64] == ([[89]] if chunk is None else [])
    assert max(len(p) for p in passes) > 1  # passes did batch several requests


def test_the_worker_refuses_a_batch_it_can_never_serve(tiny_model):
    worker = TargetWorker(tiny_model[0], 2, 64, cache=CacheOptions(blocks=2, block_size=4))
    with pytest.raises(AdmissionRefused, match="empty prompt"):
        worker.start([AdmitItem(request_id="a", tokens=[], sampling=SamplingParams())])
    with pytest.raises(AdmissionRefused, match="whole KV cache"):
        worker.start([AdmitItem(request_id="a", tokens=list(range(1, 20)), sampling=SamplingParams())])


def test_a_start_error_that_is_no_refusal_is_a_target_fault(tiny_model):
    worker, rebuilds = TargetWorker(tiny_model[0], 2, 256), []

    def start(batch, **kwargs):
        raise ValueError("a shape bug, not a refusal")

    def rebuild():
        rebuilds.append(1)
        return LocalWorker(TargetWorker(tiny_model[0], 2, 256))

    worker.start = start
    engine = SpecEngine(LocalWorker(worker), IdTokenizer(), [], SchedulerConfig(max_sequences=2, max_len=256),
                        vocab_size=64, rebuild_target=rebuild)
    outputs = engine.generate([GenerationRequest(f"r{i}", [1, 2, 3], max_new_tokens=4) for i in range(3)])
    assert [o.finish_reason for o in outputs] == ["error", "error", "length"]
    assert all(TARGET_FAILED in o.error for o in outputs[:2]) and rebuilds == [1]


def test_a_cap_below_the_decoding_requests_is_refused_naming_both_fields():
    with pytest.raises(ValueError, match="max_num_batched_tokens .*max_sequences"):
        SchedulerConfig(max_sequences=32, max_num_batched_tokens=16)
