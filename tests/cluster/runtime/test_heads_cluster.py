"""Trained heads on the Ray cluster (fake GPUs): in a draft actor beside a TP=2 target, whose rank 0
sends the hidden states, and co-located in a one-rank target's process. Output equals plain
decoding, and the heads' drafts are accepted."""
from __future__ import annotations

import pytest
import torch

from actors.model.loader import load_model, load_tokenizer
from cluster.engine.build import local_engine
from cluster.engine.config import EngineConfig
from cluster.engine.request import GenerationRequest
from cluster.runtime.cluster_spec import ClusterSpec
from cluster.runtime.spec_cluster import ColocatedWorker, SpecCluster
from cluster.serve.requests import RequestBuilder, RequestOptions, SpeculationOptions, StructuredOutput
from speculators.heads.checkpoint import save_dflash, save_eagle3, save_medusa
from speculators.lookahead import LookaheadConfig
from tests.cluster.ray_fixtures import ray_four_gpus  # noqa: F401  (module-scoped fixture)
from tests.cluster.runtime.cluster_requests import UNPLANNED
from tests.conftest import IdTokenizer

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [3] * 12, list(range(10, 40))]
SPECULATE = LookaheadConfig(policy="fixed", num_speculative_tokens=4)


def requests(prefix):
    return [GenerationRequest(f"{prefix}{i}", p, max_new_tokens=32, lookahead=SPECULATE) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    engine = local_engine(load_model(tiny_model_dir), IdTokenizer(), None)
    return [o.token_ids for o in engine.generate(requests("e"))]


@pytest.fixture(scope="module")
def head_folders(tiny_heads, tiny_dflash, tmp_path_factory):
    eagle, medusa, _, _ = tiny_heads
    folder = tmp_path_factory.mktemp("heads")
    save_dflash(tiny_dflash[0], folder / "parallel", "tiny", 4, dtype=torch.float32)
    save_eagle3(eagle, folder / "eagle3", "tiny", ["LlamaForCausalLM"], dtype=torch.float32)
    save_medusa(medusa, folder / "medusa", "tiny", [[0], [1], [0, 0], [0, 1], [0, 0, 0]], dtype=torch.float32)
    return folder


def run_cluster(spec: ClusterSpec, prefix: str):
    """(outputs, the engine's drafters, the hidden states the target was told to send)."""
    cluster = SpecCluster(spec).start()
    try:
        outputs = cluster.generate(requests(prefix), timeout_s=180)
        return outputs, cluster.loops[0].engine.drafters, cluster._hidden_spec[0]
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("method,width", [("eagle3", 2), ("medusa", 1), ("parallel", 1)],
                         ids=["eagle3-tree", "medusa", "parallel"])
def test_a_head_in_a_draft_actor_beside_a_tp2_target(ray_four_gpus, tiny_model_dir, head_folders, expected, method, width):
    engine = EngineConfig(model=str(tiny_model_dir), dtype="float32", method=method, draft=str(head_folders / method),
                          draft_width=width, max_sequences=4, max_len=256, **UNPLANNED)
    outputs, _, layers = run_cluster(ClusterSpec(engine=engine, tensor_parallel_size=2, num_draft_actors=1), method)
    assert [o.token_ids for o in outputs] == expected
    assert sum(o.stats.accepted for o in outputs) > 0
    assert layers == ((4,) if method == "medusa" else (1, 2, 3))


@pytest.mark.parametrize("method", ["eagle3", "medusa", "parallel"])
def test_a_head_colocated_with_its_target(ray_four_gpus, tiny_model_dir, head_folders, expected, method):
    engine = EngineConfig(model=str(tiny_model_dir), dtype="float32", method=method, draft=str(head_folders / method),
                          max_sequences=4, max_len=256, **UNPLANNED)
    spec = ClusterSpec(engine=engine, num_draft_actors=3, colocate_drafter=True)
    assert spec.draft_actor_count == 0 and spec.total_gpus() == 1
    outputs, drafters, layers = run_cluster(spec, "c" + method)
    assert [o.token_ids for o in outputs] == expected
    assert sum(o.stats.accepted for o in outputs) > 0
    assert [type(d) for d in drafters] == [ColocatedWorker] and layers == ()  # the shard keeps its rows


def test_colocation_needs_a_one_rank_target():
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        ClusterSpec(engine=EngineConfig(method="eagle3"), tensor_parallel_size=2, colocate_drafter=True)


def options_requests(builder: RequestBuilder, prefix: str) -> list:
    """Requests with every option that changes what the target sends back or verifies against: top
    log-probabilities, penalties and a grammar (response_format), built as the service builds them."""
    grammar = StructuredOutput(kind="regex", value="[0-9A-F]{1,40}")  # characters of the tiny vocabulary
    variants = [{"logprobs": 2}, {"presence_penalty": 0.5, "repetition_penalty": 1.2}, {"structured_output": grammar}]
    return [builder.build_request(RequestOptions(prompt_token_ids=prompt, max_new_tokens=24, **variant),
                                  f"{prefix}{i}-{j}")
            for i, prompt in enumerate(PROMPTS[:2]) for j, variant in enumerate(variants)]


def essentials(outputs) -> list:
    return [(o.finish_reason, o.token_ids, None if o.logprobs is None else [round(p.logprob, 4) for p in o.logprobs])
            for o in outputs]


@pytest.mark.parametrize("deployment", ["colocated", "draft-actor-tp2"])
def test_every_request_option_through_a_head(ray_four_gpus, tiny_model_dir, head_folders, deployment):
    """Log-probabilities, penalties and a grammar reach a co-located head's shard and a draft actor beside
    a TP=2 group without failing the group: outputs equal plain decoding of the same requests."""
    engine = EngineConfig(model=str(tiny_model_dir), dtype="float32", method="eagle3", draft=str(head_folders / "eagle3"),
                          max_sequences=6, max_len=256)
    colocated = deployment == "colocated"
    spec = ClusterSpec(engine=engine, tensor_parallel_size=1 if colocated else 2, colocate_drafter=colocated)
    tokenizer = load_tokenizer(tiny_model_dir)
    plain_engine = local_engine(load_model(tiny_model_dir), tokenizer, None,
                                engine.model_copy(update={"method": "none"}))
    plain = plain_engine.generate(options_requests(RequestBuilder.in_process(plain_engine, tokenizer, engine), "p"))
    cluster = SpecCluster(spec).start()
    try:
        served = cluster.generate(options_requests(RequestBuilder.in_process(cluster.loops[0].engine, tokenizer,
                                                                             engine), "s"), timeout_s=180)
        failures = cluster.loops[0].engine.counters.target_failures
    finally:
        cluster.shutdown()
    assert failures == 0
    assert essentials(served) == essentials(plain)
    assert all(o.finish_reason in ("stop", "length") for o in served), [(o.finish_reason, o.error) for o in served]


FIXED_FOUR = SpeculationOptions(lookahead="fixed", num_speculative_tokens=4)


def seeded_requests(builder: RequestBuilder, prefix: str) -> list:
    """Sampled requests with seeds, as a client sends them (the service's rule: keyed)."""
    return [builder.build_request(RequestOptions(prompt_token_ids=prompt, max_new_tokens=24, temperature=temperature,
                                                 top_k=top_k, seed=seed, speculation=FIXED_FOUR),
                                  f"{prefix}{i}-{seed}")
            for i, prompt in enumerate(PROMPTS) for seed, temperature, top_k in ((5, 0.8, 0), (9, 1.0, 20))]


@pytest.mark.parametrize("deployment", ["colocated", "draft-actor-tp2"])
def test_seeded_samples_through_a_tp2_group_equal_plain_decoding(ray_four_gpus, tiny_model_dir, head_folders,
                                                                 deployment):
    """The same seeds give the same samples from a TP=2 group with an EAGLE-3 head in a draft actor
    (or co-located) as from plain decoding in this process, with drafts accepted on the way."""
    engine = EngineConfig(model=str(tiny_model_dir), dtype="float32", method="eagle3", draft=str(head_folders / "eagle3"),
                          draft_width=2, max_sequences=8, max_len=256, **UNPLANNED)
    colocated = deployment == "colocated"
    spec = ClusterSpec(engine=engine, tensor_parallel_size=1 if colocated else 2, colocate_drafter=colocated)
    tokenizer = load_tokenizer(tiny_model_dir)
    plain_engine = local_engine(load_model(tiny_model_dir), tokenizer, None, engine.model_copy(update={"method": "none"}))
    plain = plain_engine.generate(seeded_requests(RequestBuilder.in_process(plain_engine, tokenizer, engine), "p"))
    cluster = SpecCluster(spec).start()
    try:
        served = cluster.generate(seeded_requests(RequestBuilder.in_process(cluster.loops[0].engine, tokenizer, engine),
                                                  "s"), timeout_s=180)
    finally:
        cluster.shutdown()
    assert [o.token_ids for o in served] == [o.token_ids for o in plain]
    assert sum(o.stats.accepted for o in served) > 0
