"""Head checkpoints in each public layout, round trips of our own, and the head's arithmetic:
drafting (cached, one row a node) computes exactly what training-time test computes."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from speculators.heads.checkpoint import (
    PickledWeights,
    default_aux_layers,
    load_head,
    save_eagle3,
    save_head,
    save_medusa,
)
from speculators.hidden import TargetHidden
from speculators.proposers.base import DraftRequest
from speculators.proposers.eagle import EagleProposer
from speculators.proposers.parallel import ParallelProposer
from speculators.sampling import SamplingParams
from speculators.train.dataset import Example
from speculators.train.dflash import DFlashObjective, start_from_target
from speculators.train.eagle3 import Eagle3Objective
from speculators.train.packing import pack
from tests.speculators.heads_fixtures import (
    AUX,
    HIDDEN,
    LAYERS,
    VOCAB,
    dflash_public_layout,
    eagle1_layout,
    eagle3_original_layout,
    layer_config,
    medusa_public_layout,
    random_dflash,
    random_eagle1,
    random_eagle3,
    random_medusa,
)


def eagle_outputs(head, seed=0, rows=9):
    """Draft logits of a chain of committed rows: a fingerprint of every weight of the head."""
    generator = torch.Generator().manual_seed(seed)
    width = len(head.aux_layers) * HIDDEN if head.version == 3 else HIDDEN
    features = head.fuse(torch.randn(rows, width, generator=generator, dtype=torch.float64))
    tokens = torch.randint(VOCAB, (rows,), generator=generator)
    q, k, v, residual = head.project(features, tokens, torch.arange(rows))
    from speculators.heads.eagle import attend

    out = head.finish(attend(q, k, v, torch.ones(rows, rows, dtype=torch.bool).tril()), residual)
    return head.logits(out)


def share_random_target(head, seed=7):
    generator = torch.Generator().manual_seed(seed)
    embedding = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64)
    head.share_target(embedding, embedding if head.needs_target_lm_head else None)
    return embedding


def test_eagle3_round_trip_in_the_speculators_format(tmp_path):
    head = random_eagle3()
    embedding = share_random_target(head)
    save_eagle3(head, tmp_path, "tiny-target", ["LlamaForCausalLM"], speculative_tokens=4, dtype=torch.float64)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Eagle3Speculator"] and config["speculators_model_type"] == "eagle3"
    assert config["norm_before_residual"] is False  # always written
    assert config["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny-target"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    loaded = load_head(tmp_path)
    assert loaded.kind == "eagle3" and loaded.speculative_tokens == 4 and loaded.verifier == "tiny-target"
    loaded.module.double().share_target(embedding)
    assert torch.equal(loaded.module.d2t, head.d2t) and torch.equal(loaded.module.t2d, head.t2d)
    assert torch.allclose(eagle_outputs(loaded.module), eagle_outputs(head))


def test_a_speculators_config_without_norm_before_residual_reads_as_vllm_does(tmp_path):
    head = random_eagle3(norm_before_residual=True)
    share_random_target(head)
    save_eagle3(head, tmp_path, "t", ["LlamaForCausalLM"], dtype=torch.float64)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["norm_before_residual"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_head(tmp_path).module.norm_before_residual is True


def test_eagle3_in_the_eagle_repository_layout(tmp_path):
    head = random_eagle3(own_embedding=True)
    loaded = load_head(eagle3_original_layout(head, tmp_path), num_target_layers=LAYERS)
    assert loaded.kind == "eagle3"
    assert loaded.module.aux_layers == default_aux_layers(LAYERS) and loaded.module.norm_before_residual is False
    assert loaded.module.embed_tokens is not None
    assert torch.allclose(eagle_outputs(loaded.module.double()), eagle_outputs(head))
    with pytest.raises(ValueError, match="layer count"):
        load_head(tmp_path)


def test_eagle1_layout_uses_the_target_lm_head(tmp_path):
    head = random_eagle1()
    lm_head = torch.randn(VOCAB, HIDDEN, dtype=torch.float64)
    head.share_target(head.embed_tokens.weight, lm_head)
    folder = eagle1_layout(random_eagle1(), tmp_path / "public")  # written before the LM head is attached
    with pytest.raises(PickledWeights, match="pytorch_model.bin.*convert-head"):  # a pickle is never loaded to serve
        load_head(folder, num_target_layers=LAYERS)
    save_head(load_head(folder, num_target_layers=LAYERS, allow_pickle=True), tmp_path / "converted", dtype=torch.float64)
    assert sorted(p.name for p in (tmp_path / "converted").iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_head(tmp_path / "converted", num_target_layers=LAYERS)
    assert loaded.kind == "eagle" and loaded.module.aux_layers == (LAYERS,)
    assert loaded.module.fc.bias is not None
    with pytest.raises(ValueError, match="LM head"):
        loaded.module.share_target(torch.zeros(1))
    loaded.module.double().share_target(lm_head, lm_head)
    assert torch.allclose(eagle_outputs(loaded.module), eagle_outputs(head))


def test_medusa_public_layout_loads_and_converts_to_the_vllm_format(tmp_path):
    heads = random_medusa(draft_vocab=None, shared=False, num_heads=3)
    loaded = load_head(medusa_public_layout(heads, tmp_path / "public"))
    assert loaded.kind == "medusa" and loaded.module.num_heads == 3 and not loaded.module.shared_lm_head
    hidden = torch.randn(5, HIDDEN, dtype=torch.float64)
    assert torch.allclose(loaded.module.double()(hidden), heads(hidden))
    save_head(loaded, tmp_path / "converted", dtype=torch.float64)
    config = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["num_heads"] == 3 and config["medusa_fc_bias"] is True
    again = load_head(tmp_path / "converted")
    assert torch.allclose(again.module.double()(hidden), heads(hidden))


def test_medusa_round_trip_with_a_shared_truncated_lm_head(tmp_path):
    heads = random_medusa()
    save_medusa(heads, tmp_path, "tiny", [[0], [0, 0], [1]], dtype=torch.float64)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["original_lm_head"] is True and config["truncated_vocab_size"] == 48
    loaded = load_head(tmp_path)
    assert loaded.medusa_choices == [[0], [0, 0], [1]]
    assert torch.equal(loaded.module.token_map, heads.token_map)
    hidden = torch.randn(4, HIDDEN, dtype=torch.float64)
    assert torch.allclose(loaded.module.double()(hidden), heads(hidden))


def test_an_unknown_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"something.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="not an EAGLE"):
        load_head(tmp_path)


class NotATensor:
    def __reduce__(self):  # what a malicious pickle does on load; the weights-only reader never calls it
        return (print, ("unpickled!",))


@pytest.mark.parametrize("content,message", [
    ({"fc.weight": torch.zeros(2), "hook": NotATensor()}, r"not pure tensors \(weights-only read: Unsupported global"),
    ({"fc.weight": torch.zeros(2), "epoch": 3}, r"not pure tensors: 1 entries are not named tensors, e\.g\. \['epoch'\]"),
    ({"state_dict": {"fc.weight": torch.zeros(2)}}, r"not pure tensors: .*\['state_dict'\]"),
    ([torch.zeros(2)], "holds a list, not a mapping of names to tensors"),
])
def test_a_pickled_head_that_is_not_pure_tensors_is_refused_even_when_converting(tmp_path, capsys, content, message):
    (tmp_path / "config.json").write_text(json.dumps(layer_config().to_dict()))
    torch.save(content, tmp_path / "pytorch_model.bin")
    with pytest.raises(PickledWeights, match="weights are PyTorch pickles"):
        load_head(tmp_path, LAYERS)
    with pytest.raises(PickledWeights, match=message):
        load_head(tmp_path, LAYERS, allow_pickle=True)
    assert "unpickled!" not in capsys.readouterr().out


def test_a_folder_without_weights_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        load_head(tmp_path)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_drafting_computes_what_training_time_test_computes(norm_before_residual):
    """A greedy chain drafted through the proposer's cache (committed rows, then one scratch row per
    depth) gives its tokens the probabilities TTT gives them when the chain is the sequence."""
    head = random_eagle3(norm_before_residual=norm_before_residual, own_embedding=True)
    committed, depth = 12, 4
    tokens = torch.randint(VOCAB, (committed,)).tolist()
    hidden = torch.randn(committed - 1, 3 * HIDDEN, dtype=torch.float64)
    request = DraftRequest("r", tokens, depth, 16, hidden=TargetHidden(0, hidden))
    tree = EagleProposer(head, width=1).propose([request])[0]
    drafted = tree.token_ids[1:]
    assert len(drafted) == depth
    rows = torch.cat([hidden, torch.randn(depth, 3 * HIDDEN, dtype=torch.float64)])
    example = Example(0, torch.tensor(tokens + drafted), rows, 0, False)
    objective = Eagle3Objective(head, depth)
    last = committed - 2  # the root's row
    with torch.no_grad():
        for step, (rows_run, out) in enumerate(objective.forward(pack([example], torch.float64))):
            row = (rows_run == last).nonzero()[0, 0]
            probs = head.logits(out[row]).softmax(-1)
            assert float(probs[objective.to_draft[drafted[step]]]) == pytest.approx(tree.confidence[step + 1], rel=1e-6)


def dflash_outputs(drafter, seed=0, rows=9):
    """Block logits after `rows` committed rows: a fingerprint of every weight of the drafter."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(VOCAB, (rows + 1,), generator=generator).tolist()
    hidden = torch.randn(rows, len(AUX) * HIDDEN, generator=generator, dtype=torch.float64)
    request = DraftRequest("r", tokens, drafter.block_size - 1, 16, hidden=TargetHidden(0, hidden))
    proposer = ParallelProposer(drafter)
    proposer._catch_up([request])
    return proposer._draft([request])[0]


