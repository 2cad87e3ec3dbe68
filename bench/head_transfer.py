"""How well a trained head predicts the target on prompts it was not trained on, in a minute.

The target answers Spec-Bench questions (greedy, recorded the way training data is), then the head
is scored teacher-forced on those answers, by task, with the objective it was trained with: top-1
agreement with the target at each drafted depth, the accepted tokens a chain that deep would
average, and how many answer tokens its draft vocabulary can name at all. Beside it, the same
figures on the head's own held-out training answers when the training data is on this machine.
The gap between the two is what a served head loses to prompts unlike its data; online, the
planner's learned depth-1 acceptance follows the Spec-Bench figure, not the held-out one.

    .venv/bin/python -m bench.head_transfer --kind eagle3 --limit 3
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from actors.model.heads import resolve_head
from actors.model.loader import DEFAULT_MODEL, cache_root, load_model, load_tensors, load_tokenizer
from bench.specbench import DEFAULT_QUESTIONS, load_questions
from cluster.engine.build import encode_prompt, recording_decoder
from speculators.heads.checkpoint import load_head
from speculators.train.dataset import Example, FeatureStore, work_folder
from speculators.train.loop import TrainConfig, evaluate
from speculators.train.objective import head_objective
from speculators.train.recorder import AnswerRecorder, recorded_layers
from speculators.train.vocab import coverage

HELD_OUT_ANSWERS = 60


def head_under_test(kind: str, draft: str, model: str, num_layers: int):
    """(module, the target layers it reads, its draft vocabulary as target ids)."""
    module = load_head(resolve_head(kind, draft, model), num_layers).module.float()
    if kind == "eagle3":
        if module.embed_tokens is None:
            module.share_target(load_tensors(model, ["model.embed_tokens.weight"])["model.embed_tokens.weight"])
        return module, module.aux_layers, module.draft_to_target
    return module, (num_layers,), module.token_map


def row(name: str, examples: list[Example], objective, vocabulary: torch.Tensor, vocab_size: int) -> str:
    figures = objective.summary(evaluate(objective, examples, TrainConfig()))
    depths = " | ".join(f"{figures[k]:.1%}" for k in figures if k.startswith("top1@"))
    covered = coverage([e.tokens[e.prompt_length:] for e in examples], vocabulary, vocab_size)
    return f"| {name} | {len(examples)} | {depths} | {figures['accept']:.2f} | {covered:.1%} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["eagle3", "medusa"], default="eagle3")
    parser.add_argument("--draft", default=None, help="a head folder or trained head name (default: the committed one)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    parser.add_argument("--limit", type=int, default=3, help="questions per task")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    target = load_model(args.model)
    num_layers, vocab_size = target.config.num_layers, target.config.vocab_size
    module, layers, vocabulary = head_under_test(args.kind, args.draft or f"{args.kind}:{Path(args.model).name}",
                                            args.model, num_layers)
    objective = head_objective(args.kind, module)
    tokenizer = load_tokenizer(args.model)
    questions = load_questions(args.questions, None, args.limit)
    prompts = [encode_prompt(tokenizer, q["turns"][0], chat=True) for q in questions]
    longest = max(map(len, prompts)) + args.max_new_tokens + 1
    answers = AnswerRecorder(tuple(layers), recording_decoder(target, tokenizer, 8, longest))
    examples = answers.record([(i, ids, True) for i, ids in enumerate(prompts)], args.max_new_tokens)
    steps = objective.steps
    print(f"| answers | count | {' | '.join(f'top-1 depth {d + 1}' for d in range(steps))} "
          f"| accepted, {steps}-deep chain | draft vocabulary covers |")
    print("|---|---:|" + "---:|" * (steps + 2))
    store = FeatureStore(work_folder(cache_root(), args.model) / "data", recorded_layers(num_layers))
    if store.shards():
        held = [e for e in store.read(layers) if e.held_out][:HELD_OUT_ANSWERS]
        print(row("own held-out training answers", held, objective, vocabulary, vocab_size))
    print(row("Spec-Bench, all tasks", examples, objective, vocabulary, vocab_size))
    for task in dict.fromkeys(q["task"] for q in questions):
        in_task = [e for e in examples if questions[e.index]["task"] == task]
        print(row(f"Spec-Bench {task}", in_task, objective, vocabulary, vocab_size))


if __name__ == "__main__":
    main()
