"""One request never takes the server down: failed steps, weight updates that must be refused,
admin-argument validation, request caps, client disconnects, the admin key, and fuzz runs of
request bodies (with slow clients) and weight files."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.serving.servers import start_servers, stop_servers
from tests.serving.test_server import KEY, PROMPT, call

GREEDY = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    procs = start_servers(tiny_model_dir, 1, "--api-key", KEY, "max_batch_size=8", "max_n=16")
    yield f"http://{procs[0][1]}"
    stop_servers(procs)


def _in_process(tiny_model_dir, step, requests: list[tuple[str, str]]) -> list[tuple[int, dict]]:
    """Our server in this process with ``model.step`` replaced; answers to ``requests``."""
    from aiohttp.test_utils import TestClient, TestServer

    from areal.api.config import from_dict
    from areal.api.config.server import GenerationServerConfig
    from areal.serving.server import GenerationServer

    srv = GenerationServer(from_dict(GenerationServerConfig, {"model_path": str(tiny_model_dir)}))
    srv.generator.model.step = step(srv.generator.model.step)
    srv.generator.start()

    async def run() -> list[tuple[int, dict]]:
        async with TestClient(TestServer(srv.build_app(), host="127.0.0.1")) as client:
            answers = []
            for method, path in requests:
                resp = await client.request(method, path, json=GREEDY if method == "POST" else None)
                answers.append((resp.status, await resp.json()))
            return answers

    try:
        return asyncio.run(run())
    finally:
        srv.generator.shutdown()


def test_a_failed_step_fails_its_requests_with_500_and_the_server_goes_on(tiny_model_dir):
    def fail_once(real):
        calls = []

        def step(*args):
            calls.append(1)
            if len(calls) == 1:
                raise FloatingPointError("bad kernel")
            return real(*args)

        return step

    requests = [
        ("POST", "/generate"),
        ("POST", "/generate"),
        ("GET", "/health"),
        ("GET", "/get_server_info"),
    ]
    (s1, failed), (s2, ok), (s3, _), (_, info) = _in_process(tiny_model_dir, fail_once, requests)
    assert (
        s1 == 500
        and "generation step failed: FloatingPointError('bad kernel')" in failed["error"]["message"]
    )
    assert s2 == 200 and len(ok["output_ids"]) == 8
    assert s3 == 200 and info["failed_steps"] == 1


def test_a_generator_that_keeps_failing_counts_as_broken_503_naming_the_cause(tiny_model_dir):
    from areal.serving.generator import MAX_FAILED_STEPS

    def always(real):
        def step(*args):
            raise FloatingPointError("bad kernel")

        return step

    requests = [("POST", "/generate")] * (MAX_FAILED_STEPS + 1) + [
        ("GET", "/health"),
        ("GET", "/health_generate"),
    ]
    answers = _in_process(tiny_model_dir, always, requests)
    statuses = [s for s, _ in answers]
    assert statuses == [500] * (MAX_FAILED_STEPS - 1) + [503] * 4
    assert (
        "generator crashed: FloatingPointError('bad kernel')"
        in answers[MAX_FAILED_STEPS - 1][1]["error"]["message"]
    )
    assert all("bad kernel" in body["error"]["message"] for _, body in answers[MAX_FAILED_STEPS:])


def test_a_broken_generator_makes_areal_serve_exit_1(tiny_model_dir, tmp_path):
    # The step breaks for good (a sitecustomize in the server process patches the forward).
    hook = tmp_path / "sitecustomize.py"
    hook.write_text(
        "import areal.serving.model as m\n"
        "def step(self, *a):\n    raise FloatingPointError('bad kernel')\n"
        "m.Qwen2Forward.step = step\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    port = _free()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal.cli",
            "serve",
            "--model",
            tiny_model_dir,
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while call_or_none(f"{url}/health") is None:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[
                -2000:
            ]
            time.sleep(0.2)
        from areal.serving.generator import MAX_FAILED_STEPS

        for _ in range(MAX_FAILED_STEPS):
            call_or_none(f"{url}/generate", GREEDY)
        assert proc.wait(timeout=30) == 1
        assert (
            "generator broken, exiting: FloatingPointError('bad kernel')"
            in proc.stdout.read().decode()
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def call_or_none(url: str, body: dict | None = None):
    try:
        return call(url, body, timeout=10)
    except OSError:
        return None


def _free() -> int:
    from areal.utils.network import free_port

    return free_port()


# ------------------------------------------------------------------ weight updates


def _bad_dirs(tiny_model_dir: str, root: Path) -> dict[str, Path]:
    """Model dirs a weight update must refuse: NaN weights, a missing tensor, a truncated file,
    a float64 value finite only before the cast to float32, an integer tensor."""
    from safetensors.torch import load_file, save_file

    src = Path(tiny_model_dir)
    (weights,) = src.glob("*.safetensors")
    tensors = load_file(str(weights))
    out = {}
    for kind in ("nan", "partial", "truncated", "empty", "overflow", "int"):
        d = root / kind
        shutil.copytree(src, d)
        target = d / weights.name
        name = next(n for n in tensors if n.endswith("mlp.down_proj.weight"))
        if kind == "nan":
            save_file({**tensors, name: torch.full_like(tensors[name], float("nan"))}, str(target))
        elif kind in ("overflow", "int"):
            bad = (
                torch.full(tensors[name].shape, 1e300, dtype=torch.float64)
                if kind == "overflow"
                else tensors[name].to(torch.int64)
            )
            save_file({**tensors, name: bad}, str(target))
        elif kind == "partial":
            save_file(
                {n: t for n, t in tensors.items() if "layers.0.self_attn.q_proj" not in n},
                str(target),
            )
        elif kind == "truncated":
            data = target.read_bytes()
            target.write_bytes(data[: len(data) // 2])
        else:
            target.write_bytes(b"")
        out[kind] = d
    return out


def test_weight_updates_refuse_nan_partial_and_unreadable_weights_and_keep_the_old_ones(
    server, tiny_model_dir, tmp_path
):
    before = call(f"{server}/generate", GREEDY)[1]["output_ids"]
    version = call(f"{server}/get_model_info")[1]["weight_version"]
    expected = {
        "nan": "NaN or inf",
        "partial": "missing 2 weight(s)",
        "truncated": "cannot read",
        "empty": "cannot read",
        "overflow": "NaN or inf values once cast to torch.float32",
        "int": "is not floating point",
    }
    for kind, path in _bad_dirs(tiny_model_dir, tmp_path).items():
        status, out = call(f"{server}/update_weights_from_disk", {"model_path": str(path)}, key=KEY)
        assert status == 400 and out["error"]["param"] == "model_path", (kind, out)
        assert expected[kind] in out["error"]["message"], (kind, out)
        assert call(f"{server}/generate", GREEDY)[1]["output_ids"] == before, kind
    assert call(f"{server}/get_model_info")[1]["weight_version"] == version


@pytest.mark.parametrize(
    "body,field",
    [
        (
            {
                "master_address": "127.0.0.1",
                "master_port": "abc",
                "rank_offset": 1,
                "world_size": 2,
            },
            "master_port",
        ),
        (
            {
                "master_address": "127.0.0.1",
                "master_port": 70000,
                "rank_offset": 1,
                "world_size": 2,
            },
            "master_port",
        ),
        (
            {"master_address": "127.0.0.1", "master_port": 1e20, "rank_offset": 1, "world_size": 2},
            "master_port",
        ),
        (
            {"master_address": "127.0.0.1", "master_port": 2000, "rank_offset": 5, "world_size": 2},
            "rank_offset",
        ),
        (
            {"master_address": 7, "master_port": 2000, "rank_offset": 1, "world_size": 2},
            "master_address",
        ),
        (
            {
                "master_address": "h",
                "master_port": 2000,
                "rank_offset": 1,
                "world_size": 2,
                "timeout": float("inf"),
            },
            "timeout",
        ),
    ],
)
def test_bad_weight_group_arguments_get_400(server, body, field):
    status, out = call(f"{server}/init_weights_update_group", body, key=KEY)
    assert status == 400 and out["error"]["param"] == field, out


def test_bad_versions_and_n_above_the_cap_get_400(server):
    status, out = call(f"{server}/update_weight_version", {"new_version": float("inf")}, key=KEY)
    assert status == 400 and out["error"]["param"] == "new_version"
    status, out = call(f"{server}/update_weight_version", {"new_version": 2**80}, key=KEY)
    assert status == 400 and out["error"]["param"] == "new_version"
    model = _served_model(server)
    status, out = call(
        f"{server}/v1/completions", {"model": model, "prompt": [5, 6], "n": 17, "max_tokens": 1}
    )
    assert (
        status == 400 and out["error"]["param"] == "n" and "server.max_n" in out["error"]["message"]
    )
    status, out = call(
        f"{server}/v1/completions", {"model": "m", "prompt": [5, 6], "temperature": 10**400}
    )
    assert status == 400 and out["error"]["param"] == "temperature"
    assert call(f"{server}/health")[0] == 200


# ------------------------------------------------------------------ disconnects


def _load(url: str) -> int:
    return call(f"{url}/get_server_info")[1]["running"]


def test_a_client_that_disconnects_frees_its_slot(server):
    body = json.dumps(
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 100000, "ignore_eos": True}}
    )
    host, port = server.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    deadline = time.monotonic() + 20
    while _load(server) != 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    sock.close()
    deadline = time.monotonic() + 5
    while _load(server) != 0:
        assert time.monotonic() < deadline, "the disconnected request still holds its slot"
        time.sleep(0.05)


# ------------------------------------------------------------------ admin key


def test_the_key_by_env_is_off_the_command_line_and_the_trainer_client_sends_it(tiny_model_dir):
    from areal.api.config.rollout import InferenceEngineConfig
    from areal.api.launch import api_key_env
    from areal.rollout.remote import RemoteEngineError, RemoteInferenceEngine

    secret = "env-secret-123"
    saved = dict(os.environ)
    os.environ.update(api_key_env(secret))  # start_servers passes os.environ on
    try:
        procs = start_servers(tiny_model_dir, 1)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    proc, addr = procs[0]
    try:
        assert secret not in Path(f"/proc/{proc.pid}/cmdline").read_text()
        assert call(f"http://{addr}/pause_generation", {})[0] == 401
        keyed = RemoteInferenceEngine(InferenceEngineConfig(setup_timeout=10), api_key=secret)
        keyed.initialize([addr])
        try:
            keyed.pause()
            keyed.resume()
        finally:
            keyed.destroy()
        bare = RemoteInferenceEngine(InferenceEngineConfig(setup_timeout=10))
        bare.initialize([addr])
        try:
            with pytest.raises(RemoteEngineError, match="401"):
                bare.pause()
        finally:
            bare.destroy()
    finally:
        stop_servers(procs)


def test_secret_fields_stay_out_of_written_configs_and_trainer_argv(tmp_path):
    from areal.api.config import load_config
    from areal.api.config.experiments import GRPOConfig
    from areal.api.config.loader import save_config
    from areal.launcher.local import without_secrets

    argv = [
        f"fileroot={tmp_path}",
        "server.api_key=s3cret",
        "actor.path=m",
        "actor.use_critic=false",
        "cluster.n_servers=1",
    ]
    cfg = load_config(GRPOConfig, argv)
    assert cfg.server.api_key == "s3cret"
    assert "s3cret" not in save_config(cfg, tmp_path / "config.yaml").read_text()
    assert without_secrets(argv, cfg) == [a for a in argv if "api_key" not in a]


# ------------------------------------------------------------------ fuzz

VALUES = [
    None,
    0,
    1,
    -1,
    2,
    7,
    2**31,
    2**63,
    10**30,
    -(10**30),
    0.5,
    -0.0,
    1e-45,
    1e308,
    float("nan"),
    float("inf"),
    "",
    "x",
    "1",
    [],
    [1],
    [-1, 2**40],
    {},
    {"a": 1},
    True,
    False,
    [5, 17, 99],
    "\ud800",
    ["s"] * 100,
    ["x" * 300] * 20,
    list(range(259)),
    {"type": "function"},
    [{"type": "function", "function": {"name": "f", "parameters": {"a": {"b": {"c": 1}}}}}],
    "required",
]
SAMPLING_KEYS = [
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "seed",
    "n",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "frequency_penalty",
    "bogus",
]
TOP_KEYS = {
    "/generate": [
        "input_ids",
        "text",
        "sampling_params",
        "return_logprob",
        "rid",
        "stream",
        "bogus",
    ],
    "/v1/completions": [
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "stop",
        "seed",
        "logprobs",
        "echo",
        "stream",
        "min_tokens",
        "top_k",
        "min_p",
        "stop_token_ids",
        "best_of",
        "ignore_eos",
        "bogus",
    ],
    "/v1/chat/completions": [
        "model",
        "messages",
        "max_tokens",
        "temperature",
        "n",
        "stop",
        "seed",
        "logprobs",
        "top_logprobs",
        "max_completion_tokens",
        "min_tokens",
        "stop_token_ids",
        "tools",
        "tool_choice",
        "stream",
        "bogus",
    ],
}


def _value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if r < 0.6 or depth > 1:
        v = rng.choice(VALUES)
        return list(v) if isinstance(v, list) else v
    if r < 0.8:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(SAMPLING_KEYS): _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _hostile(rng: random.Random) -> tuple[str, bytes]:
    """Variants of the bodies that took the server down or stalled it (issue #32)."""
    vocab = list(range(259))  # the tiny model's
    kind = rng.randrange(6)
    if kind == 0:  # every id a stop id, before min_new_tokens: all logits masked
        sp = {
            "min_new_tokens": rng.randint(1, 3),
            "max_new_tokens": 4,
            "stop_token_ids": vocab,
            "temperature": rng.choice([0, 1.0]),
        }
        return "/generate", json.dumps({"input_ids": PROMPT, "sampling_params": sp}).encode()
    if kind == 1:
        body = {
            "prompt": PROMPT,
            "max_tokens": 4,
            "min_tokens": rng.randint(1, 3),
            "stop_token_ids": vocab,
        }
        return "/v1/completions", json.dumps(body).encode()
    if kind == 2:  # a lone surrogate where text is tokenized
        path, key = rng.choice([("/generate", "text"), ("/v1/completions", "prompt")])
        return path, json.dumps(
            {key: rng.choice(["\ud800", "a\udfff", ["\ud83d"]]), "max_tokens": 1}
        ).encode()
    if kind == 3:  # nested past the parser, or past server.max_json_depth in a tools schema
        depth = rng.choice([2000, 200_000])
        return rng.choice(list(TOP_KEYS)), b"[" * depth + b"]" * depth
    if kind == 4:
        d = rng.randint(100, 900)
        tools = (
            '[{"type": "function", "function": {"name": "f", "parameters": '
            + '{"a": ' * d
            + "1"
            + "}" * d
            + "}}]"
        )
        return (
            "/v1/chat/completions",
            f'{{"messages": [{{"role": "user", "content": "hi"}}], "tools": {tools}}}'.encode(),
        )
    body = {
        "prompt": "a",
        "max_tokens": 1,
        rng.choice(["n", "stop"]): rng.choice([3_000_000, ["s"] * 200_000]),
    }
    return "/v1/completions", json.dumps(body).encode()


def _body(rng: random.Random) -> tuple[str, bytes]:
    if rng.random() < 0.05:
        return _hostile(rng)
    path = rng.choice(list(TOP_KEYS))
    if rng.random() < 0.05:  # not JSON or not UTF-8 at all
        return path, rng.choice(
            [
                b"{",
                b"\xff\xfe",
                b"[]",
                b"null",
                b'"x"',
                bytes(rng.randrange(256) for _ in range(20)),
            ]
        )
    body: dict = {}
    for key in rng.sample(TOP_KEYS[path], rng.randint(0, 4)):
        body[key] = _value(rng)
    if path == "/generate":
        body.setdefault("input_ids", rng.choice([PROMPT, [1], [], [10**9], "x"]))
        sp = {k: _value(rng) for k in rng.sample(SAMPLING_KEYS, rng.randint(0, 5))}
        body["sampling_params"] = {
            **sp,
            "max_new_tokens": rng.choice([0, 1, 3, 8, -1, 2**40, None]),
        }
    else:
        body.setdefault("max_tokens", rng.choice([0, 1, 4, -3, 10**20, "4"]))
        if path == "/v1/chat/completions":
            body.setdefault(
                "messages", rng.choice([[{"role": "user", "content": "hi"}], [{"role": 1}], "x"])
            )
        else:
            body.setdefault("prompt", rng.choice(["1+1=", [5, 6], [[5], [6]], [], [2**70]]))
    text = json.dumps(body, allow_nan=True).encode()
    return path, text


class _SlowClients:
    """``n`` connections that trickle request heads a few bytes at a time (slowloris) while the
    block runs."""

    HEAD = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Pad: "
        + b"a" * 4000
    )

    def __init__(self, url: str, n: int):
        host, port = url.removeprefix("http://").split(":")
        self.address, self.n, self.stop = (host, int(port)), n, threading.Event()
        self.thread = threading.Thread(target=self._trickle, daemon=True)

    def _trickle(self) -> None:
        socks = [socket.create_connection(self.address, timeout=5) for _ in range(self.n)]
        at = 0
        while not self.stop.wait(0.1):
            for sock in socks:
                try:
                    sock.sendall(self.HEAD[at % len(self.HEAD) : at % len(self.HEAD) + 3])
                except OSError:  # cut off by the server's head deadline or connection cap: fine
                    pass
            at += 3
        for sock in socks:
            sock.close()

    def __enter__(self) -> _SlowClients:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)


