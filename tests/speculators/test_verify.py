"""The verifier: exact greedy cases and the statistical proof that sampling is lossless."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from speculators.sampling import SamplingParams, warp
from speculators.tree import DraftTree
from speculators.verify import verify, verify_greedy

V = 6


def peaked(*best: int) -> torch.Tensor:
    """Logits rows of +-100: the argmax of row i is best[i] (vLLM's trick for exact greedy cases)."""
    logits = torch.full((len(best), V), -100.0)
    logits[torch.arange(len(best)), torch.tensor(best)] = 100.0
    return logits


def test_greedy_accepts_the_longest_matching_path():
    tree = DraftTree([0, 1, 2, 3, 4], [-1, 0, 0, 2, 3])  # 0 -> {1, 2 -> 3 -> 4}
    result = verify_greedy(tree, [2, 5, 3, 4, 5])
    assert result.accepted_nodes == [0, 2, 3, 4]
    assert result.accepted_tokens == [2, 3, 4]
    assert result.next_token == 5  # bonus from the leaf


def test_greedy_rejection_returns_the_target_token():
    tree = DraftTree.chain(0, [1, 2])
    result = verify_greedy(tree, [1, 3, 0])
    assert result.accepted_tokens == [1] and result.next_token == 3
    assert verify_greedy(tree, [4, 0, 0]).new_tokens == [4]


def test_root_only_tree_is_plain_decoding():
    result = verify(DraftTree.root_only(3), peaked(2), SamplingParams())
    assert result.accepted_nodes == [0] and result.new_tokens == [2]


def test_logits_rows_must_cover_the_tree():
    with pytest.raises(ValueError, match="all 3 nodes"):
        verify(DraftTree.chain(0, [1, 2]), peaked(1, 2), SamplingParams())


def test_warp_applies_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(warp(logits, SamplingParams(1.0, top_k=2)), torch.tensor([0.625, 0.375, 0, 0]))
    assert torch.allclose(warp(logits, SamplingParams(1.0, top_p=0.7)), torch.tensor([0.625, 0.375, 0, 0]))
    assert torch.allclose(warp(logits, SamplingParams(1.0, top_p=0.85)).sum(), torch.tensor(1.0))
    assert warp(logits, SamplingParams(1.0, top_p=0.85))[3] == 0


# ---------- sampling is lossless: chi-square tests -----------------------------------------------

TARGET = torch.tensor([
    [0.30, 0.25, 0.20, 0.12, 0.08, 0.05],
    [0.05, 0.40, 0.05, 0.30, 0.10, 0.10],
    [0.20, 0.10, 0.30, 0.10, 0.20, 0.10],
    [0.10, 0.10, 0.10, 0.10, 0.30, 0.30],
    [0.25, 0.05, 0.25, 0.05, 0.30, 0.10],
    [0.02, 0.08, 0.20, 0.30, 0.20, 0.20],
    [0.50, 0.10, 0.10, 0.10, 0.10, 0.10],
])
DRAFT = torch.tensor([0.10, 0.35, 0.30, 0.05, 0.15, 0.05])  # deliberately unlike the target
SAMPLES = 12_000


def node_distribution(tree: DraftTree) -> torch.Tensor:
    """The target's next-token distribution at each node, from a fixed table by node index."""
    return TARGET[: tree.size]


def first_token_counts(make_tree, verifier=verify, seed=0) -> np.ndarray:
    """Histogram of the first new token over many verifications of freshly drawn trees."""
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0)
    counts = np.zeros(V)
    for _ in range(SAMPLES):
        tree = make_tree(generator)
        result = verifier(tree, node_distribution(tree).log(), params, generator)
        counts[result.new_tokens[0]] += 1
    return counts


def sampled_chain(generator) -> DraftTree:
    first = int(torch.multinomial(DRAFT, 1, generator=generator))
    second = int(torch.multinomial(DRAFT, 1, generator=generator))
    probs = torch.stack([torch.zeros(V), DRAFT, DRAFT])
    return DraftTree.chain(0, [first, second], probs)


