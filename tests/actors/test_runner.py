"""The KV cache through the ModelRunner: prefill, tree passes, commit, rollback, batching."""
from __future__ import annotations

import pytest
import torch

from actors.model.kv_cache import CacheFullError
from actors.model.runner import ModelRunner
from speculators.proposers.base import TreeInput
from speculators.tree import DraftTree, chain_parents

PROMPT = [3, 7, 1, 9, 4, 4, 2]


def run_chain(model, ids):
    runner = ModelRunner(model, 1, 128)
    runner.add("s")
    return runner.forward([TreeInput("s", ids, chain_parents(len(ids)))])[0]


def prefilled(model, prompt=PROMPT, slots=2):
    runner = ModelRunner(model, slots, 128)
    runner.add("s")
    runner.forward([TreeInput("s", prompt, chain_parents(len(prompt)), logits="none")])
    runner.commit("s", range(len(prompt)))
    return runner


def test_tree_pass_equals_each_path_run_alone(tiny_model):
    model, _ = tiny_model
    runner = prefilled(model)
    tree = DraftTree([5, 11, 12, 13, 21, 22], [-1, 0, 0, 1, 3, 2])
    logits = runner.forward([TreeInput("s", tree.token_ids, tree.parents)])[0]
    for path in tree.paths:
        expected = run_chain(model, PROMPT + [tree.token_ids[n] for n in path])[len(PROMPT):]
        torch.testing.assert_close(logits[path], expected, rtol=1e-9, atol=1e-9)


def test_commit_keeps_the_accepted_path_only(tiny_model):
    model, _ = tiny_model
    runner = prefilled(model)
    tree = DraftTree([5, 11, 12, 13, 21], [-1, 0, 0, 2, 3])
    runner.forward([TreeInput("s", tree.token_ids, tree.parents)])
    runner.commit("s", [0, 2, 3])  # keep 5 -> 12 -> 13, drop 11 and 21
    assert runner.committed_length("s") == len(PROMPT) + 3
    after = runner.forward([TreeInput("s", [30], [-1])])[0]
    expected = run_chain(model, PROMPT + [5, 12, 13, 30])[-1:]
    torch.testing.assert_close(after, expected, rtol=1e-9, atol=1e-9)


def test_commit_refuses_a_set_that_is_not_a_path(tiny_model):
    model, _ = tiny_model
    runner = prefilled(model)
    runner.forward([TreeInput("s", [5, 11, 12], [-1, 0, 0])])
    with pytest.raises(ValueError, match="not a path"):
        runner.commit("s", [0, 1, 2])


def test_rollback_then_refeed_matches_a_fresh_run(tiny_model):
    model, _ = tiny_model
    runner = prefilled(model)
    runner.truncate("s", 4)
    logits = runner.forward([TreeInput("s", [8, 8], [-1, 0])])[0]
    torch.testing.assert_close(logits, run_chain(model, PROMPT[:4] + [8, 8])[4:], rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError):
        runner.truncate("s", 99)


def test_mixed_lengths_in_one_packed_pass(tiny_model):
    model, _ = tiny_model
    runner = ModelRunner(model, 3, 128)
    prompts = {"a": [1, 2, 3, 4, 5, 6, 7, 8, 9], "b": [9], "c": [4, 4, 4, 4]}
    for seq_id, ids in prompts.items():
        runner.add(seq_id)
    runner.forward([TreeInput(s, p, chain_parents(len(p)), logits="none") for s, p in prompts.items()])
    for seq_id, ids in prompts.items():
        runner.commit(seq_id, range(len(ids)))
    trees = {"a": DraftTree([1, 2, 3], [-1, 0, 0]), "b": DraftTree([5], [-1]), "c": DraftTree.chain(6, [7, 8])}
    outputs = runner.forward([TreeInput(s, t.token_ids, t.parents) for s, t in trees.items()])
    for (seq_id, tree), logits in zip(trees.items(), outputs):
        for path in tree.paths:
            expected = run_chain(model, prompts[seq_id] + [tree.token_ids[n] for n in path])[len(prompts[seq_id]):]
            torch.testing.assert_close(logits[path], expected, rtol=1e-9, atol=1e-9)


def test_cache_limits_give_clear_errors(tiny_model):
    model, _ = tiny_model
    runner = ModelRunner(model, 1, 8, block_size=4)
    runner.add("s")
    runner.add("t")
    with pytest.raises(CacheFullError, match="positions"):
        runner.forward([TreeInput("s", list(range(9)), chain_parents(9))])
    runner.forward([TreeInput("s", list(range(8)), chain_parents(8))])
    with pytest.raises(CacheFullError, match="blocks"):  # refused whole: nothing written, no scratch kept
        runner.forward([TreeInput("t", [1], [-1])])
    assert runner.scratch_size("t") == 0
    runner.remove("s")
    runner.forward([TreeInput("t", [1], [-1])])  # its blocks are free again
