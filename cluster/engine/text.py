"""The text of one request's output as its tokens arrive: detokenizing and stop strings, in one place.

Decoding each token alone breaks multi-byte characters and merges, so the whole output is decoded
and only the new suffix is released. Text is held back while it ends in an incomplete character, or
while its tail could still become a stop string (a stop string is never sent, even in part). When a
stop string appears, the output ends before it, and the tokens past it are dropped.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class TextUpdate:
    text: str
    """Text now safe to send."""
    stopped: bool = False
    """A stop string ended the output: `OutputText.tokens` was cut back to the tokens before it."""


class OutputText:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.sent = ""
        self.final: str | None = None
        """The whole text once a stop string cut it."""

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def add(self, token_ids: Sequence[int]) -> TextUpdate:
        """Take new tokens; say what text is now safe and whether a stop string ended the output."""
        self.tokens.extend(token_ids)
        text = self._decode(self.tokens)
        hits = [text.find(stop) for stop in self.stop if stop in text]
        if hits:
            return self._cut(text, min(hits))
        if text.endswith("\ufffd"):
            return TextUpdate("")
        return TextUpdate(self._advance(text[: len(text) - self.hold] if self.hold else text))

    def _cut(self, text: str, cut: int) -> TextUpdate:
        """End the output at a stop string: keep the fewest tokens whose text covers what precedes it."""
        keep = len(self.tokens)
        while keep > 0 and len(self._decode(self.tokens[: keep - 1])) >= cut:
            keep -= 1
        del self.tokens[keep:]
        self.final = text[:cut]
        return TextUpdate(self._advance(self.final), stopped=True)

    def text(self) -> str:
        """The whole output text as it stands (cut at the stop string when one was found)."""
        return self.final if self.final is not None else self._decode(self.tokens)

    def finish(self) -> str:
        """The text held back so far: the output has ended, so nothing can complete a stop string."""
        return self._advance(self.text())

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent):], text
        return new
