"""Stop strings checked incrementally: each step decodes only the newest tokens (with a few
before them as context) and searches only where a stop string could newly end, so a request's
check costs O(new text), not a decode of its whole output per token.

The text is built as vLLM's incremental detokenizer builds it: the new tokens are decoded
together with the ones read at the previous advance (``prefix``), so a tokenizer that renders a
token differently after another (SentencePiece's leading space) gives the text one decode of the
whole output gives. A tail that ends inside a multi-byte character (decoded as U+FFFD) stays
pending, searched but not settled, until the tokens that complete it come.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"  # what a decode of a partial UTF-8 sequence ends with


class StopText:
    """The decoded output of one request with stop strings, and how far it was searched."""

    def __init__(self, stops: tuple[str, ...], decode: Callable[[list[int]], str]):
        self.stops = stops
        self.decode = decode
        self.text = ""  # the settled text of the output's tokens before ``read``
        self.prefix = 0  # tokens from here on are decoded together with the new ones
        self.read = 0  # tokens before this are in ``text``
        self.searched = 0  # characters of ``text`` no new occurrence can end within

    def search(self, out: list[int], allowed: bool) -> str | None:
        """Read the tokens of ``out`` past those read; when ``allowed`` (the request is past its
        ``min_new_tokens``) return the first stop string (in the request's order) the output's
        text now holds, else None. Called at every token."""
        before = self.decode(out[self.prefix : self.read]) if self.read > self.prefix else ""
        now = self.decode(out[self.prefix :])
        pending = now[len(before) :] if len(now) > len(before) else ""
        if pending and not now.endswith(REPLACEMENT):
            self.text += pending
            self.prefix, self.read = self.read, len(out)
            pending = ""
        if not allowed:
            return None
        text = self.text + pending
        for stop in self.stops:
            if stop in text[max(0, self.searched - len(stop) + 1) :]:
                return stop
        self.searched = len(self.text)
        return None


def decoder(tokenizer) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` as stop strings need it (special tokens kept): for a fast tokenizer
    that cleans up no spaces, its Rust decoder, which returns the same text without
    transformers' per-call conversions (about 3x less time per call, and stop strings decode at
    every token)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: tokenizer.decode(ids)
    return lambda ids: backend.decode(ids, skip_special_tokens=False)
