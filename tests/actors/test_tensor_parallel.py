"""Tensor-parallel targets on Ray (fake GPUs, CPU compute): TP=2 decodes exactly as TP=1.

Shards run as Ray actors joined in a gloo group (Ray gives each actor OMP_NUM_THREADS=1). Each
model's TP=1 and TP=2 groups take 3 of the 4 fake GPUs, so the groups are a module fixture
parametrized by model: pytest finishes one model's tests and frees its groups before the next.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch
from transformers import LlamaForCausalLM

from actors.messages import AdmitItem, RequestFailed, VerifyItem
from actors.model.loader import load_model
from actors.model.projection import project
from actors.model.sharding import ShardPlan
from actors.target_group import TargetGroup
from actors.target_worker import CacheOptions
from speculators.sampling import SamplingParams
from speculators.tree import DraftTree
from tests.cluster.ray_fixtures import ray_four_gpus  # noqa: F401  (module-scoped fixture)
from tests.conftest import tiny_hf_config

pytestmark = pytest.mark.usefixtures("ray_four_gpus")
CALL_TIMEOUT_S = 60


@dataclass
class Case:
    path: str
    dtype: str
    prompt: list[int]
    vocab_size: int
    new_tokens: int


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A random GQA Llama (4 heads over 2 KV heads) whose vocabulary and MLP split unevenly on 2 ranks.

    float64, so TP=1 and TP=2 (which sum in different orders) cannot disagree on an argmax.
    """
    torch.manual_seed(0)
    config = tiny_hf_config(
        vocab_size=101, hidden_size=64, intermediate_size=129, num_hidden_layers=3, initializer_range=0.2
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).to(torch.float64).save_pretrained(path)
    return path


def tiny_case(request) -> Case:
    return Case(str(request.getfixturevalue("tiny_model_dir")), "float64", [3, 17, 42, 5, 99, 64, 8], 101, 16)


def default_case(request) -> Case:
    """SmolLM2-135M: 3 KV heads, split 2 + 1 over 2 ranks; tied embeddings split by vocabulary."""
    from actors.model.loader import load_tokenizer

    path = request.getfixturevalue("default_model_path")
    prompt = load_tokenizer(path).encode("The capital of France is")
    return Case(str(path), "float32", prompt, 49152, 12)


@pytest.fixture(
    scope="module",
    params=[pytest.param(tiny_case, id="tiny"), pytest.param(default_case, id="smollm2", marks=pytest.mark.default_model)],
)
def model(request):
    """A model case and its TP=1 and TP=2 groups, shut down when its tests are done. The groups start
    at once: most of a start is waiting for worker processes."""
    case = request.param(request)
    groups = {}
    try:
        with ThreadPoolExecutor(2) as pool:
            starting = {size: pool.submit(TargetGroup, case.path, size, max_sequences=2, max_len=128, dtype=case.dtype,
                                          cache=CacheOptions(block_size=4, prefix_caching=True)) for size in (1, 2)}
        groups.update({size: future.result() for size, future in starting.items() if future.exception() is None})
        for future in starting.values():
            future.result()  # a failed start raises, once the groups that started are kept for shutting down
        yield case, groups
    finally:
        for group in groups.values():
            group.shutdown()


def call(group: TargetGroup, method: str, *args):
    return group.submit(method, *args).result(CALL_TIMEOUT_S)


def greedy_decode(group: TargetGroup, seq_id: str, prompt: list[int], steps: int, trees: dict | None = None):
    """Greedy tokens from `steps` verify calls: plain decoding (a root-only tree) except at the steps
    named in `trees`, which map the last token to a multi-branch tree to verify instead."""
    call(group, "start", [AdmitItem(request_id=seq_id, tokens=prompt, sampling=SamplingParams())])
    tokens = []
    for step in range(steps):
        last = tokens[-1] if tokens else prompt[-1]
        tree = (trees or {}).get(step, DraftTree.root_only)(last)
        tokens += call(group, "verify", [VerifyItem(seq_id, tree)]).results[0].new_tokens
    call(group, "finish", seq_id)
    return tokens


def test_every_rank_makes_the_same_block_decisions(model):
    """Prefix reuse, a chunked prefill beside trees, rejected nodes given back, a finished request:
    both ranks of the TP=2 group hold the same block tables, with nothing sent between them."""
    import ray

    case, groups = model
    group, prompt = groups[2], case.prompt * 3
    call(group, "start", [AdmitItem(request_id="p", tokens=prompt, sampling=SamplingParams(), cache_scope="t")])
    shared = (len(prompt) - 1) // 4 * 4  # p's full blocks of 4
    longer = AdmitItem(request_id="q", tokens=prompt + [5, 6], sampling=SamplingParams(), cache_scope="t")
    assert call(group, "start", [longer]).cached_tokens == {"q": shared}
    call(group, "start", [AdmitItem(request_id="r", tokens=prompt[::-1], sampling=SamplingParams(), cache_scope="t")], False)
    wide = DraftTree.from_paths(prompt[-1], [[1, 2, 3], [4, 5]])
    call(group, "verify", [VerifyItem("p", wide), VerifyItem("q", DraftTree.root_only(6))], [("r", 8)])
    call(group, "verify", [VerifyItem("q", wide)], [("r", len(prompt) - 9)])
    call(group, "finish", "p")
    tables = ray.get([shard.block_tables.remote() for shard in group._shards])
    assert tables[0] == tables[1] and set(tables[0]) == {"q", "r"}
    for seq_id in "qr":
        call(group, "finish", seq_id)


