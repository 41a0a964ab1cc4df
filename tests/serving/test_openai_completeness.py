"""Prompt and top logprobs, as eval harnesses (lm-eval's loglikelihood) and agent frameworks ask
for them: /v1/completions echo + logprobs, /generate logprob_start_len + top_logprobs_num, chat
top_logprobs; every value equals the HF forward's log-softmax."""

from __future__ import annotations

import pytest
import torch

from tests.serving.servers import start_servers, stop_servers
from tests.serving.test_server import PROMPT, call


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    procs = start_servers(tiny_model_dir, 1, "max_batch_size=8")
    yield f"http://{procs[0][1]}"
    stop_servers(procs)


def _hf_logp(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)  # [n, V]


def _model(url: str) -> str:
    return call(f"{url}/v1/models")[1]["data"][0]["id"]


def test_completions_echo_returns_prompt_logprobs_equal_to_the_hf_forward(server, hf_model):
    body = {"model": _model(server), "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2}
    status, out = call(f"{server}/v1/completions", body)
    assert status == 200, out
    lp = out["choices"][0]["logprobs"]
    ref = _hf_logp(hf_model, PROMPT)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing before it
    expected = [ref[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    for i in range(1, len(PROMPT)):  # the 2 most likely plus the chosen token
        top = lp["top_logprobs"][i]
        best = ref[i - 1].topk(2)
        assert 2 <= len(top) <= 3 and max(top.values()) == pytest.approx(
            best.values[0].item(), abs=1e-4
        )
    assert len(lp["tokens"]) == len(PROMPT) and lp["text_offset"][0] == 0
    assert out["choices"][0]["text"].startswith(lp["tokens"][0])


def test_generate_returns_input_and_top_logprobs_in_sglangs_format(server, hf_model):
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
    }
    status, out = call(f"{server}/generate", body)
    assert status == 200, out
    meta = out["meta_info"]
    ref = _hf_logp(hf_model, PROMPT + out["output_ids"])
    inputs = meta["input_token_logprobs"]
    assert [t for _, t, _ in inputs] == PROMPT and inputs[0][0] is None
    assert [lp for lp, _, _ in inputs[1:]] == pytest.approx(
        [ref[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))], abs=1e-4
    )
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 3
    for k, (top, (lp, tok, _)) in enumerate(
        zip(meta["output_top_logprobs"], meta["output_token_logprobs"])
    ):
        assert (
            len(top) == 3 and top[0][1] == tok and top[0][0] == pytest.approx(lp)
        )  # greedy: the best one
        values = [v for v, _, _ in top]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(ref[len(PROMPT) - 1 + k].topk(3).values.tolist(), abs=1e-4)


def test_chat_top_logprobs_with_real_bytes_through_the_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    c = client.chat.completions.create(
        model=_model(server),
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens == 4
    for entry in content:
        assert (
            len(entry.top_logprobs) == 2
            and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        )
        assert entry.bytes and all(0 <= b < 256 for b in entry.bytes)
    status, out = call(
        f"{server}/v1/chat/completions",
        {
            "model": _model(server),
            "top_logprobs": 2,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert status == 400 and out["error"]["param"] == "top_logprobs"  # needs logprobs=true


def test_distinct_tokens_never_share_a_logprobs_key(tiny_model_dir):
    from areal.api.config import from_dict
    from areal.api.config.server import GenerationServerConfig
    from areal.serving.server import GenerationServer

    srv = GenerationServer(from_dict(GenerationServerConfig, {"model_path": str(tiny_model_dir)}))
    ids = range(len(srv.tokenizer))
    keys = [srv.text.token_str(t) for t in ids]
    assert len(set(keys)) == len(keys)
    assert all(srv.text.token_bytes(t) for t in ids)


def test_token_pieces_join_into_the_text_and_a_lone_byte_is_no_bytes_escape(tiny_model_dir):
    """A character split over byte tokens: the first gets "", the last the character; a byte
    that starts no character shows as the text shows it (U+FFFD), never "bytes:\\x.."."""
    from transformers import AutoTokenizer

    from areal.serving.tokens import TokenText

    text = TokenText(AutoTokenizer.from_pretrained(tiny_model_dir))
    ids = text.encode("aé€")
    assert text.pieces(ids) == ["a", "", "é", "", "", "€"]
    bad = [t for t in range(256) if text.token_bytes(t) == b"\xff"]
    assert text.pieces(bad + ids) == ["\ufffd", "a", "", "é", "", "", "€"]
    assert "".join(text.pieces(bad + ids)) == text.decode(bad + ids)


def test_streamed_chat_and_completions_equal_the_unstreamed_answer(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    model = _model(server)
    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[
        0
    ].finish_reason
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )
    # completions, two choices, a stop string: the streamed text never runs past the cut
    plain = client.completions.create(
        model=model, prompt=[5, 17, 99], max_tokens=10, temperature=0, n=2
    )
    stop = plain.choices[0].text[3:5] if len(plain.choices[0].text) >= 5 else None
    kwargs = {"stop": [stop]} if stop else {}
    cut = client.completions.create(
        model=model, prompt=[5, 17, 99], max_tokens=10, temperature=0, n=2, **kwargs
    )
    streamed = {0: "", 1: ""}
    for c in client.completions.create(
        model=model, prompt=[5, 17, 99], max_tokens=10, temperature=0, n=2, stream=True, **kwargs
    ):
        for ch in c.choices:
            streamed[ch.index] += ch.text
    assert streamed == {ch.index: ch.text for ch in cut.choices}


def test_a_client_that_leaves_a_stream_frees_its_slot(server):
    import json
    import socket
    import time

    body = json.dumps(
        {
            "model": _model(server),
            "prompt": [5, 17],
            "max_tokens": 2000,  # the tiny model's context is 2048: a limit past it is a 400
            "ignore_eos": True,
            "stream": True,
        }
    )
    host, port = server.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    sock.settimeout(30)
    got = b""
    while b"data: " not in got:  # the stream began
        got += sock.recv(4096)
    sock.close()
    deadline = time.monotonic() + 5
    while call(f"{server}/get_server_info")[1]["running"] != 0:
        assert time.monotonic() < deadline, "the abandoned stream still holds its slot"
        time.sleep(0.05)


def test_the_streamed_text_holds_back_what_may_still_change():
    from areal.serving.streaming import _safe_prefix

    assert _safe_prefix("hello wo", ()) == "hello wo"
    assert _safe_prefix("caf\ufffd", ()) == "caf"  # half of a UTF-8 character: wait for the rest
    assert _safe_prefix("hello wo", ("world",)) == "hell"  # 4 chars could begin "world"
    assert _safe_prefix("say STOP now", ("STOP",)) == "say "  # the final text ends before it


def test_tool_calls_are_parsed_from_hermes_blocks_and_bad_blocks_stay_text():
    from areal.serving.tools import extract_tool_calls

    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    content, calls = extract_tool_calls(text)
    assert content == "Let me add." and len(calls) == 1
    assert (
        calls[0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
        and calls[0]["type"] == "function"
    )
    two = text + '<tool_call>{"name": "mul", "arguments": "{\\"x\\": 3}"}</tool_call>'
    assert [c["function"]["name"] for c in extract_tool_calls(two)[1]] == [
        "add",
        "mul",
    ]  # parallel calls
    assert extract_tool_calls("<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>",
        [],
    )
    assert extract_tool_calls("plain answer") == ("plain answer", [])


def test_the_openai_client_runs_an_agent_turn_with_tools(server, tiny_model_dir, monkeypatch):
    """Tools reach the prompt through the chat template; the standard agent turn (an assistant
    message with content null + tool_calls, then the tool's answer) is accepted; a model answer
    holding a call comes back as message.tool_calls with finish_reason tool_calls."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    model = _model(server)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "a + b",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    turn = [
        {"role": "user", "content": "1+2?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    with_tools = client.chat.completions.create(
        model=model, messages=turn, tools=tools, max_tokens=2, temperature=0
    )
    without = client.chat.completions.create(
        model=model, messages=turn, max_tokens=2, temperature=0
    )
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens  # the tools were rendered
    # The random tiny model never writes a call: have the generator answer with one.
    from areal.api.config import from_dict
    from areal.api.config.server import GenerationServerConfig
    from areal.serving.server import GenerationServer

    # then EOS
    answer = '<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 5}}\n</tool_call><|im_end|>'
    srv = GenerationServer(from_dict(GenerationServerConfig, {"model_path": str(tiny_model_dir)}))
    ids = srv.encode(answer)
    forced = _forced_sampler(ids)
    monkeypatch.setattr("areal.serving.sampler.BatchSampler._pick", forced)
    srv.generator.start()
    try:
        import asyncio

        from aiohttp.test_utils import TestClient, TestServer

        async def run():
            async with TestClient(TestServer(srv.build_app(), host="127.0.0.1")) as c:
                body = {
                    "messages": [{"role": "user", "content": "4+5?"}],
                    "tools": tools,
                    "max_tokens": len(ids),
                }
                plain = await (await c.post("/v1/chat/completions", json=body)).json()
                forced.count.clear()  # the next request writes the call from its start again
                events = await (
                    await c.post("/v1/chat/completions", json={**body, "stream": True})
                ).text()
                return plain, events

        plain, events = asyncio.run(run())
    finally:
        srv.generator.shutdown()
    choice = plain["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "add",
        "arguments": '{"a": 4, "b": 5}',
    }
    assert '"tool_calls": [{"index": 0' in events and '"finish_reason": "tool_calls"' in events
    assert events.rstrip().endswith("data: [DONE]")


def _forced_sampler(ids: list[int]):
    """A stand-in for BatchSampler._pick that writes ``ids`` one token per step, then EOS-free."""

    def sample(sampler, logits, n):  # logits [B, V] masked by the grammar
        out = []
        for row in range(logits.shape[0]):
            k = sample.count.get(row, 0)
            out.append(ids[min(k, len(ids) - 1)])
            sample.count[row] = k + 1
        return torch.tensor(out)

    sample.count = {}
    return sample


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("logit_bias", {"5": 10}, "logit_bias is not supported"),
        ("presence_penalty", 0.5, "only 0.0 is supported"),
        ("frequency_penalty", 1.0, "only 0.0 is supported"),
    ],
)
def test_what_the_server_does_not_do_is_refused_with_the_reason(server, field, value, message):
    body = {"model": _model(server), "messages": [{"role": "user", "content": "hi"}], field: value}
    status, out = call(f"{server}/v1/chat/completions", body)
    assert (
        status == 400 and out["error"]["param"] == field and message in out["error"]["message"]
    ), out
    ok = {**body, field: {} if field == "logit_bias" else 0.0, "max_tokens": 1}
    assert call(f"{server}/v1/chat/completions", ok)[0] == 200  # the neutral value is accepted


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            },
        },
    },
    {"type": "function", "function": {"name": "mul", "description": "a * b"}},
]
ADD = {"type": "function", "function": {"name": "add"}}


def test_a_forced_tool_choice_adds_no_prompt_tokens_and_a_bad_choice_is_refused(server):
    """A forced call is constrained decoding (test_structured_outputs.py), not a prefilled
    opening: the prompt is the same as with auto."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    model, messages = _model(server), [{"role": "user", "content": "1+2?"}]

    def ask(choice):
        return client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=6,
            temperature=0,
        )

    auto, required, named = ask("auto"), ask("required"), ask(ADD)
    assert required.usage.prompt_tokens == named.usage.prompt_tokens == auto.usage.prompt_tokens
    for c in (required, named):  # 6 tokens cannot hold a call: cut, reported as length
        assert c.choices[0].finish_reason == "length" and c.choices[0].message.content is None
    assert not required.choices[0].message.tool_calls  # cut before a name: no call, no text
    assert [
        (t.function.name, t.function.arguments) for t in named.choices[0].message.tool_calls
    ] == [("add", "")]  # the named call, cut before its arguments
    for bad, message in [
        ({"type": "function", "function": {"name": "sub"}}, "not among the tools"),
        ({"type": "function"}, "expected 'auto', 'none', 'required'"),
        ("always", "expected 'auto', 'none', 'required'"),
    ]:
        with pytest.raises(openai.BadRequestError, match=message) as e:
            ask(bad)
        assert e.value.body["param"] == "tool_choice"


@pytest.mark.parametrize(
    "choice,written",
    [
        (
            "required",
            '<tool_call>\n{"name": "mul", "arguments": {"a": 4, "b": 5}}\n</tool_call><|im_end|>',
        ),
        (
            ADD,
            '<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 5}}\n</tool_call><|im_end|>',
        ),
    ],
)
def test_a_forced_call_is_parsed_through_the_openai_client(
    tiny_model_dir, monkeypatch, choice, written
):
    """With a generator made to answer ``written`` (which the forced call's grammar allows), the
    answer parses as one call, streamed and not, read by the official (async) client from a live
    in-process server."""
    openai = pytest.importorskip("openai")
    import asyncio

    from aiohttp.test_utils import TestServer

    from areal.api.config import from_dict
    from areal.api.config.server import GenerationServerConfig
    from areal.serving.server import GenerationServer

    srv = GenerationServer(from_dict(GenerationServerConfig, {"model_path": str(tiny_model_dir)}))
    ids = srv.encode(written)
    forced = _forced_sampler(ids)
    monkeypatch.setattr("areal.serving.sampler.BatchSampler._pick", forced)
    kwargs = {
        "model": srv.model_name,
        "messages": [{"role": "user", "content": "4*5?"}],
        "tools": TOOLS,
        "tool_choice": choice,
        "max_tokens": len(ids),
    }

    async def run():
        async with TestServer(srv.build_app(), host="127.0.0.1") as ts:
            client = openai.AsyncOpenAI(base_url=str(ts.make_url("/v1")), api_key="unused")
            whole = await client.chat.completions.create(**kwargs)
            forced.count.clear()  # the next request writes the answer from its start again
            chunks = [c async for c in await client.chat.completions.create(**kwargs, stream=True)]
            return whole, chunks

    srv.generator.start()
    try:
        whole, chunks = asyncio.run(run())
    finally:
        srv.generator.shutdown()
    name = "mul" if choice == "required" else "add"
    choice0 = whole.choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice0.message.tool_calls] == [
        (name, '{"a": 4, "b": 5}')
    ]
    streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.function.name, tc.function.arguments) for tc in streamed] == [
        (name, '{"a": 4, "b": 5}')
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_n_stop_seed_and_usage_through_the_openai_client(server):
    """OpenAI's documented behaviour of n, stop, seed and usage (list prompts, include_usage)."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    model, messages = _model(server), [{"role": "user", "content": "hi"}]
    sampled = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 1.0, "n": 3}
    a = client.chat.completions.create(**sampled, seed=5)
    b = client.chat.completions.create(**sampled, seed=5)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2] and texts == [
        c.message.content for c in b.choices
    ]
    assert len(set(texts)) == 3  # one seed, n different samples
    assert (
        a.usage.completion_tokens == 3 * 8 and a.usage.prompt_tokens == b.usage.prompt_tokens
    )  # prompt once
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=messages, seed=2**64)
    assert e.value.body["param"] == "seed"
    # stop: the answer ends before the stop string, finish_reason "stop", streamed or not
    whole = (
        client.completions.create(model=model, prompt="ab", max_tokens=10, temperature=0)
        .choices[0]
        .text
    )
    stop = whole[3:5]
    cut = client.completions.create(
        model=model, prompt="ab", max_tokens=10, temperature=0, stop=[stop, "zz"]
    )
    assert (
        cut.choices[0].text == whole[: whole.find(stop)] and cut.choices[0].finish_reason == "stop"
    )
    # list prompts x n: each prompt counted once in usage, streamed usage equal to the plain one
    kwargs = {"model": model, "prompt": ["ab", "cde"], "max_tokens": 3, "n": 2, "temperature": 0}
    plain = client.completions.create(**kwargs)
    assert [c.index for c in plain.choices] == [0, 1, 2, 3] and plain.usage.prompt_tokens == 5
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert all(c.usage is None for c in chunks[:-1]) and "usage" in chunks[0].model_dump(
        exclude_unset=True
    )