def test_fuzz_thousands_of_random_bodies_leave_the_server_as_it_was(server):
    """Random bodies on the SGLang and OpenAI routes (stop lists, stop ids covering the
    vocabulary, min_tokens, tools, surrogates, streaming), with slow clients trickling heads."""
    before = call(f"{server}/generate", GREEDY)[1]["output_ids"]
    rng = random.Random(1234)
    bodies = [_body(rng) for _ in range(2500)]

    def send(item: tuple[str, bytes]) -> int:
        path, data = item
        req = urllib.request.Request(server + path, data=data, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status
        except urllib.error.HTTPError as e:
            return e.code

    with _SlowClients(server, 50), ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(send, bodies))
    counts = {s: statuses.count(s) for s in set(statuses)}
    bad = [
        b for b, s in zip(bodies, statuses) if s not in (200, 400, 404)
    ]  # 404: a model not served
    assert not bad, (counts, bad[:5])  # no 500s, no 503s: every request was answered cleanly
    assert counts.get(200, 0) > 50 and counts.get(400, 0) > 500, counts  # both paths were exercised
    assert call(f"{server}/health")[0] == 200
    assert call(f"{server}/get_server_info")[1]["failed_steps"] == 0
    assert call(f"{server}/generate", GREEDY)[1]["output_ids"] == before


