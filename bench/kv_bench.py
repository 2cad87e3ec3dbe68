"""`specserve bench kv`: what the paged KV cache, prefix caching and chunked prefill give a client.

The deployment of a Serve config (default `configs/serve.yaml`, what `make serve` runs) is served
over HTTP in this process's Ray instance, once per variant of its engine settings, and driven as a
client drives it (streamed chat completions, greedy), each scenario with speculation as deployed
and with `"speculation": {"method": "off"}` on the same requests:

- capacity: N clients (N = 8, 16, 32, 64) asking 2N Spec-Bench questions between them (those of up
  to 1,000 tokens; each level on a fresh deployment), each client sending its next question when
  its answer ends, the paged cache as deployed against the same memory decoding 8 requests at once
  (`max_sequences: 8`: what the slot cache of earlier releases allowed); output tokens/s over the
  round (a single wave of N would end with its slowest answer). How many decode together is counted
  in process (the engine's running requests at each step, 64 questions, plain decoding).
- shared-prefix: 32 questions behind one ~1,000-token system prompt, all at once: prefix caching
  on after one request has put the prompt in the cache ("on"), on with nothing cached before the
  32 arrive ("together": computed once, by the first), and off: time to first token, the wave's
  wall time, and the cached prompt tokens the server reports.
- multi-turn: mt_bench conversations; each second turn is sent with the first turn and its answer
  as history (both turns through the server); prefix caching on and off: the second turns' time to
  first token.
- interference: 8 streams decoding while a ~1,500-token prompt arrives every few seconds; chunked
  prefill on and off: the gaps between the running streams' chunks while the prompts arrive (p50,
  p99; a chunk carries one or more tokens).

Requests share the prefix cache of their scope (`limits.cache_sharing: tenant`; a deployment
without keys is one tenant): one `cache_salt` for the speculative requests and another for the
plain ones, so that neither finds prompts the other sent in the cache (the plain requests repeat
the speculative ones' questions). Runs before 2026-12-03 used one bearer token per setting, which
a deployment without keys then took for a tenant. Greedy texts must be identical
with and without speculation, and across variants.
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import yaml

from bench.openai_stream import stream_chat
from bench.serve_bench import percentile
from bench.specbench import DEFAULT_QUESTIONS, RESULTS_DIR, command_line, load_questions, machine, write_report

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "serve.yaml"
SCENARIOS = ("capacity", "shared-prefix", "multi-turn", "interference")
SETTINGS = {"speculative": {}, "plain": {"speculation": {"method": "off"}}}
CACHE_SALT = "kv-bench"
"""The cache salts are this plus the setting's name: one cache scope per setting (see the module docstring)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=CONFIG, help="Serve config whose first application is measured")
    parser.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma separated: " + ", ".join(SCENARIOS))
    parser.add_argument("--levels", default="8,16,32,64", help="capacity: requests in flight, comma separated")
    parser.add_argument("--slot-levels", default="8,16,32,64",
                        help="capacity: the levels measured for 8 requests at once (empty: none)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="capacity and multi-turn: max_tokens")
    parser.add_argument("--prefix-variants", default="on,together,off",
                        help="shared-prefix, comma separated: on (prefix caching, the system prompt put in the "
                             "cache by one request first), together (prefix caching, all requests arriving at once "
                             "with nothing cached), off (no prefix caching)")
    parser.add_argument("--port", type=int, default=8124, help="HTTP port of the app this run starts")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/kv-bench-<time>.json)")


@dataclass
class Reply:
    text: str
    tokens: int
    first_token_s: float
    seconds: float
    cached_tokens: int
    arrivals: list[float] = field(default_factory=list)
    """When each content chunk arrived (perf_counter)."""


class Client:
    def __init__(self, url: str, model: str):
        self.url, self.model = url, model

    def chat(self, messages: list[dict], max_tokens: int, setting: str) -> Reply:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "cache_salt": f"{CACHE_SALT}-{setting}",
                **SETTINGS[setting]}
        began, text, usage, arrivals = time.perf_counter(), "", {}, []
        for now, event in stream_chat(self.url, body, None, 1200):
            choices = event.get("choices") or []
            delta = choices[0].get("delta", {}).get("content") if choices else None
            if delta:
                text += delta
                arrivals.append(now)
            usage = event.get("usage") or usage
        if not arrivals:
            raise RuntimeError("a stream ended without tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return Reply(text=text, tokens=usage.get("completion_tokens", 0), first_token_s=arrivals[0] - began,
                     seconds=time.perf_counter() - began, cached_tokens=cached, arrivals=arrivals)

    def wave(self, conversations: list[list[dict]], max_tokens: int, setting: str,
             in_flight: int | None = None) -> tuple[list[Reply], float]:
        """`in_flight` at a time (default: all at once); the replies in order and the wall time."""
        began = time.perf_counter()
        with ThreadPoolExecutor(in_flight or len(conversations)) as clients:
            replies = list(clients.map(lambda messages: self.chat(messages, max_tokens, setting), conversations))
        return replies, time.perf_counter() - began


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


