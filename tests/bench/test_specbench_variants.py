"""Spec-Bench method variants: one method with settings of its own, side by side with others."""
from __future__ import annotations

import argparse

import pytest

from bench.specbench import METHODS, comma_list, method_variant, variant_config
from specserve.cli import build_parser


def test_a_variant_names_a_method_and_its_settings():
    assert method_variant("eagle3") == ("eagle3", {})
    assert method_variant("eagle3+draft_width=4+lookahead.policy=fixed") == (
        "eagle3", {"draft_width": "4", "lookahead.policy": "fixed"})
    with pytest.raises(argparse.ArgumentTypeError, match="field=value"):
        method_variant("eagle3+draft_width")
    parse = comma_list(METHODS, variants=True)
    assert parse("pld,eagle3+draft_width=4") == ["pld", "eagle3+draft_width=4"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown"):
        parse("eagle9+draft_width=4")


def test_a_variant_overrides_the_command_options():
    args = build_parser().parse_args(["bench", "specbench", "--lookahead", "heuristic", "--draft-width", "2"])
    plain = variant_config(args, "eagle3")
    assert (plain.method, plain.draft_width, plain.lookahead.policy) == ("eagle3", 2, "heuristic")
    tree = variant_config(args, "eagle3+draft_width=4+lookahead.policy=confidence+lookahead.confidence_threshold=0.2")
    assert (tree.draft_width, tree.lookahead.policy, tree.lookahead.confidence_threshold) == (4, "confidence", 0.2)
    assert tree.lookahead.num_speculative_tokens == plain.lookahead.num_speculative_tokens