def sampled_tree(generator) -> DraftTree:
    """Three root children drawn without replacement from q, one grandchild under the first."""
    kids = torch.multinomial(DRAFT, 3, replacement=False, generator=generator).tolist()
    grandchild = int(torch.multinomial(DRAFT, 1, generator=generator))
    probs = torch.stack([torch.zeros(V), DRAFT, DRAFT, DRAFT, DRAFT])
    return DraftTree([0, *kids, grandchild], [-1, 0, 0, 0, 1], probs)


def deterministic_tree(generator) -> DraftTree:
    return DraftTree.from_paths(0, [[1, 3], [2], [4, 4]])


def p_value(counts: np.ndarray, row: int = 0) -> float:
    """Chi-square p-value of observed counts against the target's distribution at node `row`."""
    expected = TARGET[row].double().numpy()
    return chisquare(counts, expected / expected.sum() * counts.sum()).pvalue


def assert_follows_target(counts: np.ndarray) -> None:
    assert p_value(counts) > 1e-3, counts


@pytest.mark.parametrize("make_tree", [sampled_chain, sampled_tree, deterministic_tree],
                         ids=["chain", "tree-without-replacement", "deterministic-tree"])
def test_sampled_first_token_follows_the_target(make_tree):
    assert_follows_target(first_token_counts(make_tree))


def test_the_test_detects_a_two_percent_shift():
    """Power check: a verifier whose output moves 2% of the mass from token 0 to token 5 fails."""
    def shifted(tree, logits, params, generator):
        result = verify(tree, logits, params, generator)
        if result.new_tokens[0] == 0 and torch.rand((), generator=generator) < 0.02 / 0.30:
            result.accepted_tokens, result.next_token = [], 5
        return result

    assert p_value(first_token_counts(sampled_tree, verifier=shifted)) < 1e-3


def test_a_naive_tree_rule_is_caught():
    """Treating without-replacement siblings as if each were drawn from the full q is biased."""
    counts = first_token_counts(sampled_tree, verifier=_verify_with_replacement_rule)
    assert p_value(counts) < 1e-3


def _verify_with_replacement_rule(tree, logits, params, generator):
    """SpecInfer's with-replacement rule (q never changes) applied to without-replacement draws."""
    p = logits.softmax(-1)[0].double()
    q = tree.draft_probs[1].double()
    for kid in tree.children[0]:
        token = tree.token_ids[kid]
        if torch.rand((), generator=generator, dtype=torch.float64) < min(1.0, float(p[token] / q[token])):
            return _Result([token])
        p = (p - q).clamp_min(0)
        p = p / p.sum()
    return _Result([int(torch.multinomial(p.float(), 1, generator=generator))])


class _Result:
    def __init__(self, tokens):
        self.new_tokens = tokens


def test_second_token_follows_the_target_given_the_first():
    """Joint check on a chain: P(second | first accepted = 1) equals the target's row for node 1."""
    generator = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=1.0)
    counts = np.zeros(V)
    while counts.sum() < 6000:
        probs = torch.stack([torch.zeros(V), DRAFT, DRAFT])
        tree = DraftTree.chain(0, [1, int(torch.multinomial(DRAFT, 1, generator=generator))], probs)
        result = verify(tree, TARGET[:3].log(), params, generator)
        if result.new_tokens[0] == 1 and len(result.new_tokens) > 1:
            counts[result.new_tokens[1]] += 1
    assert p_value(counts, row=1) > 1e-3


def test_same_seed_same_result():
    def run(seed):
        generator = torch.Generator().manual_seed(seed)
        return [verify(sampled_tree(generator), TARGET[:5].log(), SamplingParams(1.0), generator).new_tokens
                for _ in range(50)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_any_64_bit_seed_makes_a_generator():
    for seed in (0, 2**62 - 1, 2**64 - 1):
        SamplingParams(1.0, seed=seed).generator(salt=1)
