"""Soak test: concurrent streaming clients, gRPC and HTTP mixed, against the served app, with faults.

Starts the Serve app on a local Ray (or targets one already running on 127.0.0.1), then runs
`--clients` threads for `--duration` seconds. Each client streams greedy requests back to back, its
prompts drawn with a fixed seed from Spec-Bench; even-numbered clients speak gRPC (token ids come
back), odd ones HTTP server-sent events (text comes back). Optionally a draft actor and a target shard
are killed (SIGKILL to their processes, found through Ray's actor table) at given times.

With `--tenants N` the app is served with N API keys, each naming a tenant of its own (a keys
file), and the clients take them in turn; each answer's cached prompt tokens (gRPC stats, HTTP
usage) must be explained by prompts its own tenant sent before it: more is a cross-tenant hit.

Every answer is compared with the target's plain greedy decoding of the same prompt, computed in
this process before the run. The report (JSON): completed, errors_by_kind, lost (no answer within
`--request-timeout-s`, or a stream that ended without a finish), mismatched, cross-tenant cache
hits, p50/p99 time to first token and inter-token latency, aggregate tokens/s.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import yaml

from bench.openai_stream import StreamFailed, stream_chat
from bench.specbench import DEFAULT_QUESTIONS, RESULTS_DIR, command_line, load_questions, machine

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "serve.yaml"
RETRYABLE = {"grpc:UNAVAILABLE", "grpc:RESOURCE_EXHAUSTED", "http:503", "http:stream-error"}
"""What a client may retry: a failed worker group or a full replica."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=16, help="concurrent streaming clients (half gRPC, half HTTP)")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds during which clients start requests")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=32, help="Spec-Bench questions in the pool")
    parser.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt choice (requests are greedy)")
    parser.add_argument("--kill-draft-at", type=float, default=None, help="seconds into the run: SIGKILL a draft actor")
    parser.add_argument("--kill-target-at", type=float, default=None, help="seconds into the run: SIGKILL a target shard")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="Serve config whose first application's args are served (when starting the app)")
    parser.add_argument("--target", action="store_true",
                        help="use an app already running on 127.0.0.1 (--grpc-port, --http-port) instead of starting one")
    parser.add_argument("--grpc-port", type=int, default=9000)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--api-key", action="append", default=None,
                        help="key for a running app that requires one; with --tenants N and --target, N keys "
                        "(repeat the option), one a tenant")
    parser.add_argument("--tenants", type=int, default=1,
                        help="tenants (API keys naming a tenant each) the clients take in turn; over 1, the app "
                        "started here serves a keys file of that many")
    parser.add_argument("--request-timeout-s", type=float, default=300.0, help="a request not finished by then is lost")
    parser.add_argument("--out", type=Path, default=None, help="JSON report (default bench/results/soak-<time>.json)")


# ---- one request ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    client: int
    protocol: str
    prompt: int
    started: float
    tenant: int = 0
    cached_tokens: int | None = None
    """Prompt tokens the prefix cache held for it, as the server reported them."""
    first_token_s: float | None = None
    gaps: list[float] = field(default_factory=list)
    """Seconds between streamed tokens (a chunk's gap shared by its tokens; HTTP chunks count as one)."""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    def chunk(self, now: float, last: float, tokens: int) -> None:
        if self.first_token_s is None:
            self.first_token_s = now - self.started
        elif tokens:
            self.gaps.extend([(now - last) / tokens] * tokens)
        self.tokens += tokens


@dataclass
class Prompt:
    question_id: int
    text: str
    token_ids: list[int]
    expected_ids: list[int]
    expected_text: str


def grpc_request(stub, prompt: Prompt, outcome: Outcome, max_new_tokens: int, timeout_s: float, metadata) -> None:
    import grpc

    from protos import specserve_pb2 as pb

    message = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=prompt.text)]),
                                 sampling=pb.Sampling(max_new_tokens=max_new_tokens, temperature=0.0, seed=outcome.client))
    last = outcome.started
    try:
        for chunk in stub.GenerateStream(message, timeout=timeout_s, metadata=metadata):
            now = time.perf_counter()
            outcome.chunk(now, last, len(chunk.token_ids))
            last = now
            outcome.token_ids.extend(chunk.token_ids)
            outcome.text += chunk.text
            if chunk.finish_reason:
                outcome.finish_reason = chunk.finish_reason
                outcome.cached_tokens = chunk.stats.cached_prompt_tokens
    except grpc.RpcError as error:
        outcome.error = "lost" if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED else f"grpc:{error.code().name}"