class Deployment:
    """The config's application served under one set of engine overrides at a time."""

    def __init__(self, app: dict, port: int):
        self.app, self.port = app, port
        self.url = f"http://127.0.0.1:{port}"

    def serve(self, overrides: dict) -> Client:
        """A fresh deployment (empty caches, suffix index and cost statistics) with `overrides`."""
        from ray import serve

        from cluster.serve.app import AppArgs, build_app

        args = yaml.safe_load(yaml.safe_dump(self.app.get("args") or {}))
        args["cluster"]["engine"].update(overrides)
        serve.delete("kv-bench")
        serve.run(build_app(args), name="kv-bench", route_prefix="/")
        client = Client(self.url, AppArgs.model_validate(args).served()[0].model_id)
        client.chat(user("Hello"), 4, "plain")  # the first request pays lazy set-up
        return client


CAPACITY_PROMPT_TOKENS = 1000
"""Capacity asks the Spec-Bench questions up to this long (227 of 240), within the default
`max_prompt_tokens` once the chat template is added."""


def capacity(deployment: Deployment, questions: list[dict], args: argparse.Namespace, tokenizer, save) -> dict:
    """Each level on a fresh deployment (the suffix index has learned nothing) with the first 2N
    questions; `save` keeps what is measured after each level."""
    short = [q for q in questions if len(tokenizer.encode(q["turns"][0])) <= CAPACITY_PROMPT_TOKENS]
    variants = {"paged": ({}, args.levels), "8 at once": ({"max_sequences": 8}, args.slot_levels)}
    report: dict = {"by_variant": {name: {} for name in variants}, "texts_identical": True}
    texts: dict = {}
    for name, (overrides, levels) in variants.items():
        for level in (int(level) for level in levels.split(",") if level):
            client = deployment.serve(overrides)
            chosen = short[: 2 * level]
            row = {}
            for setting in SETTINGS:
                replies, seconds = client.wave([user(q["turns"][0]) for q in chosen], args.max_new_tokens, setting, level)
                tokens = sum(r.tokens for r in replies)
                row[setting] = {"tokens_per_s": round(tokens / seconds, 2), "seconds": round(seconds, 2),
                                "ttft_p50_s": percentile([r.first_token_s for r in replies], 0.5)}
                texts.setdefault(level, []).append([r.text for r in replies])
                print(f"capacity {name} {level} in flight {setting}: {row[setting]['tokens_per_s']} tokens/s", flush=True)
            row["speedup"] = round(row["speculative"]["tokens_per_s"] / row["plain"]["tokens_per_s"], 3)
            report["by_variant"][name][str(level)] = row
            report["texts_identical"] = all(all(t == v[0] for t in v) for v in texts.values())
            save(report)
    report["decoding_together"] = decoding_together(deployment.app, short[:64], args.max_new_tokens)
    return report


def decoding_together(app: dict, questions: list[dict], max_new_tokens: int) -> dict:
    """In process, plain decoding: how many of 64 Spec-Bench requests the default KV memory runs at
    once (the most at any step), and the preemptions it took."""
    from cluster.engine.build import build_engine
    from cluster.serve.app import AppArgs
    from cluster.serve.requests import RequestBuilder, RequestOptions, SpeculationOptions

    deployment = AppArgs.model_validate(app.get("args") or {})
    config = deployment.served()[0].cluster.engine.model_copy(update={"method": "none"})
    engine, tokenizer = build_engine(config)
    engine_model = engine.target.target.model
    builder = RequestBuilder(engine, tokenizer, config.model, config.method, config.lookahead, deployment.limits)
    for question in questions:
        engine.add(builder.build_request(RequestOptions(messages=user(question["turns"][0]), max_new_tokens=max_new_tokens,
                                                        speculation=SpeculationOptions(method="off"))))
    most = 0
    while engine.has_work:
        engine.step()
        most = max(most, engine.scheduler.decoding)
    return {"requests": len(questions), "most_decoding_at_once": most, "preemptions": engine.counters.preemptions,
            "kv_cache_bytes": config.kv_budget(engine_model.config, engine_model.dtype), "max_sequences": config.max_sequences}


