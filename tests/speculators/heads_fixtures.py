"""Small random EAGLE and Medusa heads and DFlash drafters for the tiny target of tests/conftest.py (vocabulary 64,
hidden size 32, 4 layers), and public-layout checkpoints written from them."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, Qwen3Config

from speculators.heads.dflash import DFlashDrafter
from speculators.heads.eagle import EagleHead
from speculators.heads.medusa import MedusaHeads

VOCAB, HIDDEN, LAYERS = 64, 32, 4
AUX = (1, 2, 3)


def layer_config(vocab: int = VOCAB) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6)


def random_eagle3(seed: int = 1, draft_vocab: int = 48, own_embedding: bool = False, norm_before_residual=False,
                  scale: float = 0.3, vocab: int = VOCAB) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(layer_config(vocab), 3, HIDDEN, draft_vocab, AUX, norm_before_residual, own_embedding=own_embedding)
    for parameter in head.parameters():
        parameter.data.normal_(0, scale)
    head.set_vocabulary(torch.randperm(vocab)[:draft_vocab])
    return head.double()


def random_eagle1(seed: int = 2, scale: float = 0.3, vocab: int = VOCAB) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(layer_config(vocab), 1, aux_layers=(LAYERS,), fc_bias=True, own_embedding=True)
    for parameter in head.parameters():
        parameter.data.normal_(0, scale)
    return head.double()


def random_medusa(seed: int = 3, num_heads: int = 4, draft_vocab: int | None = 48, shared=True,
                  vocab: int = VOCAB) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(HIDDEN, vocab, num_heads, 1, draft_vocab, shared_lm_head=shared)
    for parameter in heads.parameters():
        parameter.data.normal_(0, 0.3)
    if draft_vocab:
        heads.token_map.copy_(torch.randperm(vocab)[:draft_vocab])
    return heads.double()


DFLASH_BLOCK, DFLASH_MASK = 4, VOCAB - 1


def dflash_config(vocab: int = VOCAB, layers: int = 2) -> Qwen3Config:
    return Qwen3Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                       tie_word_embeddings=False)


def random_dflash(seed: int = 4, block_size: int = DFLASH_BLOCK, vocab: int = VOCAB, scale: float = 0.3,
                  draft_vocab: int | None = None) -> DFlashDrafter:
    """A drafter reading the outputs of the tiny target's layers AUX - 1 (hidden states AUX); with
    `draft_vocab`, an LM head of its own over that many random tokens."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(dflash_config(vocab), [layer - 1 for layer in AUX], block_size, DFLASH_MASK,
                            draft_vocab_size=draft_vocab)
    for parameter in drafter.parameters():
        parameter.data.normal_(0, scale)
    if draft_vocab:
        drafter.set_vocabulary(torch.randperm(vocab)[:draft_vocab])
    return drafter.double()


def dflash_public_layout(drafter: DFlashDrafter, folder: Path) -> Path:
    """z-lab's layout as its published checkpoints have it: the block size at the top level, the
    layer ids and mask token under dflash_config, an auto_map this project does not run."""
    extension = {"draft_vocab_size": drafter.draft_vocab_size} if drafter.draft_vocab_size else {}
    config = {**drafter.config.to_dict(), **extension, "architectures": ["DFlashDraftModel"], "block_size": drafter.block_size,
              "num_target_layers": LAYERS, "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
              "dflash_config": {"mask_token_id": drafter.mask_token_id, "target_layer_ids": list(drafter.target_layer_ids)}}
    return write(folder, config, drafter.own_state())


def write(folder: Path, config: dict, tensors: dict[str, torch.Tensor], file: str = "model.safetensors") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if file.endswith(".safetensors"):
        save_file(tensors, folder / file)
    else:
        torch.save(tensors, folder / file)
    return folder


def eagle3_original_layout(head: EagleHead, folder: Path) -> Path:
    """The EAGLE repository's EAGLE-3 layout: a Llama config with draft_vocab_size, `midlayer.` names."""
    config = {**layer_config().to_dict(), "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": head.draft_vocab_size}
    tensors = {k.replace("layers.0.", "midlayer."): v for k, v in head.state_dict().items()}
    return write(folder, config, tensors)


def eagle1_layout(head: EagleHead, folder: Path) -> Path:
    """EAGLE-1/2: a one-layer Llama config, fc over 2H with a bias, pickled weights."""
    config = {**layer_config().to_dict(), "architectures": ["LlamaForCausalLM"], "bias": True}
    return write(folder, config, head.state_dict(), "pytorch_model.bin")


