"""bench/gpu_check.py: the dry run passes every check, and the harness isolates and times them."""
from __future__ import annotations

import json
import time

from bench import gpu_check
from bench.gpu_checks import CHECKS
from tests.cluster.ray_fixtures import ray_four_gpus  # noqa: F401  (module-scoped fixture)


def report(out) -> dict:
    (path,) = out.glob("gpu-check-*-cpu-dry-run.json")
    return json.loads(path.read_text())


def test_the_cpu_dry_run_passes_every_check(tmp_path, ray_four_gpus):
    """shard_path puts its actors on the shared Ray: the check uses a Ray that is up instead of starting one."""
    assert gpu_check.main(["--cpu-dry-run", "--out", str(tmp_path)]) == 0
    checks = report(tmp_path)["checks"]
    assert list(checks) == list(CHECKS)
    assert {name: record["status"] for name, record in checks.items()} == dict.fromkeys(CHECKS, "ok")
    assert checks["greedy_losslessness"]["result"]["pass"] is True
    assert checks["shard_path"]["result"]["identical_to_plain"] is True
    table = next(tmp_path.glob("*.md")).read_text()
    assert all(f"| {name} | ok |" in table for name in CHECKS)


def test_an_error_is_recorded_and_the_next_check_runs(tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("kernel exploded")

    monkeypatch.setitem(CHECKS, "environment", broken)
    assert gpu_check.main(["--cpu-dry-run", "--out", str(tmp_path), "--only", "environment", "draft_step"]) == 1
    checks = report(tmp_path)["checks"]
    assert checks["environment"]["status"] == "error" and "kernel exploded" in checks["environment"]["error"]
    assert checks["draft_step"]["status"] == "ok"


def test_a_check_past_the_budget_is_interrupted_and_the_rest_skipped(tmp_path, monkeypatch):
    monkeypatch.setitem(CHECKS, "environment", lambda ctx: time.sleep(30))
    began = time.perf_counter()
    gpu_check.main(["--cpu-dry-run", "--out", str(tmp_path), "--budget-s", "1.5", "--only", "environment", "draft_step"])
    assert time.perf_counter() - began < 10
    checks = report(tmp_path)["checks"]
    assert checks["environment"]["status"] == "timeout"
    assert checks["draft_step"] == {"status": "skipped", "reason": "time budget spent", "seconds": 0.0}
