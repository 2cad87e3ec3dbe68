"""Cluster benchmark: concurrent requests through a SpecCluster on Ray (fake GPUs on a CPU machine).

For each concurrency level N, Spec-Bench prompts run through one cluster with N requests in flight
(a client that sends the next prompt as soon as one of its N finishes, as a loaded server sees
them), greedy, with speculation on (the engine's defaults: the planner sizes every draft) and off
(plain decoding on the same actors). A run decodes `max(REQUESTS_PER_SLOT * N, MIN_REQUESTS)`
prompts. Each round takes questions never run before (tasks in turn) and decodes them
speculatively, then plainly: the same prompts give both settings the same work (the same outputs,
so the same lengths). A level's speedup is the ratio of the two settings' median tokens/s over its
rounds (prefill included); every round's own ratio is reported beside it. Requests are built by
the service's own RequestBuilder, so they take the planner exactly as a served request does.

Why requests keep arriving rather than N starting and ending together: in such a closed batch the
run lasts as long as its slowest request, and the others' steps saved by speculation end in a
batch that shrinks to a few stragglers paying a whole pass each (measured: 16 requests, 0.93x, with
1.6 tokens accepted per pass; bench/results/cluster-bench-suffix-closed-batch.md).

Speculation goes first in every round because the draft actors learn every finished output
(suffix decoding's index of earlier outputs): a prompt whose answer they had seen would be drafted
from it, while plain decoding drafts nothing and cannot gain from what they learned. Its plain
outputs are also the check that speculation changed nothing: they must be identical.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import get_args

from bench.specbench import DEFAULT_QUESTIONS, RESULTS_DIR, comma_list, command_line, load_questions, machine
from cluster.engine.build import encode_prompt, engine_config_from_args
from cluster.engine.config import EngineConfig, Method
from cluster.engine.stats import mean_accepted_tokens
from cluster.serve.requests import RequestBuilder, RequestOptions, SpeculationOptions

REQUESTS_PER_SLOT, MIN_REQUESTS = 2, 4
SETTINGS = ("speculative", "plain")
"""Run in this order each round, on the same prompts (see the module docstring)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    parser.add_argument("--concurrency", type=comma_list(), default=["1", "2", "4", "8", "16"],
                        help="requests in flight at once, comma separated levels")
    parser.add_argument("--tensor-parallel", type=int, default=2, help="target shards in the target group")
    parser.add_argument("--draft-actors", type=int, default=1, help="draft actors")
    parser.add_argument("--colocate", action="store_true",
                        help="the drafter in the target shard's process instead of draft actors (needs --tensor-parallel 1)")
    parser.add_argument("--method", default=EngineConfig().method, choices=[m for m in get_args(Method) if m != "none"],
                        help="drafter of the draft actors")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both settings per concurrency level")
    parser.add_argument("--fake-gpus", type=int, default=4, help="GPUs Ray pretends to have (CPU machine)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/cluster-bench-<time>.json)")


def run_setting(cluster, requests: RequestBuilder, prompts: list[list[int]], speculate: bool, max_new_tokens: int,
                concurrency: int) -> dict:
    """Decode `prompts` with `concurrency` requests in flight, built as the service builds them (plain
    decoding: `speculation.method: off`, as a client asks); outputs in the prompts' order."""
    speculation = SpeculationOptions(method="default" if speculate else "off")

    def one(prompt: list[int]):
        request = requests.build_request(RequestOptions(prompt_token_ids=prompt, max_new_tokens=max_new_tokens,
                                                        speculation=speculation))
        return cluster.generate([request], timeout_s=3600)[0]

    began = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as clients:
        outputs = list(clients.map(one, prompts))
    seconds = time.perf_counter() - began
    tokens = sum(len(o.token_ids) for o in outputs)
    forwards = sum(o.stats.target_forwards for o in outputs)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "mean_accepted_tokens": mean_accepted_tokens(tokens, forwards), "token_ids": [o.token_ids for o in outputs]}


def requests_per_run(level: int) -> int:
    return max(REQUESTS_PER_SLOT * level, MIN_REQUESTS)


class PromptPool:
    """Hands out prompts never handed out before."""

    def __init__(self, prompts: list[list[int]]):
        self.prompts, self.used = prompts, 0

    def take(self, count: int) -> list[list[int]]:
        if self.used + count > len(self.prompts):
            raise SystemExit(f"cluster-bench: {len(self.prompts)} questions are too few for these levels and rounds "
                             "(each round needs prompts of its own); use fewer --rounds or --concurrency levels")
        self.used += count
        return self.prompts[self.used - count:self.used]


