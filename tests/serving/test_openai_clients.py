"""What OpenAI clients (instructor, pydantic-ai, smolagents) rely on beyond the schemas: objects
a schema names properties of allow no others (vLLM's and SGLang's reading), a forced tool
choice answers exactly the calls asked for (a cut one partial, never raw text), OpenAI's fields
that change no answer are accepted, and a context overflow is OpenAI's 400.

A generator made to prefer a given answer (:func:`_preferring_sampler`) shows what the grammar
lets through: it writes each wanted token the mask allows, else the first allowed fallback."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import pytest
import torch
from pydantic import BaseModel

from areal.api.config import from_dict
from areal.api.config.server import GenerationServerConfig
from areal.serving.server import GenerationServer
from areal.utils.tool_calls import forbid_unnamed_properties

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "1+2?"}]
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {  # as Pydantic writes it: additionalProperties unset
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
MUL = {"type": "function", "function": {"name": "mul", "parameters": ADD["function"]["parameters"]}}
CALL_ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
CALL_MUL = '<tool_call>\n{"name": "mul", "arguments": {"a": 3, "b": 4}}\n</tool_call>'


class Answer(BaseModel):
    a: int


class Inner(BaseModel):
    x: int


class Outer(BaseModel):
    inner: Inner
    tags: dict[str, int]
    maybe: Inner | None = None


@contextlib.contextmanager
def _server(model_dir: str, **cfg: Any):
    srv = GenerationServer(from_dict(GenerationServerConfig, {"model_path": model_dir, **cfg}))
    srv.generator.start()
    try:
        yield srv
    finally:
        srv.generator.shutdown()


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    with _server(tiny_model_dir) as s:
        yield s


def _post(srv: GenerationServer, path: str, body: dict) -> tuple[int, Any]:
    """POST ``body`` to the in-process server -> (status, JSON answer or the event text)."""
    from aiohttp.test_utils import TestClient, TestServer

    async def run():
        async with TestClient(TestServer(srv.build_app(), host="127.0.0.1")) as c:
            resp = await c.post(path, json=body)
            return resp.status, (await resp.text() if body.get("stream") else await resp.json())

    return asyncio.run(run())


def _preferring_sampler(ids: list[int], fallback: list[int]):
    """A stand-in for BatchSampler._pick that writes ``ids[k]`` at step k where the grammar's mask
    allows it, else the first allowed of ``fallback``, else the best allowed token."""

    def sample(sampler, logits, n):  # logits [B, V] masked by the grammar
        out = []
        for row in range(logits.shape[0]):
            k = sample.count.get(row, 0)
            sample.count[row] = k + 1
            allowed = logits[row] > float("-inf")
            tok = ids[min(k, len(ids) - 1)]
            if not allowed[tok]:
                tok = next((t for t in fallback if allowed[t]), int(logits[row].argmax()))
            out.append(tok)
        return torch.tensor(out)

    sample.count = {}
    return sample


def _prefer(monkeypatch, srv: GenerationServer, text: str) -> list[int]:
    """Make the generator prefer ``text`` then EOS (falling back to ``}``); its token ids."""
    ids = srv.encode(text) + [srv.tokenizer.eos_token_id]
    sampler = _preferring_sampler(ids, srv.encode("}"))
    monkeypatch.setattr("areal.serving.sampler.BatchSampler._pick", sampler)
    return ids


# ---------------------------------------------------------------- 10: unnamed properties


def test_pydantic_objects_are_closed_and_explicit_choices_and_intersections_kept():
    schema = Outer.model_json_schema()
    sent = json.dumps(schema)
    closed = forbid_unnamed_properties(schema)
    assert json.dumps(schema) == sent  # the request's own object (also the prompt's) unchanged
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["Inner"]["additionalProperties"] is False
    assert closed["properties"]["tags"] == schema["properties"]["tags"]  # a dict: stays open
    assert closed["properties"]["tags"]["additionalProperties"] == {"type": "integer"}
    mixed = {
        "properties": {"kind": {"type": "string"}},
        "allOf": [{"properties": {"x": {"type": "integer"}}}],
        "anyOf": [{"properties": {"y": {}}}],
    }
    assert forbid_unnamed_properties(mixed) == mixed  # intersected: closing would forbid x, y
    explicit = {"type": "object", "properties": {"a": {}}, "additionalProperties": True}
    assert forbid_unnamed_properties(explicit) == explicit
    odd = {"properties": {"properties": {"type": "object"}, "enum": {"enum": [{"properties": 1}]}}}
    assert forbid_unnamed_properties(odd)["properties"] == odd["properties"]  # names, data


@pytest.mark.parametrize("where", ["response_format", "tool", "generate"])
def test_a_model_cannot_invent_keys_a_schema_does_not_name(srv, monkeypatch, where):
    """The generator prefers an extra key; the grammar closes the object instead (all three
    routes a JSON schema reaches the grammar by)."""
    if where == "tool":
        _prefer(monkeypatch, srv, CALL_ADD.replace('"b": 2', '"b": 2, "c": 5'))
        body = {"messages": MESSAGES, "tools": [ADD], "tool_choice": ADD, "max_tokens": 200}
        status, out = _post(srv, "/v1/chat/completions", body)
        assert status == 200, out
        assert out["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == (
            '{"a": 1, "b": 2}'
        )
        return
    _prefer(monkeypatch, srv, '{"a": 1, "extra": 2}')
    schema = Answer.model_json_schema()
    if where == "generate":
        sp = {"json_schema": json.dumps(schema), "max_new_tokens": 50}
        status, out = _post(srv, "/generate", {"text": "hi", "sampling_params": sp})
        assert status == 200 and out["text"] == '{"a": 1}', out
        return
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    status, out = _post(
        srv,
        "/v1/chat/completions",
        {"messages": MESSAGES, "response_format": fmt, "max_tokens": 50},
    )
    assert status == 200 and out["choices"][0]["message"]["content"] == '{"a": 1}', out


def test_an_explicit_additional_properties_or_the_server_flag_allows_other_keys(
    srv, tiny_model_dir, monkeypatch
):
    wanted = '{"a": 1, "extra": 2}'
    schema = {**Answer.model_json_schema(), "additionalProperties": True}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    body = {"messages": MESSAGES, "response_format": fmt, "max_tokens": 50}
    _prefer(monkeypatch, srv, wanted)
    assert _post(srv, "/v1/chat/completions", body)[1]["choices"][0]["message"]["content"] == wanted
    with _server(tiny_model_dir, json_schema_additional_properties=True) as open_srv:
        _prefer(monkeypatch, open_srv, wanted)
        fmt["json_schema"]["schema"] = Answer.model_json_schema()
        status, out = _post(open_srv, "/v1/chat/completions", body)
    assert status == 200 and out["choices"][0]["message"]["content"] == wanted, out


# ---------------------------------------------------------------- 11: forced tool choices


def _chat(srv, **kwargs: Any) -> dict:
    """A chat answer's one choice (streamed: its deltas merged)."""
    status, out = _post(srv, "/v1/chat/completions", {"messages": MESSAGES, **kwargs})
    assert status == 200, out
    if not kwargs.get("stream"):
        return out["choices"][0]
    chunks = [json.loads(line[6:]) for line in out.splitlines() if line.startswith("data: {")]
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    message = {"content": content or None, **({"tool_calls": calls} if calls else {})}
    return {"message": message, "finish_reason": chunks[-1]["choices"][0]["finish_reason"]}


