"""Spec-Bench: speedup, mean accepted tokens and greedy losslessness per task, with peers side by side.

Protocol (Spec-Bench, DESIGN.md "Measuring"): greedy, batch size 1, the first turn of each question.
Speedup of a method = mean per-question tokens/s of the method / the same mean for plain decoding of
the same target in the same run, over the questions both completed. Mean accepted tokens = new
tokens / target verification passes, pooled over the questions (plain decoding = 1.00). Every
method decodes each question back to back before the next question starts, so drifts in machine
load hit all methods alike; the report is rewritten after every question, so an interrupted run
keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import replace
from datetime import datetime, timezone
from itertools import zip_longest
from pathlib import Path
from typing import get_args

import torch

from bench.peers import PEERS, Generation, Runner, build_peers, with_baselines
from cluster.engine.build import ENGINE_OPTIONS, build_engine, encode_prompt, engine_config_from_args
from cluster.engine.config import Method
from cluster.engine.stats import mean_accepted_tokens
from cluster.serve.requests import RequestBuilder, RequestOptions

PLAIN = "none"
METHODS = get_args(Method)
TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
"""Spec-Bench's six tasks; any other category is one of MT-bench's eight (writing, coding, ...)."""
DEFAULT_QUESTIONS = Path(__file__).resolve().parent / "data" / "specbench" / "question.jsonl"
"""Spec-Bench's public dev half (240 questions), shipped with the project; SOURCE.md beside it says where from."""
RESULTS_DIR = Path(__file__).resolve().parent / "results"
WARMUP_PROMPT, WARMUP_TOKENS = "Say hello.", 8
_NOT_OPTIONS = ("command", "benchmark", "func")
ENGINE_FLAGS = {path: flags[0] for flags, path in ENGINE_OPTIONS.items()}
"""Engine options are stored under their EngineConfig field; their flags say it differently."""
"""Namespace entries set by the CLI's subcommands, not by options."""


def comma_list(choices: Iterable[str] | None = None, variants: bool = False) -> Callable[[str], list[str]]:
    """argparse type for 'a,b,c' ("none" or "" = empty), checked against `choices` when given;
    with `variants`, an item may carry settings ('eagle3+draft_width=4', see method_variant)."""
    allowed = None if choices is None else tuple(choices)

    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip() and item.strip() != "none"]
        base = (lambda item: item.split("+")[0]) if variants else (lambda item: item)
        unknown = [item for item in items if allowed is not None and base(item) not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(allowed)}")
        return items

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="Spec-Bench question.jsonl")
    parser.add_argument("--methods", type=comma_list(METHODS, variants=True), default=["pld", "suffix"],
                        help=f"our methods, comma separated ({', '.join(METHODS)}); plain decoding 'none' always "
                             "runs. A method may carry engine settings of its own, joined by '+': "
                             "'eagle3+draft_width=4+lookahead.policy=fixed'")
    parser.add_argument("--peers", type=comma_list(PEERS), default=["hf", "hf-pld", "hf-assisted", "llama-cpp-pld"],
                        help=f"peers, comma separated ({', '.join(PEERS)}) or 'none'; each peer's own plain "
                             "decoding (hf, llama-cpp) runs with it")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="questions per task (default: all)")
    parser.add_argument("--tasks", type=comma_list(), default=None,
                        help=f"tasks or categories, comma separated (tasks: {', '.join(TASKS)})")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON report; a .md table is written next to it (default bench/results/specbench-<time>.json)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of every request (Spec-Bench: 0, greedy)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of every sampled request (same seed, same text: speculation cannot change it); "
                             "a variant '+rule=rejection' samples with the rule unseeded requests get instead")
    parser.add_argument("--no-chat", action="store_true",
                        help="tokenize the raw question instead of applying the chat template (Spec-Bench applies it)")


# --- questions ---------------------------------------------------------------------------------

def task_of(category: str) -> str:
    return category if category in TASKS else "mt_bench"


