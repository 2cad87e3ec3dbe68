"""`specserve`: generate text from the command line and run the benchmarks.

The command line sits above both the engine (cluster/) and the benchmarks (bench/), so neither
imports the other's command code.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from typing import get_args

from pydantic import ValidationError

from cluster.engine.build import add_engine_arguments, build_engine, engine_config_from_args
from cluster.engine.config import EngineConfig, Method
from cluster.serve.requests import RequestBuilder, RequestOptions
from speculators.sampling import SamplingParams


def cmd_generate(args: argparse.Namespace) -> int:
    # refused before loading the model
    SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    config = engine_config_from_args(args, args.method)
    engine, tokenizer = build_engine(config)
    prompt = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    options = RequestOptions(**prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop or [])
    request = RequestBuilder.in_process(engine, tokenizer, config).build_request(options)
    output = engine.generate([request])[0]
    stats = output.stats
    summary = {
        "text": output.text,
        "token_ids": output.token_ids,
        "new_tokens": len(output.token_ids),
        "seconds": round(output.seconds, 4),
        "tokens_per_s": round(len(output.token_ids) / output.seconds, 3) if output.seconds else None,
        "target_forwards": stats.target_forwards,
        "mean_accepted_tokens": round(output.mean_accepted_tokens, 4),
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "finish_reason": output.finish_reason,
        "method": args.method,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(output.text)
        print(
            f"[{summary['new_tokens']} new tokens in {summary['seconds']:.2f} s, {summary['tokens_per_s']} tokens/s, "
            f"{stats.target_forwards} target forwards, mean accepted tokens {summary['mean_accepted_tokens']:.2f}, "
            f"method {args.method}, finish {output.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def cmd_convert_head(args: argparse.Namespace) -> int:
    """Read a head in any layout speculators/heads/checkpoint.py knows, write it as vLLM serves it."""
    import torch

    from speculators.heads.checkpoint import load_head, save_head

    checkpoint = load_head(args.source, args.target_layers, allow_pickle=True)  # tensors only, weights_only=True
    save_head(checkpoint, args.dest, dtype=getattr(torch, args.dtype))
    print(f"{args.source}: {checkpoint.kind} head -> {args.dest}")
    return 0


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default, shown once. argparse prints no help line for an option without help,
    so its default went unshown; and ArgumentDefaultsHelpFormatter appends "(default: X)" to any help
    without %(default)s, so help that states its default in words ("(default: all)") got a second one."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and action.option_strings and action.default is not argparse.SUPPRESS:
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        if "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """The parser of `specserve` and of each of its commands (subparsers are made of the parent's
    class): a bad option is one line naming it, with a pointer to the command's --help, instead of
    the whole usage; defaults show in --help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        command = self.prog.split()[0]
        self.exit(2, f"{command}: error: {' '.join(message.split())} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and self._is_command():  # reported here, by the command that got them, not by `specserve`
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras

    def _is_command(self) -> bool:
        return " " in self.prog


def build_parser() -> argparse.ArgumentParser:
    from bench import (
        busy_neighbour,
        cluster_bench,
        cost_curve,
        draft_pool_bench,
        fuzz,
        grammar_engines,
        greedy_agreement,
        kv_bench,
        path_cost,
        ray_overhead,
        serve_bench,
        side_by_side,
        soak,
        specbench,
    )
    from bench.lossless import report as lossless
    from cluster.serve import grpc_tls
    from specserve import datastore, train

    parser = Parser(prog="specserve", description="Lossless tree speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    defaults = HelpFormatter

    gen = sub.add_parser("generate", help="generate text for one prompt and print stats", formatter_class=defaults)
    gen.add_argument("prompt")
    gen.add_argument("--method", default=EngineConfig().method, choices=get_args(Method), help="drafter")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="longest answer")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: 1.0 = off")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed; None: a random one")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text and stats")
    add_engine_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    spec = bench_sub.add_parser("specbench", help="Spec-Bench: speedup and mean accepted tokens per task",
                                formatter_class=defaults)
    specbench.add_arguments(spec)
    add_engine_arguments(spec)
    spec.set_defaults(func=specbench.run)
    curve = bench_sub.add_parser("cost-curve", help="what a verification pass costs, by the tokens in it",
                                 formatter_class=defaults)
    cost_curve.add_arguments(curve)
    add_engine_arguments(curve)
    curve.set_defaults(func=cost_curve.run)
    overhead = bench_sub.add_parser("ray-overhead", help="router -> worker round trips: actor calls and compiled graphs",
                                    formatter_class=defaults)
    ray_overhead.add_arguments(overhead)
    overhead.set_defaults(func=ray_overhead.run)
    neighbour = bench_sub.add_parser("busy-neighbour", help="`specserve generate` alone and beside a CPU-bound job",
                                     formatter_class=defaults)
    busy_neighbour.add_arguments(neighbour)
    neighbour.set_defaults(func=busy_neighbour.run)
    path = bench_sub.add_parser("path-cost", help="the same requests in process, through Ray actors and through the "
                                "Serve app: what each layer of the served path costs", formatter_class=defaults)
    path_cost.add_arguments(path)
    path.set_defaults(func=path_cost.run)
    kv = bench_sub.add_parser("kv", help="the paged KV cache through the Serve app: capacity at 8-64 in flight, a shared "
                              "system prompt, multi-turn history and long prompts beside running streams",
                              formatter_class=defaults)
    kv_bench.add_arguments(kv)
    kv.set_defaults(func=kv_bench.run)
    proof = bench_sub.add_parser("lossless", help="sampled output against the exact distribution of a tiny target, "
                                 "every drafter, tree, lookahead, warp and deployment", formatter_class=defaults)
    lossless.add_arguments(proof)
    proof.set_defaults(func=lossless.run)
    served = bench_sub.add_parser("serve", help="a running app through its HTTP API: speculation as deployed against "
                                  "speculation off, 1 to 32 requests in flight", formatter_class=defaults)
    serve_bench.add_arguments(served)
    served.set_defaults(func=serve_bench.run)
    peers = bench_sub.add_parser("side-by-side", help="vLLM's CPU build (out of the box, tuned, n-gram) and `make serve` "
                                 "(speculation on, off), one server at a time, the same prompts and client",
                                 formatter_class=defaults)
    side_by_side.add_arguments(peers)
    peers.set_defaults(func=side_by_side.run)
    agreement = bench_sub.add_parser("greedy-agreement", help="plain against speculative greedy decoding of real "
                                     "prompts in bfloat16: where they part, and whether only at near-ties",
                                     formatter_class=defaults)
    greedy_agreement.add_arguments(agreement)
    agreement.set_defaults(func=greedy_agreement.run)
    pooled = bench_sub.add_parser("draft-pool", help="N target groups drafting from one shared drafter against one "
                                  "drafter each (fake GPUs)", formatter_class=defaults)
    draft_pool_bench.add_arguments(pooled)
    add_engine_arguments(pooled)
    pooled.set_defaults(func=draft_pool_bench.run)
    grammars = bench_sub.add_parser("grammar-engines", help="xgrammar against llguidance: compile, mask and rollback "
                                    "times for structured output", formatter_class=defaults)
    grammar_engines.add_arguments(grammars)
    grammars.set_defaults(func=grammar_engines.run)

    convert = sub.add_parser("convert-head", formatter_class=defaults,
                             help="rewrite a head checkpoint (Medusa's public layout, EAGLE-3 in the EAGLE "
                                  "repository's layout) in the format vLLM and this project serve")
    convert.add_argument("source", help="checkpoint folder")
    convert.add_argument("dest", help="folder to write")
    convert.add_argument("--target-layers", type=int, default=None,
                         help="the target's layer count, for an EAGLE-3 checkpoint that names no aux layers")
    convert.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    convert.set_defaults(func=cmd_convert_head)

    trainer = sub.add_parser("train", help="train an EAGLE-3 or Medusa head on the target's own answers",
                             formatter_class=defaults)
    train.add_arguments(trainer)
    trainer.set_defaults(func=train.run)

    store = sub.add_parser("build-datastore", help="REST's datastore: a corpus tokenized with the target's tokenizer, "
                           "and its suffix array", formatter_class=defaults)
    datastore.add_arguments(store)
    store.set_defaults(func=datastore.run)

    cluster = sub.add_parser("cluster-bench", help="concurrent requests through a Ray cluster (fake GPUs on CPU)",
                             formatter_class=defaults)
    cluster_bench.add_arguments(cluster)
    add_engine_arguments(cluster)
    cluster.set_defaults(func=cluster_bench.run)

    load = sub.add_parser("soak", help="streaming clients (gRPC and HTTP) against the served app, with faults",
                          formatter_class=defaults)
    soak.add_arguments(load)
    load.set_defaults(func=soak.run)

    fuzzing = sub.add_parser("fuzz", help="property-based fuzz of both request schemas", formatter_class=defaults)
    fuzz.add_arguments(fuzzing)
    fuzzing.set_defaults(func=fuzz.run)

    tls = sub.add_parser("grpc-tls", help="serve the gRPC API over TLS, forwarding to Serve's plaintext gRPC proxy",
                         formatter_class=defaults)
    grpc_tls.add_arguments(tls)
    tls.set_defaults(func=grpc_tls.run)
    return parser


USER_ERRORS = (ValueError, FileNotFoundError)
"""What a user's options or files cause (a bad value, a missing model, unreadable weights): reported
in one line, without a traceback. pydantic's ValidationError and WeightsError are ValueErrors."""


def _one_line(error: Exception) -> str:
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        return f"{'.'.join(str(part) for part in first['loc'])}: {first['msg']}"
    return " ".join(str(error).split()) or type(error).__name__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as error:
        parser.exit(2, f"{parser.prog}: error: {_one_line(error)}\n")


if __name__ == "__main__":
    sys.exit(main())
