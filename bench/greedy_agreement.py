"""What greedy losslessness means in bf16, measured.

The verifier is exact: every token a verification pass emits is the argmax of the target's logits
in that pass. In fp32/fp64 those logits equal a one-token step's, so speculative output is token
for token plain decoding. In bf16 a pass over many tokens runs other kernels (other summation
orders) than a one-token step and can round a logit differently, so the two outputs may part at a
near-tie: a position where the target's top two logits are within bf16 rounding of each other.

`measure_agreement` decodes each prompt plainly and speculatively (with an oracle drafter that
proposes plain decoding's own continuation, so every pass is a many-token pass) and, where they
first differ, measures the gap between the top two logits of a full-precision copy of the target
at that position. The promise tested (tests/bench/test_greedy_agreement.py) and reported by
bench/gpu_check.py: outputs agree except after such near-ties.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from actors.messages import AdmitItem, VerifyItem
from actors.model.llama import LlamaDecoder
from actors.model.loader import DEFAULT_MODEL, load_model, load_tokenizer
from actors.model.runner import ModelRunner
from actors.target_worker import TargetWorker
from bench.specbench import DEFAULT_QUESTIONS, command_line, load_questions, machine
from cluster.engine.build import encode_prompt
from speculators.proposers.base import TreeInput
from speculators.sampling import SamplingParams
from speculators.tree import DraftTree, chain_parents

Drafter = Callable[[list[int]], DraftTree]
"""The whole sequence so far (prompt and output) -> a tree rooted at its last token."""


@dataclass
class Decoded:
    tokens: list[int]
    passes: int


def decode(worker: TargetWorker, prompt: Sequence[int], new_tokens: int, drafter: Drafter | None = None,
           seq_id: str = "greedy") -> Decoded:
    """Greedy decoding through the target worker's verification pass (plain when `drafter` is None)."""
    worker.start([AdmitItem(request_id=seq_id, tokens=list(prompt), sampling=SamplingParams())])
    sequence, passes = list(prompt), 0
    try:
        while len(sequence) - len(prompt) < new_tokens:
            tree = DraftTree.root_only(sequence[-1]) if drafter is None else drafter(sequence)
            sequence += worker.verify([VerifyItem(seq_id, tree)]).results[0].new_tokens
            passes += 1
    finally:
        worker.finish(seq_id)
    return Decoded(sequence[len(prompt): len(prompt) + new_tokens], passes)


def oracle_drafter(prompt_length: int, reference: Sequence[int], depth: int, width: int = 1,
                   vocab_size: int = 0) -> Drafter:
    """Proposes the next `depth` tokens of `reference` (plain decoding's output): a drafter that
    always agrees with the target, as long as the output follows the reference. With `width` > 1
    the tree also gets `width - 1` wrong first tokens as siblings (a tree, not a chain, to verify)."""
    def propose(sequence: list[int]) -> DraftTree:
        done = len(sequence) - prompt_length
        good = list(reference[done: done + depth])
        wrong = [[(good[0] + k) % vocab_size] for k in range(1, width)] if good else []
        return DraftTree.from_paths(sequence[-1], [good, *wrong])
    return propose


@dataclass
class Divergence:
    prompt: int
    position: int
    """Index into the output of the first token that differs."""
    top2_gap: float
    """The full-precision target's top logit minus its second, at that position."""
    rounding: float
    """The largest difference between the target's logits and the full-precision copy's there."""

    @property
    def near_tie(self) -> bool:
        """Whether rounding alone can swap the top two: each may move by `rounding`."""
        return self.top2_gap <= 2 * self.rounding


@dataclass
class Agreement:
    prompts: int
    identical: int
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def match_rate(self) -> float:
        return self.identical / self.prompts

    def as_dict(self) -> dict:
        return {"prompts": self.prompts, "identical": self.identical, "match_rate": self.match_rate,
                "all_at_near_ties": all(d.near_tie for d in self.divergences),
                "divergences": [{**vars(d), "near_tie": d.near_tie} for d in self.divergences]}


def next_logits(model: LlamaDecoder, tokens: Sequence[int]) -> torch.Tensor:
    """The model's next-token logits after `tokens` (one plain pass, float64)."""
    runner = ModelRunner(model, 1, len(tokens) + 1)
    runner.add("probe")
    return runner.forward([TreeInput("probe", list(tokens), chain_parents(len(tokens)), logits="last")])[0][-1].double()


def divergence_at(target: LlamaDecoder, full_precision: LlamaDecoder, prompt: int, tokens: Sequence[int],
                  position: int) -> Divergence:
    exact, rounded = next_logits(full_precision, tokens), next_logits(target, tokens)
    first, second = torch.topk(exact, 2).values.tolist()
    return Divergence(prompt=prompt, position=position, top2_gap=first - second,
                      rounding=float((rounded.to(exact.device) - exact).abs().max()))


def measure_agreement(target: LlamaDecoder, full_precision: LlamaDecoder, prompts: Sequence[Sequence[int]],
                      new_tokens: int, depth: int = 4, width: int = 1) -> Agreement:
    """Plain against oracle-drafted speculative greedy decoding of `target`, prompt by prompt."""
    worker = TargetWorker(target, 1, max(len(p) for p in prompts) + new_tokens + depth + 1)
    agreement = Agreement(len(prompts), 0)
    for index, prompt in enumerate(prompts):
        plain = decode(worker, prompt, new_tokens).tokens
        speculative = decode(worker, prompt, new_tokens,
                             oracle_drafter(len(prompt), plain, depth, width, target.config.vocab_size)).tokens
        if speculative == plain:
            agreement.identical += 1
            continue
        position = next(i for i, (a, b) in enumerate(zip(plain, speculative)) if a != b)
        agreement.divergences.append(divergence_at(target, full_precision, index, [*prompt, *plain[:position]], position))
    return agreement


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="target")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="the dtype served")
    parser.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    parser.add_argument("--prompts", type=int, default=24, help="first turns, one task after another")
    parser.add_argument("--new-tokens", type=int, default=128, help="greedy tokens decoded per prompt")
    parser.add_argument("--depth", type=int, default=4, help="tokens the oracle drafts each pass")
    parser.add_argument("--out", type=Path, default=None, help="JSON report")


def run(args: argparse.Namespace) -> None:
    """Plain against oracle-drafted decoding of real prompts in `--dtype`, every divergence priced
    against a float64 copy of the same weights."""
    tokenizer = load_tokenizer(args.model)
    prompts = [encode_prompt(tokenizer, q["turns"][0], chat=True)
               for q in load_questions(args.questions)[:args.prompts]]
    target = load_model(args.model, getattr(torch, args.dtype))
    full = load_model(args.model, torch.float64)
    report = {"command": command_line(args, "bench", "greedy-agreement"), "machine": machine(), "dtype": args.dtype,
              "new_tokens": args.new_tokens, "depth": args.depth,
              **measure_agreement(target, full, prompts, args.new_tokens, depth=args.depth).as_dict()}
    print(f"{report['identical']}/{report['prompts']} prompts identical over {args.new_tokens} tokens; "
          f"every divergence at a near-tie: {report['all_at_near_ties']}")
    for d in report["divergences"]:
        print(f"  prompt {d['prompt']} token {d['position']}: top-2 gap {d['top2_gap']:.4f}, rounding {d['rounding']:.4f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
