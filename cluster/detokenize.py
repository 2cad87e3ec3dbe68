"""Streaming text from streamed token ids, for every front end.

Decoding each token alone breaks multi-byte characters and merges; so the whole output is decoded
and only the new suffix is sent. Text is held back while it ends in an incomplete character, or
while its tail could still become a stop string (a stop string is never sent, even in part).
"""
from __future__ import annotations

from collections.abc import Sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.tokens: list[int] = []
        self.sent = ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Text that is now safe to send."""
        self.tokens.extend(token_ids)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        safe = text[: len(text) - self.hold] if self.hold else text
        return self._advance(safe)

    def finish(self, final_text: str) -> str:
        """The rest of the engine's final text (already cut at a stop string)."""
        return self._advance(final_text)

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent):], text
        return new
