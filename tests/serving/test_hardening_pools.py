"""Work off the event loop on bounded pools (issue #56): grammar compiles (a slow grammar holds
one compile thread and fails alone, a cached grammar never waits, the queue is bounded: 503) and
request parsing (a short body is not parsed behind long ones; the long lane is bounded: 503;
every parse has a deadline); and the shapes of bad input that were 500s or invalid JSON
(``-Infinity`` in top_logprobs under a grammar, non-object chat messages on /tokenize).

The server runs in this process so a grammar can be made slow: ``to_grammar`` sleeps for the
ones holding "slow" (llguidance compiles with the GIL released, as ``time.sleep`` does)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from areal.serving import constraints

pytestmark = pytest.mark.slow
SLOW_S = 1.5  # seconds a "slow" grammar takes to compile
COMPILE_TIMEOUT_S = 0.5  # server.grammar_compile_timeout here
MESSAGES = [{"role": "user", "content": "Call add."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
FORCED_CALL = {
    "messages": MESSAGES,
    "tools": TOOLS,
    "tool_choice": "required",
    "max_tokens": 4,
    "temperature": 0,
}


def _regex_chat(regex: str, **extra) -> dict:
    return {
        "messages": MESSAGES,
        "max_tokens": 4,
        "temperature": 0,
        "structured_outputs": {"regex": regex},
        **extra,
    }


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from areal.api.config import from_dict
    from areal.api.config.server import GenerationServerConfig
    from areal.serving.server import GenerationServer

    real = constraints.to_grammar

    def to_grammar(c):
        if "slow" in c.source:
            time.sleep(SLOW_S)
        return real(c)

    patch = pytest.MonkeyPatch()
    patch.setattr(constraints, "to_grammar", to_grammar)
    cfg = {
        "model_path": str(tiny_model_dir),
        "grammar_compile_timeout": COMPILE_TIMEOUT_S,
        "grammar_compile_threads": 2,
        "max_queued_grammars": 1,
        "parse_threads": 1,
        "max_queued_parses": 1,
    }
    srv = GenerationServer(from_dict(GenerationServerConfig, cfg))
    srv.generator.start()
    yield srv
    srv.generator.shutdown()
    patch.undo()


def _reject_constant(name: str):
    raise ValueError(f"{name} is not strict JSON")


def _serve(srv, scenario):
    """Run ``scenario(post)`` against ``srv`` on a loopback port; ``post(path, body, delay)``
    answers (status, strict JSON, seconds taken, headers). Returns once no grammar compile is
    left running (bounded), so the next test starts with free compile threads."""
    from aiohttp.test_utils import TestClient, TestServer

    async def run():
        async with TestClient(TestServer(srv.build_app(), host="127.0.0.1")) as client:

            async def post(path: str, body, delay: float = 0.0):
                await asyncio.sleep(delay)
                t0 = time.monotonic()
                data = body if isinstance(body, bytes) else json.dumps(body)
                resp = await client.post(path, data=data)
                text = await resp.text()
                out = json.loads(text, parse_constant=_reject_constant)
                return resp.status, out, time.monotonic() - t0, resp.headers

            result = await scenario(post)
        deadline = time.monotonic() + 4 * SLOW_S
        while srv.grammars._pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return result

    return asyncio.run(run())


# ------------------------------------------------------------------ grammar compile pool


def test_a_cached_grammar_is_served_at_once_while_slow_grammars_hold_every_compile_thread(server):
    async def scenario(post):
        status, out, _, _ = await post("/v1/chat/completions", FORCED_CALL)  # compiles, cached
        assert status == 200, out
        return await asyncio.gather(
            post("/v1/chat/completions", _regex_chat("slow1[a-z]")),
            post("/v1/chat/completions", _regex_chat("slow2[a-z]")),
            post("/v1/chat/completions", FORCED_CALL, delay=0.2),
        )

    slow1, slow2, cached = _serve(server, scenario)
    assert cached[0] == 200, cached[1]
    assert cached[2] < SLOW_S - 0.2, f"the cached grammar waited {cached[2]:.2f} s"
    for status, out, took, _ in (slow1, slow2):
        assert status == 400 and out["error"]["param"] == "structured_outputs.regex", out
        assert f"did not compile within {COMPILE_TIMEOUT_S} s" in out["error"]["message"]
        assert took < SLOW_S, f"the slow grammar's request waited {took:.2f} s"


def test_a_grammar_slower_than_its_deadline_fails_alone_and_a_new_one_compiles_beside_it(server):
    async def scenario(post):
        return await asyncio.gather(
            post("/v1/chat/completions", _regex_chat("slow3[a-z]")),
            post("/v1/chat/completions", _regex_chat("[0-9]{2}"), delay=0.1),
        )

    (slow_status, slow, _, _), (status, out, took, _) = _serve(server, scenario)
    assert slow_status == 400 and "did not compile" in slow["error"]["message"], slow
    assert status == 200, out
    assert len(out["choices"][0]["message"]["content"]) == 2, out
    assert took < SLOW_S - 0.2, f"the fast grammar waited {took:.2f} s behind the slow one"


def test_compiles_past_the_queue_bound_are_refused_with_503_at_once(server):
    async def scenario(post):
        return await asyncio.gather(
            post("/v1/chat/completions", _regex_chat("slow4[a-z]")),  # running
            post("/v1/chat/completions", _regex_chat("slow5[a-z]")),  # running
            post("/v1/chat/completions", _regex_chat("slow6[a-z]"), delay=0.1),  # queued
            post("/v1/chat/completions", _regex_chat("slow7[a-z]"), delay=0.2),  # past the bound
        )

    *_, queued, refused = _serve(server, scenario)
    status, out, took, headers = refused
    assert status == 503 and out["error"]["param"] == "structured_outputs.regex", out
    assert "server.max_queued_grammars=1" in out["error"]["message"], out
    assert headers["Retry-After"] == "1" and took < COMPILE_TIMEOUT_S, took
    # the queued one waited its deadline for a thread: busy (503), not its grammar's fault
    status, out, _, _ = queued
    assert status == 503 and "no grammar compile thread was free" in out["error"]["message"], out


# ------------------------------------------------------------------ parse pool


def test_a_short_request_is_not_parsed_behind_long_bodies(server):
    long_body = {"prompt": "hello world, this is text. " * 12_000}  # ~320 KB

    async def scenario(post):
        return await asyncio.gather(
            post("/tokenize", long_body),
            post("/tokenize", long_body),
            post("/tokenize", {"prompt": "four tokens"}, delay=0.1),
        )

    *longs, short = _serve(server, scenario)
    assert all(s == 200 for s, *_ in [*longs, short]), [o for _, o, *_ in [*longs, short]]
    slowest = max(took for _, _, took, _ in longs)
    assert short[2] < slowest / 4, f"short {short[2]:.2f} s, long bodies up to {slowest:.2f} s"


def test_long_bodies_past_the_parse_queue_bound_are_refused_with_503(server):
    long_body = {"prompt": "hello world, this is text. " * 20_000}  # ~540 KB

    async def scenario(post):
        return await asyncio.gather(*(post("/tokenize", long_body) for _ in range(3)))

    answers = _serve(server, scenario)
    refused = [(out, headers) for status, out, _, headers in answers if status == 503]
    assert refused and all(s in (200, 503) for s, *_ in answers), [s for s, *_ in answers]
    for out, headers in refused:
        assert out["error"]["param"] == "body" and headers["Retry-After"] == "1", out
        assert "server.max_queued_parses=1" in out["error"]["message"], out


def test_a_parse_that_cannot_start_before_its_deadline_is_dropped_with_503():
    from areal.serving.parsing import ParsePool
    from areal.serving.requests import Overloaded

    pool = ParsePool(threads=1, small_bytes=10, max_queued=4, timeout=0.2)
    ran: list[str] = []

    async def scenario():
        hold = asyncio.ensure_future(pool.run(100, lambda: time.sleep(0.6)))
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded, match="request_parse_timeout") as e:
            await pool.run(100, lambda: ran.append("late"))
        with pytest.raises(Overloaded):
            await hold  # its own deadline passed while it ran
        await asyncio.sleep(0.6)  # the thread is free again: the dropped parse never ran
        return e.value

    error = asyncio.run(scenario())
    assert error.field == "body" and ran == []


# ------------------------------------------------------------------ bad input shapes


def test_top_logprobs_under_a_grammar_are_strict_json_with_masked_tokens_at_minus_9999(server):
    async def scenario(post):
        chat = await post(
            "/v1/chat/completions", _regex_chat("[a-c]{3}", logprobs=True, top_logprobs=5)
        )
        gen = await post(
            "/generate",
            {
                "input_ids": [5, 17, 99],
                "return_logprob": True,
                "top_logprobs_num": 5,
                "sampling_params": {"max_new_tokens": 4, "regex": "[a-c]{3}"},
            },
        )
        return chat, gen

    (chat_status, chat, _, _), (gen_status, gen, _, _) = _serve(server, scenario)
    assert chat_status == 200 and gen_status == 200, (chat, gen)
    content = chat["choices"][0]["logprobs"]["content"]
    # 3 tokens a, b or c: of each position's 5 alternatives, 3 are allowed and 2 masked
    for entry in content:
        values = sorted(t["logprob"] for t in entry["top_logprobs"])
        assert values[:2] == [-9999.0, -9999.0] and all(v > -9999.0 for v in values[2:])
    for position in gen["meta_info"]["output_top_logprobs"][:3]:
        assert sorted(lp for lp, *_ in position)[:2] == [-9999.0, -9999.0], position


@pytest.mark.parametrize(
    "path,body,param,says",
    [
        ("/tokenize", {"messages": [1]}, "messages[0]", "a number (1)"),
        ("/tokenize", {"messages": ["hi"]}, "messages[0]", "a string 'hi'"),
        ("/tokenize", {"messages": [None]}, "messages[0]", "null"),
        ("/tokenize", {"messages": "hi"}, "messages", "a string 'hi'"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": {"text": "hi"}}]},
            "messages[0].content",
            "an object",
        ),
        ("/tokenize", {"prompt": 5}, "prompt", "a number (5)"),
        ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, "return_token_strs", "a string"),
        (
            "/v1/chat/completions",
            {
                "messages": MESSAGES,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": '["not", "a schema"]'},
                },
            },
            "response_format.json_schema.schema",
            "holding an array",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": MESSAGES,
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": '{"type": "object"}'},
                    }
                ],
            },
            "tools[0].function.parameters",
            'a string \'{"type": "object"}\'',
        ),
        (
            "/v1/chat/completions",
            {
                "messages": MESSAGES,
                "tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}],
            },
            "tools[0].function.strict",
            "a string 'yes'",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "structured_outputs": {"choice": ["a", 1]}},
            "structured_outputs.choice",
            "a number (1)",
        ),
        (
            "/generate",
            {"text": "x", "sampling_params": {"json_schema": "[1]"}},
            "sampling_params.json_schema",
            "holding an array",
        ),
    ],
)
def test_bad_input_shapes_get_400_naming_the_field_and_what_it_held(
    server, path, body, param, says
):
    async def scenario(post):
        return await post(path, body)

    status, out, _, _ = _serve(server, scenario)
    assert status == 400 and out["error"]["param"] == param, out
    assert says in out["error"]["message"], out


def test_tokenize_honours_add_generation_prompt(server):
    async def scenario(post):
        return await asyncio.gather(
            post("/tokenize", {"messages": MESSAGES}),
            post("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}),
        )

    (s1, with_prompt, _, _), (s2, without, _, _) = _serve(server, scenario)
    assert s1 == 200 and s2 == 200, (with_prompt, without)
    assert with_prompt["tokens"][: without["count"]] == without["tokens"]
    assert with_prompt["count"] > without["count"]
