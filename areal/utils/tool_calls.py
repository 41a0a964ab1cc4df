"""Parsing a model's tool calls out of its answer: Hermes-style blocks, the format Qwen2.5 and
our tiny model use::

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

Pure text in, OpenAI-shaped ``tool_calls`` out, shared by the server's chat completions
(areal.serving.tools) and the in-process OpenAI client of agent workflows
(areal.workflow.openai_client), so both read a model's answer the same way.

Both also force calls the same way (:func:`tool_choice_prefill`, OpenAI's ``tool_choice``
without constrained decoding): ``required`` opens the assistant's answer with ``<tool_call>\n``,
so the model writes a call and picks the function; ``{"type": "function", "function": {"name":
F}}`` opens it with ``<tool_call>\n{"name": "F", "arguments": `` so the model writes F's
arguments. The opening is prompt (the model is conditioned on it, never trained on it) and leads
the text that is parsed; a continuation that still makes no valid call comes back as text.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
CALL_OPEN = "<tool_call>\n"  # how a Hermes-style call begins (see the chat template)


class ToolChoiceError(ValueError):
    """An invalid ``tool_choice``; ``detail`` says what is wrong without the field name (the
    server wraps it into its HTTP 400, the in-process client raises it as is)."""

    def __init__(self, detail: str):
        self.detail = detail
        super().__init__(f"tool_choice: {detail}")


def tool_choice_prefill(choice: Any, names: list[str] | None) -> str:
    """The text that opens the assistant's answer for ``tool_choice`` (empty for ``auto`` and
    ``none``), given the request's tool names (None: the request has no tools).

    Raises :class:`ToolChoiceError` for a choice that needs tools the request lacks, a malformed
    choice, or a function not among ``names``.
    """
    if choice in ("auto", "none"):
        return ""
    if names is None:
        raise ToolChoiceError(
            f"{json.dumps(choice, default=repr)[:120]} needs tools; pass tools=[...] or use 'auto'"
        )
    if choice == "required":
        return CALL_OPEN
    fn = choice.get("function") if isinstance(choice, dict) else None
    if (
        not isinstance(fn, dict)
        or choice.get("type") != "function"
        or not isinstance(fn.get("name"), str)
    ):
        raise ToolChoiceError(
            "expected 'auto', 'none', 'required' or {\"type\": \"function\", \"function\": "
            f'{{"name": ...}}}}, got {json.dumps(choice, default=repr)[:120]}'
        )
    if fn["name"] not in names:
        raise ToolChoiceError(
            f"names function {fn['name']!r}, which is not among the tools {names}"
        )
    return f'{CALL_OPEN}{{"name": {json.dumps(fn["name"])}, "arguments": '


def extract_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content outside the tool-call blocks or None, the parsed calls) of a model's answer.

    Each well-formed block (JSON with a string ``name``) becomes one OpenAI tool call with its
    ``arguments`` as a JSON string; a malformed block stays in the content as the model wrote it.
    """
    calls, kept = [], []
    last = 0
    for m in _BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        kept.append(text[last : m.start()])
        last = m.end()
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls
