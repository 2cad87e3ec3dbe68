import json

import pytest

from specserve.cli import main


@pytest.mark.default_model
@pytest.mark.parametrize("method", ["none", "pld", "draft"])
def test_generate_json(capsys, method, default_model_cost_curve):
    code = main(["generate", "List three colors: red, green, and blue. List them again: red,", "--method", method,
                 "--max-new-tokens", "12", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert {"text", "token_ids", "new_tokens", "seconds", "target_forwards", "mean_accepted_tokens"} <= set(result)
    assert result["new_tokens"] == len(result["token_ids"]) <= 12
    assert result["target_forwards"] >= 1 and result["mean_accepted_tokens"] >= 1.0
    if method == "none":
        assert result["mean_accepted_tokens"] == 1.0


@pytest.mark.default_model
def test_generate_chat_prints_text_and_a_stats_line(capsys, default_model_cost_curve):
    assert main(["generate", "Say hello.", "--chat", "--max-new-tokens", "8", "--method", "pld"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "target forwards" in captured.err and "mean accepted tokens" in captured.err


def test_engine_options_take_their_defaults_from_the_engine_config_and_accept_vllm_names():
    from cluster.engine.build import engine_config_from_args
    from cluster.engine.config import EngineConfig
    from specserve.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["generate", "x"])
    default = engine_config_from_args(args, args.method)
    assert default.model_dump(exclude={"max_sequences"}) == EngineConfig().model_dump(exclude={"max_sequences"})
    named = engine_config_from_args(parser.parse_args(
        ["generate", "x", "--num-speculative-tokens", "6", "--prompt-lookup-num-tokens", "4", "--confidence-threshold", "0.1"]))
    assert (named.lookahead.num_speculative_tokens, named.prompt_lookup_num_tokens, named.lookahead.confidence_threshold) \
        == (6, 4, 0.1)


def test_draft_width_defaults_to_the_methods_best_and_an_option_overrides_it():
    from cluster.engine.build import engine_config_from_args
    from specserve.cli import build_parser

    parser = build_parser()
    widths = {method: engine_config_from_args(parser.parse_args(["generate", "x"]), method).drafting_width()
              for method in ("eagle3", "draft", "medusa")}
    assert widths == {"eagle3": 4, "draft": 1, "medusa": 1}
    chain = engine_config_from_args(parser.parse_args(["generate", "x", "--draft-width", "1"]), "eagle3")
    assert (chain.draft_width, chain.drafting_width()) == (1, 1)


def test_suffix_decoding_goes_in_front_of_a_head_from_the_command_line():
    from cluster.engine.build import engine_config_from_args
    from specserve.cli import build_parser

    parser = build_parser()
    assert engine_config_from_args(parser.parse_args(["generate", "x"]), "eagle3").suffix_min_score is None
    hybrid = engine_config_from_args(parser.parse_args(["generate", "x", "--suffix-min-score", "1.5"]), "eagle3")
    assert hybrid.suffix_min_score == 1.5


def test_engine_config_keeps_the_old_field_names_as_aliases():
    from cluster.engine.config import EngineConfig

    old = EngineConfig.model_validate({"pld_num_pred_tokens": 4, "pld_max_ngram_size": 3, "pld_max_branches": 2,
                                       "lookahead": {"max_tokens": 9, "threshold": 0.3}})
    assert (old.prompt_lookup_num_tokens, old.prompt_lookup_max_ngram_size, old.prompt_lookup_max_branches) == (4, 3, 2)
    assert (old.lookahead.num_speculative_tokens, old.lookahead.confidence_threshold) == (9, 0.3)


@pytest.mark.default_model
def test_fuzz_command_runs_the_property(capsys):
    assert main(["fuzz", "--examples", "20", "--seed", "3"]) == 0
    assert "20 HTTP bodies and 20 gRPC messages" in capsys.readouterr().out


@pytest.mark.parametrize("arguments,message", [
    (["--model", "/tmp/specserve-no-such-model"], "/tmp/specserve-no-such-model"),
    (["--temperature", "-1"], "temperature must be 0 (greedy) or at least"),
    pytest.param(["--method", "draft", "--draft", "layer-skip:99"], "layer-skip draft needs 1..29 layers, got 99",
                 marks=pytest.mark.default_model),
])
def test_a_user_error_is_one_line_without_a_traceback(capsys, arguments, message):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hi", "--max-new-tokens", "2", *arguments])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("specserve: error: ") and message in err and err.count("\n") == 1 and "Traceback" not in err


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "(default: 0.0)" in capsys.readouterr().out


@pytest.mark.parametrize("arguments,named,command", [
    (["generate", "hi", "--max-new-tokens", "many"], "argument --max-new-tokens: invalid int value: 'many'", "generate"),
    (["generate", "hi", "--no-such-option", "3"], "unrecognized arguments: --no-such-option 3", "generate"),
    (["generate"], "the following arguments are required: prompt", "generate"),
    (["bench", "specbench", "--limit", "x"], "argument --limit: invalid int value: 'x'", "bench specbench"),
    (["no-such-command"], "argument command: invalid choice: 'no-such-command'", None),
])
def test_a_bad_option_is_one_line_naming_it_not_the_usage(capsys, arguments, named, command):
    with pytest.raises(SystemExit) as exit_:
        main(arguments)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    hint = f"(see specserve {command} --help)" if command else "(see specserve --help)"
    assert err.startswith(f"specserve: error: {named}")
    assert err.endswith(f" {hint}\n") and err.count("\n") == 1 and "usage" not in err


def _parsers(parser):
    import argparse

    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _parsers(sub)


def test_help_shows_every_options_default_once(capsys):
    import argparse

    from specserve.cli import build_parser

    for parser in _parsers(build_parser()):
        shown = [a for a in parser._actions if a.option_strings and a.default is not argparse.SUPPRESS
                 and a.help is not argparse.SUPPRESS]
        text = " ".join(parser.format_help().split())
        assert text.count("(default") == len(shown), parser.prog
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option, default in [("--max-new-tokens MAX_NEW_TOKENS", "128"), ("--top-p TOP_P", "1.0"), ("--seed SEED", "None"),
                            ("--temperature TEMPERATURE", "0.0")]:
        assert f"{option} " in text and f"(default: {default})" in text.split(f"{option} ", 1)[1].split(" --", 1)[0]
    with pytest.raises(SystemExit):
        main(["bench", "specbench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "questions per task (default: all)" in text and "(default: all) (default" not in text


def test_convert_head_refuses_a_pickle_that_is_not_pure_tensors_in_one_line(tmp_path, capsys):
    import torch

    from tests.speculators.heads_fixtures import layer_config

    (tmp_path / "config.json").write_text(json.dumps(layer_config().to_dict()))
    torch.save({"fc.weight": torch.zeros(2), "optimizer": {"lr": 0.1}}, tmp_path / "pytorch_model.bin")
    with pytest.raises(SystemExit) as exit_:
        main(["convert-head", str(tmp_path), str(tmp_path / "out"), "--target-layers", "4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("specserve: error: ") and "not pure tensors" in err and "['optimizer']" in err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()
