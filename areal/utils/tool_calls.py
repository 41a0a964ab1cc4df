"""Parsing a model's tool calls out of its answer: Hermes-style blocks, the format Qwen2.5 and
our tiny model use::

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

Pure text in, OpenAI-shaped ``tool_calls`` out, shared by the server's chat completions
(areal.serving.tools) and the in-process OpenAI client of agent workflows
(areal.workflow.openai_client), so both read a model's answer the same way.
"""

from __future__ import annotations

import json
import re
import uuid

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


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
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls
