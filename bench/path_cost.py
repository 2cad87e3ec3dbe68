"""`specserve bench path-cost`: what each layer of the served path costs a request.

The deployment of a Serve config (default `configs/serve.yaml`, what `make serve` runs) is built
three times in this process's Ray instance, each path adding layers to the one before:

- in-process: the engine and the target in this process, driven on this thread (what `specserve
  generate` and Spec-Bench run);
- ray: the deployment's SpecCluster (target shard and draft actor as Ray actors, the engine on its
  loop thread), called from this process as a Serve replica calls it;
- served: the Serve app itself over HTTP, streamed chat completions, as a client calls it.

Every question runs through every path in turn, plain decoding (`speculation.method: off`) and
speculation as deployed, one request in flight, so a burst of other work on the machine hits all
paths alike. Requests are built by the service's RequestBuilder with the deployment's limits (the
served path builds them from the same messages). Per path and setting: the median tokens/s over
questions, and for the two engines this process holds, the engine's wait per step for the
target's verification and for the drafter. Greedy texts must agree across paths and settings.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import yaml

from bench.openai_stream import stream_chat
from bench.specbench import DEFAULT_QUESTIONS, RESULTS_DIR, command_line, load_questions, machine, write_report

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "serve.yaml"
PATHS = ("in-process", "ray", "served")
SETTINGS = {"plain": "off", "speculative": "default"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=CONFIG, help="Serve config whose first application is measured")
    parser.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    parser.add_argument("--count", type=int, default=12, help="questions (the first of each task in turn)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="max_tokens of every request")
    parser.add_argument("--port", type=int, default=8123, help="HTTP port of the app this run starts")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/path-cost-<time>.json)")


@dataclass
class Run:
    text: str
    tokens: int
    seconds: float
    verify_wait_s: float | None = None
    draft_wait_s: float | None = None
    cpu_s: Counter = field(default_factory=Counter)
    """CPU seconds each process took during the run (`cpu_by_process`)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def cpu_by_process() -> Counter:
    """CPU seconds so far of every process on the machine, by role: Ray actors by class, Ray's own
    daemons, this process (the client, the in-process engine and the ray path's engine loop), and
    everything else."""
    import psutil

    totals = Counter()
    for process in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
        times, command = process.info["cpu_times"], process.info["cmdline"] or [""]
        if times is None:
            continue
        if process.info["pid"] == os.getpid():
            role = "bench process"
        elif command[0].startswith("ray::"):
            role = command[0][len("ray::"):].split(":")[0]
        elif any(name in command[0] for name in ("raylet", "gcs_server")):
            role = "raylet, gcs"
        else:
            role = "other"
        totals[role] += times.user + times.system
    return totals


def measured(run, *args) -> Run:
    """`run(*args)`, with the CPU time each process took during it."""
    before = cpu_by_process()
    done = run(*args)
    after = cpu_by_process()
    done.cpu_s = Counter({role: after[role] - before.get(role, 0.0) for role in after})
    return done


class EnginePath:
    """An engine this process can see (in-process or on the cluster), called through `generate`."""

    def __init__(self, engine, builder, generate):
        self.engine, self.builder, self.generate = engine, builder, generate

    def run(self, question: dict, method: str, max_new_tokens: int) -> Run:
        from cluster.serve.requests import RequestOptions, SpeculationOptions

        options = RequestOptions(messages=[{"role": "user", "content": question["turns"][0]}],
                                 max_new_tokens=max_new_tokens, speculation=SpeculationOptions(method=method))
        counters = self.engine.counters
        steps, verify, draft = counters.steps, counters.verify_seconds, counters.draft_wait_seconds
        began = time.perf_counter()
        output = self.generate(self.builder.build_request(options))
        seconds = time.perf_counter() - began
        taken = max(1, counters.steps - steps)
        return Run(text=self.builder.tokenizer.decode(output.token_ids, skip_special_tokens=True), tokens=len(output.token_ids),
                   seconds=seconds, verify_wait_s=(counters.verify_seconds - verify) / taken,
                   draft_wait_s=(counters.draft_wait_seconds - draft) / taken)


class ServedPath:
    def __init__(self, url: str, model: str):
        self.url, self.model = url, model

    def run(self, question: dict, method: str, max_new_tokens: int) -> Run:
        body = {"model": self.model, "messages": [{"role": "user", "content": question["turns"][0]}],
                "max_tokens": max_new_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "speculation": {"method": method}}
        began, text, tokens = time.perf_counter(), "", 0
        for _, event in stream_chat(self.url, body, None, 600):
            choices = event.get("choices") or []
            text += (choices[0].get("delta", {}).get("content") or "") if choices else ""
            tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
        return Run(text, tokens, time.perf_counter() - began)