def load_questions(path: Path, tasks: list[str] | None = None, limit: int | None = None) -> list[dict]:
    """First `limit` questions per task, taking one question of each task in turn.

    Round-robin order so that a run stopped early has measured every task, not just the first.
    """
    per_task: dict[str, list[dict]] = defaultdict(list)
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        question = json.loads(line)
        task = task_of(question["category"])
        if tasks and task not in tasks and question["category"] not in tasks:
            continue
        if limit is None or len(per_task[task]) < limit:
            per_task[task].append({**question, "task": task})
    ordered = sorted(per_task, key=lambda t: (TASKS.index(t) if t in TASKS else len(TASKS), t))
    rounds = zip_longest(*(per_task[task] for task in ordered))
    return [question for row in rounds for question in row if question is not None]


# --- methods -----------------------------------------------------------------------------------

def method_variant(name: str) -> tuple[str, dict[str, str]]:
    """'eagle3+draft_width=4+lookahead.policy=fixed' -> ('eagle3', {'draft_width': '4', ...}): a method
    with engine options of its own, so variants of one method run side by side in one run. 'rule' is
    the sampling rule of its requests (SamplingParams.rule), not an engine option."""
    method, *settings = name.split("+")
    overrides = {}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{name!r}: a variant's settings read field=value, got {setting!r}")
        overrides[key] = value
    return method, overrides


def variant_config(args: argparse.Namespace, name: str):
    """The EngineConfig of a method variant: the command's options, then the variant's own."""
    method, overrides = method_variant(name)
    config = engine_config_from_args(args, method)
    lookahead = {k.removeprefix("lookahead."): v for k, v in overrides.items() if k.startswith("lookahead.")}
    top = {k: v for k, v in overrides.items() if not k.startswith("lookahead.") and k != "rule"}
    return type(config).model_validate({**config.model_dump(), **top,
                                        "lookahead": {**config.lookahead.model_dump(), **lookahead}})


def engine_runner(args: argparse.Namespace, name: str):
    """Our engine for one method (or method variant), built once: (Runner, engine, tokenizer)."""
    config = variant_config(args, name)
    engine, tokenizer = build_engine(config)

    requests = RequestBuilder.in_process(engine, tokenizer, config)
    rule = method_variant(name)[1].get("rule")

    def generate(prompt_ids: list[int], max_new_tokens: int) -> Generation:
        request = requests.build_request(RequestOptions(prompt_token_ids=prompt_ids, max_new_tokens=max_new_tokens,
                                                        temperature=args.temperature, seed=args.seed))
        if rule is not None:
            request.sampling = replace(request.sampling, rule=rule)
        output = engine.generate([request])[0]
        return Generation(output.token_ids, output.finish_reason, output.stats.target_forwards)

    return Runner(name, PLAIN, generate), engine, tokenizer


def warm_up(runners: list[Runner], prompt_ids: list[int], notes: dict[str, str]) -> list[Runner]:
    """Run each method once untimed (first calls pay for allocation and kernel selection).

    A peer that fails here is dropped with a note; plain decoding failing means nothing can be measured.
    """
    kept = []
    for runner in runners:
        try:
            runner.generate(prompt_ids, WARMUP_TOKENS)
            kept.append(runner)
        except Exception as error:
            if runner.name == PLAIN:
                raise
            notes[runner.name] = f"failed warm-up: {type(error).__name__}: {error}"
    return kept


def measure(runner: Runner, question: dict, prompt_ids: list[int], max_new_tokens: int) -> dict:
    """One timed generation; an exception becomes an 'error' record so the run goes on."""
    record = {"question_id": question["question_id"], "task": question["task"], "method": runner.name}
    began = time.perf_counter()
    try:
        generation = runner.generate(prompt_ids, max_new_tokens)
    except Exception as error:
        return record | {"error": f"{type(error).__name__}: {error}"}
    seconds = time.perf_counter() - began
    new, forwards = len(generation.token_ids), generation.target_forwards
    return record | {
        "new_tokens": new,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(new / seconds, 3),
        "target_forwards": forwards,
        "mean_accepted_tokens": round(mean_accepted_tokens(new, forwards), 4) if forwards else None,
        "finish_reason": generation.finish_reason,
        "token_ids": generation.token_ids,
    }


def first_mismatch(ids: list[int], reference: list[int]) -> int | None:
    """Index of the first token that differs from the reference (None when equal)."""
    if ids == reference:
        return None
    return next((i for i, (a, b) in enumerate(zip(ids, reference)) if a != b), min(len(ids), len(reference)))


