"""`specserve train eagle3|medusa|dflash`: the target's own answers and hidden states, then the head.

Two resumable stages under one work folder (default `$SPECSERVE_CACHE/train/<model>`):
1. data: the target answers the prompt set (speculators/train/prompts.py, plus user turns the
   target writes itself, see `self_written_prompts`) with greedy decoding,
   in batches through the project's engine (prompt lookup drafts, which keeps it lossless and
   faster); a `HiddenRecorder` drafter keeps the hidden states the engine hands it from those same
   decoding passes (every layer any head here reads), so no second pass over the text is needed.
   Shards of `data/` are written a batch at a time; a stopped run continues after the last one.
2. training (speculators/train/): checkpoints in the run folder, resumed when present; the
   final head is written in its serving format to `--out`.
This module composes the runtime (actors/, cluster/) with the pure training code, which never
imports either.
"""
from __future__ import annotations

import json
import shlex
import sys
import uuid
from dataclasses import asdict
from pathlib import Path

import torch

from actors.model.loader import DEFAULT_MODEL, cache_root, load_config, load_model, load_tensors, load_tokenizer, resolve_model
from actors.model.precision import cpu_has_bfloat16, resolve_dtype
from cluster.engine.build import encode_prompt, local_engine, recording_decoder
from cluster.engine.config import SchedulerConfig
from cluster.engine.request import GenerationRequest
from speculators.heads.checkpoint import default_aux_layers, save_dflash, save_eagle3, save_medusa
from speculators.sampling import SamplingParams
from speculators.train.dataset import FeatureStore
from speculators.train.dataset import work_folder as train_folder
from speculators.train.dflash import ANCHORS, new_drafter, start_from_target
from speculators.train.eagle3 import new_head
from speculators.train.loop import TrainConfig, train
from speculators.train.medusa import new_heads
from speculators.train.objective import head_objective
from speculators.train.prompts import Prompt, build_prompts
from speculators.train.ranks import choose_tree
from speculators.train.recorder import AnswerRecorder, recorded_layers
from speculators.train.vocab import coverage, frequent_tokens

GENERATION_BATCH = 32
"""Prompts handed to the engine at once (it decodes `max_sequences` of them concurrently)."""
SELF_PROMPT_INDEX = 1_000_000
"""Self-written prompts' indices in the data start here (the written prompt set's lie below)."""
SELF_PROMPT_TOKENS = 96
"""Longest self-written user turn."""


def work_folder(model: str) -> Path:
    return train_folder(cache_root(), model)


def self_written_prompts(target, tokenizer, count: int, path: Path, log=print) -> list[Prompt]:
    """`count` user turns written by the target itself: sampled (temperature 1, top-p 0.95) after its
    chat template's opening of a user turn, the way Magpie makes instruction data from a chat model
    alone. Templates cover the kinds Spec-Bench measures; these cover what the model expects to be
    asked, in its own words, which is what a served head meets most. Kept in `path` (JSON lines):
    written once, so a resumed run answers the same prompts."""
    prompts = [json.loads(line)["text"] for line in path.read_text().splitlines()] if path.exists() else []
    if len(prompts) >= count:
        return [Prompt("self", text) for text in prompts[:count]]
    template = tokenizer.apply_chat_template([{"role": "user", "content": "\x00"}], tokenize=False,
                                             add_generation_prompt=True)
    opening = tokenizer.encode(template[: template.index("\x00")], add_special_tokens=False)
    seen, seed = set(prompts), len(prompts)
    engine = local_engine(target, tokenizer, None, SchedulerConfig(max_sequences=GENERATION_BATCH,
                                                                   max_len=len(opening) + SELF_PROMPT_TOKENS + 1))
    while len(prompts) < count and seed < 4 * count + 64:
        wanted = min(GENERATION_BATCH, count - len(prompts))  # only the missing turns: top-p sorts the vocabulary a token
        sampling = [SamplingParams(temperature=1.0, top_p=0.95, seed=seed + i) for i in range(wanted)]
        seed += wanted
        requests = [GenerationRequest(uuid.uuid4().hex, opening, s, max_new_tokens=SELF_PROMPT_TOKENS, speculate=False)
                    for s in sampling]
        for output in engine.generate(requests):
            text = output.text.strip()
            if len(text.split()) >= 4 and text not in seen and len(prompts) < count:  # a turn cut at the limit still asks
                seen.add(text)
                prompts.append(text)
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in prompts))
        log(f"data: {len(prompts)}/{count} self-written prompts")
    return [Prompt("self", text) for text in prompts]