def tree_at(step: int, reference: list[int], vocab_size: int) -> dict:
    """At `step`, a tree whose middle branch is the reference's next 3 tokens and whose other
    branches go wrong at once or after one token: 3 accepted tokens plus a bonus if all is well."""
    good = reference[step:step + 3]
    wrong = [(token + 1) % vocab_size for token in good]
    return {step: lambda root: DraftTree.from_paths(root, [[wrong[0], good[1]], good, [good[0], wrong[1]]])}


def test_tp2_greedy_tokens_equal_tp1(model):
    case, groups = model
    reference = greedy_decode(groups[1], "ref", case.prompt, case.new_tokens)
    assert len(set(reference)) > 3  # a model that repeats one token would prove little
    assert greedy_decode(groups[2], "plain", case.prompt, case.new_tokens) == reference
    # 6 plain steps, then one tree step that yields 4 tokens, then plain steps to the same length
    trees = tree_at(6, reference, case.vocab_size)
    assert greedy_decode(groups[2], "tree", case.prompt, case.new_tokens - 3, trees) == reference


def test_tp2_ranks_each_hold_about_half_the_weights(model):
    _, groups = model
    (full,), ranks = groups[1].parameter_bytes(), groups[2].parameter_bytes()
    assert all(part < 0.7 * full for part in ranks), (ranks, full)
    assert sum(ranks) == pytest.approx(full, rel=0.05)


def test_a_verifier_error_reaches_every_rank_and_the_group_goes_on(model):
    """Only rank 0 runs the verifier: its error must be broadcast, or rank 1 would wait forever. It
    comes back as that request's RequestFailed (the request fails alone; the ranks' caches agree)."""
    case, groups = model
    sampled = SamplingParams(temperature=1.0, seed=0, rule="rejection")
    call(groups[2], "start", [AdmitItem(request_id="bad", tokens=case.prompt, sampling=sampled)])
    malformed = DraftTree.chain(case.prompt[-1], [50], draft_probs=torch.full((2, 5), 0.2))  # 5-token q
    (failed,) = call(groups[2], "verify", [VerifyItem("bad", malformed)]).results
    assert isinstance(failed, RequestFailed) and "IndexError" in failed.reason
    call(groups[2], "finish", "bad")
    assert greedy_decode(groups[2], "after", case.prompt, 2) == greedy_decode(groups[1], "after", case.prompt, 2)


def test_tp_size_above_kv_heads_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="tensor parallel size 3 exceeds the model's 2 KV heads"):
        TargetGroup(str(tiny_model_dir), 3)


def test_group_answers_pings_until_shut_down(tiny_model_dir):
    group = TargetGroup(str(tiny_model_dir), 1, max_len=32, dtype="float64")
    assert group.alive()
    group.shutdown()
    assert not group.alive()
    with pytest.raises(RuntimeError, match="shut down"):
        group.submit("ping")


def test_a_shard_starts_in_two_steps_and_a_world_of_one_needs_no_rendezvous(tiny_model_dir):
    """Constructing a shard loads nothing (the group first asks rank 0 for its port); join loads."""
    import socket

    from actors.target_group import TargetShard

    shard = TargetShard(str(tiny_model_dir), 0, 1, max_sequences=1, max_len=32, dtype="float64")
    assert shard.worker is None and shard.device == torch.device("cpu")
    port = shard.rendezvous_port()
    with socket.socket() as listener:
        listener.bind(("", port))  # free on every address of this node
    shard.join("127.0.0.1", 0)
    shard.start([AdmitItem(request_id="r", tokens=[1, 2, 3], sampling=SamplingParams())])
    assert len(shard.verify([VerifyItem("r", DraftTree.root_only(3))]).results[0].new_tokens) == 1


def test_a_rank_loads_contiguous_weights_and_strided_ones_still_project_right(tiny_model_dir):
    """Column slices come out of safetensors strided, and oneDNN's linear crawls on those (a
    TP=2 shard of the default target took minutes per pass): the loader stores them contiguous,
    and `project` gives a strided weight to a path that handles it."""
    model = load_model(tiny_model_dir, dtype=torch.float64, plan=ShardPlan(rank=1, world_size=2))  # as stored: no copy
    assert all(p.is_contiguous() for p in model.parameters())
    weight = torch.randn(16, 24, dtype=torch.float64)[:, :12]
    rows = torch.randn(8, 12, dtype=torch.float64)
    assert torch.allclose(project(rows, weight), rows @ weight.T)
