"""`python bench/gpu_check.py --out DIR`: the GPU path, checked unattended in a few minutes.

Random-weight Llama-family models are built on the GPU (bench/gpu_models.py) and the checks of
bench/gpu_checks.py run one after another: logits against transformers, greedy losslessness of
tree verification in bf16, sampling with a device generator, the cost of verification passes,
tokens/s with an oracle drafter and plainly, a draft model's step, CUDA graphs against eager
passes, and a TP=1 shard with a draft worker on the same GPU. Each check is isolated (its error is
recorded and the next one runs) and the whole run keeps to a time budget (a check still running when
it is spent is interrupted). Results go to DIR as JSON and a short Markdown table, rewritten after
every check so that a run cut short still leaves what it measured. `--cpu-dry-run` runs the same
checks on tiny shapes on the CPU (the test suite does); bench/gpu_check.sh is the one command for a
GPU machine.
"""
from __future__ import annotations

import argparse
import gc
import json
import re
import signal
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the project is the checkout this file lives in
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.gpu_checks import CHECKS, DRY_RUN_SIZES, GPU_SIZES, Context, Skip
from bench.gpu_models import CPU_SHAPES, GPU_SHAPES

GPU_BUDGET_S, DRY_RUN_BUDGET_S = 420.0, 120.0


class BudgetSpent(Exception):
    """The run's time budget ran out while a check was running."""


@contextmanager
def deadline(seconds: float):
    """Raise BudgetSpent in this (main) thread after `seconds`."""
    def expire(signum, frame):
        raise BudgetSpent(f"time budget spent after {seconds:.0f} s of this check")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_check(name: str, ctx: Context, seconds_left: float) -> dict:
    began = time.perf_counter()
    record: dict = {}
    try:
        with deadline(seconds_left):
            record["result"] = CHECKS[name](ctx)
        record["status"] = "failed" if record["result"].get("pass") is False else "ok"
    except Skip as reason:
        record.update(status="skipped", reason=str(reason))
    except BudgetSpent as spent:
        record.update(status="timeout", reason=str(spent))
    except Exception as error:  # recorded; the next check still runs
        record.update(status="error", error=f"{type(error).__name__}: {error}",
                      traceback=traceback.format_exc().splitlines()[-12:])
    finally:
        gc.collect()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    record["seconds"] = round(time.perf_counter() - began, 2)
    return record


def machine_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu-dry-run"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def headline(name: str, record: dict) -> str:
    """One line of the table: the numbers a reader looks for first."""
    if record["status"] != "ok" and record["status"] != "failed":
        return record.get("reason") or record.get("error", "")
    result = record["result"]
    if name == "environment":
        return f"{result.get('gpu', 'cpu')}, torch {result['torch']}, split prefix kernel {result['split_prefix_kernel']}"
    if name == "logits_vs_transformers":
        return "; ".join(f"{k}: max diff {v['relative_max_diff']:.3g}, top-1 {v['top1_agreement']:.0%}"
                         for k, v in result["results"].items())
    if name == "greedy_losslessness":
        return "; ".join(f"{k}: match {v['match_rate']:.0%}, near-ties only {v['all_at_near_ties']}"
                         for k, v in result["results"].items())
    if name == "sampling_with_a_device_generator":
        return f"chi-square p {result['chi_square_pvalue']:.3g}, generator on {result['generator_device']}"
    if name == "verification_cost":
        return "; ".join(f"{k} {batch}: " + " ".join(f"{size}:{cell['relative']:.2f}x" for size, cell in row.items())
                         for k, rows in result["results"].items() for batch, row in rows.items())
    if name == "tokens_per_second":
        return "; ".join(f"{k}: " + ", ".join(f"{label} {cell['tokens_per_s']:.0f} tok/s" for label, cell in row.items())
                         for k, row in result["results"].items())
    if name == "draft_step":
        return "; ".join(f"{batch}: {cell['ms_per_depth']:.2f} ms/depth" for batch, cell in result["results"].items())
    if name == "cuda_graphs":
        return "; ".join(f"{k}: plain {row['plain_speedup']:.2f}x with graphs {row['cuda graphs']['graphed_sizes']}, "
                         f"same tokens {row['same_plain_tokens']}" for k, row in result["results"].items())
    if name == "shard_path":
        return f"{result['route']}; identical to plain: {result['identical_to_plain']}"
    return ""


def write(report: dict, out: Path, stem: str) -> None:
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2, default=str))
    lines = [f"# GPU check: {report['machine']}, {report['started']}", "",
             f"`{report['command']}` ({report['mode']}, {report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget)",
             "", "| check | status | seconds | headline |", "|---|---|---:|---|"]
    for name, record in report["checks"].items():
        cell = headline(name, record).replace("|", "/")
        lines.append(f"| {name} | {record['status']} | {record['seconds']:.1f} | {cell} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON and the Markdown table")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on the CPU (float32)")
    parser.add_argument("--budget-s", type=float, default=None, help="time budget for all checks together")
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), help="run only these checks")
    args = parser.parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here; use --cpu-dry-run to run the checks on the CPU")
    device = torch.device("cpu") if args.cpu_dry_run else torch.device("cuda", 0)
    if args.cpu_dry_run:
        torch.set_num_threads(1)  # tiny matrices: a second thread only adds waiting on a shared machine
    budget = args.budget_s or (DRY_RUN_BUDGET_S if args.cpu_dry_run else GPU_BUDGET_S)
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    now = datetime.now(timezone.utc)
    stem = f"gpu-check-{now:%Y-%m-%d}-{machine_name(device)}"
    report = {"machine": machine_name(device), "started": now.isoformat(timespec="seconds"),
              "mode": "cpu-dry-run" if args.cpu_dry_run else "gpu", "budget_s": budget,
              "command": " ".join(["python bench/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
              "seconds": 0.0, "checks": {}}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        ctx = Context(device=device, dtype=torch.float32 if args.cpu_dry_run else torch.bfloat16,
                      shapes=CPU_SHAPES if args.cpu_dry_run else GPU_SHAPES,
                      sizes=DRY_RUN_SIZES if args.cpu_dry_run else GPU_SIZES, workdir=Path(workdir))
        for name in args.only or CHECKS:
            left = budget - (time.perf_counter() - started)
            record = run_check(name, ctx, left) if left > 1 else {"status": "skipped", "reason": "time budget spent",
                                                                    "seconds": 0.0}
            report["checks"][name] = record
            report["seconds"] = time.perf_counter() - started
            print(f"{name}: {record['status']} ({record['seconds']:.1f} s) {headline(name, record)}", flush=True)
            write(report, args.out, stem)
    return 0 if all(r["status"] in ("ok", "skipped") for r in report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
