"""A request refused for what it asks is the agent's error, never the engine's (issue #56):
sampling fields out of the server's range are refused before sending, a server's 400 (a
conversation longer than the context) reaches the agent with the server's message, through the
agent proxy and in process (as openai's ``BadRequestError``), counted per episode, and the run
goes on. Also the proxy's other refusals: a non-finite reward, a deep or malformed body (400,
never 500), a body over the limit by its Content-Length before it is read (413), and sessions
that stay responsive while a long conversation is tokenized; and an agent program's environment,
which holds its session key and base URL but none of the run's secrets.

The proxy serves on the test's loop over a scripted engine that refuses as the generation server
does (areal.rollout.remote.ServerRejected); the remote client's side of it runs against a
loopback HTTP server answering 400 and 401."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest
from aiohttp import web

from areal.api.config.base import GenerationHyperparameters
from areal.api.config.reward import AgentConfig
from areal.api.config.rollout import InferenceEngineConfig
from areal.api.engine import InferenceEngine
from areal.api.io import ModelRequest, ModelResponse
from areal.api.sampling import MAX_SEED, RequestRejected
from areal.rollout.remote import RemoteEngineError, RemoteInferenceEngine, ServerRejected
from areal.workflow.agent import AgentWorkflow
from areal.workflow.agent_cmd import AgentCommandWorkflow
from areal.workflow.agent_control import ProxyClient
from areal.workflow.agent_proxy import AgentProxy

G = GenerationHyperparameters(n_samples=1, max_new_tokens=8)
TOKEN = "control-token-of-this-test"
CONTEXT = 64  # tokens: the scripted server's context
SHORT = [{"role": "user", "content": "hi"}]
LONG = [{"role": "user", "content": "x" * 200}]  # ~200 tokens with the tiny tokenizer


class ContextLimited(InferenceEngine):
    """Answers ``ok`` + EOS; a prompt of ``CONTEXT`` tokens or more is refused with the message
    and field our server gives (HTTP 400, surfacing from the remote client as ServerRejected)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.requests = tokenizer, []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        await asyncio.sleep(0)
        self.requests.append(req)
        if len(req.input_ids) >= CONTEXT:
            raise ServerRejected(
                f"s:1 (POST /generate) refused the request (HTTP 400): input_ids: prompt has "
                f"{len(req.input_ids)} tokens, the context is {CONTEXT}; shorten the prompt",
                "input_ids",
                400,
            )
        out = self.tokenizer("ok", add_special_tokens=False)["input_ids"]
        out.append(self.tokenizer.eos_token_id)
        return ModelResponse(list(req.input_ids), out, [-0.5] * len(out), [0] * len(out), "stop")

    def update_weights(self, meta) -> None: ...
    def get_version(self) -> int:
        return 0

    def set_version(self, version: int) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...


async def _post(http, url, key, data, **kw) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"}
    async with http.post(url, data=data, headers=headers, **kw) as r:
        return r.status, await r.json(content_type=None)


def _on_proxy(tokenizer, test, max_bytes: int = 1 << 20):
    """Run ``await test(proxy, base, http, engine)`` with a proxy serving on this loop."""

    async def run():
        engine = ContextLimited(tokenizer)
        proxy = AgentProxy(tokenizer, engine, max_bytes, TOKEN)
        base = f"http://{await proxy.start()}/v1"
        try:
            async with aiohttp.ClientSession() as http:
                await test(proxy, base, http, engine)
        finally:
            await proxy.stop()

    asyncio.run(run())


def test_a_conversation_the_server_refuses_is_the_agents_400_and_the_session_goes_on(
    tiny_tokenizer,
):
    async def test(proxy, base, http, engine):
        key, session = proxy.open(G, "q", "q/0", 60.0)
        status, body = await _post(
            http, f"{base}/chat/completions", key, json.dumps({"messages": LONG})
        )
        assert status == 400, body
        assert body["error"]["param"] == "input_ids"
        assert "the context is 64; shorten the prompt" in body["error"]["message"]
        chat = json.dumps({"messages": SHORT})
        assert (await _post(http, f"{base}/chat/completions", key, chat))[0] == 200
        assert session.client.engine_failure is None and session.client.n_rejected == 1
        assert len(session.client.calls) == 1  # the refused call recorded nothing

    _on_proxy(tiny_tokenizer, test)


BAD_FIELDS = [
    ("chat", {"top_p": 5}, "top_p"),
    ("chat", {"top_p": 0}, "top_p"),
    ("chat", {"stop": [f"s{i}" for i in range(100)]}, "stop"),
    ("chat", {"stop": [5]}, "stop"),
    ("chat", {"seed": MAX_SEED + 1}, "seed"),
    ("chat", {"seed": -1}, "seed"),
    ("chat", {"n": 10**6}, "n"),
    ("text", {"prompt": [1000000]}, "prompt"),
    ("text", {"prompt": [-1]}, "prompt"),
]


