"""`specserve bench lossless`: every case, every negative control and the power checks, one report.

The report's `cases` say whether the engine's sampled sequences follow the target's exact
distribution and what shift each case could have missed; `negative_controls` say whether verifiers
with a deliberate mistake were caught; `power_checks` judge each core case's own sample against the
target with 1% of first-token mass moved, as if the engine were off by that much: a core case is
sized to reject it with probability at least POWER.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.lossless.cases import CASES, CASES_BY_NAME, Case
from bench.lossless.controls import CONTROLS, Control
from bench.lossless.engines import run_case
from bench.lossless.stats import ALPHA, POWER, GroupSample, Verdict, judge, shifted_first_token
from bench.lossless.target import TinyModels
from bench.specbench import RESULTS_DIR, comma_list, command_line, log, machine, write_report
from cluster.engine.stats import mean_accepted_tokens

POWER_CHECK_SHIFT = 0.01


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON report; a .md is written beside it (default bench/results/lossless-<time>.json)")
    parser.add_argument("--cases", type=comma_list(CASES_BY_NAME), default=None,
                        help="cases to run, comma separated (default: all); controls run on the selected cases they concern")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every case's number of samples")
    parser.add_argument("--control-samples", type=int, default=10_000,
                        help="samples of each case a negative control is tried on (times --scale)")
    parser.add_argument("--fake-gpus", type=int, default=4, help="GPUs Ray pretends to have, for the Ray cases")


def sample_case(case: Case, models: TinyModels, samples: int,
                control: Control | None = None) -> tuple[list[GroupSample], dict]:
    """The case's samples per request group, and what the engine did while drawing them (under
    `control`'s mistake, when given)."""
    began = time.perf_counter()
    run = run_case(case, models, samples, *(() if control is None else (control.applied,)))
    groups = [GroupSample(counts, models.distribution(group.prompt, group.sampling, group.new_tokens,
                                                      group.penalties, group.rule))
              for counts, group in zip(run.counts, case.groups)]
    speculation = {"seconds": round(time.perf_counter() - began, 1), "drafted": run.drafted,
                   "accepted": sum(run.accepted_by_depth), "accepted_by_depth": run.accepted_by_depth,
                   "mean_accepted_tokens": round(mean_accepted_tokens(run.tokens, run.target_forwards), 3),
                   "differ_from_plain": run.differ_from_plain, "preemptions": run.preemptions,
                   "cached_prompt_tokens": run.cached_prompt_tokens}
    return groups, speculation


def case_record(case: Case, verdict: Verdict, speculation: dict) -> dict:
    return {
        "name": case.name, "samples": verdict.samples, "statistic": round(verdict.statistic, 2),
        "p_value": verdict.p_value, "detectable_shift": _rounded(verdict.detectable_shift),
        "passed": case_passed(verdict, speculation), "core": case.core, "df": verdict.df, "p_sequences": verdict.p_sequences,
        "p_conditionals": verdict.p_conditionals, "conditionals_tested": verdict.conditionals,
        "worst_conditional": verdict.worst_conditional, "impossible_samples": verdict.impossible,
        "detectable_shift_by_depth": [_rounded(s) for s in verdict.detectable_shift_by_depth],
        "deployment": "ray" if case.deployment.ray else "in-process",
        "tensor_parallel_size": case.deployment.tensor_parallel_size, **speculation,
    }


def case_passed(verdict: Verdict, speculation: dict) -> bool:
    """The sample follows the target and, for a keyed case, every sequence is plain decoding's."""
    return verdict.passed and not speculation["differ_from_plain"]


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def power_check(case: Case, groups: list[GroupSample]) -> dict:
    verdict = judge([GroupSample(g.counts, shifted_first_token(g.exact, POWER_CHECK_SHIFT)) for g in groups])
    return {"case": case.name, "shift": POWER_CHECK_SHIFT, "p_value": verdict.p_value, "caught": not verdict.passed}