def long_text(questions: list[dict], tokenizer, tokens: int) -> str:
    """Spec-Bench question texts joined until about `tokens` tokens: a stand-in for a long document."""
    text = ""
    for question in questions:
        text += question["turns"][0] + "\n\n"
        if len(tokenizer.encode(text)) >= tokens:
            break
    ids = tokenizer.encode(text)[:tokens]
    return tokenizer.decode(ids)


def shared_prefix(deployment: Deployment, questions: list[dict], args: argparse.Namespace, tokenizer) -> dict:
    system = "Answer using the reference material below.\n\n" + long_text(questions[100:], tokenizer, 1000)
    short = [q for q in questions[:100] if len(tokenizer.encode(q["turns"][0])) <= 150]  # within max_prompt_tokens
    asks = [[{"role": "system", "content": system}, *user(q["turns"][0])] for q in short[:33]]
    results, texts = {}, {}
    variants = {"on": (True, True), "together": (True, False), "off": (False, True)}
    for name in args.prefix_variants.split(","):
        caching, warm = variants[name]
        client = deployment.serve({"enable_prefix_caching": caching})
        for setting in SETTINGS:
            if warm:
                client.chat(asks[32], 4, setting)  # the system prompt is now cached (when caching is on)
            replies, seconds = client.wave(asks[:32], 32, setting)
            results.setdefault(name, {})[setting] = {
                "ttft_p50_s": round(percentile([r.first_token_s for r in replies], 0.5), 3),
                "ttft_p99_s": round(percentile([r.first_token_s for r in replies], 0.99), 3),
                "seconds": round(seconds, 2),
                "cached_tokens_median": statistics.median(r.cached_tokens for r in replies)}
            texts[(name, setting)] = [r.text for r in replies]
            print(f"shared-prefix caching {name} {setting}: {results[name][setting]}", flush=True)
    system_tokens = len(tokenizer.encode(system))
    for name, key in (("on", "ttft_ratio"), ("together", "ttft_ratio_together")):
        for setting in SETTINGS:
            if name in results and "off" in results:
                ratio = results["off"][setting]["ttft_p50_s"] / results[name][setting]["ttft_p50_s"]
                results.setdefault(key, {})[setting] = round(ratio, 2)
    return {"system_prompt_tokens": system_tokens, "by_caching": results,
            "texts_identical": len({tuple(v) for v in texts.values()}) == 1}


def multi_turn(deployment: Deployment, questions: list[dict], args: argparse.Namespace) -> dict:
    conversations = [q for q in questions if q.get("category") == "mt_bench" or len(q["turns"]) > 1][:8]
    results, texts = {}, {}
    for name, caching in (("on", True), ("off", False)):
        client = deployment.serve({"enable_prefix_caching": caching})
        for setting in SETTINGS:
            firsts, _ = client.wave([user(q["turns"][0]) for q in conversations], args.max_new_tokens, setting)
            seconds = [[*user(q["turns"][0]), {"role": "assistant", "content": first.text}, *user(q["turns"][1])]
                       for q, first in zip(conversations, firsts)]
            replies, wall = client.wave(seconds, args.max_new_tokens, setting)
            results.setdefault(name, {})[setting] = {
                "ttft_p50_s": round(percentile([r.first_token_s for r in replies], 0.5), 3),
                "seconds": round(wall, 2), "cached_tokens_median": statistics.median(r.cached_tokens for r in replies)}
            texts[(name, setting)] = [r.text for r in firsts + replies]
            print(f"multi-turn caching {name} {setting}: {results[name][setting]}", flush=True)
    return {"conversations": len(conversations), "by_caching": results,
            "texts_identical": len({tuple(v) for v in texts.values()}) == 1}


