"""Penalties at tree nodes: the rule against transformers' repetition penalty and a plain count, the
drafted path counted, and the bounds OpenAI sets."""
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from speculators.penalties import Penalties, PenaltyContext, penalize
from speculators.shaping import Shaping, path_tokens, unpack_bits
from speculators.tree import DraftTree

VOCAB = 16
PROMPT = [3, 4, 4]
OUTPUT = [5, 3, 5]


def reference(logits: torch.Tensor, sequence: list[int], prompt_length: int, penalties: Penalties) -> torch.Tensor:
    """One row, as transformers penalises repetition over the whole sequence, then OpenAI's
    presence and frequency over the output."""
    row = RepetitionPenaltyLogitsProcessor(penalties.repetition)(torch.tensor([sequence]), logits.clone()[None])[0]
    for token in range(VOCAB):
        count = sequence[prompt_length:].count(token)
        row[token] -= penalties.frequency * count + penalties.presence * (count > 0)
    return row


@pytest.mark.parametrize("penalties", [Penalties(presence=0.7), Penalties(frequency=-0.4), Penalties(repetition=1.8),
                                       Penalties(0.5, 1.5, 0.6)])
def test_each_tree_node_is_penalised_for_its_own_path(penalties):
    torch.manual_seed(0)
    tree = DraftTree([5, 6, 3, 6, 5], [-1, 0, 0, 1, 3])  # root (committed), then two branches
    logits = torch.randn(tree.size, VOCAB, dtype=torch.float64) * 3
    context = PenaltyContext(penalties, PROMPT + OUTPUT, len(PROMPT))
    got = penalize(logits, context, path_tokens(tree))
    for node, path in enumerate(path_tokens(tree)):
        expected = reference(logits[node], PROMPT + OUTPUT + path, len(PROMPT), penalties)
        assert torch.allclose(got[node], expected), node
    assert path_tokens(tree) == [[], [6], [3], [6, 6], [6, 6, 5]]


def test_neutral_penalties_change_nothing():
    logits = torch.randn(3, VOCAB)
    assert not Penalties().active
    assert torch.equal(penalize(logits, PenaltyContext(Penalties(), PROMPT + OUTPUT, 3), [[], [1], [1, 2]]), logits)


@pytest.mark.parametrize("values,field", [
    ({"presence": 2.5}, "presence_penalty"), ({"frequency": -3}, "frequency_penalty"),
    ({"repetition": 0}, "repetition_penalty"), ({"presence": float("nan")}, "presence_penalty"),
])
def test_out_of_range_penalties_name_their_field(values, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        Penalties(**values)


def test_a_grammar_mask_allows_exactly_its_bits():
    words = torch.tensor([[0b1011, 0], [0, 1 << 3], [-1, -1]], dtype=torch.int32)
    allowed = unpack_bits(words, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 1, 3]
    assert allowed[1].nonzero().flatten().tolist() == [35]
    assert allowed[2].all()
    tree = DraftTree([1, 2, 3], [-1, 0, 1])
    masked = Shaping(allowed=words).apply(tree, torch.zeros(3, 40))
    assert torch.equal(torch.isfinite(masked), allowed)


def test_a_mask_that_allows_nothing_fails_the_request():
    with pytest.raises(ValueError, match="allows no token"):
        Shaping(allowed=torch.zeros(1, 1, dtype=torch.int32)).apply(DraftTree.root_only(0), torch.zeros(1, 8))
