"""Bounded work before admission: what a request body may hold before the server parses it.

Every limit is a ``server.*`` field (``GenerationServerConfig``): the body's bytes
(``max_body_bytes``, checked by the HTTP layer), then, on the parsed JSON and before anything
is tokenized or rendered, its nesting depth (``max_json_depth``) and the characters of all its
strings together (``max_text_chars``). A string holding a lone UTF-16 surrogate (``"\\ud800"``
is valid JSON but no text) is refused here too: the tokenizer and the chat template cannot take
it. Each refusal is a :class:`BadRequest` naming the top-level field it was found under.
"""

from __future__ import annotations

import json
from typing import Any

from areal.serving.protocol import BadRequest


def loads(raw: bytes) -> Any:
    """Parse a request body; malformed or too deeply nested JSON is a BadRequest naming body."""
    try:
        return json.loads(raw)
    except RecursionError:  # the C parser's recursion guard: deeper than the interpreter allows
        raise BadRequest(
            "body", "JSON nested too deeply to parse; send at most a few dozen levels"
        ) from None
    except json.JSONDecodeError as e:
        raise BadRequest("body", f"malformed JSON ({e.msg} at position {e.pos})") from None
    except UnicodeDecodeError as e:
        raise BadRequest("body", f"not UTF-8 ({e.reason} at byte {e.start})") from None


def check_body(body: Any, max_depth: int, max_chars: int) -> None:
    """Walk ``body`` (iteratively: no recursion however deep) and refuse nesting deeper than
    ``max_depth``, more than ``max_chars`` characters in all strings together (object keys
    included), and strings with lone surrogates."""
    chars = 0
    stack: list[tuple[Any, int, str]] = [(body, 1, "body")]
    while stack:
        value, depth, field = stack.pop()
        if isinstance(value, str):
            chars += len(value)
            if chars > max_chars:
                raise BadRequest(
                    field,
                    f"the request's strings hold more than {max_chars} characters "
                    "together (server.max_text_chars); send less text or raise the limit",
                )
            if not value.isascii():
                _check_utf8(value, field)
        elif isinstance(value, (list, dict)):
            if depth > max_depth:
                raise BadRequest(
                    field,
                    f"nested deeper than {max_depth} levels (server.max_json_depth); "
                    "flatten it or raise the limit",
                )
            if isinstance(value, dict):
                for key, item in value.items():
                    stack.append((key, depth, key if field == "body" else field))
                    stack.append((item, depth + 1, key if field == "body" else field))
            else:
                stack.extend((item, depth + 1, field) for item in value)


def _check_utf8(value: str, field: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(
            field,
            f"holds a lone surrogate ({value[e.start]!a} at character {e.start}), which "
            "is not text; send valid UTF-16 pairs or the character itself",
        ) from None