def http_request(port: int, prompt: Prompt, outcome: Outcome, max_new_tokens: int, timeout_s: float,
                 api_key: str | None) -> None:
    body = {"messages": [{"role": "user", "content": prompt.text}], "max_tokens": max_new_tokens,
            "temperature": 0, "seed": outcome.client, "stream": True, "stream_options": {"include_usage": True}}
    last = outcome.started
    try:
        for now, event in stream_chat(f"http://127.0.0.1:{port}", body, api_key, timeout_s):
            choices = event.get("choices") or [{}]
            text = choices[0].get("delta", {}).get("content") or ""
            outcome.chunk(now, last, 1 if text else 0)
            last = now if text else last
            outcome.text += text
            outcome.finish_reason = choices[0].get("finish_reason") or outcome.finish_reason
            if event.get("usage"):
                outcome.cached_tokens = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except StreamFailed as error:
        outcome.error = error.kind
    except TimeoutError:
        outcome.error = "lost"
    except (OSError, http.client.HTTPException) as error:
        outcome.error = f"http:{type(error).__name__}"


# ---- the run --------------------------------------------------------------------------------------


def reference_prompts(args: argparse.Namespace, model: str) -> list[Prompt]:
    """The prompt pool and each prompt's plain greedy output (batch of one, as plain decoding is)."""
    from cluster.engine.build import build_engine, encode_prompt
    from cluster.engine.config import EngineConfig
    from cluster.serve.requests import RequestBuilder, RequestOptions

    questions = load_questions(args.questions)
    chosen = random.Random(args.seed).sample(questions, min(args.prompts, len(questions)))
    config = EngineConfig(model=model, method="none", max_sequences=1)
    engine, tokenizer = build_engine(config)
    requests = RequestBuilder.in_process(engine, tokenizer, config)
    prompts = []
    for question in chosen:
        ids = encode_prompt(tokenizer, question["turns"][0], chat=True)
        request = requests.build_request(RequestOptions(prompt_token_ids=ids, max_new_tokens=args.max_new_tokens),
                                         f"ref{question['question_id']}")
        output = engine.generate([request])[0]
        prompts.append(Prompt(question_id=question["question_id"], text=question["turns"][0], token_ids=ids,
                              expected_ids=output.token_ids, expected_text=output.text))
    return prompts


def start_app(args: argparse.Namespace, app_args: dict) -> None:
    import ray
    from ray import serve

    from cluster.serve.app import GRPC_SERVICERS, build_app

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.http_port},
                grpc_options={"port": args.grpc_port, "grpc_servicer_functions": GRPC_SERVICERS})
    serve.run(build_app(app_args), name="specserve", route_prefix="/")


def kill_actor(class_name: str) -> dict:
    """SIGKILL the process of one live actor of this class (a crash, not a polite ray.kill)."""
    import ray._private.state  # the actor table; the public state API needs the dashboard

    alive = [a for a in ray._private.state.actors().values()
             if a["ActorClassName"] == class_name and a["State"] == "ALIVE" and a.get("Pid")]
    if not alive:
        return {"actor": class_name, "killed": False, "why": "no live actor of this class"}
    victim = alive[0]
    os.kill(victim["Pid"], signal.SIGKILL)
    return {"actor": class_name, "killed": True, "pid": victim["Pid"]}


