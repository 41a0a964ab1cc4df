"""``areal serve`` as a real process on a free loopback port: SGLang and OpenAI APIs, 400s,
API key, pause/continue, weight updates from disk and over gloo, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from areal.utils.network import free_port
from tests.serving.conftest import HAS_CC, hf_greedy
from tests.serving.servers import start_servers, stop_servers

KEY = "test-key"
PROMPT = [5, 17, 99, 200, 3]


def call(url: str, body: dict | bytes | None = None, key: str | None = None, timeout: float = 60.0):
    """POST (body given) or GET; returns (status, parsed JSON)."""
    data = (
        body
        if isinstance(body, bytes)
        else (json.dumps(body).encode() if body is not None else None)
    )
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(
        url, data=data, headers=headers, method="POST" if data is not None else "GET"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server_procs(tiny_model_dir):
    procs = start_servers(tiny_model_dir, 1, "--api-key", KEY, "max_batch_size=8")
    yield procs
    stop_servers(procs)


@pytest.fixture(scope="module")
def server(server_procs):
    return f"http://{server_procs[0][1]}"


def test_sglang_generate_request_in_documented_format(server, hf_model, tiny_tokenizer):
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0},
        "return_logprob": True,
    }
    status, out = call(f"{server}/generate", body)
    assert status == 200
    assert out["output_ids"] == hf_greedy(hf_model, PROMPT, 12)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 12
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert len(meta["output_token_versions"]) == 12
    status, out = call(
        f"{server}/generate", {"text": ["ab", "cd"], "sampling_params": {"max_new_tokens": 3}}
    )
    assert (
        status == 200
        and isinstance(out, list)
        and len(out) == 2
        and isinstance(out[0]["text"], str)
    )


def test_info_endpoints(server):
    for path in (
        "/health",
        "/health_generate",
        "/get_model_info",
        "/get_server_info",
        "/v1/models",
    ):
        status, out = call(server + path)
        assert status == 200, (path, out)
    assert call(f"{server}/get_model_info")[1]["is_generation"] is True
    info = call(f"{server}/get_server_info")[1]
    assert "api_key" not in info and info["cpu_attention"] == "auto"
    assert info["decode_attention"] == ("compiled" if HAS_CC else "torch")


def test_openai_client_completions_and_chat(server):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, timeout=60, max_retries=0)
    model = client.models.list().data[0].id
    c = client.completions.create(
        model=model, prompt="Hello", max_tokens=6, temperature=0, logprobs=1
    )
    assert c.choices[0].finish_reason in ("length", "stop") and c.usage.completion_tokens <= 6
    assert len(c.choices[0].logprobs.token_logprobs) == c.usage.completion_tokens
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        n=2,
        seed=3,
        logprobs=True,
    )
    assert len(chat.choices) == 2 and chat.choices[0].message.role == "assistant"
    assert isinstance(chat.choices[0].message.content, str)
    assert chat.usage.completion_tokens <= 10


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/generate", {"input_ids": [1] * 5000}, "input_ids"),
        ("/generate", {"input_ids": [1], "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
        (
            "/generate",
            {"input_ids": [1], "sampling_params": {"max_new_tokens": -2}},
            "sampling_params.max_new_tokens",
        ),
        ("/generate", {"input_ids": []}, "input_ids"),
        ("/generate", {"text": ""}, "text"),
        ("/generate", b"{not json", "body"),
        ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("/v1/chat/completions", {"model": "m", "messages": []}, "messages"),
    ],
)
def test_bad_input_gets_400_naming_the_field(server, path, body, field):
    status, out = call(server + path, body)
    assert status == 400
    assert out["error"]["param"] == field and field in out["error"]["message"]


HOSTILE = [  # each once left the server answering 503 for every later request
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": 1e-45}, "temperature"),
    ({"top_k": 10**20, "top_p": 0.9}, "top_k"),
    ({"min_new_tokens": 2, "max_new_tokens": 4, "stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"seed": 2**70}, "seed"),
    ({"top_p": float("nan")}, "top_p"),
]


@pytest.mark.parametrize("sampling,field", HOSTILE, ids=[f for _, f in HOSTILE])
def test_hostile_sampling_values_get_400_and_the_server_keeps_serving(server, sampling, field):
    status, out = call(
        f"{server}/generate", {"input_ids": [5, 17, 99], "sampling_params": sampling}
    )
    assert status == 400 and out["error"]["param"] == f"sampling_params.{field}", out
    body = {"input_ids": [5, 17, 99], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    status, out = call(f"{server}/generate", body)
    assert status == 200 and len(out["output_ids"]) == 4
    assert call(f"{server}/health")[0] == 200


def test_admin_endpoints_need_the_api_key(server):
    assert call(f"{server}/flush_cache", {})[0] == 401
    assert call(f"{server}/flush_cache", {}, key="wrong")[0] == 401
    assert call(f"{server}/flush_cache", {}, key=KEY)[0] == 200


def test_non_loopback_bind_without_key_is_a_config_error():
    from areal.api.config import ConfigError, from_dict
    from areal.api.config.server import GenerationServerConfig

    with pytest.raises(ConfigError, match="api_key"):
        from_dict(GenerationServerConfig, {"model_path": "m", "host": "0.0.0.0"})


def _generate_in_thread(url: str, body: dict, out: dict) -> threading.Thread:
    t = threading.Thread(
        target=lambda: out.update(zip(("status", "body"), call(f"{url}/generate", body)))
    )
    t.start()
    return t


def test_pause_returns_partials_with_abort_then_continue(server):
    out: dict = {}
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
        "return_logprob": True,
    }
    t = _generate_in_thread(server, body, out)
    time.sleep(1.0)
    status, paused = call(f"{server}/pause_generation", {}, key=KEY)
    t.join(30)
    assert status == 200 and paused["num_aborted_requests"] >= 1
    meta = out["body"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < 1500
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    assert call(f"{server}/continue_generation", {}, key=KEY)[0] == 200
    assert (
        call(f"{server}/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})[
            0
        ]
        == 200
    )


def _greedy_ids(url: str) -> list[int]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    return call(f"{url}/generate", body)[1]["output_ids"]


def test_update_weights_from_disk_then_over_gloo(server, hf_model, tiny_model_dir, other_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(other_model_dir, dtype=torch.float32).eval()
    v0 = call(f"{server}/get_model_info")[1]["weight_version"]
    status, out = call(
        f"{server}/update_weights_from_disk", {"model_path": other_model_dir}, key=KEY
    )
    assert status == 200 and out["weight_version"] == v0 + 1
    assert _greedy_ids(server) == hf_greedy(other, PROMPT, 12)
    status, out = call(
        f"{server}/update_weights_from_disk", {"model_path": "/nonexistent"}, key=KEY
    )
    assert status == 400 and out["error"]["param"] == "model_path"
    # A separate process plays the trainer: joins the gloo group, broadcasts the original weights.
    trainer = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.serving.trainer_proc",
            server,
            tiny_model_dir,
            str(free_port()),
            KEY,
        ],
        capture_output=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert trainer.returncode == 0, (
        trainer.stdout.decode()[-1500:] + trainer.stderr.decode()[-1500:]
    )
    assert call(f"{server}/get_model_info")[1]["weight_version"] == 7
    assert _greedy_ids(server) == hf_greedy(hf_model, PROMPT, 12)


def test_a_broadcast_the_trainer_abandons_leaves_the_old_weights_serving_and_says_so(
    server, server_procs, tiny_model_dir, other_model_dir
):
    from areal.serving.model import read_hf_dir
    from areal.utils.weight_sync import announcement

    v0 = call(f"{server}/get_model_info")[1]["weight_version"]
    before = _greedy_ids(server)
    trainer = subprocess.Popen(
        [sys.executable, "-m", "tests.serving.trainer_proc", server, other_model_dir,
         str(free_port()), KEY, "interrupt"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        assert trainer.stdout.readline().strip() == b"joined", trainer.stderr.read()[-1500:]
        body = {**announcement(sorted(read_hf_dir(other_model_dir)[1].items())),
                "bucket_bytes": 64 << 10, "weight_version": v0 + 5}  # fmt: skip
        answer: dict = {}
        post = threading.Thread(
            target=lambda: answer.update(
                r=call(f"{server}/update_weights_from_distributed", body, key=KEY)
            )
        )
        post.start()
        time.sleep(0.5)  # the server is receiving; the trainer sends one bucket and dies
        trainer.stdin.write(b"go\n")
        trainer.stdin.flush()
        post.join(60)
    finally:
        trainer.kill()
        trainer.wait(10)
    status, out = answer["r"]
    assert (
        status == 500 and f"keeps serving the old weights (version {v0})" in out["error"]["message"]
    )
    assert call(f"{server}/get_model_info")[1]["weight_version"] == v0
    assert _greedy_ids(server) == before  # nothing of the first bucket was loaded
    log = (server_procs[0][0].log_dir / "server0.log").read_text(errors="replace")
    assert "weight update over the group broke off" in log
    status, out = call(f"{server}/update_weights_from_distributed", body, key=KEY)
    assert status == 400 and "init_weights_update_group" in out["error"]["message"]


def test_sigterm_answers_in_flight_requests_frees_port_and_exits_0(tiny_model_dir):
    procs = start_servers(tiny_model_dir)
    proc, url = procs[0][0], f"http://{procs[0][1]}"
    try:
        out: dict = {}
        body = {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
        }
        t = _generate_in_thread(url, body, out)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        assert proc.wait(timeout=30) == 0
        assert out["status"] == 200 and out["body"]["meta_info"]["finish_reason"]["type"] == "abort"
        port = int(url.rsplit(":", 1)[1])
        with socket.socket() as s:
            # SO_REUSEADDR as every server sets it: TIME_WAIT remnants of the closed client
            # connection may linger, but nothing listens on the port any more.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
    finally:
        stop_servers(procs)
