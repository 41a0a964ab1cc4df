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
- ``{"type": "function", "function": {"name": F}}``: exactly one call of F (as OpenAI and vLLM
  answer it): generation ends when the call closes.

A forced answer is calls only (``content`` null): ``required`` one call, or with
``parallel_tool_calls`` (the default) one or more separated by newlines. Where ``max_tokens``
cuts it, the calls written so far are returned with ``finish_reason`` ``length``, the last one
partial (its ``arguments`` as far as written; a ``required`` call cut before its name is
complete is dropped), never the raw ``<tool_call>`` text. With ``auto`` and
``parallel_tool_calls: false`` only the first call is returned. This reading,
areal.utils.tool_calls.answer_calls, is the in-process agent client's too. A tool's ``"strict":
true`` makes unsupported schema keywords a 400 instead of being ignored; its ``parameters``
objects allow only the properties they name unless they set ``additionalProperties``
(``server.json_schema_additional_properties``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areal.serving.constraints import Constraint
from areal.serving.requests import BadRequest, json_type
from areal.utils.tool_calls import (
    TOOL_CALL_SHAPE,
    ToolChoiceError,
    answer_calls,
    clean_tool_call,
    extract_tool_calls,
    tool_call_grammar,
    tool_choice_prefill,
)

__all__ = ["answer_calls", "clean_messages", "extract_tool_calls", "parse_tools"]


@dataclass(frozen=True)
class ToolUse:
    """What a chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` ask for."""

    tools: list[dict] | None  # for the chat template
    parse_calls: bool  # read calls out of the answer (tools given, tool_choice not "none")
    constraint: Constraint | None  # the grammar a forced answer follows
    parallel: bool  # several calls may come
    forced: bool = False  # tool_choice "required" or named: the answer is calls only
    named: str | None = None  # the function a named tool_choice forces


def parse_tools(body: dict, additional_properties: bool) -> ToolUse:
    """The request's :class:`ToolUse`; a forced call's grammar (tools' parameter schemas per
    ``server.json_schema_additional_properties``, ``additional_properties``): a named choice
    exactly one call of that function, ``required`` one call or, with ``parallel_tool_calls``
    (the default), one or more."""
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto")
    parallel = body.get("parallel_tool_calls")
    if parallel not in (None, True, False):
        raise BadRequest("parallel_tool_calls", f"expected true or false, got {str(parallel)[:40]}")
    if tools is not None:
        _check_tools(tools)
    try:  # validates the choice; a forced one is constrained rather than prefilled here
        forced = tool_choice_prefill(
            choice, None if tools is None else [t["function"]["name"] for t in tools]
        )
    except ToolChoiceError as e:
        raise BadRequest("tool_choice", e.detail) from e
    parse_calls = tools is not None and choice != "none"
    if not forced or tools is None:  # forced needs tools (tool_choice_prefill checks)
        return ToolUse(tools, parse_calls, None, parallel is not False)
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    fns = [t["function"] for t in tools if named in (None, t["function"]["name"])]
    several = parallel is not False and named is None  # a named choice: that one call, no more
    grammar = tool_call_grammar(fns, several, additional_properties=additional_properties)
    return ToolUse(tools, True, Constraint("lark", grammar, "tools"), several, True, named)


def _check_tools(tools: Any) -> None:
    """``tools``: a non-empty list of ``{"type": "function", "function": {"name", "parameters":
    a schema object, "strict": bool}}``; a 400 naming the first bad one otherwise."""
    if not isinstance(tools, list) or not tools:
        raise BadRequest("tools", "expected a non-empty list of {type: function, function: {...}}")
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


def clean_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls``, checked, for the chat template."""
    if not isinstance(calls, list):
        raise BadRequest(where, "expected a list of tool calls")
    out = []
    for j, c in enumerate(calls):
        call = clean_tool_call(c)
        if call is None:
            raise BadRequest(f"{where}[{j}]", f"expected {TOOL_CALL_SHAPE}")
        out.append(call)
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