def _corrupt(rng: random.Random, raw: bytes, tensors: dict, target: Path) -> bool:
    """Write a randomly broken copy of a safetensors file to ``target``; True when no server
    may load it (flipped bytes may still be a loadable file of other finite weights)."""
    from safetensors.torch import save_file

    kind = rng.randrange(4)
    name = rng.choice(sorted(tensors))
    if kind == 0:  # flipped bytes in the header or the data
        data = bytearray(raw)
        for _ in range(rng.randint(1, 20)):
            data[rng.randrange(min(len(data), rng.choice([200, len(data)])))] ^= 1 << rng.randrange(
                8
            )
        target.write_bytes(bytes(data))
        return False
    if kind == 1:  # cut short
        target.write_bytes(raw[: rng.randrange(len(raw))])
    elif kind == 2:  # a dtype the weight cannot hold: huge float64, float16 overflow, ints, bools
        t = tensors[name]
        bad = rng.choice(
            [
                torch.full(t.shape, 1e300, dtype=torch.float64),
                (t * 1e9).to(torch.float16),
                t.to(torch.int32),
                t > 0,
            ]
        )
        save_file({**tensors, name: bad}, str(target))
    else:  # a wrong shape
        save_file({**tensors, name: torch.zeros(tensors[name].numel() + 1)}, str(target))
    return True