def _calls(choice: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get(
        "tool_calls", []
    )]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_answers_exactly_one_call_and_stops(srv, monkeypatch, stream):
    """The generator would go on to a second call; a named choice ends after the first."""
    _prefer(monkeypatch, srv, f"{CALL_ADD}\n{CALL_MUL}")
    choice = _chat(srv, tools=[ADD, MUL], tool_choice=ADD, max_tokens=300, stream=stream)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert _calls(choice) == [("add", '{"a": 1, "b": 2}')]


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_max_tokens_is_a_partial_call_never_text(srv, monkeypatch, stream):
    both = f"{CALL_ADD}\n{CALL_MUL}"
    ids = _prefer(monkeypatch, srv, both)
    cut = len(srv.encode(f'{CALL_ADD}\n<tool_call>\n{{"name": "mul", "arguments": {{"a": 3')) - 1
    kw = {"tools": [ADD, MUL], "max_tokens": cut, "stream": stream}
    choice = _chat(srv, tool_choice="required", **kw)  # required: one or more calls
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert _calls(choice) == [("add", '{"a": 1, "b": 2}'), ("mul", '{"a": ')]
    monkeypatch.setattr("areal.serving.sampler.BatchSampler._pick", _preferring_sampler(ids, []))
    cut = len(srv.encode(CALL_ADD[: CALL_ADD.index('b"')]))  # inside the arguments
    choice = _chat(srv, tool_choice=ADD, **{**kw, "max_tokens": cut})
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert _calls(choice) == [("add", '{"a": 1, "')]
    for choice_, calls in [("required", []), (ADD, [("add", "")])]:  # cut inside the opening
        monkeypatch.setattr(
            "areal.serving.sampler.BatchSampler._pick", _preferring_sampler(ids, [])
        )
        choice = _chat(srv, tool_choice=choice_, **{**kw, "max_tokens": 6})
        assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
        assert _calls(choice) == calls


