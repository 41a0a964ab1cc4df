"""Parsing a model's tool calls out of its answer: Hermes-style blocks, the format Qwen2.5 and
our tiny model use::

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

Pure text in, OpenAI-shaped ``tool_calls`` out, shared by the server's chat completions
(areal.serving.tools) and the in-process OpenAI client of agent workflows
(areal.workflow.openai_client), so both read a model's answer the same way
(:func:`answer_calls`), a forced one cut by ``max_tokens`` included (:func:`forced_calls`).

A forced call (OpenAI's ``tool_choice`` ``required`` or ``{"type": "function", "function":
{"name": F}}``) follows one grammar, :func:`tool_call_grammar` (Lark with the tools' JSON
schemas embedded, llguidance's dialect): the server constrains the whole answer to it; the
agent client opens the answer with :func:`tool_choice_prefill`'s text (``<tool_call>\n``, or
``<tool_call>\n{"name": "F", "arguments": `` for a named F: prompt, which the model is
conditioned on and never trained on) and constrains the rest to the same grammar after that
opening, through the engine request (``gconfig.ebnf``).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Protocol

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
CALL_OPEN = "<tool_call>\n"  # how a Hermes-style call begins (see the chat template)
CALL_CLOSE = "}\n</tool_call>"  # what ends a call's JSON object and its block
# JSON without free whitespace: ", " between items, ": " after keys (Python's and Hermes' own
# layout). Free whitespace would let a model pad forever between tokens of a JSON value.
_NAME_KEY, _ARGS_KEY = '{"name": ', ', "arguments": '  # a call's JSON up to name and arguments
_JSON = json.JSONDecoder()
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# JSON schema keywords holding subschemas, by how forbid_unnamed_properties treats them
_OWN_SCHEMAS = (  # a schema (or a list of them) of a value inside the object or array
    "additionalProperties", "additionalItems", "items", "prefixItems", "contains",
    "unevaluatedProperties", "unevaluatedItems",
)  # fmt: skip
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_INTERSECTED = ("allOf", "if", "then", "else")  # schemas intersected with their parent
_MIXED = (*_INTERSECTED, "anyOf", "oneOf", "$ref", "dependentSchemas")  # parent: left open


def forbid_unnamed_properties(schema: Any) -> Any:
    """A copy of the JSON ``schema`` in which every object schema that names ``properties`` (or
    ``patternProperties``) and leaves ``additionalProperties`` unset sets it to false, through
    every subschema: vLLM's and SGLang's reading, as Pydantic means its schemas (which never
    forbid other keys); a weak model otherwise invents keys until ``max_tokens``. A schema's own
    ``additionalProperties`` stays. A schema intersected with others (beside or inside
    ``allOf``, ``$ref``, ``if``/``then``/``else``, an ``anyOf``/``oneOf`` beside properties)
    stays open: closing it would forbid the others' properties (a ``$defs`` entry is closed
    wherever it is referenced from); ``not`` is left as sent."""
    out = json.loads(json.dumps(schema))  # a copy: the request's own object is also the prompt's
    stack: list[tuple[Any, bool]] = [(out, True)]  # (schema or list of them, may be closed)
    while stack:
        node, close = stack.pop()
        if isinstance(node, list):
            stack += [(s, close) for s in node]
            continue
        if not isinstance(node, dict):
            continue
        names = "properties" in node or "patternProperties" in node
        stack += [(node[k], True) for k in _OWN_SCHEMAS if k in node]
        for k in _SCHEMA_MAPS:
            if isinstance(node.get(k), dict):
                stack += [(s, k != "dependentSchemas") for s in node[k].values()]
        stack += [(node[k], close and not names) for k in ("anyOf", "oneOf") if k in node]
        stack += [(node[k], False) for k in _INTERSECTED if k in node]
        unset = "additionalProperties" not in node and "unevaluatedProperties" not in node
        if close and names and unset and not any(k in node for k in _MIXED):
            node["additionalProperties"] = False
    return out


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
    return _opening(fn["name"])


def _opening(name: str) -> str:
    """The text that opens a call of function ``name``, up to its arguments."""
    return f'{CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": '


def tool_call_grammar(
    functions: list[dict], parallel: bool, opened: str = "", additional_properties: bool = False
) -> str:
    """A Lark grammar for Hermes tool-call blocks calling one of ``functions``, the arguments
    matching each one's ``parameters`` (any object when it has none; ``"strict": true`` makes
    schema keywords llguidance does not implement an error; an object schema naming properties
    without ``additionalProperties`` allows no others unless ``additional_properties``, see
    :func:`forbid_unnamed_properties`); ``parallel``: one or more blocks, newline-separated,
    else exactly one. ``opened``: the text the answer was opened with already (a
    :func:`tool_choice_prefill`), so the grammar is that of the rest: its first call is one
    whose opening starts with ``opened``."""
    rules, firsts = [], []
    for k, fn in enumerate(functions):
        schema: dict[str, Any] = dict(fn.get("parameters") or {"type": "object"})
        if not additional_properties:
            schema = forbid_unnamed_properties(schema)
        schema["x-guidance"] = {**JSON_LAYOUT, "lenient": not fn.get("strict", False)}
        opening = _opening(fn["name"])
        rules += [
            f"call{k}: {json.dumps(opening)} args{k} {json.dumps(CALL_CLOSE)}",
            f"args{k}: %json {json.dumps(schema)}",
        ]
        if opened and opening.startswith(opened):
            rest = opening[len(opened) :]
            head = f"{json.dumps(rest)} " if rest else ""
            rules.append(f"first{k}: {head}args{k} {json.dumps(CALL_CLOSE)}")
            firsts.append(f"first{k}")
    if opened and not firsts:
        raise ValueError(f"no function's call opens with {opened!r}")
    first = "first" if opened else "call"
    start = f'start: {first} ("\\n" call)*' if parallel else f"start: {first}"
    calls = ["call: " + " | ".join(f"call{k}" for k in range(len(functions)))]
    if opened:
        calls.append("first: " + " | ".join(firsts))
    return "\n".join([start, *calls, *rules])


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
        calls.append(_call(obj["name"], args if isinstance(args, str) else json.dumps(args)))
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls


class CallReading(Protocol):
    """What reading a chat answer's tool calls depends on: the request's ``tools``,
    ``tool_choice`` and ``parallel_tool_calls`` as the server (areal.serving.tools.ToolUse) and
    the agent client (areal.workflow.chat_prompt.ToolPlan) decide them."""

    @property
    def parse_calls(self) -> bool: ...  # tools given, tool_choice not "none"

    @property
    def parallel(self) -> bool: ...  # several calls may come (else the first is returned)

    @property
    def forced(self) -> bool: ...  # tool_choice "required" or named: the answer is calls only

    @property
    def named(self) -> str | None: ...  # the function a named tool_choice forces


def answer_calls(text: str, use: CallReading | None) -> tuple[str | None, list[dict]]:
    """(content, ``tool_calls``) of a chat answer: the text alone without tools (or with
    ``tool_choice`` none); a forced answer's calls and no content (:func:`forced_calls`); else
    the parsed blocks, the rest content. Without ``parallel_tool_calls`` only the first call is
    returned (a forced answer's grammar writes no other; an engine that ignored it may)."""
    if use is None or not use.parse_calls:
        return text, []
    if use.forced:
        content, calls = None, forced_calls(text, use.named)
    else:
        content, calls = extract_tool_calls(text)
    return content, calls if use.parallel else calls[:1]


def forced_calls(text: str, named: str | None) -> list[dict]:
    """The calls of an answer a forced tool choice's grammar wrote (Hermes blocks, newline
    separated; the agent client's prompt opening included), the last one partial where
    generation stopped early (max_tokens, abort): its ``arguments`` as far as written ("" before
    they begin). A partial call is kept where its function is known: always for a named choice,
    for ``required`` once the name is written; a fragment before that is dropped (never returned
    as text)."""
    blocks = text.split(CALL_OPEN)[1:]
    if named is not None and not blocks:  # cut inside the opening: the call asked for, empty
        return [_call(named, "")]
    calls = []
    for block in blocks:
        name, args = named, ""
        if block.startswith(_NAME_KEY):
            try:
                name, end = _JSON.raw_decode(block, len(_NAME_KEY))
            except json.JSONDecodeError:  # cut inside the name
                pass
            else:
                args = _arguments(block[end:])
        if name is not None:
            calls.append(_call(name, args))
    return calls


def _arguments(rest: str) -> str:
    """The arguments JSON in ``rest``, the text of a block after its name: complete ones end
    where their value ends (before the block's close), cut ones as far as written."""
    if not rest.startswith(_ARGS_KEY):  # cut before the arguments began
        return ""
    args = rest[len(_ARGS_KEY) :]
    try:
        return args[: _JSON.raw_decode(args)[1]]
    except json.JSONDecodeError:  # cut inside them
        return args


def _call(name: str, arguments: str) -> dict:
    """One OpenAI tool call (``arguments`` as JSON text, partial where cut)."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


TOOL_CALL_SHAPE = '{"id", "type": "function", "function": {"name": str, "arguments": JSON string}}'


def clean_tool_call(call: Any) -> dict | None:
    """An assistant turn's tool call as a chat template takes it (``id``, ``type``, ``function``
    with a ``name`` and JSON-string ``arguments``), or None when it is not of that shape
    (:data:`TOOL_CALL_SHAPE`): the server and the agent client read ``tool_calls`` alike."""
    fn = call.get("function") if isinstance(call, dict) else None
    if (
        not isinstance(call, dict)
        or not isinstance(fn, dict)
        or not isinstance(fn.get("name"), str)
        or not isinstance(fn.get("arguments"), str)
    ):
        return None
    function = {"name": fn["name"], "arguments": fn["arguments"]}
    return {"id": str(call.get("id", "")), "type": "function", "function": function}
