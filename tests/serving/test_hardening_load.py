"""Load and weight-file hardening (issue #56): generation past the connections kept for work
gets 503 with Retry-After while /health and admin still answer; a connection flood evicts its
own connections, not a client's pooled one; weight files that are named pipes, symlinks out of
the dir or far too big get 400 at once while the server keeps serving; joining an unreachable
weight-update group is a 400 within its timeout."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from areal.utils.network import free_port
from tests.serving.servers import start_servers, stop_servers
from tests.serving.test_server import KEY, PROMPT, call

GREEDY = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
# 8 connections, 2 of them kept for control routes: at most 6 inside generation requests
CAP = ("--api-key", KEY, "max_connections=8", "control_connections=2", "max_batch_size=8")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    procs = start_servers(tiny_model_dir, 1, *CAP)
    yield f"http://{procs[0][1]}"
    stop_servers(procs)


def _post(url: str, body: dict, timeout: float = 30.0) -> tuple[int, dict, str | None]:
    """(status, JSON body, Retry-After header) of a POST."""
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), resp.headers.get("Retry-After")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers.get("Retry-After")


def _until(predicate, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _info(url: str) -> dict:
    return call(f"{url}/get_server_info", timeout=5)[1]


def test_generation_past_the_work_connections_gets_503_and_health_and_admin_still_answer(server):
    held = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    assert call(f"{server}/pause_generation", {}, key=KEY)[0] == 200  # requests are held inside
    pool, futures = ThreadPoolExecutor(7), []
    with _connect(server) as pooled:  # one kept-alive connection asks how things stand

        def info() -> dict:
            return json.loads(_get(pooled, "/get_server_info").split(b"\r\n\r\n", 1)[1])

        shed_before = info()["requests_shed"]
        try:  # 1 + 7 connections: none evicted; 6 may be inside generation requests
            futures = [pool.submit(_post, f"{server}/generate", held) for _ in range(7)]
            _until(
                lambda: info()["requests_shed"] - shed_before == 1 and _busy(info()) == 6,
                "the 7th generation was not answered 503",
            )
            for _ in range(3):  # a new connection: control routes still answer
                t0 = time.monotonic()
                assert call(f"{server}/health", timeout=5)[0] == 200
                assert time.monotonic() - t0 < 1.0
            ((status, body, after),) = [f.result(timeout=5) for f in futures if f.done()]
            assert status == 503 and after == "1", body
            assert "server.max_connections=8" in body["error"]["message"], body
        finally:
            call(f"{server}/continue_generation", {}, key=KEY, timeout=10)
            results = [f.result(timeout=30) for f in futures]
            pool.shutdown()
    assert sorted(status for status, _, _ in results) == [200] * 6 + [503]


def _busy(info: dict) -> int:
    return info["connections_busy"] - 1  # less the one asking


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _get(sock: socket.socket, path: str = "/health") -> bytes:
    """Send ``GET path`` on ``sock`` (kept alive) and return the whole answer."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_a_connection_flood_evicts_its_own_connections_not_a_clients_pooled_one(server):
    flood = []
    evicted_before = _info(server)["connections_evicted"]
    with _connect(server) as pooled:  # opened first: the oldest connection
        assert _get(pooled).startswith(b"HTTP/1.1 200")
        try:
            for _ in range(12):  # past max_connections=8, each stuck in its head
                sock = _connect(server)
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                flood.append(sock)
            _until(
                lambda: _info(server)["connections_evicted"] - evicted_before >= 5,
                "the flood evicted nothing",
            )
            assert _get(pooled).startswith(b"HTTP/1.1 200")  # the same connection
        finally:
            for sock in flood:
                sock.close()


@pytest.fixture
def copies(tiny_model_dir, tmp_path):
    """``copy(name)``: a copy of the tiny model dir and its weight file's path in it."""

    def copy(name: str) -> tuple[Path, Path]:
        d = tmp_path / name
        shutil.copytree(tiny_model_dir, d)
        (weights,) = d.glob("*.safetensors")
        return d, weights

    return copy


def test_weight_files_that_are_pipes_outside_links_or_too_big_get_400_and_the_server_serves(
    server, tiny_model_dir, copies
):
    before = call(f"{server}/generate", GREEDY)[1]["output_ids"]
    pipe_dir, pipe = copies("pipe")
    pipe.unlink()
    os.mkfifo(pipe)
    link_dir, link = copies("link")
    link.unlink()
    link.symlink_to(next(Path(tiny_model_dir).glob("*.safetensors")))  # a real file, elsewhere
    big_dir, _ = copies("big")
    with open(big_dir / "extra.safetensors", "wb") as f:
        f.truncate(50 << 30)  # sparse: 50 GiB long, nothing on disk
    expected = {
        pipe_dir: f"{pipe.name}: a named pipe (FIFO)",
        link_dir: f"{link.name}: a symlink leading outside",
        big_dir: "extra.safetensors: brings the weight files to",
    }
    try:
        for d, message in expected.items():
            t0 = time.monotonic()
            status, out = call(
                f"{server}/update_weights_from_disk", {"model_path": str(d)}, key=KEY, timeout=10
            )
            assert status == 400 and out["error"]["param"] == "model_path", out
            assert message in out["error"]["message"], out
            assert time.monotonic() - t0 < 5.0
            assert call(f"{server}/health", timeout=5)[0] == 200
    finally:  # a server that blocked opening the pipe (the old reader) gets its EOF
        with contextlib.suppress(OSError):  # ENXIO: nobody opened it for reading
            os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
    assert call(f"{server}/generate", GREEDY)[1]["output_ids"] == before


