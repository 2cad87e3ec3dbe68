"""`specserve bench ray-overhead`: what one router -> worker round trip costs on Ray, with plain
actor calls and with a Ray Compiled Graph (`ray.dag`, `experimental_compile`).

The payloads are what the engine sends each step: a verify batch of draft trees to a target shard
and a propose batch of draft requests to a draft actor, answered by small results. The actors do
no work, so the figures are the transport alone. Medians of `--calls` round trips after a warm-up.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from actors.messages import VerifyItem, VerifyReply
from bench.specbench import RESULTS_DIR, command_line, machine
from speculators.proposers.base import DraftRequest
from speculators.tree import DraftTree
from speculators.verify import VerifyResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=8, help="requests per call")
    parser.add_argument("--tree-nodes", type=int, default=16, help="drafted nodes per tree")
    parser.add_argument("--calls", type=int, default=300, help="timed round trips per transport")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/ray-overhead-<time>.json)")


class Echo:
    """Answers like a target shard and a draft actor, without the work."""

    def verify(self, batch):
        return VerifyReply([VerifyResult([0], [], item.tree.token_ids[0]) for item in batch])

    def propose(self, requests):
        return [DraftTree.root_only(r.token_ids[-1]) for r in requests]


def payloads(batch: int, nodes: int) -> dict[str, object]:
    tree = DraftTree.chain(7, list(range(nodes)), confidence=[1.0] * (nodes + 1))
    return {"verify": [VerifyItem(f"r{i}", tree) for i in range(batch)],
            "propose": [DraftRequest(request_id=f"r{i}", token_ids=[5, 6, 7], num_speculative_tokens=8, max_nodes=nodes,
                                     start=900) for i in range(batch)]}


def _median_us(call, count: int) -> float:
    for _ in range(20):
        call()
    samples = []
    for _ in range(count):
        began = time.perf_counter()
        call()
        samples.append(time.perf_counter() - began)
    return round(statistics.median(samples) * 1e6, 1)


def run(args: argparse.Namespace) -> int:
    import ray
    from ray.dag import InputNode

    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False)
    actor = ray.remote(Echo).options(num_cpus=0).remote()
    results = {}
    for method, payload in payloads(args.batch, args.tree_nodes).items():
        remote = getattr(actor, method)
        plain = _median_us(lambda: ray.get(remote.remote(payload)), args.calls)
        with InputNode() as given:
            dag = remote.bind(given)
        compiled = dag.experimental_compile()
        try:
            graph = _median_us(lambda: ray.get(compiled.execute(payload)), args.calls)
        finally:
            compiled.teardown()
        results[method] = {"plain_actor_call_us": plain, "compiled_graph_us": graph}
        print(f"{method}: plain actor call {plain:.0f} us, compiled graph {graph:.0f} us", flush=True)
    report = {"command": command_line(args, "bench", "ray-overhead"), "machine": machine(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "round_trips": results}
    out = args.out or RESULTS_DIR / f"ray-overhead-{datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0
