"""Decoding methods as Spec-Bench times them, and the peer systems run beside ours.

Every method, ours or a peer's, is a `Runner`: greedy token ids for prompt token ids. The harness
times the call itself, so every system is measured the same way (prefill included). Peers decode
the same prompt ids with the same target weights, so their ids can be compared with our plain
decoding; each also names its own plain decoding (`baseline`), because a system's speedup over
its own plain decoding is the fair comparison, while absolute CPU speed of different kernels
(fp32 PyTorch against 4-bit C++) is not.
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from actors.model.loader import gguf_file, resolve_model
from cluster.engine.config import LAYER_SKIP_PREFIX, EngineConfig

HF_PEERS = ("hf", "hf-pld", "hf-assisted")
LLAMA_CPP_PEERS = ("llama-cpp", "llama-cpp-pld")
PEERS = HF_PEERS + LLAMA_CPP_PEERS
PEER_BASELINES = {**{name: "hf" for name in HF_PEERS}, **{name: "llama-cpp" for name in LLAMA_CPP_PEERS}}
LLAMA_CPP_CONTEXT = 4096


@dataclass
class Generation:
    token_ids: list[int]
    """New tokens only, EOS included when decoding stopped there (as our engine returns them)."""
    finish_reason: str
    target_forwards: int | None = None
    """Verification passes of the target; None where the system does not expose them."""


@dataclass
class Runner:
    name: str
    baseline: str
    """The method whose speed is this system's own plain decoding."""
    generate: Callable[[list[int], int], Generation]
    """(prompt ids, max new tokens) -> greedy Generation."""


def with_baselines(names: Collection[str]) -> list[str]:
    """The peers to run: those asked for plus each one's own plain decoding, in PEERS order."""
    wanted = set(names) | {PEER_BASELINES[name] for name in names}
    return [name for name in PEERS if name in wanted]


def finished(token_ids: list[int], eos_token_ids: Collection[int], max_new_tokens: int) -> Generation:
    """Cut a peer's output where our engine would stop: after the first EOS or at max_new_tokens."""
    for index, token in enumerate(token_ids[:max_new_tokens]):
        if token in eos_token_ids:
            return Generation(token_ids[: index + 1], "stop")
    return Generation(token_ids[:max_new_tokens], "length")


def build_peers(
    names: Collection[str], config: EngineConfig, eos_token_ids: Collection[int], pad_token_id: int,
) -> tuple[list[Runner], dict[str, str]]:
    """Runners for the peers that can run here, and a note for each one that cannot."""
    runners, notes = [], {}
    builders = ((HF_PEERS, lambda wanted: _hf_runners(wanted, config, eos_token_ids, pad_token_id)),
                (LLAMA_CPP_PEERS, lambda wanted: _llama_cpp_runners(wanted, config, eos_token_ids)))
    for family, build in builders:
        wanted = [name for name in family if name in names]
        if not wanted:
            continue
        try:
            built, skipped = build(wanted)
        except Exception as error:  # a peer that cannot load must not stop our own measurements
            built, skipped = [], {name: f"failed to load: {type(error).__name__}: {error}" for name in wanted}
        runners += built
        notes |= skipped
    return runners, notes


def _hf_runners(
    wanted: list[str], config: EngineConfig, eos_token_ids: Collection[int], pad_token_id: int,
) -> tuple[list[Runner], dict[str, str]]:
    """transformers `generate` on one shared copy of the target: plain, prompt lookup, assisted."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    dtype = getattr(torch, config.dtype)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(config.model), dtype=dtype).eval()
    options: dict[str, dict] = {"hf": {}, "hf-pld": {"prompt_lookup_num_tokens": config.prompt_lookup_num_tokens}}
    if hasattr(GenerationConfig(), "max_matching_ngram_size"):
        options["hf-pld"]["max_matching_ngram_size"] = config.prompt_lookup_max_ngram_size
    notes = {}
    if "hf-assisted" in wanted:
        if config.draft.startswith(LAYER_SKIP_PREFIX):
            notes["hf-assisted"] = (f"skipped: draft {config.draft!r} is our layer-skip self-draft, which "
                                    "transformers cannot use; pass --draft <model> to run it")
        else:
            assistant = AutoModelForCausalLM.from_pretrained(resolve_model(config.draft), dtype=dtype).eval()
            options["hf-assisted"] = {"assistant_model": assistant}
    common = {"do_sample": False, "eos_token_id": sorted(eos_token_ids), "pad_token_id": pad_token_id}

    def runner(name: str) -> Runner:
        def generate(prompt_ids: list[int], max_new_tokens: int) -> Generation:
            inputs = torch.tensor([prompt_ids])
            with torch.inference_mode():
                output = model.generate(inputs, attention_mask=torch.ones_like(inputs),
                                        max_new_tokens=max_new_tokens, **common, **options[name])
            return finished(output[0, len(prompt_ids):].tolist(), eos_token_ids, max_new_tokens)

        return Runner(name, PEER_BASELINES[name], generate)

    return [runner(name) for name in wanted if name in options], notes


def _llama_cpp_runners(
    wanted: list[str], config: EngineConfig, eos_token_ids: Collection[int],
) -> tuple[list[Runner], dict[str, str]]:
    """llama-cpp-python on the target's GGUF: plain, and LlamaPromptLookupDecoding.

    Optional by design: it takes ~20 minutes to build on 2 cores, so setup never installs it.
    """
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as error:
        return [], {name: f"skipped: llama_cpp is not importable ({error})" for name in wanted}
    gguf = gguf_file(config.model)
    if gguf is None:
        return [], {name: f"skipped: model {config.model!r} is not a GGUF file or known name" for name in wanted}

    def runner(name: str) -> Runner:
        draft = LlamaPromptLookupDecoding(num_pred_tokens=config.prompt_lookup_num_tokens,
                                          max_ngram_size=config.prompt_lookup_max_ngram_size) \
            if name == "llama-cpp-pld" else None
        # logits_all: its prompt lookup fails on prompts over 512 tokens without it
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=LLAMA_CPP_CONTEXT, n_threads=torch.get_num_threads(),
                              logits_all=draft is not None, draft_model=draft, verbose=False)
        stop = set(eos_token_ids) | {llm.token_eos()}

        def generate(prompt_ids: list[int], max_new_tokens: int) -> Generation:
            llm.reset()  # else generate() reuses the KV cache of a shared prefix from the previous call
            output = []
            for token in llm.generate(prompt_ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
                output.append(int(token))
                if token in stop or len(output) >= max_new_tokens:
                    break
            return finished(output, stop, max_new_tokens)

        return Runner(name, PEER_BASELINES[name], generate)

    return [runner(name) for name in wanted], {}