def test_sampling_fields_out_of_the_servers_range_are_refused_before_sending(tiny_tokenizer):
    async def test(proxy, base, http, engine):
        key, session = proxy.open(G, "q", "q/0", 60.0)
        for route, fields, field in BAD_FIELDS:
            body = {"messages": SHORT, **fields} if route == "chat" else {"prompt": "hi", **fields}
            url = f"{base}/chat/completions" if route == "chat" else f"{base}/completions"
            status, answer = await _post(http, url, key, json.dumps(body))
            assert status == 400 and answer["error"]["param"] == field, (fields, answer)
            assert answer["error"]["message"].startswith(f"{field}: "), answer
        assert engine.requests == [] and session.client.n_rejected == len(BAD_FIELDS)
        assert proxy.open_sessions == 1  # the session goes on

    _on_proxy(tiny_tokenizer, test)


def test_in_process_agents_get_openai_bad_request_and_the_run_goes_on(tiny_tokenizer):
    async def careful(client, item) -> float:
        try:
            await client.chat.completions.create(messages=LONG)
        except openai.BadRequestError as e:  # as AsyncOpenAI raises it on a server's 400
            assert e.status_code == 400 and "the context is 64" in e.message
        out = await client.chat.completions.create(messages=SHORT)
        return float(out.choices[0].message.content == "ok")

    async def careless(client, item) -> float:
        await client.chat.completions.create(messages=SHORT, top_p=5.0)
        return 1.0

    engine = ContextLimited(tiny_tokenizer)
    item = {"id": "q", "messages": SHORT}
    wf = AgentWorkflow(AgentConfig(), G, tiny_tokenizer, agent=careful)
    (traj,) = asyncio.run(wf.arun_episode(engine, item))
    assert traj.reward == 1.0 and wf.stats()["agent/calls_rejected"] == 1.0
    wf = AgentWorkflow(AgentConfig(), G, tiny_tokenizer, agent=careless)
    assert asyncio.run(wf.arun_episode(engine, item)) is None  # dropped, no EngineFailure
    stats = wf.stats()
    assert stats["agent/episodes_failed"] == 1 and stats["agent/calls_rejected"] == 1


def test_the_remote_client_raises_a_4xx_for_what_the_request_asks_as_rejected():
    """400 from a server: ServerRejected (the caller's error, and a RemoteEngineError); 401 (the
    run's admin key) stays a plain RemoteEngineError, which stops the run."""

    async def generate(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer right":
            return web.json_response({"error": {"message": "admin key"}}, status=401)
        error = {"message": "top_p: must be in (0, 1], got 5.0", "param": "sampling_params.top_p"}
        return web.json_response({"error": error}, status=400)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    async def serve():
        app = web.Application()
        app.add_routes([web.get("/health", health), web.post("/generate", generate)])
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]

    async def run():
        runner, port = await serve()
        request = ModelRequest(input_ids=[1, 2], gconfig=G)
        config = InferenceEngineConfig(setup_timeout=10.0, request_timeout=10.0)
        try:
            errors = []
            for key in ("right", "wrong"):
                engine = RemoteInferenceEngine(config, api_key=key)
                await asyncio.to_thread(engine.initialize, [f"127.0.0.1:{port}"])
                try:
                    with pytest.raises(RemoteEngineError) as caught:
                        await engine.agenerate(request)
                finally:
                    await asyncio.to_thread(engine.destroy)
                errors.append(caught.value)
            refused, unauthorised = errors
            assert isinstance(refused, ServerRejected) and isinstance(refused, RequestRejected)
            assert refused.status == 400 and refused.field == "sampling_params.top_p"
            assert str(refused).endswith("(HTTP 400): top_p: must be in (0, 1], got 5.0")
            assert not isinstance(unauthorised, RequestRejected)
        finally:
            await runner.cleanup()

    asyncio.run(run())


def test_a_reward_that_is_not_finite_in_float32_is_refused_naming_the_field(tiny_tokenizer):
    async def test(proxy, base, http, engine):
        key, session = proxy.open(G, "q", "q/0", 60.0)
        _, answer = await _post(
            http, f"{base}/chat/completions", key, json.dumps({"messages": SHORT})
        )
        for raw in ("1e308", "-1e308", "NaN", "Infinity", "-Infinity", "1" + "0" * 400):
            for extra in ("", f', "completion_id": "{answer["id"]}"'):
                data = '{"reward": ' + raw + extra + "}"
                status, body = await _post(http, f"{base}/reward", key, data)
                assert status == 400 and body["error"]["param"] == "reward", (raw, body)
                assert body["error"]["message"].startswith("reward: expected a finite number")
        assert session.reward is None and not session.client.call_rewards
        assert not session.ended.is_set()  # the session goes on: a finite reward ends it
        status, body = await _post(http, f"{base}/reward", key, json.dumps({"reward": 1e30}))
        assert status == 200 and session.reward == 1e30

    _on_proxy(tiny_tokenizer, test)


