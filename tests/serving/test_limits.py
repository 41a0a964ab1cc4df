"""Bounded work before admission (issue #32): body size, text, nesting, surrogates, n, stop
lists and prompt-logprob cost are refused (4xx naming the field and the ``server.*`` limit)
before anything is tokenized, parsing runs off the event loop, and slow or idle clients are cut
off by the head and body deadlines and the connection cap, so /health stays answerable."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from tests.serving.servers import start_servers, stop_servers
from tests.serving.test_faults import GREEDY, in_process, post, run_client
from tests.serving.test_server import call

LIMITS = (
    "max_body_bytes=1048576",
    "max_text_chars=5000",
    "max_stop_strings=4",
    "max_stop_chars=64",
    "max_prompt_logprob_tokens=64",
    "max_n=16",
    "request_head_timeout=1.5",
    "request_body_timeout=1.5",
    "max_connections=40",
)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    procs = start_servers(tiny_model_dir, 1, *LIMITS)
    yield f"http://{procs[0][1]}"
    stop_servers(procs)


def _model(url: str) -> str:
    return call(f"{url}/v1/models")[1]["data"][0]["id"]


def _timed(url: str, body: dict | bytes) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    status, out = call(url, body)
    return status, out, time.monotonic() - t0


def test_request_fields_past_their_limits_get_4xx_naming_the_field_and_the_limit(server):
    model = _model(server)
    before = call(f"{server}/generate", GREEDY)[1]["output_ids"]
    chat = {"model": model, "max_tokens": 1}
    cases = [  # (path, body, status, param, limit named)
        ("/generate", {"text": "a" * 2_000_000}, 413, "body", "server.max_body_bytes"),
        ("/generate", {"text": "a" * 6000}, 400, "text", "server.max_text_chars"),
        (
            "/v1/completions",
            {"prompt": "a", "max_tokens": 1, "n": 3_000_000},
            400,
            "n",
            "server.max_n",
        ),
        (
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": "x"}], "n": 10**9},
            400,
            "n",
            "server.max_n",
        ),
        ("/generate", {"input_ids": [[5]] * 17}, 400, "n", "server.max_n"),
        (
            "/v1/completions",
            {"prompt": [5, 6], "max_tokens": 1, "stop": ["s"] * 5},
            400,
            "stop",
            "server.max_stop_strings",
        ),
        (
            "/generate",
            {"input_ids": [5], "sampling_params": {"stop": ["x" * 40, "y" * 40]}},
            400,
            "sampling_params.stop",
            "server.max_stop_chars",
        ),
        (
            "/v1/completions",
            {"prompt": [[5] * 40, [6] * 40], "max_tokens": 1, "echo": True, "logprobs": 20},
            400,
            "logprobs",
            "server.max_prompt_logprob_tokens",
        ),
        (
            "/generate",
            {"input_ids": [5] * 65, "return_logprob": True, "logprob_start_len": 0},
            400,
            "logprob_start_len",
            "server.max_prompt_logprob_tokens",
        ),
        ("/v1/chat/completions", _deep_tools(model, 900), 400, "tools", "server.max_json_depth"),
    ]
    for path, body, status, param, limit in cases:
        got, out, seconds = _timed(server + path, body)
        assert (got, out["error"]["param"]) == (status, param), (path, out)
        assert limit in out["error"]["message"] and seconds < 5, (path, seconds, out)
    assert call(f"{server}/health")[0] == 200
    assert call(f"{server}/generate", GREEDY)[1]["output_ids"] == before


def _deep_tools(model: str, depth: int) -> bytes:
    """A chat body whose tool's parameter schema nests ``depth`` objects (written by hand:
    json.dumps stops at Python's recursion limit; json.loads still parses it)."""
    schema = '{"a": ' * depth + '{"type": "string"}' + "}" * depth
    return (
        f'{{"model": {json.dumps(model)}, "max_tokens": 1, "messages": [{{"role": "user", '
        '"content": "hi"}], "tools": [{"type": "function", "function": {"name": "f", '
        f'"parameters": {schema}}}}}]}}'
    ).encode()