def build_paths(args: argparse.Namespace, app_args: dict) -> tuple[dict, object]:
    """The three paths over one deployment, and the cluster to shut down."""
    from ray import serve

    from cluster.engine.build import build_engine
    from cluster.runtime.spec_cluster import SpecCluster
    from cluster.serve.app import AppArgs, build_app
    from cluster.serve.requests import RequestBuilder

    deployment = AppArgs.model_validate(app_args)
    served, limits = deployment.served()[0], deployment.limits
    config = served.cluster.engine

    def builder(engine, tokenizer) -> RequestBuilder:
        return RequestBuilder(engine, tokenizer, config.model, config.method, config.lookahead, limits)

    engine, tokenizer = build_engine(config)
    cluster = SpecCluster(served.cluster).start()
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(build_app(app_args), name="path-cost", route_prefix="/")
    paths = {
        "in-process": EnginePath(engine, builder(engine, tokenizer), lambda request: engine.generate([request])[0]),
        "ray": EnginePath(cluster.loops[0].engine, builder(cluster.loops[0].engine, cluster.tokenizer),
                          lambda request: cluster.generate([request], timeout_s=600)[0]),
        "served": ServedPath(f"http://127.0.0.1:{args.port}", served.model_id),
    }
    return paths, cluster


def summarize(runs: dict[str, dict[str, list[Run]]]) -> dict:
    table = {}
    for path, settings in runs.items():
        row = {}
        for setting, done in settings.items():
            row[setting] = {
                "tokens_per_s": round(statistics.median(r.tokens_per_s for r in done), 2),
                "by_question": [round(r.tokens_per_s, 2) for r in done],
            }
            tokens = sum(r.tokens for r in done)
            cpu = sum((r.cpu_s for r in done), Counter())
            row[setting]["cpu_ms_per_token"] = {role: round(1000 * seconds / tokens, 2)
                                                for role, seconds in cpu.most_common() if seconds / tokens >= 1e-4}
            for wait in ("verify_wait_s", "draft_wait_s"):
                values = [getattr(r, wait) for r in done if getattr(r, wait) is not None]
                if values:
                    row[setting][wait.replace("_s", "_ms")] = round(1000 * statistics.median(values), 2)
        row["speedup"] = round(row["speculative"]["tokens_per_s"] / row["plain"]["tokens_per_s"], 3)
        table[path] = row
    base = table["in-process"]["plain"]["tokens_per_s"]
    for row in table.values():
        row["plain_vs_in_process"] = round(row["plain"]["tokens_per_s"] / base, 3)
    return table


def markdown(report: dict) -> str:
    lines = ["# Where a served request's time goes", "", f"`{report['command']}`", "",
             f"{report['date']}; " + ", ".join(f"{k} {v}" for k, v in report["machine"].items()), "",
             f"{report['questions']} Spec-Bench questions, one request in flight, greedy; texts identical across "
             f"paths and settings: {report['texts_identical']}", "",
             "| path | plain tokens/s | plain vs in-process | speculative tokens/s | speedup | "
             "verify wait/step ms (plain, spec) | draft wait/step ms (spec) |", "|---|---:|---:|---:|---:|---|---:|"]
    for path, row in report["paths"].items():
        plain, spec = row["plain"], row["speculative"]
        verify = f"{plain.get('verify_wait_ms', '-')}, {spec.get('verify_wait_ms', '-')}"
        lines.append(f"| {path} | {plain['tokens_per_s']:.2f} | {row['plain_vs_in_process']:.2f} | "
                     f"{spec['tokens_per_s']:.2f} | {row['speedup']:.2f}x | {verify} | {spec.get('draft_wait_ms', '-')} |")
    lines += ["", "CPU milliseconds per generated token, by process (all processes on the machine during the runs):", ""]
    for path, row in report["paths"].items():
        for setting in SETTINGS:
            parts = ", ".join(f"{role} {ms:.1f}" for role, ms in row[setting]["cpu_ms_per_token"].items())
            lines.append(f"- {path}, {setting}: {parts}")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    app = yaml.safe_load(args.config.read_text())["applications"][0]
    questions = load_questions(args.questions)[:args.count]
    os.environ.setdefault("RAY_worker_niceness", "0")  # as `make serve` runs Ray's workers (Makefile)
    ray.init(address="local", include_dashboard=False)
    paths, cluster = build_paths(args, app.get("args") or {})
    runs = {path: {setting: [] for setting in SETTINGS} for path in PATHS}
    identical = True
    try:
        for path in PATHS:  # warm-up: the first request of a path pays its lazy set-up
            paths[path].run({"turns": ["Hello"]}, "off", 8)
        for number, question in enumerate(questions, 1):
            texts = set()
            for setting, method in SETTINGS.items():
                for path in PATHS:
                    done = measured(paths[path].run, question, method, args.max_new_tokens)
                    runs[path][setting].append(done)
                    texts.add(done.text)
                    print(f"[{number}/{len(questions)}] {path} {setting}: {done.tokens_per_s:.2f} tokens/s", flush=True)
            identical &= len(texts) == 1
    finally:
        serve.shutdown()
        cluster.shutdown()
    report = {"command": command_line(args, "bench", "path-cost"),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "questions": len(questions), "texts_identical": identical, "paths": summarize(runs)}
    out = args.out or RESULTS_DIR / f"path-cost-{datetime.now():%Y%m%d-%H%M%S}.json"
    write_report(report, out, markdown)
    print(markdown(report))
    return 0
