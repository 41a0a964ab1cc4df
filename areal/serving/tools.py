"""OpenAI tool calling on chat completions: the request's ``tools`` are rendered by the model's
chat template (which must use them), assistant turns with ``tool_calls`` and ``tool`` turns are
passed to it, and the model's answer is parsed for Hermes-style blocks, the format Qwen2.5 and
our tiny model use::

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

Each well-formed block becomes one entry of ``message.tool_calls`` (arguments as a JSON string)
and the finish reason is ``tool_calls``; text outside the blocks stays the content. A block that
is not valid JSON with a ``name`` is left in the content, as the model wrote it.
``tool_choice`` (OpenAI's semantics, without constrained decoding; the rule is
areal.utils.tool_calls.tool_choice_prefill, shared with the in-process agent client):

- ``auto`` (the default with tools): the model decides; calls are parsed.
- ``none``: the tools are still rendered (they may shape the answer) but no call is parsed.
- ``required``: the assistant turn is prefilled with ``<tool_call>\n``, so the model writes a
  call and picks the function.
- ``{"type": "function", "function": {"name": F}}``: the turn is prefilled with
  ``<tool_call>\n{"name": "F", "arguments": `` so the model writes F's arguments.

The prefill is appended to the prompt (counted in ``usage.prompt_tokens``) and leads the text
that is parsed; when the model's continuation still makes no valid call (bad JSON, a block
never closed before ``max_tokens``), the answer comes back as is, the prefill leading
``content``, with the generator's ``finish_reason`` (``stop`` | ``length``): the server does not
force valid JSON.
"""

from __future__ import annotations

from typing import Any

from areal.serving.protocol import BadRequest
from areal.utils.tool_calls import ToolChoiceError, extract_tool_calls, tool_choice_prefill  # shared with agents

__all__ = ["clean_tool_calls", "extract_tool_calls", "parse_tools"]


def parse_tools(body: dict) -> tuple[list[dict] | None, bool, str]:
    """(``tools`` for the chat template or None, whether to parse tool calls, the text that
    opens the assistant's answer: empty unless ``tool_choice`` forces a call) from a request."""
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto")
    if body.get("parallel_tool_calls") not in (None, True, False):
        raise BadRequest("parallel_tool_calls", "expected true or false")
    if tools is not None:
        if not isinstance(tools, list) or not tools:
            raise BadRequest("tools", "expected a non-empty list of {type: function, function: {...}}")
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                    or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise BadRequest(f"tools[{i}]", "expected {\"type\": \"function\", \"function\": {\"name\": ...}}")
            if "parameters" in fn and not isinstance(fn["parameters"], dict):
                raise BadRequest(f"tools[{i}].function.parameters", "expected a JSON schema object")
    try:
        prefill = tool_choice_prefill(choice, None if tools is None else [t["function"]["name"] for t in tools])
    except ToolChoiceError as e:
        raise BadRequest("tool_choice", e.detail) from e
    return tools, tools is not None and choice != "none", prefill


def clean_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls``, checked, for the chat template."""
    if not isinstance(calls, list):
        raise BadRequest(where, "expected a list of tool calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise BadRequest(f"{where}[{j}]", "expected {\"id\", \"type\": \"function\", \"function\": "
                             "{\"name\": str, \"arguments\": JSON string}}")
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out
