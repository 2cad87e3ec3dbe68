"""Our decoder against transformers' reference on the same weights."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from actors.model.config import DecoderConfig
from actors.model.llama import LlamaDecoder
from actors.model.loader import load_model
from actors.model.runner import ModelRunner
from speculators.proposers.base import TreeInput
from speculators.tree import chain_parents
from tests.conftest import tiny_pair

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def full_logits(model: LlamaDecoder, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(model, 1, 256)
    runner.add("s")
    return runner.forward([TreeInput("s", ids, chain_parents(len(ids)))])[0]


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).abs().max() / reference.abs().max())


def reference_logits(reference, ids):
    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"num_key_value_heads": 1},
        {"num_key_value_heads": 4},
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64}},
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    ],
    ids=["untied", "tied", "mqa", "mha", "llama3-rope", "linear-rope"],
)
def test_llama_logits_match_transformers(overrides):
    ours, reference = tiny_pair(dtype=torch.float32, **overrides)
    ids = list(range(3, 40))
    assert relative_error(full_logits(ours, ids), reference_logits(reference, ids)) < 1e-4


@pytest.mark.parametrize("config_cls,model_cls", [(Qwen2Config, Qwen2ForCausalLM), (MistralConfig, MistralForCausalLM)])
def test_other_llama_family_models_match(config_cls, model_cls):
    torch.manual_seed(1)
    reference = model_cls(config_cls(**SMALL)).eval()
    ours = LlamaDecoder(DecoderConfig.from_hf(reference.config))
    missing, _ = ours.load_state_dict(reference.state_dict(), strict=False)
    assert not missing
    ids = list(range(5, 30))
    assert relative_error(full_logits(ours, ids), reference_logits(reference, ids)) < 1e-4


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="model_type"):
        DecoderConfig.from_hf(GPT2Config())


def test_hf_directory_loads_like_the_reference(tmp_path):
    ours, reference = tiny_pair(dtype=torch.float32)
    reference.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    ids = [1, 5, 9, 2, 7]
    assert relative_error(full_logits(loaded, ids), reference_logits(reference, ids)) < 1e-4


@pytest.mark.default_model
def test_default_model_logits_match_transformers(default_model_path):
    ours = load_model(default_model_path)
    reference = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    ids = [1, 504, 3458, 282, 4649, 314, 3240, 30, 378, 253, 1234, 99, 45]
    assert relative_error(full_logits(ours, ids), reference_logits(reference, ids)) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_likeliest_token_is_the_first_of_equal_maxima_as_argmax_gives_it(dtype, monkeypatch):
    """`likeliest` takes the argmax token without the full logits' argmax: the same index, also
    where several tokens tie for the maximum (bfloat16 logits tie often) or a logit is NaN."""
    model = tiny_pair()[0].to(dtype)
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, model.config.vocab_size, generator=generator) * 2).round().to(dtype)
    logits[1, :] = 3.0  # every token ties
    logits[2, 7] = float("nan")
    monkeypatch.setattr("actors.model.llama.project", lambda hidden, weight: logits)
    hidden = torch.zeros(6, model.config.hidden_size, dtype=dtype)
    assert torch.equal(model.likeliest(hidden), logits.float().argmax(-1))
    assert model.likeliest(hidden)[1] == 0 and model.likeliest(hidden)[2] == 7
