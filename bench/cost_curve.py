"""`specserve bench cost-curve`: what a verification pass costs, by the tokens in it.

Times the default target's pass (after `--context` tokens of context, batch 1, medians) at each
token count, relative to one token: the curve the planner reads, measured the way the engine
measures it at start (actors/model/timing.py).
"""
from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path

import torch

from actors.model.loader import load_model
from actors.model.runner import ModelRunner
from actors.model.timing import time_passes
from bench.specbench import RESULTS_DIR, comma_list, command_line, machine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=comma_list(), default=["1", "2", "4", "8", "16", "32"],
                        help="tokens per pass, comma separated")
    parser.add_argument("--context", type=int, default=256, help="committed tokens before the pass")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per point (the median is kept)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/cost-curve-<time>.json)")


def run(args: argparse.Namespace) -> int:
    tokens = [int(t) for t in args.tokens]
    runner = ModelRunner(load_model(args.model, getattr(torch, args.dtype)), 1, args.context + max(tokens) + 1)
    seconds = time_passes(runner, [(t, 1) for t in tokens], args.context, args.repeats)
    one = seconds[tokens.index(1)] if 1 in tokens else seconds[0]
    report = {
        "command": command_line(args, "bench", "cost-curve"),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "model": args.model, "dtype": args.dtype, "context": args.context, "repeats": args.repeats,
        "points": [{"tokens": t, "seconds": round(s, 5), "ratio": round(s / one, 3)} for t, s in zip(tokens, seconds)],
    }
    out = args.out or RESULTS_DIR / f"cost-curve-{datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    for point in report["points"]:
        print(f"{point['tokens']:4d} tokens  {point['seconds'] * 1000:7.1f} ms  {point['ratio']:.2f}x")
    print(f"wrote {out}")
    return 0