def test_dflash_in_the_public_layout_loads_and_round_trips(tmp_path):
    drafter = random_dflash()
    share_random_target(drafter)
    loaded = load_head(dflash_public_layout(drafter, tmp_path / "public"))
    assert loaded.kind == "dflash" and loaded.speculative_tokens == drafter.block_size - 1
    module = loaded.module.double()
    assert module.hidden_layers == AUX and module.mask_token_id == drafter.mask_token_id
    share_random_target(module)
    assert torch.equal(dflash_outputs(module), dflash_outputs(drafter))
    module.tree_choices = [[0], [1], [0, 0], [0, 0, 0]]
    save_head(loaded, tmp_path / "ours", dtype=torch.float64)
    again = load_head(tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["num_target_layers"] == LAYERS
    assert config["dflash_config"] == {"mask_token_id": drafter.mask_token_id, "target_layer_ids": [0, 1, 2]}
    assert again.module.tree_choices == [[0], [1], [0, 0], [0, 0, 0]]
    share_random_target(again.module.double())
    assert torch.equal(dflash_outputs(again.module), dflash_outputs(drafter))


def test_a_dflash_drafter_with_a_draft_vocabulary_drafts_only_its_tokens(tmp_path):
    """This project's extension of the layout: an LM head of its own over a few target tokens."""
    drafter = random_dflash(draft_vocab=12)
    share_random_target(drafter)
    save_head(load_head(dflash_public_layout(drafter, tmp_path / "public")), tmp_path / "ours", dtype=torch.float64)
    loaded = load_head(tmp_path / "ours").module.double()
    assert loaded.draft_vocab_size == 12 and torch.equal(loaded.draft_to_target, drafter.draft_to_target)
    share_random_target(loaded)
    assert torch.equal(dflash_outputs(loaded), dflash_outputs(drafter))
    tokens = torch.randint(VOCAB, (10,)).tolist()
    request = DraftRequest("r", tokens, 3, 16, sampling=SamplingParams(0.9, seed=1, rule="rejection"),
                           hidden=TargetHidden(0, torch.randn(9, len(AUX) * HIDDEN, dtype=torch.float64)))
    tree = ParallelProposer(loaded).propose([request])[0]
    allowed = set(drafter.draft_to_target.tolist())
    assert tree.num_drafted == 3 and set(tree.token_ids[1:]) <= allowed
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[drafter.draft_to_target] = False
    assert tree.draft_probs[1:, outside].sum() == 0


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["DFlash2DraftModel"], "tensors": {"candidate_selector.hidden_projection.weight": torch.zeros(2, 2)}},
     "DFlash-2"),
    ({"use_sliding_window": True, "sliding_window": 16}, "sliding-window or causal"),
    ({"is_causal": True}, "sliding-window or causal"),
    ({"dflash_config": {"mask_token_id": 3}}, "target_layer_ids and mask_token_id"),
])
def test_dflash_variants_this_project_does_not_run_are_refused_by_name(tmp_path, change, message):
    drafter = random_dflash()
    folder = dflash_public_layout(drafter, tmp_path)
    config = {**json.loads((folder / "config.json").read_text()), **change}
    tensors = {**drafter.own_state(), **config.pop("tensors", {})}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        load_head(folder)


