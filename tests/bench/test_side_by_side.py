"""The side-by-side harness's own logic: disjoint prompts, the vLLM model folder and settings, the table."""
import json

import pytest

from bench import side_by_side, vllm_peer
from bench.serve_bench import Answer, latency


def _questions(count):
    return [{"question_id": i, "turns": [f"q{i}"]} for i in range(count)]


def test_every_level_and_round_gets_questions_of_its_own():
    plan = side_by_side.plan_questions(_questions(100), [1, 4, 16], rounds=2)
    ids = [q["question_id"] for questions in plan.values() for q in questions]
    assert len(ids) == len(set(ids)) == 2 * (4 + 8 + 32)
    assert min(ids) >= side_by_side.WARMUP_QUESTIONS  # warm-up questions are never measured


def test_model_folder_drops_quantization_config_and_links_weights(tmp_path):
    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {"quant_method": "gguf"}}))
    (converted / "model.safetensors").write_bytes(b"weights")
    folder = vllm_peer.model_folder(converted, tmp_path / "vllm-model")
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert json.loads((converted / "config.json").read_text())["quantization_config"]  # the source is untouched
    assert (folder / "model.safetensors").is_symlink()
    vllm_peer.model_folder(converted, tmp_path / "vllm-model")  # a second call finds it made


def test_tuned_vllm_binds_every_core_and_defaults_reserve_one(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_peer.os, "cpu_count", lambda: 2)
    tuned = vllm_peer.server_env(tmp_path, vllm_peer.SETTINGS["vllm-tuned"])
    assert tuned["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and tuned["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    default = vllm_peer.server_env(tmp_path, vllm_peer.SETTINGS["vllm"])
    assert "VLLM_CPU_OMP_THREADS_BIND" not in default or default["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    assert default["VLLM_TARGET_DEVICE"] == "cpu"
    ngram = vllm_peer.server_command(tmp_path / "vllm", tmp_path, 8100, vllm_peer.SETTINGS["vllm-ngram"], "float32")
    assert json.loads(ngram[ngram.index("--speculative-config") + 1])["method"] == "ngram"


def test_summary_compares_with_vllm_and_specserve_plain():
    def run(rate, texts):
        return {"tokens_per_s": rate, "answers": [Answer(t, 10, 0.1, 1.0, None) for t in texts]}

    runs = {"vllm": {1: [run(10.0, ["a", "b"])]}, "specserve": {1: [run(15.0, ["a", "c"])]},
            "specserve-plain": {1: [run(12.0, ["a", "c"])]}}
    rows = side_by_side.summarize(runs)["1"]
    assert rows["specserve"]["vs_vllm"] == 1.5 and rows["vllm"]["vs_vllm"] == 1.0
    assert rows["specserve"]["same_as_specserve_plain"] == 2 and rows["vllm"]["same_as_specserve_plain"] == 1
    report = {"by_concurrency": {"1": rows}, "machine": {"processor": "x86_64", "cpus": 2}, "date": "today",
              "config": {"max_new_tokens": 128}, "notes": {}, "command": "specserve bench side-by-side"}
    assert "| 1 | specserve | 15.0 | 1.50x |" in side_by_side.markdown(report)


def test_latency_gives_the_first_tokens_p90_beside_the_median_requests_whole_latency():
    """The issue's check at 32 streams of long prompts: TTFT p90 below the median request's latency."""
    answers = [Answer("a", 10, first, first + 2.0, None) for first in (0.1, 0.2, 0.3, 0.4, 5.0)]
    summary = latency(answers)
    assert summary["ttft_p90_s"] > summary["latency_p50_s"] == pytest.approx(2.3)
    assert summary["ttft_p50_s"] == pytest.approx(0.3)


def test_the_served_benchmark_refuses_too_few_questions_before_sending_any(tmp_path, monkeypatch):
    import argparse

    import pytest

    from bench import serve_bench

    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({**q, "category": "qa"}) for q in _questions(40)))
    sent = []
    monkeypatch.setattr(serve_bench, "run_setting", lambda *a, **k: sent.append(a))
    args = argparse.Namespace(model="m", questions=questions, skip_questions=0, concurrency=["4", "16"], rounds=2)
    with pytest.raises(SystemExit, match="need 82 questions"):
        serve_bench.run(args)
    assert not sent
