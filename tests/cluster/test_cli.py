import json

import pytest

from cluster.cli import main


@pytest.mark.default_model
@pytest.mark.parametrize("method", ["none", "pld", "draft"])
def test_generate_json(capsys, method):
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
def test_generate_chat_prints_text_and_a_stats_line(capsys):
    assert main(["generate", "Say hello.", "--chat", "--max-new-tokens", "8", "--method", "pld"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "target forwards" in captured.err and "mean accepted tokens" in captured.err
