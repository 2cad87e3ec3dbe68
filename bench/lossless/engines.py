"""Runs a case's requests through the real engine, in this process or on a Ray cluster, and counts
the sequences they produced.

Each request is seeded on its own (its index in the case), so a case draws the same samples on
every run and a faulty verifier is tried on the very seeds the real one passed.
"""
from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import torch

from actors.model.loader import load_model, load_tokenizer
from bench.lossless.cases import DRAFTERS, Case, RequestGroup
from bench.lossless.target import VOCAB, TinyModels
from cluster.engine.build import build_proposer, local_engine
from cluster.engine.config import EngineConfig
from cluster.engine.cost import CostCurve, CostPoint
from cluster.engine.grammar import CompiledGrammar, GrammarCompiler, GrammarSpec
from cluster.engine.request import GenerationOutput, GenerationRequest

BATCH = 512
"""Requests decoded at once (KV cache slots)."""
CHUNK = 2 * BATCH
"""Requests handed to the engine at a time: twice the batch, so requests join mid-flight, and few
enough that the engine's duplicate-id check over its queue stays cheap."""
MAX_TREE_NODES = 16
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


PLACEHOLDERS = {"<draft model>": "draft_dir", "<eagle3 head>": "eagle3_dir", "<medusa head>": "medusa_dir"}
"""DRAFTERS values that stand for a folder of TinyModels (the attribute that writes it)."""


def engine_config(case: Case, models: TinyModels) -> EngineConfig:
    drafter = {key: str(getattr(models, PLACEHOLDERS[value])) if value in PLACEHOLDERS else value
               for key, value in DRAFTERS[case.drafter].items()}
    return EngineConfig(
        model=str(models.target_dir), max_sequences=BATCH, max_len=32, max_tree_nodes=MAX_TREE_NODES,
        step_token_budget=BATCH * MAX_TREE_NODES, lookahead=case.lookahead, **drafter, **case.engine,
    )


def requests(case: Case, samples: int, models: TinyModels) -> list[tuple[int, GenerationRequest]]:
    """(group index, request) for `samples` requests, the groups interleaved so every batch mixes them."""
    grammars = group_grammars(case, models)
    seed_base = zlib.crc32(case.name.encode()) * 1_000_000
    counts = [round(samples * group.share) for group in case.groups]
    order = sorted((i / count, g) for g, count in enumerate(counts) for i in range(count))
    return [(g, _request(f"{case.name}-{i}", case.groups[g], seed_base + i, grammars[g])) for i, (_, g) in enumerate(order)]


def group_grammars(case: Case, models: TinyModels) -> list[CompiledGrammar | None]:
    """Each request group's grammar (its rule as a regular expression) compiled for the tiny
    tokenizer by the grammar engine the service uses; None for groups without one."""
    if all(group.rule is None for group in case.groups):
        return [None] * len(case.groups)
    compiler = GrammarCompiler(load_tokenizer(models.target_dir), VOCAB, [])
    return [None if group.rule is None else compiler.compile(GrammarSpec("regex", group.rule.regex()))
            for group in case.groups]


def _request(request_id: str, group: RequestGroup, seed: int, grammar: CompiledGrammar | None) -> GenerationRequest:
    return GenerationRequest(request_id, list(group.prompt), replace(group.sampling, seed=seed), group.new_tokens,
                             penalties=group.penalties, grammar=grammar)


def run_case(case: Case, models: TinyModels, samples: int) -> CaseRun:
    batch = requests(case, samples, models)
    deployment = on_ray if case.deployment.ray else in_process
    outputs = []
    with deployment(case, models) as generate:
        for start in range(0, len(batch), CHUNK):
            outputs += generate([request for _, request in batch[start:start + CHUNK]])
    counts = [np.zeros((VOCAB,) * group.new_tokens, dtype=np.int64) for group in case.groups]
    for (group, request), output in zip(batch, outputs):
        if len(output.token_ids) != case.groups[group].new_tokens:
            raise RuntimeError(f"{request.request_id} ended early ({output.finish_reason}: {output.error})")
        counts[group][tuple(output.token_ids)] += 1
    stats = [output.stats for output in outputs]
    by_depth = [sum(column) for column in itertools.zip_longest(*(s.accepted_per_position for s in stats), fillvalue=0)]
    return CaseRun(counts, sum(s.drafted for s in stats), by_depth, sum(len(o.token_ids) for o in outputs),
                   sum(s.target_forwards for s in stats))


@contextmanager
def in_process(case: Case, models: TinyModels) -> Iterator[Generate]:
    """An engine in this process over the float64 target; its worker threads stop on exit."""
    config = engine_config(case, models)
    target = load_model(models.target_dir, torch.float64)
    engine = local_engine(target, load_tokenizer(models.target_dir), build_proposer(config, target), config,
                          cost=PLANNER_COST if case.planned else False)
    try:
        yield engine.generate
    finally:
        for worker in [engine.target, *engine.drafters]:
            worker.shutdown()


@contextmanager
def on_ray(case: Case, models: TinyModels) -> Iterator[Generate]:
    """A SpecCluster: float32 target shards and draft actors on (fake) GPUs. Ray must be running."""
    from cluster.runtime.placement import ClusterSpec
    from cluster.runtime.spec_cluster import SpecCluster

    spec = ClusterSpec(engine=engine_config(case, models), tensor_parallel_size=case.deployment.tensor_parallel_size,
                       num_draft_actors=case.deployment.draft_actors)
    cluster = SpecCluster(spec).start()
    try:
        yield lambda batch: cluster.generate(batch, timeout_s=RAY_TIMEOUT_S)
    finally:
        cluster.shutdown()
