"""`specserve`: generate text from the command line and run the benchmarks."""
from __future__ import annotations

import argparse
import json
import sys
import uuid

from cluster.config import EngineConfig
from speculators.lookahead import LookaheadConfig
from speculators.sampling import SamplingParams


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    parser.add_argument("--model", default=defaults.model, help="target model name, .gguf file or HF directory")
    parser.add_argument("--draft", default=defaults.draft, help="draft model, or layer-skip:N (method draft)")
    parser.add_argument("--draft-width", type=int, default=defaults.draft_width, help="draft tree branches at the root")
    parser.add_argument("--pld-tokens", type=int, default=defaults.pld_num_pred_tokens, help="prompt lookup: tokens per match")
    parser.add_argument("--pld-ngram", type=int, default=defaults.pld_max_ngram_size, help="prompt lookup: longest n-gram")
    parser.add_argument("--pld-branches", type=int, default=defaults.pld_max_branches, help="prompt lookup: branches per tree")
    parser.add_argument("--max-tree-nodes", type=int, default=defaults.max_tree_nodes, help="drafted tokens per tree")
    parser.add_argument("--max-len", type=int, default=defaults.max_len, help="KV cache length per sequence")
    parser.add_argument("--dtype", default=defaults.dtype, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--lookahead", default="confidence", choices=["fixed", "heuristic", "confidence"],
                        help="lookahead policy")
    parser.add_argument("--lookahead-tokens", type=int, default=None,
                        help="most tokens drafted ahead (default 20; fixed: exactly this many)")
    parser.add_argument("--threshold", type=float, default=0.4, help="confidence threshold of the confidence policy")


def lookahead_from_args(args: argparse.Namespace) -> LookaheadConfig:
    extra = {} if args.lookahead_tokens is None else {"max_tokens": args.lookahead_tokens}
    return LookaheadConfig(policy=args.lookahead, threshold=args.threshold, **extra)


def engine_config_from_args(args: argparse.Namespace, method: str) -> EngineConfig:
    return EngineConfig(
        model=args.model, method=method, draft=args.draft, draft_width=args.draft_width,
        pld_num_pred_tokens=args.pld_tokens, pld_max_ngram_size=args.pld_ngram,
        pld_max_branches=args.pld_branches, max_tree_nodes=args.max_tree_nodes, max_len=args.max_len,
        dtype=args.dtype, max_sequences=1, lookahead=lookahead_from_args(args),
    )


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False))
    return tokenizer.encode(prompt)


def cmd_generate(args: argparse.Namespace) -> int:
    from cluster.factory import build_engine
    from cluster.request import GenerationRequest

    engine, tokenizer = build_engine(engine_config_from_args(args, args.method))
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    request = GenerationRequest(
        uuid.uuid4().hex, encode_prompt(tokenizer, args.prompt, args.chat), sampling,
        args.max_new_tokens, args.stop or [], args.method != "none", lookahead_from_args(args),
    )
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="Lossless tree speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt and print stats")
    gen.add_argument("prompt")
    gen.add_argument("--method", default="pld", choices=["none", "pld", "draft"])
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text and stats")
    add_engine_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    from bench.specbench import add_arguments as add_specbench_arguments, run as run_specbench

    specbench = bench_sub.add_parser("specbench", help="Spec-Bench: speedup and mean accepted tokens per task")
    add_specbench_arguments(specbench)
    add_engine_arguments(specbench)
    specbench.set_defaults(func=run_specbench)

    from bench.cluster_bench import add_arguments as add_cluster_bench_arguments, run as run_cluster_bench

    cluster_bench = sub.add_parser("cluster-bench", help="concurrent requests through a Ray cluster (fake GPUs on CPU)")
    add_cluster_bench_arguments(cluster_bench)
    add_engine_arguments(cluster_bench)
    cluster_bench.set_defaults(func=run_cluster_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