def interference(deployment: Deployment, questions: list[dict], args: argparse.Namespace, tokenizer) -> dict:
    streams = [user(q["turns"][0]) for q in questions[:8]]
    results, run = {}, 0
    for name, chunk in (("chunked", None), ("whole", {"prefill_chunk_tokens": None})):
        client = deployment.serve(chunk or {})
        for setting in SETTINGS:
            # documents of its own: ones sent before would be in the prefix cache, with nothing to prefill
            documents = [user(f"Summarise (run {run}):\n\n" + long_text(questions[40 + 20 * i:], tokenizer, 1450))
                         for i in range(4)]
            run += 1
            arrivals: list[float] = []

            def arrive(setting=setting):
                for document in documents:
                    time.sleep(3.0)
                    arrivals.append(time.perf_counter())
                    client.chat(document, 8, setting)

            feeder = threading.Thread(target=arrive)
            feeder.start()
            replies, _ = client.wave(streams, 256, setting)
            feeder.join()
            window = (arrivals[0], arrivals[-1] + 10.0) if arrivals else (0.0, float("inf"))
            gaps = [b - a for r in replies for a, b in zip(r.arrivals, r.arrivals[1:]) if window[0] <= b <= window[1]]
            results.setdefault(name, {})[setting] = {
                "gap_p50_ms": round(1e3 * percentile(gaps, 0.5), 1), "gap_p99_ms": round(1e3 * percentile(gaps, 0.99), 1),
                "gap_max_ms": round(1e3 * max(gaps), 1), "gaps": len(gaps)}
            measured = results[name][setting]
            measured["p99_over_p50"] = round(measured["gap_p99_ms"] / measured["gap_p50_ms"], 2)
            print(f"interference {name} {setting}: {results[name][setting]}", flush=True)
    return {"document_tokens": len(tokenizer.encode(documents[0][0]["content"])), "by_prefill": results}


def markdown(report: dict) -> str:
    lines = [f"KV cache benchmark through the served path ({report['date']}, {report['machine']['cpus']} CPUs). "
             f"Command: `{report['command']}`", ""]
    scenarios = report["scenarios"]
    if "capacity" in scenarios:
        c = scenarios["capacity"]
        d = c.get("decoding_together")
        lines += ["## Capacity", "",
                  (f"In process, 64 Spec-Bench requests, plain decoding, default KV memory "
                   f"({d['kv_cache_bytes'] / 2**20:.0f} MiB): "
                   f"at most {d['most_decoding_at_once']} decoded at once ({d['preemptions']} preemptions); the slot cache "
                   f"decoded 8. " if d else "") +
                  f"Texts identical across settings and variants: {c['texts_identical']}. "
                  f"Each level: N clients asking the first 2N questions of up to {CAPACITY_PROMPT_TOKENS} tokens between "
                  f"them, on a fresh deployment.", "",
                  "| in flight | variant | plain tokens/s | speculative tokens/s | speedup |", "|---:|---|---:|---:|---:|"]
        for variant, rows in c["by_variant"].items():
            for level, row in rows.items():
                lines.append(f"| {level} | {variant} | {row['plain']['tokens_per_s']} | {row['speculative']['tokens_per_s']} "
                             f"| {row['speedup']:.2f}x |")
        lines.append("")
    for key, title, axis in (("shared-prefix", "Shared ~1,000-token system prompt, 32 requests at once", "by_caching"),
                             ("multi-turn", "mt_bench second turns with their history", "by_caching"),
                             ("interference", "8 streams while ~1,500-token prompts arrive", "by_prefill")):
        if key not in scenarios:
            continue
        lines += [f"## {title}", "", "```", yaml.safe_dump({k: v for k, v in scenarios[key].items()}, sort_keys=False).strip(),
                  "```", ""]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from actors.model.loader import load_tokenizer

    app = yaml.safe_load(args.config.read_text())["applications"][0]
    questions = load_questions(args.questions)
    tokenizer = load_tokenizer(app["args"]["cluster"]["engine"]["model"])
    os.environ.setdefault("RAY_worker_niceness", "0")  # as `make serve` runs Ray's workers (Makefile)
    ray.init(address="local", include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    deployment = Deployment(app, args.port)
    report = {"command": command_line(args, "bench", "kv"), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "scenarios": {}}
    out = args.out or RESULTS_DIR / f"kv-bench-{datetime.now():%Y%m%d-%H%M%S}.json"
    def save_partial(name: str):
        def save(partial: dict) -> None:
            report["scenarios"][name] = partial
            write_report(report, out, markdown)
        return save

    runners = {"capacity": lambda: capacity(deployment, questions, args, tokenizer, save_partial("capacity")),
               "shared-prefix": lambda: shared_prefix(deployment, questions, args, tokenizer),
               "multi-turn": lambda: multi_turn(deployment, questions, args),
               "interference": lambda: interference(deployment, questions, args, tokenizer)}
    try:
        for scenario in args.scenarios.split(","):
            report["scenarios"][scenario] = runners[scenario]()
            write_report(report, out, markdown)  # each scenario kept as soon as it is measured
    finally:
        serve.shutdown()
    print(markdown(report))
    return 0
