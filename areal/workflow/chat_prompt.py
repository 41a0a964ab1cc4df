"""What the model is shown for an agent's chat call: the messages as the chat template takes
them, the tools and what ``tool_choice`` forces (an opening and the grammar of the rest), the
schema ``response_format`` asks for, and the prompt ids, with the model's own tokens
for the assistant turns it generated (:func:`render_prompt`). Used by
:class:`~areal.workflow.openai_client.ArealOpenAI`, in process and behind the agent proxy; the
server's ``/v1/chat/completions`` decides the same way (areal.serving.openai_api)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from areal.api.sampling import RequestRejected
from areal.dataset.chat import encode
from areal.utils.tool_calls import (
    TOOL_CALL_SHAPE,
    clean_tool_call,
    tool_call_grammar,
    tool_choice_prefill,
)

if TYPE_CHECKING:
    from areal.workflow.openai_client import Call


def _message_dict(m: Any, i: int) -> dict:
    """A message as a dict: the agent may pass back the pydantic message it was given."""
    if hasattr(m, "model_dump"):
        m = m.model_dump(exclude_none=True)
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"messages[{i}]: expected a dict with a string 'role', got {m!r}")
    return m


def clean_messages(messages: Any) -> list[dict]:
    """``messages`` in the shape the chat template is given, as the server's parse_chat builds it:
    assistant turns keep their ``tool_calls`` (arguments as JSON strings), text content parts
    are joined, ``tool`` turns need a ``tool_call_id``."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: expected a non-empty list of {role, content}")
    clean = []
    for i, raw in enumerate(messages):
        m = _message_dict(raw, i)
        content = m.get("content")
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                call = clean_tool_call(c)
                if call is None:
                    raise ValueError(f"messages[{i}].tool_calls[{j}]: expected {TOOL_CALL_SHAPE}")
                calls.append(call)
            clean.append({"role": "assistant", "content": content or "", "tool_calls": calls})
            continue
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise ValueError(
                f"messages[{i}].tool_call_id: a tool message needs the tool_call_id it answers"
            )
        if isinstance(content, list):
            if not all(isinstance(c, dict) and c.get("type") == "text" for c in content):
                raise ValueError(f"messages[{i}].content: only text content parts are supported")
            content = "".join(str(c.get("text", "")) for c in content)
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: expected a string, got {content!r}")
        clean.append({"role": m["role"], "content": content})
    return clean


@dataclass(frozen=True)
class ToolPlan:
    """What a chat call's ``tools``/``tool_choice``/``parallel_tool_calls`` ask for."""

    tools: list[dict] | None  # for the chat template
    parse_calls: bool  # read tool calls out of the answer
    prefill: str  # the forced opening of the answer ("" unless tool_choice forces a call)
    grammar: str  # the Lark grammar the rest of a forced answer follows ("" when not forced)
    parallel: bool  # several calls may come (else only the first is returned)
    forced: bool  # tool_choice "required" or named: the answer is calls only
    named: str | None  # the function a named tool_choice forces


def check_tools(
    tools: Any, tool_choice: Any, template: str, parallel: Any, additional_properties: bool
) -> ToolPlan:
    """The call's :class:`ToolPlan`, as the server decides (areal.serving.tools.parse_tools):
    a forced call is opened by its prefill and constrained to the tools' schemas (their objects
    per ``server.json_schema_additional_properties``, ``additional_properties``), a named
    function to exactly one call."""
    if parallel not in (None, True, False):
        raise RequestRejected(
            f"parallel_tool_calls: expected true or false, got {str(parallel)[:40]}",
            "parallel_tool_calls",
        )
    if tools is not None:
        _check_tool_list(tools)
        if "tools" not in template:
            raise ValueError(
                "tools: this model's chat template does not render tools, so the model would "
                "never see them; use a model whose template does (e.g. Qwen2.5)"
            )
    names = None if tools is None else [t["function"]["name"] for t in tools]
    prefill = tool_choice_prefill(tool_choice, names)
    grammar, several, named = "", parallel is not False, None
    if prefill:
        named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        fns = [t["function"] for t in tools or [] if named in (None, t["function"]["name"])]
        several = several and named is None  # a named choice: that one call, no more
        grammar = tool_call_grammar(fns, several, prefill, additional_properties)
    parse_calls = tools is not None and tool_choice != "none"
    return ToolPlan(tools, parse_calls, prefill, grammar, several, bool(prefill), named)


