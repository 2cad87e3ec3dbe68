"""`specserve bench lossless` writes the report the issue asks for, and its markdown beside it."""
from __future__ import annotations

import json

from specserve.cli import main


def test_the_command_writes_cases_and_controls(tmp_path):
    out = tmp_path / "lossless.json"
    code = main(["bench", "lossless", "--out", str(out), "--cases", "pld-chain", "--scale", "0.02",
                 "--control-samples", "50000"])
    report = json.loads(out.read_text())
    assert code == 0
    (case,) = report["cases"]
    assert {"name", "samples", "statistic", "p_value", "detectable_shift"} <= set(case)
    assert case["name"] == "pld-chain" and case["samples"] == 1_200 and case["p_value"] > report["alpha"]
    (control,) = report["negative_controls"]
    assert control["name"] == "draft token accepted with min(1, q/p)" and control["caught"] is True
    assert [t["case"] for t in control["cases"]] == ["pld-chain"]
    assert report["command"].startswith("specserve bench lossless --out")
    assert "| pld-chain (core) | 1200 |" in out.with_suffix(".md").read_text()