def test_block_drafting_computes_what_training_computes():
    """The proposer's block (context cached in two pieces, then one block) gives every depth the
    logits training gives the block anchored at the same root."""
    drafter = random_dflash()
    share_random_target(drafter)
    committed = 12
    tokens = torch.randint(VOCAB, (committed + drafter.block_size,)).tolist()
    hidden = torch.randn(len(tokens) - 1, len(AUX) * HIDDEN, dtype=torch.float64)
    proposer = ParallelProposer(drafter)
    proposer.propose([DraftRequest("r", tokens[:6], 0, 16, hidden=TargetHidden(0, hidden[:5]))])
    request = DraftRequest("r", tokens[:committed], drafter.block_size - 1, 16, hidden=TargetHidden(5, hidden[5:committed - 1]))
    proposer._catch_up([request])
    drafted = proposer._draft([request])
    objective = DFlashObjective(drafter)
    with torch.no_grad():
        out = objective.blocks(pack([Example(0, torch.tensor(tokens), hidden, 0, False)], torch.float64),
                               torch.tensor([committed - 1]))
    trained = drafter.logits(out[0, 1:]).float()
    assert torch.allclose(drafted[0], trained, atol=1e-6)


def test_training_blocks_of_many_sequences_each_see_only_their_own_prefix():
    """Blocks at several anchors of three packed sequences (attention per sequence and per block)
    give each the logits drafting gives that sequence's prefix alone."""
    drafter = random_dflash()
    share_random_target(drafter)
    generator = torch.Generator().manual_seed(3)
    examples = [Example(i, torch.randint(VOCAB, (n,), generator=generator),
                        torch.randn(n - 1, len(AUX) * HIDDEN, generator=generator, dtype=torch.float64), 2, False)
                for i, n in enumerate((9, 14, 11))]
    batch = pack(examples, torch.float64)
    anchors = torch.tensor([1, 5, 8 + 3, 8 + 12, 8 + 13 + 6])  # rows: sequence 0 at 1, 5; 1 at 3, 12; 2 at 6
    with torch.no_grad():
        trained = drafter.logits(DFlashObjective(drafter).blocks(batch, anchors)[:, 1:])
    for index, row in enumerate(anchors.tolist()):
        example, position = examples[batch.sequence[row]], int(batch.local[row])
        request = DraftRequest("r", example.tokens[:position + 1].tolist(), drafter.block_size - 1, 16,
                               hidden=TargetHidden(0, example.hidden[:position]))
        proposer = ParallelProposer(drafter)
        proposer._catch_up([request])
        assert torch.allclose(proposer._draft([request])[0], trained[index].float(), atol=1e-6)


