"""The Spec-Bench harness: question selection, summaries, peers, and one short end-to-end run."""
from __future__ import annotations

import argparse
import json
import sys
import types

import pytest
import torch

from bench import peers, specbench
from cluster.engine.config import EngineConfig
from specserve import cli

SUMMARY_KEYS = {"tokens_per_s", "speedup", "mean_accepted_tokens", "match_rate", "questions"}


def write_questions(path, questions):
    path.write_text("".join(json.dumps(q) + "\n" for q in questions))
    return path


def test_questions_are_grouped_into_spec_bench_tasks_and_taken_in_turn(tmp_path):
    path = write_questions(tmp_path / "q.jsonl", [
        {"question_id": 1, "category": "writing", "turns": ["a", "b"]},
        {"question_id": 2, "category": "coding", "turns": ["c", "d"]},
        {"question_id": 3, "category": "coding", "turns": ["e", "f"]},
        {"question_id": 4, "category": "qa", "turns": ["g"]},
        {"question_id": 5, "category": "qa", "turns": ["h"]},
    ])
    questions = specbench.load_questions(path, limit=2)
    assert [(q["question_id"], q["task"]) for q in questions] == [(1, "mt_bench"), (4, "qa"), (2, "mt_bench"), (5, "qa")]
    assert [q["question_id"] for q in specbench.load_questions(path, tasks=["coding"])] == [2, 3]
    assert [q["question_id"] for q in specbench.load_questions(path, tasks=["qa"], limit=1)] == [4]


def record(method, question, tokens_per_s, task="qa", forwards=None, new=10, matches=True):
    return {"question_id": question, "task": task, "method": method, "new_tokens": new, "tokens_per_s": tokens_per_s,
            "target_forwards": forwards, "matches_plain": matches, "matches_own_plain": matches}


def test_speedup_is_the_ratio_of_mean_throughputs_over_questions_both_completed():
    records = [
        record("none", 1, 10.0, forwards=10), record("none", 2, 20.0, forwards=10),
        record("pld", 1, 30.0, forwards=5), record("pld", 2, 50.0, forwards=4, matches=False),
        record("hf", 1, 40.0), record("hf-pld", 1, 60.0),
        {"question_id": 2, "task": "qa", "method": "hf", "error": "RuntimeError: boom"},
        record("hf-pld", 2, 80.0),
    ]
    summary = specbench.summarize(records, {"none": "none", "pld": "none", "hf": "hf", "hf-pld": "hf"})
    assert summary["none"]["overall"]["speedup"] == 1.0
    assert summary["pld"]["overall"] == summary["pld"]["tasks"]["qa"]
    pld = summary["pld"]["overall"]
    assert pld["speedup"] == pytest.approx(40 / 15, abs=1e-3)
    assert pld["mean_accepted_tokens"] == pytest.approx(20 / 9, abs=1e-3)  # pooled, not a mean of ratios
    assert pld["match_rate"] == 0.5
    hf, hf_pld = summary["hf"]["overall"], summary["hf-pld"]["overall"]
    assert (hf["questions"], hf["failed"], hf["mean_accepted_tokens"]) == (1, 1, None)
    assert hf_pld["speedup"] == pytest.approx(70 / 15, abs=1e-3)
    assert hf_pld["speedup_vs_own_plain"] == 1.5  # question 2 has no hf result to compare with


def test_matches_compare_with_our_plain_and_the_systems_own_plain():
    records = [{"method": "none", "token_ids": [1, 2, 3]}, {"method": "hf", "token_ids": [1, 2, 4]},
               {"method": "hf-pld", "token_ids": [1, 2, 4]}, {"method": "pld", "error": "x"}]
    specbench.mark_matches(records, {"none": "none", "hf": "hf", "hf-pld": "hf", "pld": "none"})
    assert [r.get("matches_plain") for r in records] == [True, False, False, None]
    assert records[2]["matches_own_plain"] is True and records[2]["first_mismatch"] == 2
    assert not any("token_ids" in r for r in records)


def test_peer_outputs_are_cut_where_our_engine_stops():
    assert peers.finished([5, 2, 7], {2}, 8) == peers.Generation([5, 2], "stop")
    assert peers.finished([5, 6, 7], {2}, 2) == peers.Generation([5, 6], "length")
    assert peers.with_baselines(["llama-cpp-pld", "hf-pld"]) == ["hf", "hf-pld", "llama-cpp", "llama-cpp-pld"]


def test_comma_lists_reject_unknown_names():
    parse = specbench.comma_list(specbench.METHODS)
    assert parse("pld, draft") == ["pld", "draft"] and parse("none") == []
    with pytest.raises(argparse.ArgumentTypeError):
        parse("pld,eagle")


def peer_args(**overrides):
    defaults = dict(model="smollm2-135m", draft="layer-skip:6", dtype="float32", prompt_lookup_num_tokens=10,
                    prompt_lookup_max_ngram_size=2)
    return EngineConfig(**defaults | overrides)


def test_llama_cpp_is_skipped_with_a_note_when_not_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import raises ImportError
    runners, notes = peers.build_peers(["llama-cpp", "llama-cpp-pld"], peer_args(), {2}, 2)
    assert runners == [] and set(notes) == {"llama-cpp", "llama-cpp-pld"}
    assert "not importable" in notes["llama-cpp-pld"]