def test_fuzz_weight_files_get_200_or_400_and_the_server_keeps_serving(
    server, tiny_model_dir, tmp_path
):
    from safetensors.torch import load_file

    before = call(f"{server}/generate", GREEDY)[1]["output_ids"]
    (weights,) = Path(tiny_model_dir).glob("*.safetensors")
    raw, tensors = weights.read_bytes(), load_file(str(weights))
    rng = random.Random(7)
    statuses = []
    for i in range(24):
        d = tmp_path / f"w{i}"
        shutil.copytree(tiny_model_dir, d)
        refused = _corrupt(rng, raw, tensors, d / weights.name)
        status, out = call(f"{server}/update_weights_from_disk", {"model_path": str(d)}, key=KEY)
        statuses.append(status)
        assert status == 400 if refused else status in (200, 400), out
        assert call(f"{server}/health")[0] == 200
        assert call(f"{server}/generate", GREEDY)[0] in (
            200,
            500,
        )  # 500: weights that give NaN, named
    assert statuses.count(400) >= 12, statuses
    assert (
        call(f"{server}/update_weights_from_disk", {"model_path": tiny_model_dir}, key=KEY)[0]
        == 200
    )
    assert call(f"{server}/generate", GREEDY)[1]["output_ids"] == before
    assert call(f"{server}/get_server_info")[1]["failed_steps"] == 0