def test_a_drafter_started_from_the_target_computes_its_last_layers_on_the_last_hidden_state(tiny_model):
    """`specserve train dflash` starts the drafter's layers as the target's last ones: the context
    rows' keys are then the first of those layers' own keys of the last recorded hidden state,
    normed per head at the target's typical scale."""
    reference = tiny_model[1]  # the session's float64 reference: read, never converted in place
    weights = reference.state_dict()
    drafter = random_dflash()
    features = torch.randn(12, len(AUX) * HIDDEN, dtype=torch.float64)
    start_from_target(drafter, lambda names: {name: weights[name] for name in names if name in weights}, LAYERS, features)
    target = reference.model.layers[LAYERS - len(drafter.layers)]
    assert torch.equal(drafter.layers[0].mlp.down_proj.weight, target.mlp.down_proj.weight)
    assert torch.equal(drafter.norm.weight, reference.model.norm.weight)
    attn = drafter.layers[0].self_attn
    keys = target.self_attn.k_proj(target.input_layernorm(features[:, -HIDDEN:])).view(12, attn.num_kv_heads, attn.head_dim)
    rms = keys.pow(2).mean(-1, keepdim=True).sqrt()
    assert attn.k_norm.weight.allclose(rms.mean().expand(attn.head_dim), rtol=1e-5)
    context_keys, _ = drafter.context(features, torch.zeros(12, dtype=torch.long))[0]  # position 0: no rotation
    torch.testing.assert_close(context_keys[0].transpose(0, 1), keys / rms * rms.mean(), rtol=1e-4, atol=1e-4)