def control_record(control: Control, cases: list[Case], models: TinyModels, samples: int) -> dict:
    tried = []
    for case in cases:
        groups, speculation = sample_case(case, models, samples, control)
        verdict = judge(groups)
        tried.append({"case": case.name, "samples": verdict.samples, "p_value": verdict.p_value,
                      "differ_from_plain": speculation["differ_from_plain"], "caught": not case_passed(verdict, speculation)})
        differ = speculation["differ_from_plain"]
        log(f"  control '{control.name}' on {case.name}: p = {verdict.p_value:.3g}"
            + ("" if differ is None else f", {differ} differ from plain decoding"))
    return {"name": control.name, "caught": bool(tried) and all(t["caught"] for t in tried), "cases": tried}


def measure(cases: list[Case], models: TinyModels, scale: float, control_samples: int) -> dict:
    records, checks = [], []
    for case in cases:
        groups, speculation = sample_case(case, models, round(case.samples * scale))
        records.append(case_record(case, judge(groups), speculation))
        log(f"{case.name}: {records[-1]['samples']} samples, p = {records[-1]['p_value']:.3g}, "
            f"detectable shift {records[-1]['detectable_shift']}, {speculation['seconds']} s")
        if case.core:
            checks.append(power_check(case, groups))
    selected = {case.name for case in cases}
    controls = [control_record(control, [CASES_BY_NAME[name] for name in control.cases if name in selected], models,
                               round(control_samples * scale))
                for control in CONTROLS if selected & set(control.cases)]
    return {"alpha": ALPHA, "power": POWER, "cases": records, "negative_controls": controls, "power_checks": checks}


def markdown(report: dict) -> str:
    lines = ["# Losslessness of sampled output", "", f"`{report['command']}`", "",
             f"{report['date']}; " + ", ".join(f"{k} {v}" for k, v in report["machine"].items()), "",
             f"Alpha {report['alpha']} per case; detectable shift = mass moved between the two likeliest first tokens "
             f"that the case detects with probability {report['power']} (by depth: at the likeliest prefix).", "",
             "Keyed cases (seeded requests, noise keyed by seed and position) also ran every request with "
             "speculation off: 'differ' counts the sequences that were not plain decoding's (must be 0). "
             "'preempted / cached' counts the requests' preemptions and prompt tokens found in the prefix cache.", "",
             "| case | samples | X^2 | df | p | detectable shift | by depth | mean accepted tokens | differ "
             "| preempted / cached | passed |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for c in report["cases"]:
        lines.append(f"| {c['name']}{' (core)' * c['core']} | {c['samples']} | {c['statistic']} | {c['df']} "
                     f"| {c['p_value']:.3g} | {c['detectable_shift']} | {c['detectable_shift_by_depth']} "
                     f"| {c['mean_accepted_tokens']} | {_dash(c.get('differ_from_plain'))} "
                     f"| {c.get('preemptions', 0)} / {c.get('cached_prompt_tokens', 0)} | {c['passed']} |")
    lines += ["", "| negative control | cases (p) | caught |", "|---|---|---|"]
    for control in report["negative_controls"]:
        tried = ", ".join(f"{t['case']} (p {t['p_value']:.3g}"
                          + ("" if t.get("differ_from_plain") is None else f", {t['differ_from_plain']} differ") + ")"
                          for t in control["cases"])
        lines.append(f"| {control['name']} | {tried} | {control['caught']} |")
    lines += ["", "| power check: 1% first-token shift | p | caught |", "|---|---:|---|"]
    lines += [f"| {check['case']} | {check['p_value']:.3g} | {check['caught']} |" for check in report["power_checks"]]
    return "\n".join(lines) + "\n"


def _dash(value) -> str:
    return "-" if value is None else str(value)


def run(args: argparse.Namespace) -> int:
    import ray

    cases = [CASES_BY_NAME[name] for name in args.cases] if args.cases else CASES
    started_ray = any(case.deployment.ray for case in cases) and not ray.is_initialized()
    if started_ray:  # a private local cluster, without token auth so that it can be shut down
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_gpus=args.fake_gpus, include_dashboard=False)
    try:
        with tempfile.TemporaryDirectory() as root:
            results = measure(cases, TinyModels(Path(root)), args.scale, args.control_samples)
    finally:
        if started_ray:
            ray.shutdown()
    report = {"command": command_line(args, "bench", "lossless"),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(), **results}
    out = args.out or RESULTS_DIR / f"lossless-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    write_report(report, out, markdown)
    log(markdown(report))
    passed = all(c["passed"] for c in results["cases"]) and all(c["caught"] for c in results["negative_controls"])
    return 0 if passed else 1
