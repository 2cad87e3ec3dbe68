"""Cluster benchmark: concurrent requests through a SpecCluster on Ray (fake GPUs on a CPU machine).

For each concurrency level, N Spec-Bench prompts run at once through one cluster, greedy, with
speculation off (plain decoding on the same actors) and on (the engine's defaults: the planner
sizes every draft). Each round runs both settings back to back, alternating which goes first, so
that drifts in machine load hit both alike; the report keeps each setting's median tokens/s over
the rounds, and checks that every greedy output is identical across settings and rounds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import get_args

from bench.specbench import DEFAULT_QUESTIONS, RESULTS_DIR, comma_list, command_line, load_questions, machine
from cluster.engine.build import encode_prompt, engine_config_from_args
from cluster.engine.config import EngineConfig, Method
from cluster.engine.request import GenerationRequest
from cluster.engine.stats import mean_accepted_tokens

SETTINGS = ("plain", "speculative")


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


def run_setting(cluster, prompts: list[list[int]], speculate: bool, max_new_tokens: int) -> dict:
    requests = [GenerationRequest(uuid.uuid4().hex, p, max_new_tokens=max_new_tokens, speculate=speculate)
                for p in prompts]
    began = time.perf_counter()
    outputs = cluster.generate(requests, timeout_s=3600)
    seconds = time.perf_counter() - began
    tokens = sum(len(o.token_ids) for o in outputs)
    forwards = sum(o.stats.target_forwards for o in outputs)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "mean_accepted_tokens": mean_accepted_tokens(tokens, forwards), "token_ids": [o.token_ids for o in outputs]}


def measure_level(cluster, prompts: list[list[int]], rounds: int, max_new_tokens: int) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for round_index in range(rounds):
        order = SETTINGS if round_index % 2 == 0 else SETTINGS[::-1]
        for name in order:
            runs[name].append(run_setting(cluster, prompts, name == "speculative", max_new_tokens))
            print(f"  round {round_index + 1}/{rounds} {name}: {runs[name][-1]['tokens_per_s']:.2f} tokens/s", flush=True)
    plain = statistics.median(r["tokens_per_s"] for r in runs["plain"])
    speculative = statistics.median(r["tokens_per_s"] for r in runs["speculative"])
    reference = runs["plain"][0]["token_ids"]
    return {
        "speedup": round(speculative / plain, 3),
        "plain_tokens_per_s": round(plain, 2),
        "speculative_tokens_per_s": round(speculative, 2),
        "mean_accepted_tokens": round(statistics.median(r["mean_accepted_tokens"] for r in runs["speculative"]), 3),
        "rounds": {name: [round(r["tokens_per_s"], 2) for r in results] for name, results in runs.items()},
        "outputs_identical": all(r["token_ids"] == reference for results in runs.values() for r in results),
    }


def markdown(report: dict) -> str:
    rows = ["| concurrency | plain tokens/s | speculative tokens/s | speedup | mean accepted tokens | rounds (plain / speculative) |",
            "|---:|---:|---:|---:|---:|---|"]
    for level, v in report["by_concurrency"].items():
        rounds = f"{v['rounds']['plain']} / {v['rounds']['speculative']}"
        rows.append(f"| {level} | {v['plain_tokens_per_s']:.2f} | {v['speculative_tokens_per_s']:.2f} | "
                    f"{v['speedup']:.2f}x | {v['mean_accepted_tokens']:.2f} | {rounds} |")
    config = report["config"]
    drafters = "drafter co-located with the target" if config.get("colocate") else f"{config['draft_actors']} draft actor(s)"
    head = (f"Cluster bench: TP={config['tensor_parallel']}, {drafters} ({config['method']}), "
            f"{config['max_new_tokens']} new tokens, medians of {config['rounds']} interleaved rounds; greedy outputs "
            f"identical across settings and rounds: {report['outputs_identical']}")
    return head + "\n\n" + "\n".join(rows) + f"\n\nCommand: `{report['command']}`\n"


def run(args: argparse.Namespace) -> int:
    import ray

    from actors.model.loader import load_tokenizer
    from cluster.runtime.placement import ClusterSpec
    from cluster.runtime.spec_cluster import SpecCluster

    levels = [int(level) for level in args.concurrency]
    if not ray.is_initialized():
        ray.init(address="local", num_gpus=args.fake_gpus, include_dashboard=False)
    tokenizer = load_tokenizer(args.model)
    questions = load_questions(args.questions)
    step = max(1, len(questions) // max(levels))
    prompts = [encode_prompt(tokenizer, q["turns"][0], chat=True) for q in questions[::step][: max(levels)]]
    engine = engine_config_from_args(args, args.method, max_sequences=max(levels))
    spec = ClusterSpec(engine=engine, tensor_parallel_size=args.tensor_parallel, num_draft_actors=args.draft_actors,
                       colocate_drafter=args.colocate)
    cluster = SpecCluster(spec).start()
    by_level = {}
    try:
        run_setting(cluster, prompts[:2], True, 8)  # warm-up
        for level in levels:
            print(f"concurrency {level}", flush=True)
            by_level[str(level)] = measure_level(cluster, prompts[:level], args.rounds, args.max_new_tokens)
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
