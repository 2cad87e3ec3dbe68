"""Runs a case's requests through the real engine, in this process or on a Ray cluster, and counts
the sequences they produced. Requests are built by the service's RequestBuilder, as a client's are.

Each request is seeded on its own (its index in the case), so a case draws the same samples on
every run and a faulty verifier is tried on the very seeds the real one passed. A keyed case runs
its requests a second time with speculation off, in the same deployment, and counts the requests
whose sequences differ.
"""
from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace

import numpy as np
import torch

from actors.model.kv_cache import KVCache
from actors.model.loader import load_config, load_model, load_tokenizer
from bench.lossless.cases import DRAFTERS, Case, RequestGroup
from bench.lossless.target import VOCAB, TinyModels
from cluster.engine.build import build_proposer, local_engine
from cluster.engine.config import EngineConfig
from cluster.engine.cost import CostCurve, CostPoint
from cluster.engine.request import GenerationOutput, GenerationRequest
from cluster.serve.requests import RequestBuilder, RequestOptions, SpeculationOptions, StructuredOutput
from speculators.penalties import Penalties

BATCH = 512
"""Requests decoded at once (KV cache slots)."""
CHUNK = 2 * BATCH
"""Requests handed to the engine at a time: twice the batch, so requests join mid-flight, and few
enough that the engine's duplicate-id check over its queue stays cheap."""
MAX_TREE_NODES = 16
MAX_LEN = 32
FIXED_BUDGET = BATCH * MAX_TREE_NODES
"""A step budget that verifies every tree as drafted (the planner off)."""
RAY_TIMEOUT_S = 3600
PLANNER_COST = CostCurve([CostPoint(t, 1, 1.0 + 0.1 * t ** 0.5 * (t > 1)) for t in (1, 2, 4, 8, 16, 32, 64)]
                         + [CostPoint(4 * s, s, 1.0 + 0.4 * s) for s in (2, 4, 8)])
"""Each token of a pass costs less than the one before (as on real hardware): the planner keeps the
likelier nodes, cuts the rest, and sometimes drafts nothing."""
Generate = Callable[[list[GenerationRequest]], list[GenerationOutput]]


@dataclass
class CaseRun:
    counts: list[np.ndarray]
    """Per request group, shape (V,) * L: how often each sequence came out."""
    drafted: int
    accepted_by_depth: list[int]
    """Steps in which the drafted token at depth d + 1 was accepted, over all requests."""
    tokens: int
    target_forwards: int
    differ_from_plain: int | None = None
    """Keyed cases: requests whose sequence differs from the same request's with speculation off."""
    preemptions: int = 0
    cached_prompt_tokens: int = 0
    """Prompt tokens found in the prefix cache, over all requests."""


PLACEHOLDERS = {"<draft model>": "draft_dir", "<eagle3 head>": "eagle3_dir", "<medusa head>": "medusa_dir",
                "<dflash drafter>": "dflash_dir", "<rest datastore>": "rest_datastore_dir"}
"""DRAFTERS values that stand for a folder of TinyModels (the attribute that writes it)."""


def engine_config(case: Case, models: TinyModels) -> EngineConfig:
    """On Ray the planner is on, over the cost curve the cluster measures (as served); in this
    process a fixed budget, or PLANNER_COST for the planned cases. The KV cache holds BATCH
    sequences of MAX_LEN (float64 positions), or a case's `kv_positions`."""
    drafter = {key: str(getattr(models, PLACEHOLDERS[value])) if value in PLACEHOLDERS else value
               for key, value in DRAFTERS[case.drafter].items()}
    engine = dict(case.engine)
    model = load_config(models.target_dir)
    position = KVCache.bytes_per_position(model.num_layers, model.num_kv_heads, model.head_dim, torch.float64)
    return EngineConfig(**{
        "model": str(models.target_dir), "max_sequences": BATCH, "max_len": MAX_LEN, "max_tree_nodes": MAX_TREE_NODES,
        "step_token_budget": None if case.deployment.ray else FIXED_BUDGET, "lookahead": case.lookahead,
        "kv_cache_bytes": engine.pop("kv_positions", BATCH * MAX_LEN) * position, **drafter, **engine,
    })


def requests(case: Case, samples: int, builder: RequestBuilder, plain: bool = False) -> list[tuple[int, GenerationRequest]]:
    """(group index, request) for `samples` requests, the groups interleaved so every batch mixes
    them; with `plain`, the same requests with speculation off."""
    seed_base = zlib.crc32(case.name.encode()) * 1_000_000
    counts = [round(samples * group.share) for group in case.groups]
    order = sorted((i / count, g) for g, count in enumerate(counts) for i in range(count))
    return [(g, _request(builder, f"{case.name}-{i}{'-plain' * plain}", case.groups[g], seed_base + i, case.rule, plain))
            for i, (_, g) in enumerate(order)]