def measure_level(cluster, requests: RequestBuilder, pool: PromptPool, level: int, rounds: int,
                  max_new_tokens: int) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for round_index in range(rounds):
        prompts = pool.take(requests_per_run(level))
        for name in SETTINGS:
            runs[name].append(run_setting(cluster, requests, prompts, name == "speculative", max_new_tokens, level))
            print(f"  round {round_index + 1}/{rounds} {name}: {runs[name][-1]['tokens_per_s']:.2f} tokens/s", flush=True)
    paired = list(zip(runs["speculative"], runs["plain"]))
    plain = statistics.median(r["tokens_per_s"] for r in runs["plain"])
    speculative = statistics.median(r["tokens_per_s"] for r in runs["speculative"])
    return {
        "speedup": round(speculative / plain, 3),
        "plain_tokens_per_s": round(plain, 2),
        "speculative_tokens_per_s": round(speculative, 2),
        "mean_accepted_tokens": round(statistics.median(r["mean_accepted_tokens"] for r in runs["speculative"]), 3),
        "rounds": {name: [round(r["tokens_per_s"], 2) for r in results] for name, results in runs.items()},
        "round_speedups": [round(s["tokens_per_s"] / p["tokens_per_s"], 3) for s, p in paired],
        "outputs_identical": all(s["token_ids"] == p["token_ids"] for s, p in paired),
    }


def markdown(report: dict) -> str:
    rows = ["| concurrency | plain tokens/s | speculative tokens/s | speedup | mean accepted tokens | speedup by round |",
            "|---:|---:|---:|---:|---:|---|"]
    for level, v in report["by_concurrency"].items():
        rounds = ", ".join(f"{r:.2f}x" for r in v["round_speedups"])
        rows.append(f"| {level} | {v['plain_tokens_per_s']:.2f} | {v['speculative_tokens_per_s']:.2f} | "
                    f"{v['speedup']:.2f}x | {v['mean_accepted_tokens']:.2f} | {rounds} |")
    config = report["config"]
    drafters = "drafter co-located with the target" if config.get("colocate") else f"{config['draft_actors']} draft actor(s)"
    head = (f"Cluster bench: TP={config['tensor_parallel']}, {drafters} ({config['method']}), "
            f"{config['max_new_tokens']} new tokens, N requests in flight, medians of {config['rounds']} rounds, each "
            f"round's questions new and decoded speculatively then plainly; speculative outputs identical to plain "
            f"decoding: {report['outputs_identical']}")
    return head + "\n\n" + "\n".join(rows) + f"\n\nCommand: `{report['command']}`\n"


def run(args: argparse.Namespace) -> int:
    import ray

    from actors.model.loader import load_tokenizer
    from cluster.runtime.cluster_spec import ClusterSpec
    from cluster.runtime.spec_cluster import SpecCluster

    levels = [int(level) for level in args.concurrency]
    if not ray.is_initialized():
        ray.init(address="local", num_gpus=args.fake_gpus, include_dashboard=False)
    tokenizer = load_tokenizer(args.model)
    questions = load_questions(args.questions)
    needed = args.rounds * sum(requests_per_run(level) for level in levels) + 2
    prompts = [encode_prompt(tokenizer, q["turns"][0], chat=True) for q in questions[:needed]]
    pool = PromptPool(prompts)
    engine = engine_config_from_args(args, args.method, max_sequences=max(levels))
    spec = ClusterSpec(engine=engine, tensor_parallel_size=args.tensor_parallel, num_draft_actors=args.draft_actors,
                       colocate_drafter=args.colocate)
    cluster = SpecCluster(spec).start()
    requests = RequestBuilder.in_process(cluster.loops[0].engine, cluster.tokenizer, engine)
    by_level = {}
    try:
        run_setting(cluster, requests, pool.take(2), True, 8, 2)  # warm-up
        for level in levels:
            print(f"concurrency {level}", flush=True)
            by_level[str(level)] = measure_level(cluster, requests, pool, level, args.rounds, args.max_new_tokens)
    finally:
        cluster.shutdown()
    report = {
        "command": command_line(args, "cluster-bench"),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"},
        "outputs_identical": all(v["outputs_identical"] for v in by_level.values()),
        "by_concurrency": by_level,
    }
    out = args.out or RESULTS_DIR / f"cluster-bench-{datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0