def tenant_keys(args: argparse.Namespace, app_args: dict, folder: Path) -> list[str | None]:
    """The key each tenant presents. With more than one tenant and an app started here, its limits
    get a keys file naming a tenant per key (written to `folder`)."""
    keys = args.api_key or [None]
    if args.tenants == 1:
        return keys[:1]
    if args.target:
        if len(keys) != args.tenants:
            raise SystemExit(f"--tenants {args.tenants} with --target needs {args.tenants} --api-key options")
        return keys
    keys = [f"soak-key-{tenant}" for tenant in range(args.tenants)]
    keys_file = folder / "api-keys.json"
    keys_file.write_text(json.dumps({key: f"tenant-{tenant}" for tenant, key in enumerate(keys)}))
    limits = app_args.setdefault("limits", {})
    for field_name in ("api_key", "api_key_env", "api_key_file"):
        limits.pop(field_name, None)
    limits["api_keys_file"] = str(keys_file)
    return keys


def run_clients(args: argparse.Namespace, prompts: list[Prompt], keys: list[str | None]
                ) -> tuple[list[Outcome], list[dict], float]:
    import grpc

    from protos import specserve_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{args.grpc_port}")
    stub = specserve_pb2_grpc.SpecServeStub(channel)
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    began = time.perf_counter()
    stop_at = began + args.duration

    def client(index: int) -> None:
        rng = random.Random(args.seed * 1000 + index)
        protocol = "grpc" if index % 2 == 0 else "http"
        tenant = index // 2 % len(keys)  # every tenant speaks both protocols
        key = keys[tenant]
        metadata = [("authorization", f"Bearer {key}")] if key else None
        while time.perf_counter() < stop_at:
            which = rng.randrange(len(prompts))
            outcome = Outcome(client=index, protocol=protocol, prompt=which, started=time.perf_counter(), tenant=tenant)
            with lock:
                outcomes.append(outcome)
            if protocol == "grpc":
                grpc_request(stub, prompts[which], outcome, args.max_new_tokens, args.request_timeout_s, metadata)
            else:
                http_request(args.http_port, prompts[which], outcome, args.max_new_tokens, args.request_timeout_s, key)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
    for thread in threads:
        thread.start()
    kills = []
    for at, class_name in sorted((t, c) for t, c in ((args.kill_draft_at, "DraftWorker"),
                                                     (args.kill_target_at, "TargetShard")) if t is not None):
        time.sleep(max(0.0, began + at - time.perf_counter()))
        kills.append({"at_s": round(time.perf_counter() - began, 1), **kill_actor(class_name)})
        print(f"[soak] {kills[-1]}", flush=True)
    for thread in threads:
        thread.join(max(0.0, stop_at - time.perf_counter()) + args.request_timeout_s + 30)
    seconds = time.perf_counter() - began
    channel.close()
    return outcomes, kills, seconds


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


def judge(outcome: Outcome, prompt: Prompt) -> str:
    """completed, mismatched, lost, or the error kind."""
    if outcome.error:
        return outcome.error
    if outcome.finish_reason is None:
        return "lost"  # the stream ended (or never ended) without a finish
    if outcome.protocol == "grpc":
        right = outcome.token_ids == prompt.expected_ids
    else:
        right = outcome.text == prompt.expected_text
    return "completed" if right else "mismatched"


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def cross_tenant_hits(outcomes: list[Outcome], prompts: list[Prompt]) -> list[dict]:
    """Answers whose cached prompt tokens exceed the longest prefix their prompt shares with a prompt
    of their own tenant sent before their first token: a cache hit only another tenant explains."""
    hits = []
    for outcome in outcomes:
        if not outcome.cached_tokens:
            continue
        seen_by = outcome.started + (outcome.first_token_s or float("inf"))
        own = max((common_prefix(prompts[o.prompt].token_ids, prompts[outcome.prompt].token_ids)
                   for o in outcomes if o is not outcome and o.tenant == outcome.tenant and o.started < seen_by),
                  default=0)
        if outcome.cached_tokens > own:
            hits.append({"tenant": outcome.tenant, "question_id": prompts[outcome.prompt].question_id,
                         "cached_tokens": outcome.cached_tokens, "own_tenant_prefix": own})
    return hits


