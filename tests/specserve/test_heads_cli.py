"""Heads from the command line: finding trained heads by name, converting public checkpoints, and
`specserve train` end to end (a tiny target over the default tokenizer: a few answers, a few steps)."""
from __future__ import annotations

import json

import pytest
import torch

from actors.model import heads as runtime_heads
from actors.model.heads import TRAINED_HEADS, resolve_head, trained_heads
from cluster.engine.build import build_engine
from cluster.engine.config import EngineConfig
from cluster.engine.request import GenerationRequest
from specserve.cli import main
from speculators.heads.checkpoint import load_head
from speculators.lookahead import LookaheadConfig
from tests.speculators.heads_fixtures import HIDDEN, medusa_public_layout, random_medusa


def test_the_default_targets_trained_heads_are_committed():
    assert {"eagle3:smollm2-135m", "medusa:smollm2-135m", "parallel:smollm2-135m"} <= set(trained_heads())
    for name, kind in (("eagle3-smollm2-135m", "eagle3"), ("medusa-smollm2-135m", "medusa"), ("parallel-smollm2-135m", "dflash")):
        assert load_head(TRAINED_HEADS / name).kind == kind
        assert (TRAINED_HEADS / name / "card.json").exists()


def test_trained_heads_are_found_by_name_and_by_the_method_alone(tmp_path, monkeypatch):
    trained = tmp_path / "trained"
    for name in ("eagle3-smollm2-135m", "medusa-smollm2-135m", "eagle3-unfinished"):
        (trained / name).mkdir(parents=True)
    for name in ("eagle3-smollm2-135m", "medusa-smollm2-135m"):
        (trained / name / "config.json").write_text("{}")
    monkeypatch.setattr(runtime_heads, "TRAINED_HEADS", trained)
    assert trained_heads() == ["eagle3:smollm2-135m", "medusa:smollm2-135m"]
    assert resolve_head("eagle3", "eagle3:smollm2-135m", "smollm2-135m") == trained / "eagle3-smollm2-135m"
    assert resolve_head("medusa", "layer-skip:6", "smollm2-135m") == trained / "medusa-smollm2-135m"
    (tmp_path / "config.json").write_text("{}")
    assert resolve_head("eagle3", str(tmp_path), "smollm2-135m") == tmp_path
    with pytest.raises(FileNotFoundError, match="eagle3:smollm2-135m"):
        resolve_head("eagle3", "layer-skip:6", "some-other-model")
    with pytest.raises(FileNotFoundError, match="neither"):
        resolve_head("eagle3", str(tmp_path / "missing"), "smollm2-135m")


def test_convert_head_rewrites_the_public_medusa_layout(tmp_path, capsys):
    heads = random_medusa(draft_vocab=None, shared=False, num_heads=2)
    medusa_public_layout(heads, tmp_path / "public")
    assert main(["convert-head", str(tmp_path / "public"), str(tmp_path / "vllm"), "--dtype", "float32"]) == 0
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    hidden = torch.randn(3, HIDDEN, dtype=torch.float64)
    assert torch.allclose(load_head(tmp_path / "vllm").module.double()(hidden), heads(hidden), atol=1e-6)


def test_train_writes_a_servable_head_and_its_card(tiny_chat_model_dir, tmp_path, capsys):
    model, out = str(tiny_chat_model_dir), tmp_path / "head"
    common = ["--model", model, "--workdir", str(tmp_path / "work"), "--out", str(out), "--epochs", "1",
              "--medusa-heads", "2", "--draft-vocab", "256", "--tree-size", "4"]
    assert main(["train", "medusa", *common, "--prompts", "41", "--self-prompts", "3", "--max-new-tokens", "6",
                 "--batch-rows", "512"]) == 0
    card = json.loads((out / "card.json").read_text())
    assert card["kind"] == "medusa" and card["steps"] >= 1 and len(card["tree_choices"]) == 4
    assert card["training_answers"] + card["held_out_answers"] == 44 and card["held_out_answers"] >= 1
    assert card["self_written_answers"] == 3
    assert "held-out" in (out / "README.md").read_text()
    assert main(["train", "medusa", *common, "--no-generate"]) == 0
    assert "resuming" in capsys.readouterr().out  # the run folder's checkpoint is picked up
    engine, tokenizer = build_engine(EngineConfig(model=model, method="medusa", draft=str(out), max_sequences=1,
                                                  max_len=256, step_token_budget=8))  # planner off: no timing
    plain, _ = build_engine(EngineConfig(model=model, method="none", max_sequences=1, max_len=256))
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. The quick brown fox")
    fixed = LookaheadConfig(policy="fixed", num_speculative_tokens=3)
    outputs = [e.generate([GenerationRequest("x", ids, max_new_tokens=12, speculate=e is engine, lookahead=fixed)])[0]
               for e in (engine, plain)]
    assert outputs[0].token_ids == outputs[1].token_ids and outputs[0].stats.drafted > 0
    block = tmp_path / "block"  # a DFlash drafter from the same recorded answers
    assert main(["train", "dflash", *common[:4], "--out", str(block), "--epochs", "1", "--draft-vocab", "256",
                 "--tree-size", "4", "--block-size", "4", "--draft-layers", "1", "--no-generate"]) == 0
    card = json.loads((block / "card.json").read_text())
    assert card["kind"] == "dflash" and card["block_size"] == 4 and card["mask_token_id"] == 16  # <empty_output>
    assert json.loads((block / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    parallel, _ = build_engine(EngineConfig(model=model, method="parallel", draft=str(block), max_sequences=1,
                                            max_len=256, step_token_budget=8))
    output = parallel.generate([GenerationRequest("y", ids, max_new_tokens=12, lookahead=fixed)])[0]
    assert output.token_ids == outputs[1].token_ids and output.stats.drafted > 0
