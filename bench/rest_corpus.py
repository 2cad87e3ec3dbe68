"""A REST corpus for measuring on Spec-Bench without drafting from the questions measured: every
question that `specserve bench specbench --limit N` does not run (its turns and reference answers),
one .jsonl record a question.

    python -m bench.rest_corpus --limit 2 --out /tmp/rest-corpus.jsonl
    specserve build-datastore --corpus /tmp/rest-corpus.jsonl --out /tmp/rest-store
    specserve bench specbench --limit 2 --methods rest,suffix --peers none --rest-datastore /tmp/rest-store
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.specbench import DEFAULT_QUESTIONS, load_questions


def held_out(path: Path, limit: int) -> list[dict]:
    """The questions of `path` that a run with `--limit limit` (all tasks) leaves out."""
    measured = {question["question_id"] for question in load_questions(path, limit=limit)}
    questions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [question for question in questions if question["question_id"] not in measured]


def texts(question: dict) -> list[str]:
    """A question's turns and reference answers (a RAG question's are lists of short answers)."""
    parts = list(question["turns"])
    for reference in question.get("reference") or []:
        parts += [reference] if isinstance(reference, str) else reference
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    parser.add_argument("--limit", type=int, required=True, help="the --limit of the Spec-Bench run measured")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    questions = held_out(args.questions, args.limit)
    with args.out.open("w") as out:
        for question in questions:
            out.write(json.dumps({"text": "\n\n".join(texts(question))}) + "\n")
    print(f"{args.out}: {len(questions)} questions")


if __name__ == "__main__":
    main()