def test_lone_surrogates_and_bodies_nested_past_the_parser_get_400(server):
    model = _model(server)
    surrogate = b'{"text": "\\ud800"}'
    status, out = call(f"{server}/generate", surrogate)
    assert (
        status == 400 and out["error"]["param"] == "text" and "surrogate" in out["error"]["message"]
    )
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "\ud800"}]}
    ).encode()
    status, out = call(f"{server}/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "messages"
    deep = b"[" * 200_000 + b"]" * 200_000
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        status, out = call(server + path, deep)
        assert status == 400 and out["error"]["param"] == "body", (path, out)
    assert call(f"{server}/health")[0] == 200


def test_tokenizing_runs_off_the_event_loop_so_health_answers_meanwhile(tiny_model_dir):
    with in_process(tiny_model_dir) as srv:
        real = srv.encode

        def slow_encode(text: str) -> list[int]:
            time.sleep(2.0)  # a long text's tokenization
            return real(text)

        srv.encode = slow_encode

        async def script(client):  # the client shares the server's loop: a stall delays both
            t0 = time.monotonic()
            busy = asyncio.create_task(
                post(
                    client, "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 1}}
                )
            )
            await asyncio.sleep(0.3)
            health = await client.get("/health")
            waited = time.monotonic() - t0
            return health.status, waited, (await busy)[0]

        status, waited, busy = run_client(srv, script)
    assert status == 200 and waited < 1.5 and busy == 200


# ------------------------------------------------------------------ slow clients


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _closed(sock: socket.socket) -> bool:
    """True once the server closed (or reset) the connection."""
    sock.settimeout(0.05)
    try:
        return sock.recv(4096) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_half_sent_heads_past_the_connection_cap_leave_health_answerable_and_are_cut_at_deadline(
    server,
):
    slow = []
    try:
        for _ in range(100):  # 2.5x server.max_connections, each stuck in its head
            sock = _connect(server)
            sock.sendall(
                b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            )
            slow.append(sock)
        for _ in range(5):
            status, _, seconds = _timed(f"{server}/health", None)  # type: ignore[arg-type]
            assert status == 200 and seconds < 1.0
        info = call(f"{server}/get_server_info")[1]
        assert info["connections"] <= 40 and info["connections_evicted"] >= 50
        time.sleep(2.5)  # past server.request_head_timeout
        assert all(_closed(s) for s in slow)
    finally:
        for s in slow:
            s.close()


def test_a_body_that_stops_arriving_gets_408_at_the_deadline(server):
    with _connect(server) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"input_ids": '
        )
        sock.settimeout(10)
        t0 = time.monotonic()
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408") and b"server.request_body_timeout" in answer
        assert 1.0 < time.monotonic() - t0 < 5.0
    assert call(f"{server}/health")[0] == 200


def test_a_server_with_few_descriptors_keeps_accepting_and_answering_health(tiny_model_dir):
    procs = start_servers(tiny_model_dir, 1, open_files=256)  # max_connections 1000 capped to 192
    url = f"http://{procs[0][1]}"
    idle = []
    try:
        for _ in range(400):
            idle.append(_connect(url))
        assert call(f"{url}/health")[0] == 200
        assert procs[0][0].poll() is None
        assert call(f"{url}/get_server_info")[1]["connections"] <= 256 - 64
    finally:
        for s in idle:
            s.close()
        stop_servers(procs)


def test_the_guard_evicts_the_oldest_connection_outside_a_request_and_refuses_when_none_is():
    from areal.serving.connections import ConnectionGuard

    class Handler:  # aiohttp's RequestHandler as the guard sees it
        def __init__(self):
            self.made = self.closed = False

        def connection_made(self, transport):
            self.made = True

        def force_close(self):
            self.closed = True

    class Transport:
        def __init__(self):
            self.closed = False

        def close(self):
            self.closed = True

    guard = ConnectionGuard(Handler, limit=2, clock=iter(range(100)).__next__)
    a, b = guard(), guard()
    a.connection_made(Transport())  # b is accepted but not made yet (a burst of accepts)
    with guard.in_request(a.inner):
        c = guard()  # evicts b, the oldest outside a request, before it is made
        late = Transport()
        b.connection_made(late)
        assert late.closed and not b.inner.made and not a.inner.closed
        c.connection_made(Transport())
        d = guard()  # evicts c (made: closed by aiohttp's force_close)
        assert c.inner.closed
        d.connection_made(Transport())
        with guard.in_request(d.inner):
            refused, t = guard(), Transport()
            refused.connection_made(t)
            assert t.closed and type(refused).__name__ == "_Refused"
    assert guard.stats() == {
        "connections": 2,
        "connections_busy": 0,
        "connections_evicted": 2,
        "connections_refused": 1,
        "requests_shed": 0,
    }
