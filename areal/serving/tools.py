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
``tool_choice`` (OpenAI's semantics, with constrained decoding: constraints.py):

- ``auto`` (the default with tools): the model decides; calls are parsed.
- ``none``: the tools are still rendered (they may shape the answer) but no call is parsed.
- ``required``: the answer is constrained to tool-call blocks, each naming one of the tools and
  carrying arguments that match that tool's ``parameters`` schema.
- ``{"type": "function", "function": {"name": F}}``: the same with F only.

A forced answer is one call, or with ``parallel_tool_calls`` (the default) one or more calls
separated by newlines; it always parses unless ``max_tokens`` cuts it (``finish_reason``
``length``, the partial text as ``content``). With ``parallel_tool_calls: false`` only the first
call is returned. A tool's ``"strict": true`` makes unsupported schema keywords a 400 instead of
being ignored.
"""

from __future__ import annotations

from typing import Any

from areal.serving.constraints import Constraint
from areal.serving.requests import BadRequest, json_type
from areal.utils.tool_calls import (
    ToolChoiceError,
    extract_tool_calls,
    tool_call_grammar,
    tool_choice_prefill,
)

__all__ = ["clean_messages", "extract_tool_calls", "parse_tools"]


def parse_tools(body: dict) -> tuple[list[dict] | None, bool, Constraint | None, bool]:
    """(``tools`` for the chat template or None, whether to parse tool calls, the grammar a
    forced call follows or None, whether several calls may come) from a request."""
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto")
    parallel = body.get("parallel_tool_calls")
    if parallel not in (None, True, False):
        raise BadRequest("parallel_tool_calls", f"expected true or false, got {str(parallel)[:40]}")
    if tools is not None:
        if not isinstance(tools, list) or not tools:
            raise BadRequest(
                "tools", "expected a non-empty list of {type: function, function: {...}}"
            )
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if (
                not isinstance(t, dict)
                or t.get("type") != "function"
                or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str)
                or not fn["name"]
            ):
                raise BadRequest(
                    f"tools[{i}]", 'expected {"type": "function", "function": {"name": ...}}'
                )
            if "parameters" in fn and not isinstance(fn["parameters"], dict):
                raise BadRequest(
                    f"tools[{i}].function.parameters",
                    f"expected a JSON schema object, got {json_type(fn['parameters'])}; send "
                    "the schema object itself (not JSON text), or leave parameters out",
                )
            if fn.get("strict") not in (None, True, False):
                raise BadRequest(
                    f"tools[{i}].function.strict",
                    f"expected true or false, got {json_type(fn['strict'])}",
                )
    try:  # validates the choice; a forced one is constrained rather than prefilled here
        forced = tool_choice_prefill(
            choice, None if tools is None else [t["function"]["name"] for t in tools]
        )
    except ToolChoiceError as e:
        raise BadRequest("tool_choice", e.detail) from e
    constraint = None
    if forced:
        named = choice["function"]["name"] if isinstance(choice, dict) else None
        fns = [t["function"] for t in tools if named in (None, t["function"]["name"])]  # type: ignore[union-attr]
        constraint = Constraint("lark", tool_call_grammar(fns, parallel is not False), "tools")
    return tools, tools is not None and choice != "none", constraint, parallel is not False


def clean_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls``, checked, for the chat template."""
    if not isinstance(calls, list):
        raise BadRequest(where, "expected a list of tool calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments"), str)
        ):
            raise BadRequest(
                f"{where}[{j}]",
                'expected {"id", "type": "function", "function": '
                '{"name": str, "arguments": JSON string}}',
            )
        out.append(
            {
                "id": str(c.get("id", "")),
                "type": "function",
                "function": {"name": fn["name"], "arguments": fn["arguments"]},
            }
        )
    return out


def clean_messages(messages: Any, where: str = "messages") -> list[dict]:
    """Chat ``messages`` checked and reduced to what the chat template takes: ``{role,
    content}`` (text content parts joined), an assistant's ``tool_calls``, a tool turn's
    ``tool_call_id``; a 400 naming the first bad message and what it holds otherwise."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest(
            where,
            f"expected a non-empty list of {{role, content}} objects, got "
            f"{'an empty array' if messages == [] else json_type(messages)}",
        )
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            got = json_type(m) if not isinstance(m, dict) else f"role {json_type(m.get('role'))}"
            raise BadRequest(
                f"{where}[{i}]",
                f"expected an object with a string role, got {got}; send "
                '{"role": "user", "content": "..."}',
            )
        content = m.get("content")
        if m.get("tool_calls") is not None and m["role"] == "assistant":  # an agent's call turn
            calls = clean_tool_calls(m["tool_calls"], f"{where}[{i}].tool_calls")
            clean.append({"role": "assistant", "content": content or "", "tool_calls": calls})
            continue
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise BadRequest(
                f"{where}[{i}].tool_call_id", "a tool message needs the tool_call_id it answers"
            )
        if isinstance(content, list):  # content parts: keep the text ones
            if not all(isinstance(c, dict) and c.get("type") == "text" for c in content):
                raise BadRequest(f"{where}[{i}].content", "only text content parts are supported")
            content = "".join(str(c.get("text", "")) for c in content)
        if not isinstance(content, str):
            raise BadRequest(
                f"{where}[{i}].content",
                f"expected a string or a list of text parts, got {json_type(content)}",
            )
        clean.append({"role": m["role"], "content": content})
    return clean