def generate_data(model: str, folder: Path, count: int, max_new_tokens: int, max_sequences: int,
                  max_prompt_tokens: int = 1024, device: str = "cpu", self_prompts: int = 0, dtype: str = "auto",
                  log=print) -> FeatureStore:
    """The target's greedy answers to the prompt set and to `self_prompts` prompts it writes itself,
    with their hidden states, into `folder`; the target runs in `dtype` ("auto": as it serves)."""
    target = load_model(model, getattr(torch, resolve_dtype(dtype, device)), device=device)
    store = FeatureStore(folder, recorded_layers(target.config.num_layers))
    done = store.recorded()
    tokenizer = load_tokenizer(model)
    answers = AnswerRecorder(store.layers, recording_decoder(target, tokenizer, max_sequences,
                                                          max_prompt_tokens + max_new_tokens + 1))
    numbered = list(enumerate(build_prompts(count)))
    if self_prompts:
        written = self_written_prompts(target, tokenizer, self_prompts, folder.parent / "self-prompts.jsonl", log)
        numbered += [(SELF_PROMPT_INDEX + i, prompt) for i, prompt in enumerate(written)]
    todo = [(i, p, encode_prompt(tokenizer, p.text, chat=True)) for i, p in numbered]
    todo = [item for item in todo if len(item[2]) <= max_prompt_tokens and tuple(item[2]) not in done]
    log(f"data: {len(done)} answers recorded, {len(todo)} to go ({folder})")
    for start in range(0, len(todo), GENERATION_BATCH):
        batch = todo[start:start + GENERATION_BATCH]
        store.write(answers.record([(index, ids, prompt.held_out) for index, prompt, ids in batch], max_new_tokens))
        log(f"data: {len(done) + start + len(batch)}/{len(done) + len(todo)}")
    return store


def mask_token(tokenizer) -> int:
    """The token a DFlash block's masked rows carry: the tokenizer's mask token, else the last of its
    added tokens that is none of its special ones (chat markers, end of text), which answers never hold."""
    if tokenizer.mask_token_id is not None:
        return tokenizer.mask_token_id
    special = set(tokenizer.all_special_ids)
    unused = [i for i in tokenizer.added_tokens_decoder if i not in special]
    if not unused:
        raise ValueError("the tokenizer has no mask token and no spare added token: give --mask-token-id")
    return max(unused)