def _check_tool_list(tools: Any) -> None:
    """``tools``: a non-empty list of ``{"type": "function", "function": {"name", "parameters":
    a schema object, "strict": bool}}``, as the server requires."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools: expected a non-empty list of {type: function, function: {...}}")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (
            not isinstance(fn, dict)
            or t.get("type") != "function"
            or not isinstance(fn.get("name"), str)
            or not fn["name"]
        ):
            raise ValueError(
                f'tools[{i}]: expected {{"type": "function", "function": {{"name": ...}}}}'
            )
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise RequestRejected(
                f"tools[{i}].function.parameters: expected a JSON schema object, got "
                f"{str(fn['parameters'])[:60]!r}; send the schema object itself (not JSON "
                "text), or leave parameters out",
                f"tools[{i}].function.parameters",
            )
        if fn.get("strict") not in (None, True, False):
            raise RequestRejected(
                f"tools[{i}].function.strict: expected true or false, got {fn['strict']!r}",
                f"tools[{i}].function.strict",
            )


def response_schema(fmt: Any) -> str:
    """The JSON schema (as JSON text) ``response_format`` asks every answer to follow, as the
    server reads it (areal.serving.openai_api.output_constraint): ``{"type": "json_object"}``
    is any object, ``{"type": "json_schema", "json_schema": {"schema": ...}}`` that schema;
    ``""`` for none or ``{"type": "text"}``."""
    if fmt is None or fmt == {"type": "text"}:
        return ""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return '{"type": "object"}'
    if kind != "json_schema":
        raise RequestRejected(
            f"response_format.type: expected text, json_object or json_schema, got {str(fmt)[:80]}",
            "response_format.type",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestRejected(
            'response_format.json_schema: expected {"name", "schema", "strict": bool}, got '
            f"{str(spec)[:80]}",
            "response_format.json_schema",
        )
    schema = spec.get("schema", {"type": "object"})
    if isinstance(schema, str):  # JSON text of a schema, as the server also takes it
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            pass  # refused below, as text
    if not isinstance(schema, (dict, bool)):
        where = "response_format.json_schema.schema"
        raise RequestRejected(
            f"{where}: expected a JSON schema (an object, or true/false), got "
            f"{str(spec.get('schema'))[:80]!r}; send the schema object itself",
            where,
        )
    return json.dumps(schema)


def signature(content: str | None, tool_calls: list[dict]) -> tuple:
    """What identifies an assistant message the client returned when the agent passes it back."""
    return content or "", tuple(
        (c["function"]["name"], c["function"]["arguments"]) for c in tool_calls
    )


def _template(tokenizer: Any, messages: list[dict], tools: list[dict] | None) -> str:
    """The chat template's text; a template that refuses the messages (a role it does not know,
    a turn order it forbids) is a ValueError naming ``messages``."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
    except TemplateError as e:
        raise ValueError(f"messages: the model's chat template refused them: {e}") from None


def render_prompt(
    tokenizer: Any, messages: list[dict], tools: list[dict] | None, generated: dict[tuple, Call]
) -> list[int]:
    """Prompt ids of ``messages`` by the chat template, with the model's own tokens for every
    assistant turn this client generated (``generated``: signature -> call).

    Such a turn is rendered as a placeholder, then replaced by the call's forced tool-call
    opening (its prompt's last ``prefill`` ids, if any) and completion ids (whose stop token
    stands for the template's end-of-turn token right after it). The result equals the plain
    rendering whenever the model's answer re-encodes to the same tokens, and otherwise keeps what
    the model generated (invalid UTF-8 bytes, special tokens, tool-call JSON spaced its own way)
    instead of a re-encoding of the decoded text, so an append-only template gives each call a
    prompt that extends the previous call's prompt + completion. A template that drops or alters
    the placeholder gets the plain rendering.
    """
    spliced, turns = [], []
    for i, m in enumerate(messages):
        call = (
            generated.get(signature(m["content"], m.get("tool_calls", [])))
            if m["role"] == "assistant"
            else None
        )
        if call is not None:
            turns.append(call)
            m = {"role": "assistant", "content": f"AREALTURN{i}X{uuid.uuid4().hex}"}
        spliced.append(m)
    if turns:
        text = _template(tokenizer, spliced, tools)
        marks = [m["content"] for m, orig in zip(spliced, messages) if m is not orig]
        if all(text.count(mark) == 1 for mark in marks):
            return _splice(tokenizer, text, marks, turns)
    return encode(tokenizer, _template(tokenizer, messages, tools))


def _splice(tokenizer: Any, text: str, marks: list[str], turns: list[Call]) -> list[int]:
    """Token ids of ``text`` with each placeholder replaced by its call's completion ids."""
    ids: list[int] = []
    rest = text
    for mark, call in zip(marks, turns):
        head, rest = rest.split(mark, 1)
        opening = call.prompt_ids[len(call.prompt_ids) - call.prefill :]  # [] without a forced call
        ids += encode(tokenizer, head) + opening + call.completion_ids
        # a call that stopped on its stop token (EOS, <|im_end|>, ...) already holds the template's
        # end-of-turn token, which the template writes right after the content
        end = tokenizer.decode(call.completion_ids[-1:]) if call.stop_reason == "stop" else ""
        if end and rest.startswith(end):
            rest = rest[len(end) :]
    return ids + encode(tokenizer, rest)