def test_joining_an_unreachable_weight_group_is_a_400_naming_it_within_its_timeout(server):
    port = free_port()  # nobody listens there
    body = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "timeout": 1,
    }
    t0 = time.monotonic()
    status, out = call(f"{server}/init_weights_update_group", body, key=KEY, timeout=30)
    assert status == 400 and out["error"]["param"] == "master_address", out
    assert f"127.0.0.1:{port} within 1 s" in out["error"]["message"], out
    assert "\n" not in out["error"]["message"]
    assert time.monotonic() - t0 < 10.0
    assert call(f"{server}/health", timeout=5)[0] == 200


# ------------------------------------------------------------------ pure parts


class _Handler:  # aiohttp's RequestHandler as the guard sees it
    def __init__(self):
        self.closed = False

    def connection_made(self, transport):
        pass

    def force_close(self):
        self.closed = True


class _Transport:
    def close(self):
        pass


def test_the_guard_evicts_never_used_connections_first_then_the_least_recently_used():
    from areal.serving.connections import ConnectionGuard

    guard = ConnectionGuard(_Handler, limit=3, reserve=1, clock=iter(range(1, 100)).__next__)
    a, b, c = guard(), guard(), guard()  # opened at 1, 2, 3
    for conn in (a, b, c):
        conn.connection_made(_Transport())
    with guard.in_request(b.inner, work=True):  # b and a complete requests: used at 4 and 5
        pass
    with guard.in_request(a.inner):
        pass
    x = guard()  # evicts c: never used, though opened after a and b
    x.connection_made(_Transport())
    assert c.inner.closed and not a.inner.closed and not b.inner.closed
    d = guard()  # x has not been used either: it goes before a and b
    d.connection_made(_Transport())
    assert x.inner.closed and not a.inner.closed and not b.inner.closed
    with guard.in_request(d.inner):  # used at 8
        pass
    guard()  # only used ones are left: b, the least recently used
    assert b.inner.closed and not a.inner.closed and not d.inner.closed
    assert guard.stats()["connections_evicted"] == 3


def test_work_requests_past_limit_less_reserve_are_shed_and_control_ones_never():
    from areal.serving.connections import ConnectionGuard

    guard = ConnectionGuard(_Handler, limit=4, reserve=1)
    conns = [guard() for _ in range(4)]
    with guard.in_request(conns[0].inner, work=True), guard.in_request(conns[1].inner, True):
        assert not guard.saturated(work=True)
        with guard.in_request(conns[2].inner, work=True):
            assert guard.saturated(work=True) and not guard.saturated(work=False)
            with guard.in_request(conns[3].inner):  # control: inside too, still answered
                assert guard.stats()["connections_busy"] == 4
        assert not guard.saturated(work=True)
    assert guard.stats()["requests_shed"] == 1


def test_control_connections_must_leave_some_for_generation():
    from areal.api.config.server import GenerationServerConfig

    problems = list(GenerationServerConfig(max_connections=4, control_connections=4).check())
    assert problems and problems[0].startswith("control_connections: 4 leaves none of")
    assert not list(GenerationServerConfig(max_connections=4, control_connections=3).check())


def test_the_weight_reader_matches_safetensors_and_has_a_deadline(tmp_path):
    from safetensors.torch import load_file, save_file

    from areal.serving.weight_files import read_weight_dir

    tensors = {
        "bf16": torch.randn(3, 5).bfloat16(),  # 30 bytes: what follows is misaligned
        "f32": torch.randn(7),
        "i64": torch.arange(5),
        "bool": torch.randn(3) > 0,
        "empty": torch.zeros(0, 4),
        "f16": torch.randn(2, 3).half(),
    }
    (tmp_path / "config.json").write_text("{}")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    read = read_weight_dir(tmp_path, 1 << 20, timeout=10)
    reference = load_file(str(tmp_path / "model.safetensors"))
    assert read.keys() == reference.keys()
    for name, t in reference.items():
        assert read[name].dtype == t.dtype and torch.equal(read[name], t), name
    with pytest.raises(ValueError, match=r"not read within 0 s \(server.weight_read_timeout"):
        read_weight_dir(tmp_path, 1 << 20, timeout=0)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(ValueError, match="model.safetensors: header length"):
        read_weight_dir(tmp_path, 1 << 20, timeout=10)