def train_head(kind: str, model: str, folder: Path, out: Path, config: TrainConfig, draft_vocab: int = 8192,
               ttt_steps: int = 3, medusa_heads: int = 4, tree_size: int = 24, verifier: str | None = None,
               block_size: int = 8, draft_layers: int = 2, mask_token_id: int | None = None, anchors: int = ANCHORS,
               log=print) -> dict:
    """Train an `eagle3` or `medusa` head or a `dflash` block drafter on the data in `folder` and
    write it to `out`.

    Returns what the head's card reports (data, steps, held-out figures)."""
    target_config = load_config(resolve_model(model))
    store = FeatureStore(folder / "data", recorded_layers(target_config.num_layers))
    layers = (target_config.num_layers,) if kind == "medusa" else default_aux_layers(target_config.num_layers)
    examples = store.read(layers)
    train_set = [e for e in examples if not e.held_out]
    held_out = [e for e in examples if e.held_out]
    if not held_out:
        raise ValueError(f"none of the {len(examples)} recorded answers is held out (one prompt in twenty is): "
                         "record more prompts; the card reports held-out figures")
    responses = [e.tokens[e.prompt_length:] for e in train_set]
    vocabulary = frequent_tokens(responses, draft_vocab, target_config.vocab_size)
    embedding = load_tensors(model, ["model.embed_tokens.weight", "lm_head.weight"], device=config.device)
    lm_head = embedding.get("lm_head.weight", embedding["model.embed_tokens.weight"])
    log(f"{kind}: {len(train_set)} training and {len(held_out)} held-out answers, "
        f"{sum(len(r) for r in responses)} response tokens; draft vocabulary {len(vocabulary)} covers "
        f"{coverage([e.tokens[e.prompt_length:] for e in held_out], vocabulary, target_config.vocab_size):.1%} "
        "of held-out response tokens")
    if kind == "eagle3":
        module = new_head(target_config.hf_config, vocabulary, layers, lm_head[vocabulary])
        module.share_target(embedding["model.embed_tokens.weight"])
    elif kind == "dflash":
        mask = mask_token_id if mask_token_id is not None else mask_token(load_tokenizer(model))
        module = new_drafter(target_config.hf_config, tuple(layer - 1 for layer in layers), draft_layers, block_size, mask,
                             vocabulary, lm_head[vocabulary])
        module.share_target(embedding["model.embed_tokens.weight"], lm_head)
        start_from_target(module, lambda names: load_tensors(model, names, device=config.device), target_config.num_layers,
                          torch.cat([e.hidden for e in train_set[:16]]))
    else:
        module = new_heads(target_config.hidden_size, target_config.vocab_size, medusa_heads, vocabulary, lm_head[vocabulary])
    objective = head_objective(kind, module, ttt_steps, anchors)
    held = train(module, objective, train_set, held_out, config, folder / "runs" / kind, log)
    figures = objective.summary(held)
    verifier = verifier or str(model)
    choices = None
    if kind == "eagle3":
        save_eagle3(module, out, verifier, list(target_config.hf_config.architectures or ["LlamaForCausalLM"]), ttt_steps)
    elif kind == "dflash":
        module.tree_choices = choices = choose_tree(objective.rank_rates(held), tree_size)
        save_dflash(module, out, verifier, target_config.num_layers)
    else:
        choices = choose_tree(objective.rank_rates(held), tree_size)
        save_medusa(module, out, verifier, choices)
    steps = json.loads((folder / "runs" / kind / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    return {"kind": kind, "target": verifier, "training_answers": len(train_set), "held_out_answers": len(held_out),
            "self_written_answers": sum(e.index >= SELF_PROMPT_INDEX for e in examples),
            "response_tokens": sum(len(r) for r in responses), "rows": sum(e.hidden.shape[0] for e in train_set),
            "steps": steps, "held_out": figures, "config": asdict(config), "draft_vocab": len(vocabulary),
            "vocab_coverage": coverage([e.tokens[e.prompt_length:] for e in held_out], vocabulary, target_config.vocab_size),
            **({"ttt_steps": ttt_steps} if kind == "eagle3" else {"tree_choices": choices}),
            **({"block_size": block_size, "draft_layers": draft_layers, "mask_token_id": module.mask_token_id}
               if kind == "dflash" else {})}


def add_arguments(parser) -> None:
    parser.add_argument("kind", choices=["eagle3", "medusa", "dflash"],
                        help="the head to train (dflash: a block drafter for method parallel)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="target: a known name, a .gguf file or a HF directory")
    parser.add_argument("--out", type=Path, default=None, help="where the head goes (default: <workdir>/<kind>)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="data and run checkpoints (default: $SPECSERVE_CACHE/train/<model>)")
    parser.add_argument("--prompts", type=int, default=1200, help="prompts of the written prompt set the target answers")
    parser.add_argument("--self-prompts", type=int, default=1200,
                        help="prompts the target writes itself (sampled user turns) and then answers")
    parser.add_argument("--max-new-tokens", type=int, default=192, help="longest answer")
    parser.add_argument("--max-sequences", type=int, default=8, help="answers decoded at once")
    parser.add_argument("--no-generate", action="store_true", help="train on the data already recorded, without adding more")
    parser.add_argument("--dtype", default="auto", help="the target's dtype while recording its answers (auto: the "
                        "dtype it serves in, bfloat16 on CPUs that have it natively)")
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--batch-rows", type=int, default=2048, help="tokens per training step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--draft-vocab", type=int, default=8192,
                        help="the head's vocabulary (eagle3, dflash: scored by an LM head of its own): the target's "
                        "most frequent output tokens")
    parser.add_argument("--ttt-steps", type=int, default=3,
                        help="eagle3: drafting steps unrolled in training (training-time test)")
    parser.add_argument("--medusa-heads", type=int, default=4)
    parser.add_argument("--tree-size", type=int, default=24,
                        help="medusa, dflash: nodes of the tree chosen from held-out ranks")
    parser.add_argument("--block-size", type=int, default=8,
                        help="dflash: rows of a block, the last committed token and block_size - 1 drafted ones")
    parser.add_argument("--draft-layers", type=int, default=2, help="dflash: the drafter's layers")
    parser.add_argument("--anchors", type=int, default=ANCHORS,
                        help="dflash: blocks per training step (each a random response position of the batch)")
    parser.add_argument("--mask-token-id", type=int, default=None,
                        help="dflash: the token of masked rows (default: the tokenizer's mask token, else its last "
                        "spare added token)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-autocast", action="store_true",
                        help="train in float32 instead of bfloat16 products (always so on a CPU without native "
                        "bfloat16, where emulated bfloat16 products are about ten times slower)")
    parser.add_argument("--verifier-name", default=None,
                        help="the target's name written into the head's config (default: --model)")


def run(args) -> int:
    folder = args.workdir or work_folder(args.model)
    out = args.out or folder / args.kind
    if not args.no_generate:
        generate_data(args.model, folder / "data", args.prompts, args.max_new_tokens, args.max_sequences,
                      device=args.device, self_prompts=args.self_prompts, dtype=args.dtype)
    config = TrainConfig(epochs=args.epochs, batch_rows=args.batch_rows, lr=args.lr, device=args.device,
                         autocast=not args.no_autocast and (torch.device(args.device).type != "cpu" or cpu_has_bfloat16()))
    card = train_head(args.kind, args.model, folder, out, config, args.draft_vocab, args.ttt_steps, args.medusa_heads,
                      args.tree_size, args.verifier_name, args.block_size, args.draft_layers, args.mask_token_id,
                      args.anchors)
    card["command"] = shlex.join(["specserve", *sys.argv[1:]])  # as typed
    write_card(out, card)
    print(f"wrote {out}")
    return 0


def write_card(out: Path, card: dict) -> None:
    """`card.json` and a short README.md beside the head: data, steps, held-out figures."""
    (out / "card.json").write_text(json.dumps(card, indent=1) + "\n")
    figures = card["held_out"]
    depths = ", ".join(f"{figures[k]:.1%}" for k in figures if k.startswith("top1@"))
    lines = [
        f"# {card['kind']} head for {card['target']}", "",
        f"Trained by `{card['command']}`.", "",
        f"- data: the target's own greedy answers to {card['training_answers'] + card['held_out_answers']} prompts, "
        f"{card.get('self_written_answers', 0)} of them user turns the target wrote itself, the rest from "
        "speculators/train/prompts.py (chat, writing, translation, summaries of documents, questions, questions about "
        f"documents, math, code; none from Spec-Bench): {card['response_tokens']} response tokens and "
        f"{card['rows']} hidden-state rows for training; {card['held_out_answers']} answers held out",
        f"- draft vocabulary: the {card['draft_vocab']} most frequent output tokens, "
        f"{card['vocab_coverage']:.1%} of held-out response tokens",
        f"- training: {card['steps']} steps of about {card['config']['batch_rows']} tokens, AdamW lr {card['config']['lr']}, "
        f"{card['config']['epochs']} epochs"
        + (f", training-time test over {card['ttt_steps']} steps" if "ttt_steps" in card else ""),
        f"- held-out: loss {figures['loss']:.3f}; top-1 agreement with the target by depth: {depths}; "
        f"estimated accepted tokens per pass for a chain as deep as that: {figures['accept']:.2f}",
    ]
    if card.get("tree_choices"):
        lines.append(f"- tree ({len(card['tree_choices'])} nodes, from held-out ranks): `{card['tree_choices']}`")
    (out / "README.md").write_text("\n".join(lines) + "\n")
