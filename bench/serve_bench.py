"""Served benchmark: a running app driven through its OpenAI HTTP API, as an external client drives it.

For each level N of requests in flight, each round takes Spec-Bench questions never sent before
(tasks in turn) and streams them as chat completions, greedy, N at a time: first with speculation
as deployed, then with `"speculation": {"method": "off"}` on the same questions. Speculation goes
first because the suffix index learns every finished output, including plain decoding's: a
question answered before would be drafted from its own answer. Each setting of a run sends a
`cache_salt` of its own: a deployment without API keys is one tenant, so without it the plain run
would be handed the speculative run's prompts by the prefix cache (and a later run this run's).
The plain outputs are also the check that speculation changed nothing: greedy texts must be identical.

Per level: output tokens/s of each setting (all tokens of the round / its wall time; the median
over rounds, and every round), the speedup as the ratio of the two median throughputs, time to
first token and inter-token latency (p50, p99 over requests; a request's inter-token latency is
(last token - first token) / (tokens - 1), as GuideLLM counts it), and the mean accepted tokens per
target pass that the server reports.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from bench.openai_stream import stream_chat
from bench.specbench import DEFAULT_QUESTIONS, comma_list, command_line, load_questions, machine

REQUESTS_PER_SLOT, MIN_REQUESTS = 2, 4
SETTINGS = {"speculative": {}, "plain": {"speculation": {"method": "off"}}}
"""Run in this order each round, on the same questions (see the module docstring)."""
WARMUP_QUESTIONS = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the running app's HTTP address")
    parser.add_argument("--model", default=None, help="model name to send (default: the app's first model)")
    parser.add_argument("--api-key", default=None, help="key for an app that requires one")
    parser.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    parser.add_argument("--skip-questions", type=int, default=0,
                        help="start this far into the question order (a second run against the same server "
                             "must not reuse questions the suffix index has learned)")
    parser.add_argument("--concurrency", type=comma_list(), default=["1", "4", "16", "32"],
                        help="requests in flight, comma separated levels")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of both settings per level (a round takes max(2N, 4) new questions: two rounds "
                             "of 1, 4, 16 and 32 in flight use 216 of the 240)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="max_tokens of every request")
    parser.add_argument("--request-timeout-s", type=float, default=600.0, help="a request taking longer fails the run")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON report; a .md table is written next to it (default: ./serve-bench-<time>.json)")


@dataclass
class Answer:
    text: str
    tokens: int
    first_token_s: float
    seconds: float
    mean_accepted_tokens: float | None

    @property
    def inter_token_s(self) -> float | None:
        return (self.seconds - self.first_token_s) / (self.tokens - 1) if self.tokens > 1 else None


def ask(args: argparse.Namespace, question: dict, extra: dict) -> Answer:
    body = {"model": args.model, "messages": [{"role": "user", "content": question["turns"][0]}],
            "max_tokens": args.max_new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    began, first, text, usage, speculation = time.perf_counter(), None, "", None, {}
    for now, event in stream_chat(args.url, body, args.api_key, args.request_timeout_s):
        choices = event.get("choices") or []
        delta = choices[0].get("delta", {}).get("content") if choices else None
        if delta:
            first = first if first is not None else now - began
            text += delta
        if event.get("usage"):
            usage, speculation = event["usage"], event.get("speculation") or {}
    if usage is None or first is None:
        raise RuntimeError(f"question {question['question_id']}: the stream ended without tokens or usage")
    return Answer(text=text, tokens=usage["completion_tokens"], first_token_s=first, seconds=time.perf_counter() - began,
                  mean_accepted_tokens=speculation.get("mean_accepted_tokens"))


def run_setting(args: argparse.Namespace, questions: list[dict], extra: dict, level: int) -> dict:
    began = time.perf_counter()
    with ThreadPoolExecutor(level) as clients:
        answers = list(clients.map(lambda q: ask(args, q, extra), questions))
    seconds = time.perf_counter() - began
    tokens = sum(a.tokens for a in answers)
    return {"seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 3),
            "answers": answers}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latency(answers: list[Answer]) -> dict:
    """Time to first token and inter-token latency percentiles, and the median request's whole
    latency (a first token's p90 past it means prompts wait longer than requests take)."""
    first = [a.first_token_s for a in answers]
    gaps = [a.inter_token_s for a in answers if a.inter_token_s is not None]
    return {"ttft_p50_s": percentile(first, 0.5), "ttft_p90_s": percentile(first, 0.9),
            "ttft_p99_s": percentile(first, 0.99), "itl_p50_s": percentile(gaps, 0.5),
            "itl_p99_s": percentile(gaps, 0.99), "latency_p50_s": percentile([a.seconds for a in answers], 0.5)}


def questions_per_round(level: int) -> int:
    return max(REQUESTS_PER_SLOT * level, MIN_REQUESTS)


def measure_level(args: argparse.Namespace, questions: list[dict], level: int, salt: str) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    per_round = questions_per_round(level)
    for round_index in range(args.rounds):
        chosen = questions[:per_round]
        del questions[:per_round]
        for name, extra in SETTINGS.items():
            runs[name].append(run_setting(args, chosen, {**extra, "cache_salt": f"{salt}-{name}"}, level))
            print(f"  round {round_index + 1}/{args.rounds} {name}: {runs[name][-1]['tokens_per_s']:.2f} tokens/s",
                  flush=True)
    medians = {name: statistics.median(r["tokens_per_s"] for r in results) for name, results in runs.items()}
    answers = {name: [a for r in results for a in r["answers"]] for name, results in runs.items()}
    accepted = [a.mean_accepted_tokens for a in answers["speculative"] if a.mean_accepted_tokens is not None]
    return {
        "speedup": round(medians["speculative"] / medians["plain"], 3),
        "tokens_per_s": {name: round(value, 2) for name, value in medians.items()},
        "rounds": {name: [r["tokens_per_s"] for r in results] for name, results in runs.items()},
        "latency": {name: latency(answers[name]) for name in SETTINGS},
        "mean_accepted_tokens": round(statistics.mean(accepted), 3) if accepted else None,
        "outputs_identical": [a.text for a in answers["speculative"]] == [a.text for a in answers["plain"]],
    }


def markdown(report: dict) -> str:
    rows = ["| in flight | plain tokens/s | speculative tokens/s | speedup | accepted/pass | TTFT p50 / p99 s (spec, plain) "
            "| ITL p50 / p99 ms (spec, plain) | rounds (spec / plain tokens/s) |",
            "|---:|---:|---:|---:|---:|---|---|---|"]
    for level, v in report["by_concurrency"].items():
        s, p = v["latency"]["speculative"], v["latency"]["plain"]
        ttft = f"{s['ttft_p50_s']:.2f} / {s['ttft_p99_s']:.2f}, {p['ttft_p50_s']:.2f} / {p['ttft_p99_s']:.2f}"
        itl = (f"{1e3 * s['itl_p50_s']:.0f} / {1e3 * s['itl_p99_s']:.0f}, "
               f"{1e3 * p['itl_p50_s']:.0f} / {1e3 * p['itl_p99_s']:.0f}")
        rounds = ", ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(v["rounds"]["speculative"], v["rounds"]["plain"]))
        accepted = "-" if v["mean_accepted_tokens"] is None else f"{v['mean_accepted_tokens']:.2f}"
        rows.append(f"| {level} | {v['tokens_per_s']['plain']:.2f} | {v['tokens_per_s']['speculative']:.2f} | "
                    f"{v['speedup']:.2f}x | {accepted} | {ttft} | {itl} | {rounds} |")
    config = report["config"]
    head = (f"Served benchmark against {config['url']} (model {report['model']}): Spec-Bench chat completions, greedy, "
            f"streamed, {config['max_new_tokens']} max tokens, {config['rounds']} rounds a level, each round's "
            f"questions new and sent with speculation as deployed, then with speculation off. Speedup = ratio of the "
            f"median throughputs. Greedy texts identical with and without speculation: {report['outputs_identical']}")
    return head + "\n\n" + "\n".join(rows) + f"\n\nCommand: `{report['command']}`\n"


def first_model(args: argparse.Namespace) -> str:
    import urllib.request

    request = urllib.request.Request(f"{args.url}/v1/models",
                                     headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def run(args: argparse.Namespace) -> int:
    args.model = args.model or first_model(args)
    salt = f"serve-bench-{uuid.uuid4().hex[:12]}"
    questions = load_questions(args.questions)[args.skip_questions:]
    levels = [int(level) for level in args.concurrency]
    needed = WARMUP_QUESTIONS + args.rounds * sum(questions_per_round(level) for level in levels)
    if len(questions) < needed:  # said before anything runs, not after an hour of it
        raise SystemExit(f"serve-bench: these levels and rounds need {needed} questions (every round has its own), "
                         f"{len(questions)} are left after --skip-questions; use fewer --rounds, --concurrency "
                         "levels or --skip-questions")
    run_setting(args, questions[:WARMUP_QUESTIONS], {"max_tokens": 8}, WARMUP_QUESTIONS)
    del questions[:WARMUP_QUESTIONS]
    by_level = {}
    for level in levels:
        print(f"{level} in flight", flush=True)
        by_level[str(level)] = measure_level(args, questions, level, salt)
    report = {
        "command": command_line(args, "bench", "serve"),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "model": args.model,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                   if k not in ("func", "api_key", "command", "benchmark")},
        "outputs_identical": all(v["outputs_identical"] for v in by_level.values()),
        "by_concurrency": by_level,
    }
    out = args.out or Path.cwd() / f"serve-bench-{datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0
