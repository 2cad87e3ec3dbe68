"""Cluster benchmark: concurrent requests through a SpecCluster on Ray (fake GPUs on a CPU machine).

Runs the same workload (N concurrent Spec-Bench prompts, greedy) through one cluster in three
settings, interleaved over repeats so load drifts hit all alike: speculation off (plain decoding
on the same actors), speculation on with pipelining off, and speculation on with pipelining on.
Reports aggregate tokens/s, mean time per engine step (one verification of one micro-batch), mean
accepted tokens and the time the engine waited for drafts.
"""
from __future__ import annotations

import argparse
import json
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import get_args

from bench.specbench import DEFAULT_QUESTIONS, RESULTS_DIR, load_questions, machine
from cluster.engine.build import encode_prompt, engine_config_from_args
from cluster.engine.config import EngineConfig, Method
from cluster.engine.request import GenerationRequest
from cluster.engine.stats import mean_accepted_tokens

SETTINGS = (("plain", False, False), ("speculative", True, False), ("speculative+pipeline", True, True))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--tensor-parallel", type=int, default=2, help="target shards in the target group")
    parser.add_argument("--draft-actors", type=int, default=2, help="draft actors")
    parser.add_argument("--method", default=EngineConfig().method, choices=[m for m in get_args(Method) if m != "none"],
                        help="drafter of the draft actors")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the three settings")
    parser.add_argument("--fake-gpus", type=int, default=4, help="GPUs Ray pretends to have (CPU machine)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/cluster-bench-<time>.json)")


def run_setting(cluster, prompts: list[list[int]], speculate: bool, pipeline: bool, max_new_tokens: int) -> dict:
    engine = cluster.loops[0].engine
    engine.config = engine.config.model_copy(update={"pipeline": pipeline})
    before = (engine.counters.steps, engine.counters.verify_seconds, engine.counters.draft_wait_seconds)
    requests = [GenerationRequest(uuid.uuid4().hex, p, max_new_tokens=max_new_tokens, speculate=speculate)
                for p in prompts]
    began = time.perf_counter()
    outputs = cluster.generate(requests, timeout_s=3600)
    seconds = time.perf_counter() - began
    steps = engine.counters.steps - before[0]
    tokens = sum(len(o.token_ids) for o in outputs)
    forwards = sum(o.stats.target_forwards for o in outputs)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "steps": steps,
        "step_seconds": seconds / steps if steps else None,
        "verify_seconds_per_step": (engine.counters.verify_seconds - before[1]) / steps if steps else None,
        "draft_wait_seconds_per_step": (engine.counters.draft_wait_seconds - before[2]) / steps if steps else None,
        "forwards": forwards,
        "mean_accepted_tokens": mean_accepted_tokens(tokens, forwards),
        "token_ids": [o.token_ids for o in outputs],
    }


def summarize(runs: dict[str, list[dict]]) -> dict:
    summary = {}
    for name, results in runs.items():
        tokens, seconds = sum(r["tokens"] for r in results), sum(r["seconds"] for r in results)
        steps = sum(r["steps"] for r in results)
        summary[name] = {
            "tokens_per_s": round(tokens / seconds, 2),
            "step_seconds": round(seconds / steps, 4) if steps else None,
            "verify_seconds_per_step": round(sum(r["verify_seconds_per_step"] * r["steps"] for r in results) / steps, 4),
            "draft_wait_seconds_per_step": round(sum(r["draft_wait_seconds_per_step"] * r["steps"] for r in results) / steps, 4),
            "mean_accepted_tokens": round(mean_accepted_tokens(tokens, sum(r["forwards"] for r in results)), 3),
        }
    plain = summary["plain"]["tokens_per_s"]
    for values in summary.values():
        values["speedup_vs_plain"] = round(values["tokens_per_s"] / plain, 3)
    return summary


def markdown(report: dict) -> str:
    rows = ["| setting | tokens/s | speedup vs plain | step s | verify s / step | draft wait s / step | mean accepted tokens |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name, v in report["summary"].items():
        rows.append(f"| {name} | {v['tokens_per_s']:.2f} | {v['speedup_vs_plain']:.2f}x | {v['step_seconds']:.3f} | "
                    f"{v['verify_seconds_per_step']:.3f} | {v['draft_wait_seconds_per_step']:.3f} | {v['mean_accepted_tokens']:.2f} |")
    config = report["config"]
    head = (f"Cluster bench: {config['concurrency']} concurrent requests, TP={config['tensor_parallel']}, "
            f"{config['draft_actors']} draft actors ({config['method']}), {config['max_new_tokens']} new tokens, "
            f"{config['repeats']} repeats; greedy outputs identical across settings: {report['outputs_identical']}")
    return head + "\n\n" + "\n".join(rows) + f"\n\nCommand: `{report['command']}`\n"


def run(args: argparse.Namespace) -> int:
    import ray

    from actors.model.loader import load_tokenizer
    from cluster.runtime.placement import ClusterSpec
    from cluster.runtime.spec_cluster import SpecCluster

    if not ray.is_initialized():
        ray.init(address="local", num_gpus=args.fake_gpus, include_dashboard=False)
    tokenizer = load_tokenizer(args.model)
    questions = load_questions(args.questions)
    step = max(1, len(questions) // args.concurrency)
    prompts = [encode_prompt(tokenizer, q["turns"][0], chat=True) for q in questions[::step][: args.concurrency]]
    engine = engine_config_from_args(args, args.method, max_sequences=args.concurrency)
    spec = ClusterSpec(engine=engine, tensor_parallel_size=args.tensor_parallel, num_draft_actors=args.draft_actors)
    cluster = SpecCluster(spec).start()
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in SETTINGS}
    try:
        run_setting(cluster, prompts[:2], True, True, 8)  # warm-up
        for repeat in range(args.repeats):
            for name, speculate, pipeline in SETTINGS:
                result = run_setting(cluster, prompts, speculate, pipeline, args.max_new_tokens)
                runs[name].append(result)
                print(f"[{repeat + 1}/{args.repeats}] {name}: {result['tokens_per_s']:.2f} tokens/s, "
                      f"{result['steps']} steps", flush=True)
    finally:
        cluster.shutdown()
    identical = all(r["token_ids"] == runs["plain"][0]["token_ids"] for results in runs.values() for r in results)
    report = {
        "command": "specserve cluster-bench " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in sorted(vars(args).items())
            if k not in ("func", "command", "out") and v is not None),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"},
        "outputs_identical": identical,
        "summary": summarize(runs),
        "runs": {name: [{k: v for k, v in r.items() if k != "token_ids"} for r in results] for name, results in runs.items()},
    }
    out = args.out or RESULTS_DIR / f"cluster-bench-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0