def test_deep_or_malformed_bodies_get_400_never_500(tiny_tokenizer):
    deep = "[" * 100_000 + "]" * 100_000
    bodies = [
        deep,
        '{"messages": ' + deep + "}",
        json.dumps({"messages": [{"role": "user", "content": {"a": [1]}}]}),
        json.dumps({"messages": [{"role": "user", "content": "x"}], "n": "2"}),
        json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": [1]}),
        json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": [{"function": 1}]}),
        json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
        json.dumps({"messages": "hi"}),
        json.dumps({"self": 1, "messages": SHORT}),
    ]

    async def test(proxy, base, http, engine):
        key, _ = proxy.open(G, "q", "q/0", 60.0)
        for data in bodies:
            status, body = await _post(http, f"{base}/chat/completions", key, data)
            assert status == 400, (data[:60], status, body)
            assert "\n" not in json.dumps(body["error"]["message"]), body  # one line
        assert (
            await _post(http, f"{base}/chat/completions", key, json.dumps({"messages": SHORT}))
        )[0] == 200

    _on_proxy(tiny_tokenizer, test)


def test_a_body_over_the_limit_is_refused_by_its_length_before_it_is_read(tiny_tokenizer):
    """A client announcing 10 MiB and sending 100 bytes gets 413 at once (no wait for a body
    that never comes), in one line naming the limit and its config field."""

    async def test(proxy, base, http, engine):
        key, _ = proxy.open(G, "q", "q/0", 60.0)
        host, port = proxy.address.split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: {proxy.address}\r\n"
                f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {10 << 20}\r\n\r\n"
            ).encode()
            + b"{" * 100
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        body = json.loads(await asyncio.wait_for(reader.readexactly(length), 5.0))
        writer.close()
        await writer.wait_closed()
        assert head.startswith(b"HTTP/1.1 413"), head
        message = body["error"]["message"]
        assert "\n" not in message and "workflow.agent.max_request_mb=1 (1048576 bytes)" in message

    _on_proxy(tiny_tokenizer, test)


def test_other_sessions_stay_responsive_while_a_long_conversation_is_tokenized(tiny_tokenizer):
    """A conversation of ~1.8 MiB takes seconds to tokenize (~0.6 MiB once took under 0.5 s in a
    full run here, too fast to tell anything); another session's call made
    meanwhile is answered long before it (tokenization runs off the proxy's loop, which the
    test's client shares: a blocked loop would hold the quick call back too)."""
    big = json.dumps({"messages": [{"role": "user", "content": "hello world " * 150_000}]})

    async def test(proxy, base, http, engine):
        key_a, _ = proxy.open(G, "qa", "qa/0", 60.0)
        key_b, _ = proxy.open(G, "qb", "qb/0", 60.0)
        t0 = time.monotonic()
        slow = asyncio.ensure_future(_post(http, f"{base}/chat/completions", key_a, big))
        await asyncio.sleep(0.2)
        chat = json.dumps({"messages": SHORT})
        quick = await _post(http, f"{base}/chat/completions", key_b, chat)
        # a blocked loop would answer the long call first (its handler runs on once the
        # tokenizer returns) and the quick one after it: the order, not a timing ratio, tells
        slow_done_first = slow.done()
        status, body = await slow
        took = time.monotonic() - t0
        assert quick[0] == 200 and status == 400 and body["error"]["param"] == "input_ids"
        assert took > 0.5, "the long conversation tokenized too fast to show anything"
        assert not slow_done_first, took

    _on_proxy(tiny_tokenizer, test, max_bytes=4 << 20)


PRINT_ENV = (  # its body runs at the fork server's preload too: print only as __main__
    "import json, os\nif __name__ == '__main__':\n    print(json.dumps(dict(os.environ)))"
)


@pytest.mark.parametrize("fork_server", [False, True])
def test_agent_processes_get_their_session_key_and_base_url_and_no_secret(
    fork_server, tiny_tokenizer, tmp_path, monkeypatch
):
    monkeypatch.setenv("AREAL_AGENT_PROXY_TOKEN", TOKEN)
    monkeypatch.setenv("AREAL_SERVER_API_KEY", "admin-key-of-this-test")
    monkeypatch.setenv("OPENAI_ORG_ID", "org-of-the-trainer")
    script = tmp_path / "print_env.py"
    script.write_text(PRINT_ENV + "\n")
    config = AgentConfig(command=f"python {script}", fork_server=fork_server)
    proxy = ProxyClient("127.0.0.1:9", TOKEN)  # never called: only its base URL is used
    wf = AgentCommandWorkflow(config, G, tiny_tokenizer, proxy)

    async def run() -> dict:
        proc = await wf._spawn("areal-session-key")
        proc.stdin.close()
        out = await asyncio.wait_for(proc.stdout.read(), 60.0)
        await asyncio.wait_for(proc.wait(), 60.0)
        await wf.aclose()
        return json.loads(out)

    env = asyncio.run(run())
    assert env["OPENAI_API_KEY"] == "areal-session-key"
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:9/v1"
    assert sorted(k for k in env if k.startswith("OPENAI_")) == [
        "OPENAI_API_KEY",
        "OPENAI_BASE_URL",
    ]
    assert not [k for k in env if k.startswith("AREAL_")], env
    assert TOKEN not in json.dumps(env) and "admin-key-of-this-test" not in json.dumps(env)
    assert env["PATH"]  # the rest of the trainer's environment is kept
