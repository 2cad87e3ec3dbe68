"""`specserve bench draft-pool`: N target groups drafting from one shared drafter (a draft pool)
against one drafter each, on fake GPUs.

For each N of `--groups`, N SpecClusters stand for N Serve replicas (one TP=1 target group each,
the same engine config), in two layouts: "own", each replica with a draft actor of its own (N
drafters), and "pooled", every replica naming one draft pool of a single drafter. Each replica
keeps `--clients` requests in flight (a closed loop of clients, requests built by the service's
RequestBuilder as a served request is), every replica over the same Spec-Bench questions. Per
layout: output tokens/s of all replicas together, mean accepted tokens per pass, the engines' mean
wait for drafts per step and, pooled, the mean wait of a draft call in the pool (its round trip
less the drafter's work). Greedy outputs must be identical across layouts and replicas.

On a CPU machine every actor shares the cores, so a drafter's cost shows as everyone's: the figures
say what sharing costs and saves in drafter time, not what GPUs would give.
"""
from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from bench.specbench import DEFAULT_QUESTIONS, RESULTS_DIR, comma_list, command_line, load_questions, machine, write_report
from cluster.engine.build import encode_prompt, engine_config_from_args
from cluster.engine.stats import mean_accepted_tokens
from cluster.serve.requests import RequestBuilder, RequestOptions, SpeculationOptions

LAYOUTS = ("own", "pooled")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    parser.add_argument("--groups", type=comma_list(), default=["1", "2", "4"], help="target groups (replicas), levels")
    parser.add_argument("--clients", type=int, default=2, help="requests in flight per replica")
    parser.add_argument("--prompts", type=int, default=8, help="questions each replica answers per layout")
    parser.add_argument("--method", default="suffix", help="drafter of every target group")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--fake-gpus", type=int, default=8, help="GPUs Ray pretends to have (CPU machine)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/draft-pool-<time>.json)")


def run_layout(spec, groups: int, prompts: list[list[int]], clients: int, max_new_tokens: int) -> dict:
    from cluster.runtime.spec_cluster import SpecCluster

    replicas = [SpecCluster(spec).start() for _ in range(groups)]
    try:
        builders = [RequestBuilder.in_process(r.loops[0].engine, r.tokenizer, spec.engine) for r in replicas]

        def answer(job):
            index, prompt = job
            request = builders[index].build_request(RequestOptions(
                prompt_token_ids=prompt, max_new_tokens=max_new_tokens, speculation=SpeculationOptions()))
            return index, replicas[index].generate([request], timeout_s=3600)[0]

        jobs = [(index, prompt) for prompt in prompts for index in range(groups)]
        began = time.perf_counter()
        with ThreadPoolExecutor(clients * groups) as pool:
            outputs = list(pool.map(answer, jobs))
        seconds = time.perf_counter() - began
        counters = [r.loops[0].engine.counters for r in replicas]
        waits = [p.waited for r in replicas for p in r.pooled]
    finally:
        for replica in replicas:
            replica.shutdown()
    tokens = sum(len(o.token_ids) for _, o in outputs)
    steps = sum(c.steps for c in counters)
    calls = sum(w[0] for w in waits)
    return {
        "seconds": round(seconds, 2), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 2),
        "mean_accepted_tokens": round(mean_accepted_tokens(tokens, sum(o.stats.target_forwards for _, o in outputs)), 3),
        "draft_wait_ms_per_step": round(1e3 * sum(c.draft_wait_seconds for c in counters) / max(steps, 1), 2),
        "pool_wait_ms_per_call": round(1e3 * sum(w[1] for w in waits) / calls, 2) if calls else None,
        "token_ids": {f"{index}:{position // groups}": o.token_ids for position, (index, o) in enumerate(outputs)},
    }


def markdown(report: dict) -> str:
    rows = ["| target groups | layout | drafters | tokens/s | mean accepted tokens | draft wait ms/step | pool call wait ms |",
            "|---:|---|---:|---:|---:|---:|---:|"]
    for groups, layouts in report["by_groups"].items():
        for layout, v in layouts.items():
            drafters = groups if layout == "own" else 1
            wait = "-" if v["pool_wait_ms_per_call"] is None else f"{v['pool_wait_ms_per_call']:.1f}"
            rows.append(f"| {groups} | {layout} | {drafters} | {v['tokens_per_s']:.2f} | {v['mean_accepted_tokens']:.2f} | "
                        f"{v['draft_wait_ms_per_step']:.1f} | {wait} |")
    config = report["config"]
    head = (f"Draft pool bench ({report['date']}): N replicas of one TP=1 target group, each with "
            f"{config['clients']} requests in flight over the same {config['prompts']} Spec-Bench questions, "
            f"{config['max_new_tokens']} new tokens, greedy, drafter {config['method']}; own = a draft actor per "
            f"replica, pooled = one shared drafter. Outputs identical across layouts and replicas: "
            f"{report['outputs_identical']}. Fake GPUs on a {report['machine']['cpus']}-core CPU: every actor shares "
            "the cores.")
    return head + "\n\n" + "\n".join(rows) + f"\n\nCommand: `{report['command']}`\n"


def run(args: argparse.Namespace) -> int:
    import ray

    from actors.model.loader import load_tokenizer
    from cluster.runtime.cluster_spec import ClusterSpec
    from cluster.runtime.draft_pool_spec import DraftPoolSpec

    if not ray.is_initialized():
        ray.init(address="local", num_gpus=args.fake_gpus, include_dashboard=False)
    tokenizer = load_tokenizer(args.model)
    questions = load_questions(args.questions)[:args.prompts]
    prompts = [encode_prompt(tokenizer, q["turns"][0], chat=True) for q in questions]
    engine = engine_config_from_args(args, args.method, max_sequences=args.clients)
    by_groups, identical = {}, True
    for groups in (int(level) for level in args.groups):
        print(f"{groups} target groups", flush=True)
        layouts = {}
        for layout in LAYOUTS:
            pool = DraftPoolSpec(name=f"bench-{groups}", min_drafters=1, max_drafters=1, groups_per_drafter=groups,
                                 idle_shutdown_s=1) if layout == "pooled" else None
            spec = ClusterSpec(engine=engine, draft_pool=pool)
            layouts[layout] = run_layout(spec, groups, prompts, args.clients, args.max_new_tokens)
            print(f"  {layout}: {layouts[layout]['tokens_per_s']:.2f} tokens/s", flush=True)
        own, pooled = (layouts[layout].pop("token_ids") for layout in LAYOUTS)
        identical &= own == pooled and all(own[f"{g}:{i}"] == own[f"0:{i}"] for i in range(len(prompts))
                                           for g in range(groups))
        by_groups[str(groups)] = layouts
    report = {
        "command": command_line(args, "bench", "draft-pool"),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"},
        "outputs_identical": identical,
        "by_groups": by_groups,
    }
    out = args.out or RESULTS_DIR / f"draft-pool-{datetime.now():%Y%m%d-%H%M%S}.json"
    write_report(report, out, markdown)
    print(markdown(report))
    return 0