def summarize(outcomes: list[Outcome], prompts: list[Prompt], seconds: float) -> dict:
    verdicts = [judge(o, prompts[o.prompt]) for o in outcomes]
    errors: dict[str, int] = {}
    for verdict in verdicts:
        if verdict not in ("completed", "mismatched", "lost"):
            errors[verdict] = errors.get(verdict, 0) + 1
    done = [o for o, v in zip(outcomes, verdicts) if v in ("completed", "mismatched")]
    hits = cross_tenant_hits(outcomes, prompts)
    return {
        "requests": len(outcomes),
        "completed": verdicts.count("completed"),
        "errors_by_kind": errors,
        "errors_all_retryable": set(errors) <= RETRYABLE,
        "lost": verdicts.count("lost"),
        "mismatched": verdicts.count("mismatched"),
        "mismatched_examples": [{"question_id": prompts[o.prompt].question_id, "protocol": o.protocol}
                                for o, v in zip(outcomes, verdicts) if v == "mismatched"][:10],
        "by_protocol": {p: sum(1 for o, v in zip(outcomes, verdicts) if o.protocol == p and v == "completed")
                        for p in ("grpc", "http")},
        "by_tenant": {str(t): {"completed": sum(1 for o, v in zip(outcomes, verdicts) if o.tenant == t and v == "completed"),
                               "cached_tokens": sum(o.cached_tokens or 0 for o in outcomes if o.tenant == t)}
                      for t in sorted({o.tenant for o in outcomes})},
        "cross_tenant_cache_hits": len(hits),
        "cross_tenant_examples": hits[:10],
        "time_to_first_token_s": {"p50": percentile([o.first_token_s for o in done], 0.5),
                                  "p99": percentile([o.first_token_s for o in done], 0.99)},
        "inter_token_latency_s": {"p50": percentile([g for o in done for g in o.gaps], 0.5),
                                  "p99": percentile([g for o in done for g in o.gaps], 0.99)},
        "tokens": sum(o.tokens for o in outcomes),
        "tokens_per_s": round(sum(o.tokens for o in outcomes) / seconds, 2),
        "seconds": round(seconds, 1),
    }


def _without_key(app_args: dict) -> dict:
    """The app's args as a report may show them: a literal API key is replaced."""
    limits = app_args.get("limits", {})
    return app_args | {"limits": limits | {"api_key": "<redacted>"}} if limits.get("api_key") else app_args


def run(args: argparse.Namespace) -> int:
    app_args = yaml.safe_load(args.config.read_text())["applications"][0]["args"]
    app_args.setdefault("limits", {})["max_concurrent_requests"] = max(
        args.clients, app_args.get("limits", {}).get("max_concurrent_requests", 0))
    model = app_args.get("cluster", {}).get("engine", {}).get("model", "smollm2-135m")
    print(f"[soak] plain greedy references for {args.prompts} prompts ...", flush=True)
    prompts = reference_prompts(args, model)
    keys = tenant_keys(args, app_args, Path(tempfile.mkdtemp(prefix="soak-keys-")))
    if not args.target:
        print("[soak] starting the app ...", flush=True)
        start_app(args, app_args)
    elif args.kill_draft_at is not None or args.kill_target_at is not None:
        import ray

        ray.init(address="auto")  # the running app's Ray cluster, to find the actors to kill
    print(f"[soak] {args.clients} clients for {args.duration:.0f} s", flush=True)
    outcomes, kills, seconds = run_clients(args, prompts, keys)
    report = {
        "command": command_line(argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "api_key"}))
        .replace("specserve bench specbench", "specserve soak", 1),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {"clients": args.clients, "duration_s": args.duration, "max_new_tokens": args.max_new_tokens,
                   "prompts": args.prompts, "seed": args.seed, "tenants": len(keys),
                   "app_args": _without_key(app_args)},
        "kills": kills,
        "summary": summarize(outcomes, prompts, seconds),
    }
    out = args.out or RESULTS_DIR / f"soak-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report["summary"], indent=2))
    print(f"[soak] report: {out}")
    summary = report["summary"]
    clean = summary["lost"] == 0 and summary["mismatched"] == 0 and summary["cross_tenant_cache_hits"] == 0
    return 0 if clean and summary["errors_all_retryable"] else 1