# ------------------------------------------------------------------ OpenAI semantics


def _served_model(url: str) -> str:
    return call(f"{url}/v1/models")[1]["data"][0]["id"]


def test_openai_details_unknown_model_404_usage_of_list_prompts_and_chat_without_max_tokens(server):
    model = _served_model(server)
    status, out = call(
        f"{server}/v1/completions", {"model": "gpt-nothing", "prompt": [5, 6], "max_tokens": 1}
    )
    assert (
        status == 404
        and out["error"]["code"] == "model_not_found"
        and model in out["error"]["message"]
    )
    status, out = call(
        f"{server}/v1/completions",
        {"model": model, "prompt": [[5, 6], [7, 8, 9]], "n": 2, "max_tokens": 1},
    )
    assert (
        status == 200
        and out["usage"]["prompt_tokens"] == 5
        and out["usage"]["completion_tokens"] == 4
    )
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "ignore_eos": True,
        "temperature": 0,
    }
    status, out = call(f"{server}/v1/chat/completions", body)
    assert (
        status == 200 and out["usage"]["completion_tokens"] > 16
    )  # OpenAI's chat has no 16-token default
    assert out["choices"][0]["finish_reason"] == "length"  # the context ended it


def test_an_internal_error_is_a_json_500_and_the_server_goes_on(tiny_model_dir):
    from aiohttp.test_utils import TestClient, TestServer

    from areal.api.config import from_dict
    from areal.api.config.server import GenerationServerConfig
    from areal.serving.server import GenerationServer

    srv = GenerationServer(from_dict(GenerationServerConfig, {"model_path": str(tiny_model_dir)}))
    srv.generator.start()
    real_encode = srv.encode
    srv.encode = lambda text: 1 // 0 if text == "boom" else real_encode(text)

    async def run():
        async with TestClient(TestServer(srv.build_app(), host="127.0.0.1")) as client:
            out = []
            for prompt in ("boom", "fine"):
                resp = await client.post(
                    "/v1/completions", json={"prompt": prompt, "max_tokens": 1}
                )
                out.append((resp.status, await resp.json()))
            return out

    try:
        (s1, bug), (s2, ok) = asyncio.run(run())
    finally:
        srv.generator.shutdown()
    assert s1 == 500 and "internal error: ZeroDivisionError" in bug["error"]["message"]
    assert s2 == 200 and len(ok["choices"]) == 1


