"""`specserve bench busy-neighbour`: `specserve generate` on a machine another job is using.

OpenMP threads spin at a pass's barriers, so a process that runs torch on every core is at the
mercy of any other CPU-bound process (actors/model/threads.py). This runs the command a user runs,
`specserve generate --json`, alone, beside a CPU-bound Python loop, and beside a torch job on every
core, each also with OMP_NUM_THREADS=1 (the hand-set workaround) for reference, interleaved round
by round; it reports each setting's median tokens/s and every round.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from bench.specbench import RESULTS_DIR, command_line, machine, write_report

PROMPT = "Write a short story about a robot who learns to paint."
NEIGHBOURS = {
    "none": None,
    "python loop": "while True: pass",
    "torch job": "import torch\na = torch.randn(256, 256)\nwhile True:\n    a = torch.tanh(a @ a)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=3, help="runs of each setting")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens each run generates")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="a run taking longer counts as 0 tokens/s")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default bench/results/busy-neighbour-<time>.json)")


def generate(max_new_tokens: int, timeout: float, env: dict[str, str]) -> float:
    """Tokens/s of one `specserve generate` run, as its JSON reports it (0 when it timed out)."""
    command = [shutil.which("specserve") or str(Path(sys.executable).with_name("specserve")), "generate",
               "--json", "--chat", "--method", "none", "--max-new-tokens", str(max_new_tokens), PROMPT]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=True)
    except subprocess.TimeoutExpired:
        return 0.0
    return json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_s"]


def markdown(report: dict) -> str:
    lines = ["# `specserve generate` beside another job", "", f"`{report['command']}`", "",
             f"{report['date']}; " + ", ".join(f"{k} {v}" for k, v in report["machine"].items()), "",
             "| neighbour | threads | median tokens/s | rounds |", "|---|---|---:|---|"]
    for row in report["settings"]:
        rounds = ", ".join(f"{value:.1f}" for value in row["rounds"])
        lines.append(f"| {row['neighbour']} | {row['threads']} | {row['median']:.1f} | {rounds} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    out = args.out or RESULTS_DIR / f"busy-neighbour-{datetime.now():%Y%m%d-%H%M%S}.json"
    settings = [(name, threads) for name in NEIGHBOURS for threads in ("default", "OMP_NUM_THREADS=1")]
    rounds: dict[tuple[str, str], list[float]] = {setting: [] for setting in settings}
    for number in range(1, args.rounds + 1):
        for name, threads in settings:
            env = dict(os.environ) | ({"OMP_NUM_THREADS": "1"} if threads != "default" else {})
            neighbour = NEIGHBOURS[name] and subprocess.Popen([sys.executable, "-c", NEIGHBOURS[name]])
            try:
                rounds[(name, threads)].append(generate(args.max_new_tokens, args.timeout_s, env))
            finally:
                if neighbour:
                    neighbour.kill()
                    neighbour.wait()
            print(f"round {number}: {name}, {threads}: {rounds[(name, threads)][-1]:.1f} tokens/s", flush=True)
    report = {"command": command_line(args, "bench", "busy-neighbour"),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "settings": [{"neighbour": name, "threads": threads, "median": statistics.median(values),
                            "rounds": values} for (name, threads), values in rounds.items()]}
    write_report(report, out, markdown)
    print(markdown(report))
    return 0