def test_llama_cpp_runner_decodes_from_a_fresh_cache_and_stops_like_ours(monkeypatch, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    made = []

    class FakeLlama:
        def __init__(self, **kwargs):
            self.kwargs, self.resets = kwargs, 0
            made.append(self)

        def token_eos(self):
            return 9

        def reset(self):
            self.resets += 1

        def generate(self, tokens, **kwargs):
            assert kwargs["temp"] == 0.0
            yield from [4, 5, 9, 6]

    class FakeLookup:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    module = types.ModuleType("llama_cpp")
    module.Llama = FakeLlama
    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = FakeLookup
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)
    runners, notes = peers.build_peers(["llama-cpp", "llama-cpp-pld"], peer_args(model=str(gguf)), {2}, 2)
    assert notes == {}
    assert [(r.name, r.baseline) for r in runners] == [("llama-cpp", "llama-cpp"), ("llama-cpp-pld", "llama-cpp")]
    plain, lookup = made
    assert plain.kwargs["draft_model"] is None and lookup.kwargs["logits_all"] is True
    assert lookup.kwargs["draft_model"].kwargs == {"num_pred_tokens": 10, "max_ngram_size": 2}
    assert runners[1].generate([1, 2, 3], 8) == peers.Generation([4, 5, 9], "stop")
    assert runners[1].generate([1, 2, 3], 2) == peers.Generation([4, 5], "length")
    assert lookup.resets == 2


class FakeHF:
    """Stands in for AutoModelForCausalLM: records what generate was asked, answers [7, 2, 7]."""

    made: list[FakeHF] = []

    def __init__(self, name):
        self.name, self.calls = name, []

    @classmethod
    def from_pretrained(cls, name, dtype):
        cls.made.append(cls(name))
        return cls.made[-1]

    def eval(self):
        return self

    def generate(self, inputs, **kwargs):
        self.calls.append(kwargs)
        return torch.cat([inputs, torch.tensor([[7, 2, 7]])], dim=1)


@pytest.fixture
def fake_hf(monkeypatch):
    import transformers

    monkeypatch.setattr(FakeHF, "made", [])
    monkeypatch.setattr(transformers, "AutoModelForCausalLM", FakeHF)
    monkeypatch.setattr(peers, "resolve_model", lambda name: name)
    return FakeHF


def test_hf_peers_share_one_target_and_skip_assisted_for_a_layer_skip_draft(fake_hf):
    runners, notes = peers.build_peers(["hf", "hf-pld", "hf-assisted"], peer_args(), {2}, 0)
    assert [r.name for r in runners] == ["hf", "hf-pld"] and "layer-skip" in notes["hf-assisted"]
    [target] = fake_hf.made
    assert runners[1].generate([1, 1], 8) == peers.Generation([7, 2], "stop")
    options = target.calls[-1]
    assert options["do_sample"] is False and options["eos_token_id"] == [2] and options["pad_token_id"] == 0
    assert options["prompt_lookup_num_tokens"] == 10 and options["max_matching_ngram_size"] == 2


def test_hf_assisted_uses_a_draft_model(fake_hf):
    runners, notes = peers.build_peers(["hf-assisted"], peer_args(draft="tiny-draft"), {2}, 0)
    assert notes == {} and [r.name for r in runners] == ["hf-assisted"]
    target, draft = fake_hf.made
    runners[0].generate([1], 1)
    assert target.calls[-1]["assistant_model"] is draft and draft.name == "tiny-draft"


@pytest.mark.default_model
def test_short_run_writes_the_documented_report(tmp_path, default_model_cost_curve):
    questions = write_questions(tmp_path / "question.jsonl", [
        {"question_id": 1, "category": "qa", "turns": ["What is the capital of France?"]},
        {"question_id": 2, "category": "qa", "turns": ["Name three primary colors."]},
    ])
    out = tmp_path / "results" / "sb.json"
    code = cli.main(["bench", "specbench", "--questions", str(questions), "--limit", "1", "--tasks", "qa",
                     "--max-new-tokens", "8", "--methods", "pld", "--peers", "hf", "--out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert {"command", "date", "machine", "config", "methods", "questions"} <= report.keys()
    assert report["command"].startswith("specserve bench specbench") and report["complete"] is True
    assert set(report["methods"]) == {"none", "pld", "hf"}
    for summary in report["methods"].values():
        assert SUMMARY_KEYS <= summary["overall"].keys() and set(summary["tasks"]) == {"qa"}
        assert SUMMARY_KEYS <= summary["tasks"]["qa"].keys() and summary["overall"]["questions"] == 1
    assert report["methods"]["none"]["overall"]["speedup"] == 1.0
    assert report["methods"]["none"]["overall"]["mean_accepted_tokens"] == 1.0
    assert report["methods"]["hf"]["overall"]["mean_accepted_tokens"] is None
    records = report["questions"]
    assert [(r["question_id"], r["method"]) for r in records] == [(1, "none"), (1, "pld"), (1, "hf")]
    assert all(isinstance(r["matches_plain"], bool) for r in records)
    assert all(0 < r["new_tokens"] <= 8 and r["tokens_per_s"] > 0 for r in records)
    table = out.with_suffix(".md").read_text()
    assert "## qa" in table and "## overall" in table and "| pld |" in table