def mark_matches(records: list[dict], baselines: dict[str, str]) -> None:
    """Compare one question's outputs with our plain decoding and with each system's own plain decoding.

    Token ids are dropped afterwards: the first mismatch position is what a reader needs.
    """
    ids = {r["method"]: r["token_ids"] for r in records if "token_ids" in r}
    for record in records:
        mine = record.pop("token_ids", None)
        if mine is None:
            continue
        plain, own = ids.get(PLAIN), ids.get(baselines[record["method"]])
        record["matches_plain"] = None if plain is None else mine == plain
        record["first_mismatch"] = None if plain is None else first_mismatch(mine, plain)
        record["matches_own_plain"] = None if own is None else mine == own


# --- summary -----------------------------------------------------------------------------------

def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _speedup(mine: dict[int, dict], base: dict[int, dict]) -> float | None:
    """Ratio of mean per-question tokens/s, over the questions both methods completed."""
    shared = mine.keys() & base.keys()
    base_speed = _mean(base[q]["tokens_per_s"] for q in shared)
    if not base_speed:
        return None
    return _mean(mine[q]["tokens_per_s"] for q in shared) / base_speed


def summarize_group(records: list[dict], method: str, baseline: str) -> dict:
    """Spec-Bench's numbers for one method over one group of questions (a task, or all)."""
    def completed(name: str) -> dict[int, dict]:
        return {r["question_id"]: r for r in records if r["method"] == name and "error" not in r}

    mine = completed(method)
    forwards = [r["target_forwards"] for r in mine.values()]
    accepted = None
    if mine and all(forwards):
        accepted = mean_accepted_tokens(sum(r["new_tokens"] for r in mine.values()), sum(forwards))
    matches = [r["matches_plain"] for r in mine.values() if r["matches_plain"] is not None]
    own_matches = [r["matches_own_plain"] for r in mine.values() if r["matches_own_plain"] is not None]
    return {
        "tokens_per_s": _round(_mean(r["tokens_per_s"] for r in mine.values()), 3),
        "speedup": _round(_speedup(mine, completed(PLAIN)), 3),
        "speedup_vs_own_plain": _round(_speedup(mine, completed(baseline)), 3),
        "mean_accepted_tokens": _round(accepted, 3),
        "match_rate": _round(_mean(matches), 3),
        "own_match_rate": _round(_mean(own_matches), 3),
        "questions": len(mine),
        "failed": sum(1 for r in records if r["method"] == method and "error" in r),
    }


def summarize(records: list[dict], baselines: dict[str, str]) -> dict:
    by_task: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        by_task[record["task"]].append(record)
    return {
        method: {
            "baseline": baseline,
            "overall": summarize_group(records, method, baseline),
            "tasks": {task: summarize_group(group, method, baseline) for task, group in by_task.items()},
        }
        for method, baseline in baselines.items()
    }


# --- report ------------------------------------------------------------------------------------

def command_line(args: argparse.Namespace, *command: str) -> str:
    """The full command that reproduces this run, every option spelled out (defaults may change)."""
    parts = ["specserve", *(command or ("bench", "specbench"))]
    for key, value in vars(args).items():
        if key in _NOT_OPTIONS or value is None or value is False:
            continue
        flag = ENGINE_FLAGS.get(key) or "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        else:
            parts += [flag, (",".join(value) or "none") if isinstance(value, list) else str(value)]
    return shlex.join(parts)


