"""`specserve build-datastore`: REST's datastore from a corpus the operator supplies.

Reads .txt files (a document per blank-line-separated block, or per line with `--split lines`)
and .jsonl files (a document per record's "text"), tokenizes them with the target's tokenizer, and
writes the folder speculators/datastore.py describes. The text is taken as written: no chat
template, no special tokens, since what REST matches is the running text of an answer.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path

import numpy as np

from actors.model.loader import DEFAULT_MODEL, load_tokenizer
from speculators.datastore import tokenizer_fingerprint, write_datastore

BATCH = 1024
"""Documents tokenized per call: the fast tokenizer's batch, and what is held as text at once."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the target whose tokenizer the datastore is for")
    parser.add_argument("--corpus", type=Path, nargs="+", required=True, help=".txt or .jsonl files")
    parser.add_argument("--out", type=Path, required=True, help="the datastore folder to write")
    parser.add_argument("--split", choices=["blocks", "lines"], default="blocks",
                        help=".txt files: a document per blank-line-separated block, or per line")


def documents(path: Path, split: str = "blocks") -> Iterator[str]:
    """The documents of one corpus file (blank ones left out)."""
    if path.suffix == ".jsonl":
        with path.open() as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    record = json.loads(line)
                    if not isinstance(record.get("text"), str):
                        raise ValueError(f"{path}:{number}: a record without a \"text\" string")
                    yield record["text"]
        return
    if path.suffix != ".txt":
        raise ValueError(f"{path}: a corpus file is .txt or .jsonl")
    text = path.read_text()
    parts = text.splitlines() if split == "lines" else text.split("\n\n")
    yield from (part.strip() for part in parts if part.strip())


def tokenized(tokenizer, texts: Iterable[str]) -> Iterator[np.ndarray]:
    """Token ids of each text, BATCH texts per tokenizer call."""
    texts = iter(texts)
    while batch := list(islice(texts, BATCH)):
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            yield np.asarray(ids, np.int32)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    tokenizer = load_tokenizer(args.model)
    texts = (text for path in args.corpus for text in documents(path, args.split))
    manifest = write_datastore(args.out, tokenized(tokenizer, texts), tokenizer_fingerprint(tokenizer),
                               len(tokenizer), model=args.model, corpus=[str(path) for path in args.corpus])
    size = sum(file.stat().st_size for file in args.out.iterdir())
    print(f"{args.out}: {manifest['tokens']} tokens in {manifest['documents']} documents, "
          f"{size / 1e6:.1f} MB, {time.perf_counter() - started:.1f} s")
    return 0