# ---------------------------------------------------------------- 13: fields and overflow


def test_openai_fields_that_change_no_answer_are_accepted_and_type_checked(srv):
    ignored = {
        "store": True,
        "metadata": {"run": "a"},
        "service_tier": "auto",
        "user": "u1",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
    }
    chat_only = {"prediction": {"type": "content", "content": "3"}, "modalities": ["text"]}
    base = {"messages": MESSAGES, "max_tokens": 2, **ignored, **chat_only}
    assert _post(srv, "/v1/chat/completions", base)[0] == 200
    streamed = {**base, "stream": True, "stream_options": {"include_obfuscation": False}}
    assert _post(srv, "/v1/chat/completions", streamed)[0] == 200
    assert _post(srv, "/v1/completions", {"prompt": "ab", "max_tokens": 2, **ignored})[0] == 200
    for field, value, message in [
        ("store", "yes", "expected true or false"),
        ("metadata", [], "expected an object"),
        ("modalities", ["text", "audio"], "text only"),
        ("audio", {"voice": "alloy", "format": "wav"}, "no audio output"),
    ]:
        status, out = _post(srv, "/v1/chat/completions", {**base, field: value})
        assert status == 400 and out["error"]["param"] == field, out
        assert message in out["error"]["message"], out


@pytest.fixture(scope="module")
def small(tiny_model_dir):
    with _server(tiny_model_dir, context_length=64) as s:
        yield s


def test_a_context_overflow_is_openais_400_and_an_unset_limit_runs_to_the_context(small):
    long = [{"role": "user", "content": "word " * 40}]
    for path, body, field in [
        ("/v1/chat/completions", {"messages": long}, "messages"),
        ("/v1/completions", {"prompt": "word " * 40}, "prompt"),
    ]:
        status, out = _post(small, path, body)
        assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
        assert out["error"]["param"] == field and out["error"]["type"] == "invalid_request_error"
        assert "maximum context length is 64 tokens" in out["error"]["message"]
    prompt = len(small.apply_template(MESSAGES))
    for limit in ("max_tokens", "max_completion_tokens"):
        body = {"messages": MESSAGES, limit: 64 - prompt + 1}
        status, out = _post(small, "/v1/chat/completions", body)
        assert status == 400 and out["error"]["param"] == limit, out
        assert out["error"]["code"] == "context_length_exceeded"
        assert f"prompt of {prompt} tokens" in out["error"]["message"]
        assert f"send {limit} <= {64 - prompt}" in out["error"]["message"]
    body = {"messages": MESSAGES, "max_tokens": 64 - prompt, "temperature": 0, "ignore_eos": True}
    status, out = _post(small, "/v1/chat/completions", body)
    assert status == 200 and out["usage"]["completion_tokens"] == 64 - prompt, out
    del body["max_tokens"]  # none sent: up to the context, as OpenAI's
    status, out = _post(small, "/v1/chat/completions", body)
    assert status == 200 and out["choices"][0]["finish_reason"] == "length", out
    assert out["usage"]["total_tokens"] == 64


def test_generate_keeps_sglangs_answers_at_the_context(small):
    """/generate (the rollout client's route) ends a long max_new_tokens at the context."""
    sp = {"max_new_tokens": 100, "temperature": 0, "ignore_eos": True}
    status, out = _post(small, "/generate", {"input_ids": [5, 17, 99], "sampling_params": sp})
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length", out
    assert len(out["output_ids"]) == 64 - 3
    status, out = _post(small, "/generate", {"input_ids": [5] * 64, "sampling_params": sp})
    assert status == 400 and out["error"]["param"] == "input_ids", out