def machine() -> dict:
    import transformers

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
    }


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(report: dict) -> str:
    """One table per task, then the overall table."""
    methods = report["methods"]
    tasks = list(dict.fromkeys(task for m in methods.values() for task in m["tasks"]))
    lines = [f"# Spec-Bench: {report['config']['model']}, max {report['config']['max_new_tokens']} new tokens",
             "", f"`{report['command']}`", "", f"{report['date']}; " + ", ".join(
                 f"{k} {v}" for k, v in report["machine"].items()), ""]
    lines += [f"- {name}: {note}" for name, note in report["notes"].items()]
    groups = [(task, {name: m["tasks"].get(task) for name, m in methods.items()}) for task in tasks]
    groups.append(("overall", {name: m["overall"] for name, m in methods.items()}))
    sampled = report["config"].get("temperature", 0) > 0
    match = f"same text as plain (seed {report['config'].get('seed')})" if sampled else "greedy match"
    for title, summaries in groups:
        rows = {name: row for name, row in summaries.items() if row and row["questions"]}
        count = max((row["questions"] for row in rows.values()), default=0)
        lines += ["", f"## {title} ({count} question{'s' * (count != 1)})", "",
                  f"| method | tokens/s | speedup vs plain | speedup vs own plain | mean accepted tokens | {match} |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, row in rows.items():
            own = f"{_cell(row['speedup_vs_own_plain'], '.2f')}x ({methods[name]['baseline']})"
            failed = f", {row['failed']} failed" if row["failed"] else ""
            lines.append(f"| {name} | {_cell(row['tokens_per_s'], '.2f')} | {_cell(row['speedup'], '.2f')}x | {own} "
                         f"| {_cell(row['mean_accepted_tokens'], '.2f')} | {_cell(row['match_rate'], '.0%')}{failed} |")
    return "\n".join(lines) + "\n"


def write_report(report: dict, out: Path, render: Callable[[dict], str] = markdown) -> None:
    """Write JSON and markdown through temporary files, so an interrupt never leaves half a file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for path, text in ((out, json.dumps(report, indent=1)), (out.with_suffix(".md"), render(report))):
        partial = path.with_name(path.name + ".partial")
        partial.write_text(text)
        partial.replace(path)


def log(message: str) -> None:
    print(message, flush=True)


def describe(record: dict) -> str:
    if "error" in record:
        return f"  {record['method']:>14}: FAILED {record['error']}"
    accepted = record["mean_accepted_tokens"]
    match = {True: "match", False: f"MISMATCH at {record['first_mismatch']}", None: "-"}[record["matches_plain"]]
    return (f"  {record['method']:>14}: {record['new_tokens']:4d} tokens {record['seconds']:7.2f} s "
            f"{record['tokens_per_s']:7.2f} tok/s  accepted {_cell(accepted, '.2f')}  {match}")


# --- run ---------------------------------------------------------------------------------------

def build_runners(args: argparse.Namespace, notes: dict[str, str]):
    """Plain decoding first, then our methods, then the peers: (runners, tokenizer)."""
    runners, tokenizer, eos = [], None, None
    for method in dict.fromkeys([PLAIN, *args.methods]):
        log(f"building engine: {method}")
        runner, engine, tokenizer = engine_runner(args, method)
        runners.append(runner)
        eos = engine.eos_token_ids
    if args.peers:
        log(f"loading peers: {', '.join(with_baselines(args.peers))}")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
        peers, skipped = build_peers(with_baselines(args.peers), engine_config_from_args(args), eos, pad)
        runners += peers
        notes.update(skipped)
    return runners, tokenizer


def run(args: argparse.Namespace) -> int:
    questions = load_questions(args.questions, args.tasks, args.limit)
    if not questions:
        log(f"no questions in {args.questions} for tasks {args.tasks}")
        return 2
    out = args.out or RESULTS_DIR / f"specbench-{datetime.now():%Y%m%d-%H%M%S}.json"
    chat = not args.no_chat
    notes: dict[str, str] = {}
    runners, tokenizer = build_runners(args, notes)
    runners = warm_up(runners, encode_prompt(tokenizer, WARMUP_PROMPT, chat), notes)
    for name, note in notes.items():
        log(f"note: {name}: {note}")
    baselines = {runner.name: runner.baseline for runner in runners}
    report = {
        "command": command_line(args),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in _NOT_OPTIONS}
        | {"out": str(out)},
        "notes": notes,
        "complete": False,
        "methods": {},
        "questions": [],
    }
    for number, question in enumerate(questions, 1):
        prompt_ids = encode_prompt(tokenizer, question["turns"][0], chat)
        log(f"[{number}/{len(questions)}] question {question['question_id']} ({question['task']}), "
            f"{len(prompt_ids)} prompt tokens")
        records = [measure(runner, question, prompt_ids, args.max_new_tokens) for runner in runners]
        mark_matches(records, baselines)
        for record in records:
            log(describe(record))
        report["questions"] += records
        report["methods"] = summarize(report["questions"], baselines)
        report["complete"] = number == len(questions)
        write_report(report, out)
    log(markdown(report))
    log(f"wrote {out} and {out.with_suffix('.md')}")
    return 0
