"""Cluster benchmark: concurrent requests through a SpecCluster on Ray (fake GPUs on a CPU machine).

For each concurrency level, N Spec-Bench prompts run at once through one cluster, greedy, with
speculation off (plain decoding on the same actors) and on (the engine's defaults: the planner
sizes every draft). Each round runs both settings back to back, alternating which goes first, so
that drifts in machine load hit both alike; the report keeps each setting's median tokens/s over
the rounds.

No prompt runs twice: the draft actors learn every finished output (suffix decoding's index of
earlier outputs), so a prompt seen before would be drafted from its own answer. Each run takes the
next questions of the set (tasks in turn); afterwards every speculative run's prompts are decoded
once more with speculation off, untimed, and the outputs must be identical.
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


class PromptPool:
    """Hands out prompts never handed out before."""

    def __init__(self, prompts: list[list[int]]):
        self.prompts, self.used = prompts, 0

    def take(self, count: int) -> list[list[int]]:
        if self.used + count > len(self.prompts):
            raise SystemExit(f"cluster-bench: {len(self.prompts)} questions are too few for these levels and rounds "
                             "(each run needs prompts of its own); use fewer --rounds or --concurrency levels")
        self.used += count
        return self.prompts[self.used - count:self.used]


def measure_level(cluster, pool: PromptPool, level: int, rounds: int, max_new_tokens: int) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for round_index in range(rounds):
        order = SETTINGS if round_index % 2 == 0 else SETTINGS[::-1]
        for name in order:
            prompts = pool.take(level)
            runs[name].append({**run_setting(cluster, prompts, name == "speculative", max_new_tokens), "prompts": prompts})
            print(f"  round {round_index + 1}/{rounds} {name}: {runs[name][-1]['tokens_per_s']:.2f} tokens/s", flush=True)
    plain = statistics.median(r["tokens_per_s"] for r in runs["plain"])
    speculative = statistics.median(r["tokens_per_s"] for r in runs["speculative"])
    return {
        "speedup": round(speculative / plain, 3),
        "plain_tokens_per_s": round(plain, 2),
        "speculative_tokens_per_s": round(speculative, 2),
        "mean_accepted_tokens": round(statistics.median(r["mean_accepted_tokens"] for r in runs["speculative"]), 3),
        "rounds": {name: [round(r["tokens_per_s"], 2) for r in results] for name, results in runs.items()},
        "speculative_runs": runs["speculative"],
    }


def identical_to_plain(cluster, level_report: dict, max_new_tokens: int) -> bool:
    """Decode the speculative runs' prompts with speculation off (untimed); outputs must match."""
    runs = level_report.pop("speculative_runs")
    prompts = [p for run in runs for p in run["prompts"]]
    plain = run_setting(cluster, prompts, False, max_new_tokens)["token_ids"]
    return plain == [ids for run in runs for ids in run["token_ids"]]


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
            f"{config['max_new_tokens']} new tokens, medians of {config['rounds']} interleaved rounds, every run on "
            f"questions of its own; speculative outputs identical to plain decoding: {report['outputs_identical']}")
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
    needed = 2 * args.rounds * sum(levels) + 2
    prompts = [encode_prompt(tokenizer, q["turns"][0], chat=True) for q in questions[:needed]]
    pool = PromptPool(prompts)
    engine = engine_config_from_args(args, args.method, max_sequences=max(levels))
    spec = ClusterSpec(engine=engine, tensor_parallel_size=args.tensor_parallel, num_draft_actors=args.draft_actors,
                       colocate_drafter=args.colocate)
    cluster = SpecCluster(spec).start()
    by_level = {}
    try:
        run_setting(cluster, pool.take(2), True, 8)  # warm-up
        for level in levels:
            print(f"concurrency {level}", flush=True)
            by_level[str(level)] = measure_level(cluster, pool, level, args.rounds, args.max_new_tokens)
        for report in by_level.values():
            report["outputs_identical"] = identical_to_plain(cluster, report, args.max_new_tokens)
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
