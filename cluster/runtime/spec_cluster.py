"""SpecCluster: a ClusterSpec brought up on Ray.

Placement reserves disjoint GPU sets; each target group is a TargetGroup of tensor-parallel shard
actors; draft actors are DraftWorkers that restart themselves when they die (their per-request
state is rebuilt from the next call's token ids). Each target group gets its own engine and engine
loop thread, and every engine uses all draft actors, starting from a different one, so that the
two micro-batches of a pipelined engine are drafted on different actors. With `colocate_drafter`
there are no draft actors: each target shard runs its own drafter in its process. With
`draft_pool`, neither: each target group drafts through a PooledDrafter on the drafters of a pool
shared with other replicas (cluster/runtime/draft_pool.py, cluster/runtime/pooled_drafter.py).

With the target in the replica (`target_placement`, by default for one CPU rank) the target is no actor: it is built in this
process on its engine loop's thread and called there directly, so a step costs no actor call.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future

import ray
import torch

from actors.draft_worker import DraftWorker
from actors.model.loader import load_config, load_tokenizer, resolve_model
from actors.target_group import TargetGroup, TargetShard
from actors.worker import LocalWorker, RayActorWorker
from cluster.engine.build import build_proposer, cost_key_of
from cluster.engine.cost import measure as measure_cost
from cluster.engine.loop import EngineLoop, least_loaded
from cluster.engine.request import GenerationOutput, GenerationRequest
from cluster.engine.spec_engine import SpecEngine
from cluster.runtime.cluster_spec import ClusterSpec
from cluster.runtime.draft_actors import draft_actor_builder
from cluster.runtime.draft_pool import pool_actor, pool_fingerprint
from cluster.runtime.placement import Placement, reserve
from cluster.runtime.pooled_drafter import PooledDrafter

log = logging.getLogger(__name__)


def _build_with_target(config, target):
    """The drafter of a co-located target shard, sharing the shard's decoder (module level: pickled)."""
    return build_proposer(config, target)


class ColocatedWorker:
    """The engine's handle on a drafter that lives in its target group's shard: draft calls go to
    the shard's `draft` method, on whichever group is current (a failed group is rebuilt)."""

    def __init__(self, group: Callable[[], TargetGroup]):
        self.group = group

    def submit(self, method: str, *args) -> Future:
        return self.group().submit("draft", method, *args)


