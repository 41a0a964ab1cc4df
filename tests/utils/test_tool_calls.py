"""tool_choice -> the forced opening of the assistant's answer (areal.utils.tool_calls), the one
rule the server and the in-process agent client share."""

from __future__ import annotations

import json

import pytest

from areal.utils.tool_calls import ToolChoiceError, extract_tool_calls, tool_choice_prefill

NAMES = ["add", "mul"]


def test_auto_and_none_open_nothing_required_and_named_open_a_call():
    assert tool_choice_prefill("auto", NAMES) == tool_choice_prefill("none", None) == ""
    assert tool_choice_prefill("required", NAMES) == "<tool_call>\n"
    named = tool_choice_prefill({"type": "function", "function": {"name": "mul"}}, NAMES)
    assert named == '<tool_call>\n{"name": "mul", "arguments": '
    # the opening + what the model writes after it is one call to the named function
    content, calls = extract_tool_calls(named + '{"a": 4, "b": 5}}\n</tool_call>')
    assert content is None and [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
    ] == [("mul", {"a": 4, "b": 5})]


@pytest.mark.parametrize(
    "choice,names,message",
    [
        (
            {"type": "function", "function": {"name": "sub"}},
            NAMES,
            "names function 'sub', which is not among",
        ),
        ({"type": "function"}, NAMES, "expected 'auto', 'none', 'required'"),
        ({"function": {"name": "add"}}, NAMES, "expected 'auto', 'none', 'required'"),
        ("always", NAMES, "expected 'auto', 'none', 'required'"),
        ("required", None, "needs tools"),
    ],
)
def test_a_bad_choice_is_an_error_naming_tool_choice(choice, names, message):
    with pytest.raises(ToolChoiceError, match=f"^tool_choice: .*{message}") as e:
        tool_choice_prefill(choice, names)
    assert isinstance(e.value, ValueError) and message in e.value.detail
