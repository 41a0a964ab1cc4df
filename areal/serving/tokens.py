"""Tokens as text: what the server says a token is (logprobs entries), and ``/tokenize`` and
``/detokenize`` as vLLM's and SGLang's clients call them.

A byte-level BPE token may be part of a UTF-8 character (or, with a random model, a byte that
starts none). Two renderings, for two uses:

- :meth:`TokenText.pieces`: each generated token's share of the decoded text (an incremental
  UTF-8 decode of the tokens' bytes): a token that starts a character gets ``""`` and the one
  that completes it the whole character, a byte that can never be text ``"\\ufffd"`` (as the
  text itself shows it). Joined, the pieces are the text, so ``logprobs.tokens`` (completions),
  ``logprobs.content[].token`` (chat) and ``text_offset`` agree with the text.
- :meth:`TokenText.token_str`: a token alone, as a key of completions' ``top_logprobs`` dicts
  and of chat's alternatives: its text, or ``bytes:\\xNN..`` when its bytes are not UTF-8 on their
  own, so distinct alternatives never share a key. Chat entries carry the exact ``bytes`` too.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from typing import Any, NotRequired, TypedDict

from transformers.convert_slow_tokenizer import bytes_to_unicode

from areal.serving.requests import BadRequest, json_type
from areal.serving.tools import clean_messages

_BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}  # byte-level BPE's char -> byte


class Tokenized(TypedDict):
    """The answer to ``POST /tokenize``."""

    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: NotRequired[list[str]]  # with "return_token_strs": true


class TokenText:
    """Text <-> token ids through one HF tokenizer."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> token ids."""
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Token ids -> text."""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, tok: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE token may be part of a character)."""
        piece = self.tokenizer.convert_ids_to_tokens(tok)
        if isinstance(piece, str) and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        return self.tokenizer.decode([tok]).encode()

    def token_str(self, tok: int) -> str:
        """One token alone: its text, or ``bytes:\\xNN...`` when its bytes are not valid UTF-8
        on their own (so distinct tokens never share a key)."""
        raw = self.token_bytes(tok)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def pieces(self, ids: list[int]) -> list[str]:
        """Each token's share of the text of ``ids`` (see the module docstring)."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        out = [decoder.decode(self.token_bytes(t)) for t in ids]
        if out:
            out[-1] += decoder.decode(b"", final=True)  # an unfinished character at the end
        return out


def parse_tokenize(
    body: Any,
    text: TokenText,
    apply_template: Callable[[list[dict], None, bool], list[int]],
    context_length: int,
) -> Tokenized:
    """``POST /tokenize``: ``{"prompt": str, "add_special_tokens"?}`` (vLLM and SGLang) or
    ``{"messages": [...], "add_generation_prompt"?}`` (vLLM's chat form) -> ``{"tokens",
    "count", "max_model_len"}``; ``"return_token_strs": true`` adds each token's string.
    ``apply_template(messages, tools, add_generation_prompt)`` renders the chat form."""
    if not isinstance(body, dict):
        raise BadRequest("body", f"expected a JSON object, got {json_type(body)}")
    unknown = set(body) - {
        "model",
        "prompt",
        "messages",
        "add_special_tokens",
        "add_generation_prompt",
        "return_token_strs",
    }
    if unknown:
        raise BadRequest(sorted(unknown)[0], "unknown parameter; send prompt or messages")
    flags = {
        name: _flag(body, name, default)
        for name, default in (
            ("add_special_tokens", True),
            ("add_generation_prompt", True),
            ("return_token_strs", False),
        )
    }
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise BadRequest("prompt", "send exactly one of a prompt string or a messages list")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise BadRequest("prompt", f"expected a string, got {json_type(prompt)}")
        ids = text.encode(prompt, add_special_tokens=flags["add_special_tokens"])
    else:
        ids = apply_template(clean_messages(messages), None, flags["add_generation_prompt"])
    out: Tokenized = {"tokens": ids, "count": len(ids), "max_model_len": context_length}
    if flags["return_token_strs"]:
        out["token_strs"] = [text.token_str(t) for t in ids]
    return out


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(name, f"expected true or false, got {json_type(value)}")
    return value


def parse_detokenize(body: Any, text: TokenText, vocab_size: int) -> dict:
    """``POST /detokenize`` ``{"tokens": [ids]}`` -> ``{"prompt": text}`` (vLLM) with the same
    text under ``"text"`` (SGLang)."""
    if not isinstance(body, dict) or set(body) - {"model", "tokens", "skip_special_tokens"}:
        raise BadRequest("body", 'expected {"tokens": [token ids]}')
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids
    ):
        raise BadRequest(
            "tokens", f"expected a list of token ids in [0, {vocab_size}), got {str(ids)[:80]}"
        )
    decoded = text.decode(ids, skip_special_tokens=_flag(body, "skip_special_tokens", False))
    return {"prompt": decoded, "text": decoded}
