"""Training pieces: the prompt set, recorded hidden states, stored data, the loop's resume, the
draft vocabulary and Medusa's tree search."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculators.train.dataset import Example, FeatureStore
from speculators.train.loop import CHECKPOINT, LEGACY_CHECKPOINT, TrainConfig, load_checkpoint, save_checkpoint, train
from speculators.train.medusa import MedusaObjective, new_heads
from speculators.train.prompts import KINDS, build_prompts
from speculators.train.ranks import choose_tree
from speculators.train.vocab import coverage, frequent_tokens
from tests.actors.test_hidden_states import full_pass
from tests.speculators.heads_fixtures import AUX, HIDDEN, LAYERS, VOCAB, tiny_training_data

SPEC_BENCH = Path(__file__).resolve().parents[2] / "bench" / "data" / "specbench" / "question.jsonl"


def test_the_prompt_set_is_diverse_reproducible_and_not_spec_bench():
    prompts = build_prompts(400)
    assert prompts == build_prompts(400) and len(prompts) == 400
    assert [p.kind for p in prompts[: len(KINDS)]] == list(KINDS)  # interleaved by kind
    assert {p.kind for p in prompts} == set(KINDS)
    assert 0 < sum(p.held_out for p in prompts) < 0.12 * len(prompts)
    questions = [json.loads(line)["turns"][0] for line in SPEC_BENCH.read_text().splitlines() if line.strip()]
    texts = {p.text for p in prompts}
    assert not any(q in texts or q[:80] in p.text for q in questions for p in prompts[:50])
    assert not texts & set(questions)


def test_recorded_rows_are_the_target_hidden_states_of_each_token(tiny_model):
    model, _ = tiny_model
    examples = tiny_training_data(model, prompts=4, new_tokens=10)
    for example in examples:
        assert example.hidden.shape == (len(example.tokens) - 1, 4 * HIDDEN)
        assert len(example.tokens) > example.prompt_length + 1  # only the last pass's rows are lost
        reference = full_pass(model, example.tokens[:-1].tolist(), (*AUX, LAYERS))
        assert torch.allclose(example.hidden, reference, atol=1e-8)


def test_the_feature_store_round_trips_and_resumes(tmp_path):
    store = FeatureStore(tmp_path, (1, 2, 4))
    examples = [Example(i, torch.arange(5 + i) + 10 * i, torch.randn(4 + i, 3 * 8), 2, i == 1) for i in range(3)]
    store.write(examples[:2])
    store.write(examples[2:])
    assert store.recorded() == {(0, 1), (10, 11), (20, 21)}  # each answer's prompt: its first 2 tokens
    read = FeatureStore(tmp_path, (1, 2, 4)).read((4, 1))
    for original, again in zip(examples, read):
        assert torch.equal(again.tokens, original.tokens) and again.held_out == original.held_out
        assert torch.equal(again.hidden, torch.cat([original.hidden[:, 16:], original.hidden[:, :8]], dim=1))
    with pytest.raises(ValueError, match="holds layers"):
        FeatureStore(tmp_path, (1, 2))


def test_the_draft_vocabulary_is_the_most_frequent_tokens():
    sequences = [torch.tensor([5, 5, 5, 2, 2, 9]), torch.tensor([2, 7])]
    vocabulary = frequent_tokens(sequences, 3, 10)
    assert vocabulary.tolist() == [2, 5, 7]  # counts 3, 3, 1, 1: ties by lower id
    assert coverage(sequences, vocabulary, 10) == pytest.approx(7 / 8)  # all but the 9


def test_medusa_tree_search_adds_the_likeliest_paths_first():
    rates = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.1], [0.4, 0.1, 0.0]]
    tree = choose_tree(rates, 5)
    assert tree == [[0], [0, 0], [1], [0, 1], [0, 0, 0]]  # estimated 0.6, 0.3, 0.2, 0.18, 0.12
    assert all(path[:-1] in tree for path in tree if len(path) > 1)


class Interrupt(Exception):
    pass


def test_training_resumes_from_its_checkpoint(tiny_model, tmp_path):
    model, _ = tiny_model
    examples = [Example(e.index, e.tokens, e.hidden[:, -HIDDEN:].float(), e.prompt_length, e.held_out)
                for e in tiny_training_data(model, prompts=16, new_tokens=8)]
    vocabulary = frequent_tokens([e.tokens for e in examples], 32, VOCAB)
    rows = model.head_weight()[vocabulary].float()
    config = TrainConfig(epochs=2, batch_rows=64, lr=1e-2, warmup_steps=2, eval_every=3, checkpoint_every=3, autocast=False)

    def run(folder, stop_after=None):
        heads = new_heads(HIDDEN, VOCAB, 2, vocabulary, rows)
        objective = MedusaObjective(heads)
        steps, logs = [], []

        def interrupted(batch):
            if torch.is_grad_enabled():  # a training step, not an evaluation
                steps.append(1)
                if stop_after is not None and len(steps) > stop_after:
                    raise Interrupt
            return objective(batch)
        interrupted.summary = objective.summary
        train(heads, interrupted, examples, examples[:4], config, folder, log=logs.append)
        return heads, len(steps), logs

    straight, total, _ = run(tmp_path / "straight")
    with pytest.raises(Interrupt):
        run(tmp_path / "resumed", stop_after=4)
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == [CHECKPOINT, "metrics.jsonl"]  # no pickle
    resumed, done_after, logs = run(tmp_path / "resumed")
    assert logs[0].startswith("resuming at step 3")
    assert done_after == total - 3
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), atol=1e-5)


def _trained_linear(seed: int = 0):
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))
    module[1].weight.requires_grad_(False)  # frozen: in the module's state, not the optimizer's
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2, betas=(0.9, 0.95))
    for _ in range(3):
        module(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return module, optimizer


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            _assert_same_state(a[key], b[key])
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]) and a[key].dtype == b[key].dtype
        else:
            assert a[key] == b[key], key


def test_a_checkpoint_round_trips_module_and_optimizer_without_pickle(tmp_path):
    from safetensors import safe_open

    module, optimizer = _trained_linear()
    save_checkpoint(tmp_path / CHECKPOINT, module, optimizer, 3, {"lr": 1e-2})
    with safe_open(tmp_path / CHECKPOINT, "pt") as handle:  # a plain safetensors file: tensors and JSON metadata
        assert {"module.0.weight", "module.1.weight", "optimizer.0.exp_avg", "optimizer.1.step"} <= set(handle.keys())
        assert json.loads(handle.metadata()["state"])["step"] == 3
    fresh, fresh_optimizer = _trained_linear(seed=1)
    state = load_checkpoint(tmp_path / CHECKPOINT, fresh, fresh_optimizer)
    assert (state["step"], state["config"]) == (3, {"lr": 1e-2})
    _assert_same_state(fresh.state_dict(), module.state_dict())
    _assert_same_state(fresh_optimizer.state_dict(), optimizer.state_dict())  # betas a tuple again, step tensors
    x = torch.randn(2, 4)  # and both optimizers take the same next step
    for m, o in ((module, optimizer), (fresh, fresh_optimizer)):
        m(x).sum().backward()
        o.step()
    _assert_same_state(fresh.state_dict(), module.state_dict())


def test_a_checkpoint_written_before_safetensors_resumes_read_as_weights_only(tmp_path):
    module, optimizer = _trained_linear()
    config = TrainConfig(epochs=1, batch_rows=64, warmup_steps=1, autocast=False)
    torch.save({"module": module.state_dict(), "optimizer": optimizer.state_dict(), "step": 1, "config": {}},
               tmp_path / LEGACY_CHECKPOINT)
    fresh, _ = _trained_linear(seed=1)
    logs = []

    def objective(batch):  # the run is complete: nothing is trained or evaluated
        raise AssertionError("called")
    train(fresh, objective, [Example(0, torch.arange(4), torch.randn(3, 4), 1, False)], [], config, tmp_path, logs.append)
    assert logs[0].startswith(f"resuming at step 1 of 1 from {tmp_path / LEGACY_CHECKPOINT}")
    _assert_same_state(fresh.state_dict(), module.state_dict())