# ------------------------------------------------------------------ Host and Origin (issue 56)


def _with_headers(url: str, headers: dict[str, str], body: dict | None = None) -> tuple[int, dict]:
    """POST (body given) or GET with these headers (``Host`` included); (status, JSON)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_pages_of_other_sites_and_rebound_names_cannot_pause_or_relabel_the_server(server):
    """What a browser did to a local server (issue 56): a page of another origin paused it and
    set its weight version. Its requests carry the admin key here, so only the guard stops them."""
    port = server.rsplit(":", 1)[1]
    before = call(f"{server}/get_server_info")[1]
    admin = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    page = {**admin, "Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}
    no_cors = {**admin, "Sec-Fetch-Site": "cross-site"}  # a no-cors form post without Origin
    rebound = {**admin, "Host": f"rebind.evil.example:{port}"}  # DNS rebinding: same origin
    refused = [
        (f"{server}/pause_generation", page, {}),
        (f"{server}/update_weight_version", no_cors, {"new_version": 99}),
        (f"{server}/update_weight_version", rebound, {"new_version": 99}),
        (f"{server}/generate", {"Origin": "null"}, GREEDY),
        (f"{server}/get_server_info", {"Host": f"rebind.evil.example:{port}"}, None),
    ]
    for url, headers, body in refused:
        status, answer = _with_headers(url, headers, body)
        assert status == 403, (url, headers, answer)
        message = answer["error"]["message"]
        assert "\n" not in message and "server.allowed_hosts" in message, message
    after = call(f"{server}/get_server_info")[1]
    assert not after["paused"] and after["weight_version"] == before["weight_version"]
    # non-browser clients naming the server by loopback name, IP or its own host name go on
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"{socket.gethostname()}:{port}"):
        assert _with_headers(f"{server}/flush_cache", {**admin, "Host": host}, {})[0] == 200
    same_origin = {**admin, "Origin": f"http://127.0.0.1:{port}", "Sec-Fetch-Site": "same-origin"}
    assert _with_headers(f"{server}/flush_cache", same_origin, {})[0] == 200


# ------------------------------------------------------------------ fuzz: proxy and viewer routes

JUNK_SEGMENTS = ["", "..", "%2e%2e", "%", "%zz", "%00", "%ff", "\u00e9", "a" * 3000, "1" * 300]
JUNK_SEGMENTS += [";x", "*"]
JUNK_VALUES = ["", "nan", "-inf", "1e999", "-1", "0", "abc", "%ff", "\u2603", "1" * 400, "[]"]


def _fuzz_path(rng: random.Random, routes: list[str], query_keys: list[str]) -> str:
    """One of ``routes`` with a segment replaced, junk appended, or a random query string."""
    path = rng.choice(routes)
    r = rng.random()
    if r < 0.3:
        parts = path.split("/")
        parts[rng.randrange(1, len(parts))] = rng.choice(JUNK_SEGMENTS + ["7", "99999999999999"])
        path = "/".join(parts)
    elif r < 0.4:
        path = rng.choice(["/", "//", "/../../etc/passwd", "/static/../viewer.py"]) + path
    if rng.random() < 0.4:
        pairs = [
            f"{rng.choice(query_keys + ['limit', 'x'])}={rng.choice(JUNK_VALUES)}"
            for _ in range(rng.randint(1, 4))
        ]
        path += "?" + "&".join(pairs)
    return path


def _fuzz_request(
    rng: random.Random, address: str, method: str, path: str, auth: str, body: bytes
) -> bytes:
    """A raw HTTP/1.1 request with random Host, Origin, Authorization and content headers; now
    and then a header or request line no parser should take."""
    host = rng.choice([address, address, "localhost", "evil.example", "[::1]", "a b", "\u00ff"])
    lines = [f"{method} {path} HTTP/1.1", "Connection: close"]
    lines += [f"Host: {host}"] if rng.random() < 0.95 else []
    if rng.random() < 0.2:
        lines.append(
            f"Origin: {rng.choice(['http://evil.example', 'null', 'http://[', 'http://' + host])}"
        )
    if rng.random() < 0.1:
        lines.append(f"Sec-Fetch-Site: {rng.choice(['cross-site', 'same-origin', 'x'])}")
    if auth:
        lines.append(f"Authorization: {auth}")
    ctype = rng.choice(["application/json", "text/plain", "multipart/form-data; boundary=", ""])
    lines += [f"Content-Type: {ctype}"] if ctype else []
    length = str(len(body)) if body or rng.random() < 0.9 else rng.choice(["abc", "-1", "0 0"])
    lines.append(f"Content-Length: {length}")
    if rng.random() < 0.03:
        lines.append(rng.choice(["X-\u00ff: \x01", "no colon", " folded: x", "Host: twice"]))
    if rng.random() < 0.02:
        lines[0] = rng.choice(["GET", "GET / HTTP/9.9", f"{method}  {path}", "\x00 / HTTP/1.1"])
    return "\r\n".join(lines).encode("utf-8", "surrogateescape") + b"\r\n\r\n" + body


async def _status(address: str, request: bytes) -> int:
    """The status of the answer to ``request`` (0: the connection closed without one)."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 60)
    except ConnectionError:  # refused mid-send (a head no parser takes): no answer
        return 0
    finally:
        writer.close()
    return int(line.split()[1]) if line.startswith(b"HTTP/") else 0