def medusa_public_layout(heads: MedusaHeads, folder: Path) -> Path:
    """The Medusa repository's layout: per-head residual block and full-vocabulary LM head."""
    if heads.shared_lm_head or heads.draft_vocab_size != heads.vocab_size:
        raise ValueError("the public layout has one full-vocabulary LM head per head")
    tensors = {}
    for k in range(heads.num_heads):
        tensors[f"medusa_head.{k}.0.linear.weight"] = heads.blocks[k].layers[0].weight
        tensors[f"medusa_head.{k}.0.linear.bias"] = heads.blocks[k].layers[0].bias
        tensors[f"medusa_head.{k}.1.weight"] = heads.lm_heads[k].weight
    config = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": 1, "base_model_name_or_path": "tiny"}
    return write(folder, config, tensors, "medusa_lm_head.safetensors")


def tiny_training_data(model, prompts: int = 128, new_tokens: int = 32, seed: int = 0):
    """The tiny target's own greedy answers to random prompts, with the hidden states heads read,
    recorded from the decoding passes as `specserve train` records them."""
    import random

    from cluster.engine.build import recording_decoder
    from speculators.train.recorder import AnswerRecorder
    from tests.conftest import IdTokenizer

    rng = random.Random(seed)
    answers = AnswerRecorder((*AUX, LAYERS), recording_decoder(model, IdTokenizer(), 8, 128), dtype=model.dtype)
    prompts = [(index, [rng.randrange(VOCAB) for _ in range(rng.randint(3, 30))], index % 8 == 0)
               for index in range(prompts)]
    return answers.record(prompts, new_tokens)


TRAINING = {"prompts": 128, "new_tokens": 32, "data_seed": 0, "seed": 0, "draft_vocab": 48, "medusa_heads": 4,
            "train": {"epochs": 40, "batch_rows": 1024, "lr": 3e-3, "warmup_steps": 10, "eval_every": 10_000,
                      "checkpoint_every": 10_000, "autocast": False}}
"""How `trained_tiny_heads` trains; with the tiny target's weights, the key of the committed heads."""

TINY_HEADS = Path(__file__).parents[1] / "data" / "tiny-heads"
"""The heads trained_tiny_heads trained, committed (weights, figures and key) so that a session loads
them instead of training for a minute; `python -m tests.speculators.heads_fixtures` rewrites them."""


def trained_tiny_heads(model, folder: Path):
    """An EAGLE-3 head and Medusa heads trained for a few seconds on the tiny target's answers:
    they predict it well enough that drafts get accepted. Returns (eagle3 head, medusa heads,
    held-out figures of each)."""
    from speculators.train.dataset import Example
    from speculators.train.eagle3 import Eagle3Objective, new_head
    from speculators.train.loop import TrainConfig, train
    from speculators.train.medusa import MedusaObjective, new_heads
    from speculators.train.vocab import frequent_tokens
    from tests.conftest import tiny_hf_config

    torch.manual_seed(TRAINING["seed"])
    examples = tiny_training_data(model, TRAINING["prompts"], TRAINING["new_tokens"], TRAINING["data_seed"])
    train_set = [e for e in examples if not e.held_out]
    vocabulary = frequent_tokens([e.tokens for e in train_set], TRAINING["draft_vocab"], VOCAB)
    lm_rows = model.head_weight()[vocabulary].float()
    config = TrainConfig(**TRAINING["train"])

    def columns(layers):
        width = [*AUX, LAYERS]
        keep = torch.cat([torch.arange(HIDDEN) + width.index(layer) * HIDDEN for layer in layers])
        return [Example(e.index, e.tokens, e.hidden[:, keep].float(), e.prompt_length, e.held_out) for e in examples]

    eagle_examples = columns(AUX)
    head = new_head(tiny_hf_config(), vocabulary, AUX, lm_rows)
    head.share_target(model.model.embed_tokens.weight.float())
    eagle_objective = Eagle3Objective(head, 3)
    eagle_figures = eagle_objective.summary(train(head, eagle_objective, [e for e in eagle_examples if not e.held_out],
                                                  [e for e in eagle_examples if e.held_out], config, folder / "eagle3",
                                                  log=lambda _: None))
    medusa_examples = columns((LAYERS,))
    heads = new_heads(HIDDEN, VOCAB, TRAINING["medusa_heads"], vocabulary, lm_rows)
    medusa_objective = MedusaObjective(heads)
    medusa_figures = medusa_objective.summary(train(heads, medusa_objective, [e for e in medusa_examples if not e.held_out],
                                                    [e for e in medusa_examples if e.held_out], config, folder / "medusa",
                                                    log=lambda _: None))
    return head, heads, eagle_figures, medusa_figures


