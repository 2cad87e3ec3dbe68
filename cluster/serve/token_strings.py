"""Each token's own text and bytes, for log-probabilities on both protocols."""
from __future__ import annotations

import json
from functools import lru_cache


def _printable_bytes() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): each byte is written as one printable character, the
    printable ASCII and Latin-1 bytes as themselves and the others as characters from U+0100 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters, extra = {}, 0
    for byte in range(256):
        if byte in kept:
            characters[chr(byte)] = byte
        else:
            characters[chr(256 + extra)] = byte
            extra += 1
    return characters


class TokenStrings:
    """A byte-level BPE token (GPT-2, Llama 3, SmolLM2) gives its raw bytes, so a token holding part
    of a character reports what it really holds; other tokenizers' tokens give the UTF-8 of their
    text. Built once per tokenizer (reading its decoder type parses the whole tokenizer)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
        self._alphabet = _printable_bytes() if (decoder or {}).get("type") == "ByteLevel" else None
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _bytes(self, token: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if self._alphabet is not None and piece and all(c in self._alphabet for c in piece):
            return [self._alphabet[c] for c in piece]
        return list(self.text(token).encode("utf-8"))