def _request(builder: RequestBuilder, request_id: str, group: RequestGroup, seed: int, rule: str,
             plain: bool) -> GenerationRequest:
    """Built as the service builds a client's request (the group's grammar as a regular expression
    over the tiny tokenizer's texts, compiled by the service's grammar engine). The rule is set
    after: the service keys every seeded request, and the rejection cases stand for unseeded
    requests, seeded here so that a case draws the same samples on every run."""
    penalties = group.penalties or Penalties()
    options = RequestOptions(
        prompt_token_ids=list(group.prompt), max_new_tokens=group.new_tokens, temperature=group.sampling.temperature,
        top_k=group.sampling.top_k, top_p=group.sampling.top_p, seed=seed, presence_penalty=penalties.presence,
        frequency_penalty=penalties.frequency, repetition_penalty=penalties.repetition,
        structured_output=None if group.rule is None else StructuredOutput(kind="regex", value=group.rule.regex()),
        speculation=SpeculationOptions(method="off" if plain else "default"))
    request = builder.build_request(options, request_id)
    request.sampling = replace(request.sampling, rule=rule)
    return request


def run_case(case: Case, models: TinyModels, samples: int,
             fault: Callable[[], AbstractContextManager] = nullcontext) -> CaseRun:
    """`fault`: a negative control, entered around each run of the engine (a fresh one each time)."""
    deployment = on_ray if case.deployment.ray else in_process
    with deployment(case, models) as (generate, builder):
        batch = requests(case, samples, builder)
        with fault():
            outputs = _in_chunks(generate, [request for _, request in batch])
        plain = None
        if case.keyed:
            with fault():
                plain = _in_chunks(generate, [request for _, request in requests(case, samples, builder, plain=True)])
    counts = [np.zeros((VOCAB,) * group.new_tokens, dtype=np.int64) for group in case.groups]
    for (group, request), output in zip(batch, outputs):
        if len(output.token_ids) != case.groups[group].new_tokens:
            raise RuntimeError(f"{request.request_id} ended early ({output.finish_reason}: {output.error})")
        counts[group][tuple(output.token_ids)] += 1
    stats = [output.stats for output in outputs]
    by_depth = [sum(column) for column in itertools.zip_longest(*(s.accepted_per_position for s in stats), fillvalue=0)]
    differ = None if plain is None else sum(o.token_ids != p.token_ids for o, p in zip(outputs, plain))
    return CaseRun(counts=counts, drafted=sum(s.drafted for s in stats), accepted_by_depth=by_depth,
                   tokens=sum(len(o.token_ids) for o in outputs), target_forwards=sum(s.target_forwards for s in stats),
                   differ_from_plain=differ, preemptions=sum(s.preemptions for s in stats),
                   cached_prompt_tokens=sum(s.cached_prompt_tokens for s in stats))


def _in_chunks(generate: Generate, batch: list[GenerationRequest]) -> list[GenerationOutput]:
    outputs = []
    for start in range(0, len(batch), CHUNK):
        outputs += generate(batch[start:start + CHUNK])
    return outputs


@contextmanager
def in_process(case: Case, models: TinyModels) -> Iterator[tuple[Generate, RequestBuilder]]:
    """An engine in this process over the float64 target; its worker threads stop on exit."""
    config = engine_config(case, models)
    target, tokenizer = load_model(models.target_dir, torch.float64), load_tokenizer(models.target_dir)
    engine = local_engine(target, tokenizer, build_proposer(config, target), config,
                          cost=PLANNER_COST if case.planned else False)
    try:
        yield engine.generate, RequestBuilder.in_process(engine, tokenizer, config)
    finally:
        for worker in [engine.target, *engine.drafters]:
            worker.shutdown()


@contextmanager
def on_ray(case: Case, models: TinyModels) -> Iterator[tuple[Generate, RequestBuilder]]:
    """A SpecCluster: float32 target shards and draft actors on (fake) GPUs. Ray must be running."""
    from cluster.runtime.cluster_spec import ClusterSpec
    from cluster.runtime.spec_cluster import SpecCluster

    config = engine_config(case, models)
    spec = ClusterSpec(engine=config, tensor_parallel_size=case.deployment.tensor_parallel_size,
                       num_draft_actors=case.deployment.draft_actors)
    cluster = SpecCluster(spec).start()
    try:
        builder = RequestBuilder.in_process(cluster.loops[0].engine, load_tokenizer(models.target_dir), config)
        yield (lambda batch: cluster.generate(batch, timeout_s=RAY_TIMEOUT_S)), builder
    finally:
        cluster.shutdown()
