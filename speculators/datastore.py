"""REST's datastore: a tokenized corpus and its suffix array, written once, read memory-mapped.

A folder of three files:
- `tokens.npy`: int32, every document's token ids, one SEPARATOR between documents (so no match
  and no continuation runs from one document into the next);
- `suffixes.npy`: its suffix array (speculators/suffix_array.py), int32 (int64 past 2^31 tokens);
- `manifest.json`: format version, counts, and the fingerprint of the tokenizer that made the ids,
  so a datastore is never read with another target's tokenizer.

Both arrays are opened with `np.load(mmap_mode="r")`: every drafter on a node reads the same page
cache, and a lookup touches only the pages its binary search and continuations land on. 4 bytes a
token for the text and 4 (8) for the suffix array.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speculators.suffix_array import build_suffix_array, occurrences

FORMAT_VERSION = 1
TOKENS, SUFFIXES, MANIFEST = "tokens.npy", "suffixes.npy", "manifest.json"
SEPARATOR = -1
"""Between documents: below every token id, so it sorts first and never equals a context token."""


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the tokenizer's vocabulary (token text -> id, added tokens included): what token
    ids mean. Two tokenizers with the same one read the same datastore."""
    vocabulary = sorted(tokenizer.get_vocab().items())
    return "sha256:" + hashlib.sha256(json.dumps(vocabulary).encode()).hexdigest()


def read_manifest(path: str | Path) -> dict:
    """The manifest of a datastore folder, checked to be one this code reads (ValueError if not)."""
    folder = Path(path)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{folder} is not a readable REST datastore ({error}); build one with "
                         "`specserve build-datastore`") from error
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"{folder}: datastore format {manifest.get('format')!r}, this code reads {FORMAT_VERSION}")
    for name in (TOKENS, SUFFIXES):
        if not (folder / name).is_file():
            raise ValueError(f"{folder}: {name} is missing")
    return manifest


def write_datastore(path: str | Path, documents: Iterable[Sequence[int]], tokenizer_id: str, vocab_size: int,
                    **about) -> dict:
    """Write the documents' token ids as a datastore folder; `about` goes into the manifest as is
    (the model, the corpus files). Returns the manifest."""
    parts, count = [], 0
    for document in documents:
        if len(document):
            parts += [np.asarray(document, dtype=np.int32), np.array([SEPARATOR], np.int32)]
            count += 1
    tokens = np.concatenate(parts) if parts else np.empty(0, np.int32)
    if len(tokens) and (tokens.max() >= vocab_size):
        raise ValueError(f"token id {tokens.max()} is outside the vocabulary of {vocab_size}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / TOKENS, tokens)
    np.save(folder / SUFFIXES, build_suffix_array(tokens))
    manifest = {"format": FORMAT_VERSION, "tokenizer": tokenizer_id, "vocab_size": vocab_size,
                "tokens": int(len(tokens) - count), "documents": count, **about}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


@dataclass(frozen=True)
class Datastore:
    """A datastore opened read-only: the lookups REST drafts with."""

    tokens: np.ndarray
    suffixes: np.ndarray
    manifest: dict

    @classmethod
    def open(cls, path: str | Path) -> Datastore:
        manifest = read_manifest(path)
        folder = Path(path)
        return cls(np.load(folder / TOKENS, mmap_mode="r"), np.load(folder / SUFFIXES, mmap_mode="r"), manifest)

    def longest_match(self, context: Sequence[int], max_length: int, min_length: int) -> tuple[int, int, int] | None:
        """(lo, hi, length): the suffix-array range of the longest suffix of `context`, between
        `min_length` and `max_length` tokens, that occurs in the corpus; None if none does. A
        binary search on the length, since every suffix of a run that occurs occurs too."""
        best, low, high = None, min_length, min(max_length, len(context))
        while low <= high:
            length = (low + high) // 2
            lo, hi = occurrences(self.tokens, self.suffixes, context[len(context) - length:])
            if hi > lo:
                best, low = (lo, hi, length), length + 1
            else:
                high = length - 1
        return best

    def follows(self, lo: int, hi: int, length: int, depth: int, limit: int) -> list[list[int]]:
        """Up to `depth` tokens that followed the occurrences in suffix-array range [lo, hi) of a
        run of `length` tokens, for at most `limit` of them, evenly spaced over the range: the
        range is sorted by what follows, so even spacing keeps each continuation's share of the
        whole range (the first `limit` would all start with the smallest token ids). A
        continuation ends at its document's end; empty ones are left out."""
        taken = min(hi - lo, limit)
        picks = lo + np.arange(taken, dtype=np.int64) * (hi - lo) // taken
        window = np.asarray(self.suffixes[picks], np.int64)[:, None] + length + np.arange(depth)
        rows = np.where(window < len(self.tokens), self.tokens[np.minimum(window, len(self.tokens) - 1)], SEPARATOR)
        ends = np.where((rows == SEPARATOR).any(axis=1), (rows == SEPARATOR).argmax(axis=1), depth)
        return [row[:end] for row, end in zip(rows.tolist(), ends.tolist()) if end]