DFLASH_TRAINING = {"anchors": 256, "train": {"epochs": 30, "batch_rows": 1024, "lr": 1e-2, "warmup_steps": 10,
                                              "eval_every": 10_000, "checkpoint_every": 10_000, "autocast": False}}


def trained_tiny_dflash(model, folder: Path):
    """A one-layer DFlash drafter (blocks of 4) trained for half a minute on the tiny target's
    answers, as `specserve train dflash` trains: (drafter, held-out figures). Its layers start
    random, not from the target's (`start_from_target`): the tiny target's layers are random too, and
    starting from them learned less in this half minute (held-out top-1 at depth 1 0.34 against 0.4+)."""
    from speculators.train.dataset import Example
    from speculators.train.dflash import DFlashObjective, new_drafter
    from speculators.train.loop import TrainConfig, train
    from tests.conftest import tiny_hf_config

    torch.manual_seed(TRAINING["seed"])
    width = [*AUX, LAYERS]
    keep = torch.cat([torch.arange(HIDDEN) + width.index(layer) * HIDDEN for layer in AUX])
    examples = [Example(e.index, e.tokens, e.hidden[:, keep].float(), e.prompt_length, e.held_out)
                for e in tiny_training_data(model, TRAINING["prompts"], TRAINING["new_tokens"], TRAINING["data_seed"])]
    drafter = new_drafter(tiny_hf_config(), tuple(layer - 1 for layer in AUX), 1, DFLASH_BLOCK, DFLASH_MASK)
    drafter.share_target(model.model.embed_tokens.weight.float(), model.head_weight().float())
    objective = DFlashObjective(drafter, DFLASH_TRAINING["anchors"])
    held = train(drafter, objective, [e for e in examples if not e.held_out], [e for e in examples if e.held_out],
                 TrainConfig(**DFLASH_TRAINING["train"]), folder, log=lambda _: None)
    return drafter.eval(), objective.summary(held)


def tiny_heads_key(model) -> str:
    """What the heads are trained from: the tiny target's weights and the training settings."""
    from speculators.train.loop import TrainConfig

    settings = {**TRAINING, "train": asdict(TrainConfig(**TRAINING["train"]))}  # the defaults count too
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def save_tiny_heads(model, trained, folder: Path = TINY_HEADS) -> None:
    head, heads, eagle_figures, medusa_figures = trained
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {**{f"eagle3.{k}": v for k, v in head.state_dict().items()},
               **{f"medusa.{k}": v for k, v in heads.state_dict().items()}}
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "heads.safetensors")
    record = {"key": tiny_heads_key(model), "eagle3": eagle_figures, "medusa": medusa_figures}
    (folder / "heads.json").write_text(json.dumps(record, indent=1) + "\n")


def tiny_heads(model, folder: Path):
    """trained_tiny_heads' result: the committed heads when their key is this target's and these
    settings', else trained here (with a warning saying how to commit them again)."""
    import warnings

    from safetensors.torch import load_file

    from speculators.train.eagle3 import new_head
    from speculators.train.medusa import new_heads
    from tests.conftest import tiny_hf_config

    record = json.loads((TINY_HEADS / "heads.json").read_text()) if (TINY_HEADS / "heads.json").exists() else {}
    if record.get("key") != tiny_heads_key(model):
        warnings.warn(f"{TINY_HEADS} holds no heads for this tiny target and these settings: trained them instead; "
                      "`python -m tests.speculators.heads_fixtures` commits new ones", stacklevel=2)
        return trained_tiny_heads(model, folder)
    tensors = load_file(TINY_HEADS / "heads.safetensors")
    draft, rows = torch.arange(TRAINING["draft_vocab"]), torch.zeros(TRAINING["draft_vocab"], HIDDEN)
    head = new_head(tiny_hf_config(), draft, AUX, rows)  # the vocabulary and every weight are loaded next
    head.load_state_dict({k.removeprefix("eagle3."): v for k, v in tensors.items() if k.startswith("eagle3.")})
    head.share_target(model.model.embed_tokens.weight.float())
    heads = new_heads(HIDDEN, VOCAB, TRAINING["medusa_heads"], draft, rows)
    heads.load_state_dict({k.removeprefix("medusa."): v for k, v in tensors.items() if k.startswith("medusa.")})
    return head.eval(), heads.eval(), record["eagle3"], record["medusa"]


if __name__ == "__main__":
    import tempfile

    from tests.conftest import tiny_pair

    target = tiny_pair()[0]
    with tempfile.TemporaryDirectory() as scratch:
        save_tiny_heads(target, trained_tiny_heads(target, Path(scratch)))
    print(f"wrote {TINY_HEADS}")
