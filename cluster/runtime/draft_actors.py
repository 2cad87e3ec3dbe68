"""What a draft actor runs to build its drafter: a replica's own draft actors (cluster/runtime/spec_cluster.py)
and a draft pool's drafters (cluster/runtime/draft_pool.py) build theirs the same way, from here."""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from actors.model.loader import load_config, resolve_model
from actors.model.threads import use_cores
from cluster.engine.build import build_proposer
from cluster.runtime.cluster_spec import ClusterSpec


def _build_in_draft_actor(config):
    """A draft actor's drafter, with torch on the actor's cores (module level: pickled)."""
    use_cores(config.cpu_threads)
    return build_proposer(config)


def draft_actor_builder(spec: ClusterSpec, groups: int) -> Callable:
    """What a draft actor runs to build its drafter: the engine's, with room for the requests of
    `groups` target groups (a draft actor drafts for every group it serves)."""
    config = spec.engine
    dtype = getattr(torch, config.dtype)
    shared = config.model_copy(update={"max_sequences": config.max_sequences * groups,
                                       "kv_cache_bytes": config.kv_budget(load_config(resolve_model(config.model)), dtype)
                                       * groups})
    return functools.partial(_build_in_draft_actor, shared)
