"""What suffix decoding's index of earlier outputs costs: memory per learned token (tracemalloc), the
learning time per token, and the latency of a draft worker's `propose` right after a big `release`
(the outputs of a finished batch), learned in `release` and by the background learner.

Token sequences are Spec-Bench's questions (bench/data/specbench) through the default model's
tokenizer, at the serving default depth (24).

    .venv/bin/python -m bench.suffix_index [--release-tokens 4096] [--calls 30]
"""
from __future__ import annotations

import argparse
import gc
import json
import pickle
import statistics
import time
import tracemalloc

from actors.draft_worker import DraftWorker
from actors.model.loader import DEFAULT_MODEL, load_tokenizer, resolve_model
from bench.specbench import DEFAULT_QUESTIONS
from speculators.proposers.base import DraftRequest
from speculators.proposers.suffix import MAX_DEPTH, SuffixCache, SuffixProposer

BATCH, CONTEXT = 8, 512
"""Requests per propose call and their context length."""


def documents() -> list[list[int]]:
    tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
    questions = [json.loads(line) for line in DEFAULT_QUESTIONS.read_text().splitlines() if line.strip()]
    return [tokenizer.encode(turn) for question in questions for turn in question["turns"]]


def memory(docs: list[list[int]]) -> dict:
    """Bytes per learned token as allocated (the documents arrive as new int objects, as from the
    engine), against the cache's own estimate; and the learning time per token."""
    copies = pickle.loads(pickle.dumps(docs))
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cache = SuffixCache(MAX_DEPTH, 10**9)
    for doc in copies:
        cache.add(doc)
    copies = None
    gc.collect()
    allocated = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    began = time.perf_counter()
    timed = SuffixCache(MAX_DEPTH, 10**9)
    for doc in docs:
        timed.add(doc)
    seconds = time.perf_counter() - began
    return {"tokens": cache.tokens, "bytes_per_token": round(allocated / cache.tokens),
            "estimated_bytes_per_token": round(cache.bytes / cache.tokens),
            "learn_us_per_token": round(seconds / cache.tokens * 1e6, 2)}


def latency(docs: list[list[int]], background: bool, release_tokens: int, calls: int) -> dict:
    """`propose` latency (median, worst), and release + propose, right after releasing
    `release_tokens` tokens of outputs (the worker's next call after a batch ends); the batch's
    requests are running ones (each call adds 3 committed tokens to each, as a decode step does)."""
    worker = DraftWorker(SuffixProposer, learn_in_background=background)
    stream = [token for doc in docs for token in doc]
    worker.release([], [stream[i:i + 4096] for i in range(0, 32768, 4096)])  # an index in use
    worker.flush()
    begins = {f"r{b}": 40000 + 2048 * b for b in range(BATCH)}  # where each request's text is in the stream
    sequences = {rid: stream[begin:begin + CONTEXT] for rid, begin in begins.items()}
    worker.propose([DraftRequest(request_id=rid, token_ids=tokens, num_speculative_tokens=8, max_nodes=16)
                    for rid, tokens in sequences.items()])
    propose_ms, total_ms = [], []
    for call in range(calls):
        start = (call * release_tokens) % (len(stream) - release_tokens)
        novel = stream[start:start + release_tokens][::-1]  # text read backwards: new to the index
        outputs = [novel[i:i + 512] for i in range(0, release_tokens, 512)]
        requests = []
        for rid, tokens in sequences.items():
            tokens.extend(stream[begins[rid] + len(tokens):begins[rid] + len(tokens) + 3])
            requests.append(DraftRequest(request_id=rid, token_ids=tokens, num_speculative_tokens=8, max_nodes=16))
        began = time.perf_counter()
        worker.release([], outputs)
        released = time.perf_counter()
        worker.propose(requests)
        done = time.perf_counter()
        propose_ms.append((done - released) * 1e3)
        total_ms.append((done - began) * 1e3)
        worker.flush()
    return {"propose_ms_median": round(statistics.median(propose_ms), 3), "propose_ms_max": round(max(propose_ms), 3),
            "release_and_propose_ms_median": round(statistics.median(total_ms), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release-tokens", type=int, default=4096, help="tokens of outputs released before each propose")
    parser.add_argument("--calls", type=int, default=30, help="timed propose calls per mode")
    args = parser.parse_args()
    docs = documents()
    report = {"memory": memory(docs)}
    report["nothing_to_learn"] = latency(docs, False, 0, args.calls)
    for background in (False, True):
        report["background" if background else "in_release"] = latency(docs, background, args.release_tokens, args.calls)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