class SpecCluster:
    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.placement: Placement | None = None
        self.drafters: list[RayActorWorker] = []
        self.pooled: list[PooledDrafter] = []
        self.target_groups: list[TargetGroup] = []
        self.loops: list[EngineLoop] = []

    def start(self) -> SpecCluster:
        spec, engine_config = self.spec, self.spec.engine
        path = resolve_model(engine_config.model)  # convert once here, not in every actor
        self.tokenizer = load_tokenizer(path)
        self.model_config = load_config(path)
        try:
            if spec.draft_pool is not None:  # first: a replica the pool refuses reserves nothing
                fingerprint = pool_fingerprint(spec)
                connect = functools.partial(pool_actor, spec, fingerprint)
                pool = spec.draft_pool
                self.pooled = [PooledDrafter(connect, fingerprint, pool.report_period_s, pool.member_timeout_s)
                               for _ in range(spec.num_target_groups)]
            self.placement = reserve(spec)
            draft_actor = ray.remote(DraftWorker)
            # every draft actor serves the requests of every target group: room for all of them
            builder = draft_actor_builder(spec, spec.num_target_groups) if spec.draft_actor_count else None
            self.drafters = [
                RayActorWorker(draft_actor.options(max_restarts=-1, **self.placement.draft_options(i)).remote(
                    builder, learn_in_background=True))  # finished outputs learned between propose calls
                for i in range(spec.draft_actor_count)
            ]
            any_drafter = self.drafters[0] if self.drafters else self.pooled[0] if self.pooled else None
            self._hidden_spec = any_drafter.submit("hidden_spec").result() if any_drafter else ((), "float32")
            colocated = spec.colocate_drafter and engine_config.method != "none"
            plan = engine_config.step_token_budget is None and (bool(self.drafters or self.pooled) or colocated)
            for group in range(spec.num_target_groups):
                count = len(self.drafters)
                drafters = [self.drafters[(group + k) % count] for k in range(count)]
                if self.pooled:
                    drafters = [self.pooled[group]]
                if colocated:
                    drafters = [ColocatedWorker(functools.partial(lambda g: self.target_groups[g], group))]
                build = functools.partial(self._new_engine, group, drafters, plan)
                # a target in this process is built on the loop's thread, where all its work runs
                self.loops.append(EngineLoop(build if spec.target_in_replica else build(), name=f"engine-{group}"))
        except BaseException:
            self.shutdown()
            raise
        return self

    def _new_engine(self, group: int, drafters: list, plan: bool) -> SpecEngine:
        """Target group `group` (started here) and the engine that drives it with `drafters`."""
        engine_config = self.spec.engine
        # the curve's key first: a target built in this process sets this thread's torch threads, and
        # the key must be the one computed for an actor target, in this process as it started
        key = cost_key_of(engine_config, self.spec.tensor_parallel_size)
        self.target_groups.append(self._new_target_group(group))
        target = self.target_groups[group]
        costly_drafter = bool(drafters) and drafters[0].submit("runs_a_model").result()
        engine = SpecEngine(
            target, self.tokenizer, drafters, engine_config, self.model_config.eos_token_ids,
            functools.partial(self._rebuild_target_group, group), vocab_size=self.model_config.vocab_size,
            cost=measure_cost(target, engine_config.max_sequences, engine_config.max_len, key) if plan else None,
            costly_drafter=costly_drafter,
        )
        if self.pooled:
            self.pooled[group].counters = functools.partial(getattr, engine, "counters")
        return engine

    def _new_target_group(self, group: int) -> TargetGroup | LocalWorker:
        config = self.spec.engine
        colocated = self.spec.colocate_drafter and config.method != "none"
        layers, dtype = self._hidden_spec
        drafter = functools.partial(_build_with_target, config) if colocated else None
        cache = config.cache_options(self.model_config, getattr(torch, config.dtype))
        if self.spec.target_in_replica:
            shard = TargetShard(config.model, 0, 1, config.max_sequences, config.max_len, config.dtype, config.device,
                                config.attention_backend, config.cuda_graphs, layers, dtype, drafter,
                                config.cpu_threads, cache)
            shard.join("127.0.0.1", 0)  # a world of one: loads the model, meets nobody
            return LocalWorker(shard, "target")
        options = [self.placement.target_options(group, rank) for rank in range(self.spec.tensor_parallel_size)]
        return TargetGroup(
            config.model, self.spec.tensor_parallel_size, max_sequences=config.max_sequences,
            max_len=config.max_len, dtype=config.dtype, device=config.device,
            attention_backend=config.attention_backend, cuda_graphs=config.cuda_graphs, actor_options=options,
            hidden_layers=layers, hidden_dtype=dtype,
            build_drafter=drafter, cpu_threads=config.cpu_threads, cache=cache,
        )

    def _rebuild_target_group(self, group: int) -> TargetGroup | LocalWorker:
        """A failed group's surviving ranks may be stuck in a collective: replace them all."""
        log.warning("rebuilding target group %d", group)
        self.target_groups[group].shutdown()
        self.target_groups[group] = self._new_target_group(group)  # on the loop's thread, like the first
        return self.target_groups[group]

    def generate(self, requests: Iterable[GenerationRequest], timeout_s: float | None = None) -> list[GenerationOutput]:
        """Run requests concurrently across target groups; outputs in the order given."""
        import concurrent.futures

        futures = []
        for request in requests:
            future: concurrent.futures.Future = concurrent.futures.Future()

            def on_event(event, future=future):
                if event.finished:
                    future.set_result(event.finished)

            least_loaded(self.loops).submit(request, on_event)
            futures.append(future)
        return [future.result(timeout_s) for future in futures]

    def shutdown(self) -> None:
        for loop in self.loops:
            loop.stop()
        for group in self.target_groups:
            group.shutdown()
        for drafter in self.drafters:
            drafter.shutdown()
        for pooled in self.pooled:
            pooled.shutdown()
        if self.placement is not None:
            self.placement.release()
        self.loops, self.target_groups, self.drafters, self.pooled, self.placement = [], [], [], [], None