async def _fuzz(address: str, requests: list[bytes]) -> list[int]:
    """Send ``requests`` eight at a time; their statuses in order."""
    gate = asyncio.Semaphore(8)

    async def one(request: bytes) -> int:
        async with gate:
            return await _status(address, request)

    return await asyncio.gather(*(one(r) for r in requests))


def _json_junk(rng: random.Random, shapes: dict) -> bytes:
    """A body: a route's fields with random values, other JSON, or bytes that are not JSON."""
    r = rng.random()
    if r < 0.1:
        return rng.choice([b"", b"{", b"\xff\xfe", b"[]", b"null", b'"x"', b"[" * 5000])
    body = {k: _value(rng) if rng.random() < 0.5 else rng.choice(v) for k, v in shapes.items()}
    for k in rng.sample(list(body), rng.randint(0, len(body))):
        del body[k]
    return json.dumps(body, allow_nan=True).encode()


def test_fuzz_agent_proxy_routes_never_500_and_it_keeps_serving(tiny_tokenizer):
    """Random and malformed paths, methods, headers, keys, query strings and bodies on every
    route of the agent proxy (agent and control side) with live session keys: every answer is
    below 500 and a well-formed episode still works after."""
    from areal.workflow.agent_proxy import AgentProxy
    from tests.workflow.test_agent_proxy import TOKEN, G, ToolThenAnswer

    chat = {"messages": [[{"role": "user", "content": "hi"}], [{"role": 1}], "x", []]}
    shapes = {
        "/v1/chat/completions": {**chat, "max_tokens": [1, -1, 10**20], "stream": [True, 1]},
        "/v1/completions": {"prompt": ["1+1=", [5, 6], []], "max_tokens": [1, 0, "4"]},
        "/v1/reward": {"reward": [1, 0.5, "1", None, True, 1e308], "completion_id": ["x", 3]},
        "/control/sessions": {
            "gconfig": [
                {"n_samples": 1, "max_new_tokens": 4},
                {"max_new_tokens": -1},
                [],
                {"x": 1},
            ],
            "group_id": ["g", 1, None],
            "name": ["n", None],
            "timeout": [5.0, 0, -1, "x", 1e308],
            "version": [0, -1, "x", 2**70],
        },
        "wait": {"timeout": [0, 0.05, -1, "x", None, True]},
    }
    routes = ["/v1/chat/completions", "/v1/completions", "/v1/reward", "/v1/models", "/health"]
    routes += ["/control/sessions", "/control/sessions/ID/wait", "/control/sessions/ID/close"]

    async def run() -> tuple[list[int], list[bytes], int]:
        proxy = AgentProxy(tiny_tokenizer, ToolThenAnswer(tiny_tokenizer), 1 << 16, TOKEN)
        address = await proxy.start()
        keys = [proxy.open(G, f"q{i}", f"q{i}/0", 60.0) for i in range(4)]
        ended_key, ended = keys[0]
        proxy.end(ended_key, "reward")  # its wait returns at once: no fuzz request idles 30 s
        rng = random.Random(56)
        auths = [
            "",
            "Bearer ",
            "Basic eA==",
            f"Bearer {TOKEN}",
            f"Bearer {TOKEN}x",
            "Bearer \u00e9",
        ]
        auths += [f"Bearer {k}" for k, _ in keys]
        requests = []
        for _ in range(600):
            path = _fuzz_path(rng, routes, ["stream", "model"])
            if "/ID/" in path:
                path = path.replace("ID", ended.id if "wait" in path else rng.choice(
                    [ended.id, keys[1][1].id, "s-0", "%00"]))  # fmt: skip
            shape = shapes["wait"] if path.endswith("/wait") else shapes.get(path, {})
            method = rng.choice(["POST"] * 6 + ["GET", "PUT", "DELETE", "OPTIONS", "HEAD"])
            requests.append(
                _fuzz_request(rng, address, method, path, rng.choice(auths), _json_junk(rng, shape))
            )
        statuses = await _fuzz(address, requests)
        try:
            key, session = proxy.open(G, "after", "after/0", 60.0)
            body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
            good = (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n"
                f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body
            after = await _status(address, good)
        finally:
            await proxy.stop()
        return statuses, requests, after

    statuses, requests, after = asyncio.run(run())
    counts = {s: statuses.count(s) for s in set(statuses)}
    bad = [r[:300] for r, s in zip(requests, statuses) if s >= 500]
    assert not bad, (counts, bad[:5])
    assert counts.get(200, 0) > 10 and counts.get(401, 0) > 50, counts  # keys and junk both ran
    assert after == 200


def test_fuzz_viewer_routes_never_500_on_odd_requests_or_recorded_files(tmp_path):
    """Random and malformed paths, query strings and headers on every route of ``areal view``,
    over a run whose recorded files include an empty and a truncated sample file, a non-finite
    reward and broken stats and timeline lines: every answer is below 500."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from areal.utils.viewer import make_app
    from tests.utils.test_viewer_api import _record

    for step in (1, 2, 3):
        _record(tmp_path, step, [[0], [0, 0]], version=0)
    step1 = tmp_path / "samples" / "step-000001-rank0.parquet"
    rows = pq.read_table(step1).to_pylist()
    rows[0]["reward"] = float("nan")
    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(step1)), step1)
    (tmp_path / "samples" / "step-000002-rank0.parquet").write_bytes(b"")
    step3 = tmp_path / "samples" / "step-000003-rank0.parquet"
    step3.write_bytes(step3.read_bytes()[:200])
    (tmp_path / "stats.jsonl").write_text(
        '{"step": 1, "perf/step_seconds": "x"}\n{"step": [2]}\nnull\n{"step": 3, "r": Infinity}\n{'
    )
    (tmp_path / "timeline.jsonl").write_text('{"step": "1", "spans": 3}\n{"step": [2]}\n[]\n')
    routes = ["/", "/static/viewer.js", "/api/runs", "/api/stats/0", "/api/samples/0"]
    routes += ["/api/timeline/0", "/api/sample/0/1/0/0", "/api/sample/0/3/0/1", "/api/stats/1"]
    keys = [
        f"{c}_{side}" for c in ("step", "reward", "staleness", "length") for side in ("min", "max")
    ]

    async def run() -> tuple[list[int], list[bytes]]:
        from aiohttp import web

        runner = web.AppRunner(make_app([tmp_path]))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        address = f"127.0.0.1:{runner.addresses[0][1]}"
        rng = random.Random(8)
        requests = [
            _fuzz_request(
                rng,
                address,
                rng.choice(["GET"] * 8 + ["POST", "HEAD", "OPTIONS"]),
                _fuzz_path(rng, routes, keys + ["server", "worker"]),
                "",
                rng.choice([b"", b"{}", b"\xff"]),
            )
            for _ in range(600)
        ]
        try:
            return await _fuzz(address, requests), requests
        finally:
            await runner.cleanup()

    statuses, requests = asyncio.run(run())
    counts = {s: statuses.count(s) for s in set(statuses)}
    bad = [r[:300] for r, s in zip(requests, statuses) if s >= 500]
    assert not bad, (counts, bad[:5])
    assert counts.get(200, 0) > 50 and counts.get(403, 0) > 20, counts
