"""What the model is shown for an agent's chat call: the messages as the chat template takes
them, the tools and what ``tool_choice`` forces, and the prompt ids, with the model's own tokens
for the assistant turns it generated (:func:`render_prompt`). Used by
:class:`~areal.workflow.openai_client.ArealOpenAI`, in process and behind the agent proxy; the
server's ``/v1/chat/completions`` decides the same way (areal.serving.openai_api)."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from areal.dataset.chat import encode
from areal.utils.tool_calls import tool_choice_prefill

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
                fn = c.get("function") if isinstance(c, dict) else None
                if (
                    not isinstance(fn, dict)
                    or not isinstance(fn.get("name"), str)
                    or not isinstance(fn.get("arguments"), str)
                ):
                    raise ValueError(
                        f"messages[{i}].tool_calls[{j}]: expected {{id, type: function, "
                        "function: {name: str, arguments: JSON string}}"
                    )
                calls.append(
                    {
                        "id": str(c.get("id", "")),
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": fn["arguments"]},
                    }
                )
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


def check_tools(tools: Any, tool_choice: Any, template: str) -> tuple[list[dict] | None, bool, str]:
    """(``tools`` for the template or None, whether to parse tool calls, the text that opens the
    assistant's answer: empty unless ``tool_choice`` forces a call), as the server decides."""
    if tools is not None:
        if not isinstance(tools, list) or not tools:
            raise ValueError(
                "tools: expected a non-empty list of {type: function, function: {...}}"
            )
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if (
                not isinstance(fn, dict)
                or t.get("type") != "function"
                or not isinstance(fn.get("name"), str)
            ):
                raise ValueError(
                    f'tools[{i}]: expected {{"type": "function", "function": {{"name": ...}}}}'
                )
        if "tools" not in template:
            raise ValueError(
                "tools: this model's chat template does not render tools, so the model would "
                "never see them; use a model whose template does (e.g. Qwen2.5)"
            )
    prefill = tool_choice_prefill(
        tool_choice, None if tools is None else [t["function"]["name"] for t in tools]
    )
    return tools, tools is not None and tool_choice != "none", prefill


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
