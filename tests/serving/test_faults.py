"""Faults the server survives (issue #32): a stop list that covers the vocabulary, non-finite
logits from any cause, weights that are finite only before the cast or not floating point,
pause and continue racing, a blank admin key, a port in use."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.serving.test_server import PROMPT

GREEDY = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
MARK = 13  # a prompt holding this token gets NaN logits from the poisoned step below


@contextlib.contextmanager
def in_process(tiny_model_dir, patch_step=None, **overrides):
    """Our server in this process (optionally with ``model.step`` wrapped by ``patch_step``)."""
    from areal.api.config import from_dict
    from areal.api.config.server import GenerationServerConfig
    from areal.serving.server import GenerationServer

    srv = GenerationServer(
        from_dict(GenerationServerConfig, {"model_path": str(tiny_model_dir), **overrides})
    )
    if patch_step is not None:
        srv.generator.model.step = patch_step(srv.generator.model.step)
    srv.generator.start()
    try:
        yield srv
    finally:
        srv.generator.shutdown()


def run_client(srv, script):
    """``await script(client)`` against ``srv``'s app on a loopback test server."""
    from aiohttp.test_utils import TestClient, TestServer

    async def main():
        async with TestClient(TestServer(srv.build_app(), host="127.0.0.1")) as client:
            return await script(client)

    return asyncio.run(main())


async def post(client, path: str, body: dict) -> tuple[int, dict]:
    resp = await client.post(path, json=body)
    return resp.status, await resp.json()


# ------------------------------------------------------------------ stop lists


def test_stop_list_covering_the_vocabulary_before_min_new_tokens_gets_400_and_harms_no_other(
    tiny_model_dir,
):
    with in_process(tiny_model_dir) as srv:
        vocab = list(range(srv.generator.model.spec.vocab_size))
        sampled = {
            "input_ids": [1, 2, 3],
            "sampling_params": {
                "min_new_tokens": 1,
                "max_new_tokens": 4,
                "stop_token_ids": vocab,
                "temperature": 1.0,
            },
        }
        greedy = {
            "input_ids": [1, 2, 3],
            "sampling_params": {
                "min_new_tokens": 1,
                "max_new_tokens": 4,
                "stop_token_ids": vocab,
                "temperature": 0,
            },
        }
        openai = {"prompt": [1, 2, 3], "max_tokens": 4, "min_tokens": 1, "stop_token_ids": vocab}

        async def script(client):
            before = (await post(client, "/generate", GREEDY))[1]["output_ids"]
            answers = []
            for _ in range(4):  # the reproducer killed the server after three
                answers += await asyncio.gather(
                    post(client, "/generate", sampled),
                    post(client, "/generate", greedy),
                    post(client, "/v1/completions", openai),
                    *(post(client, "/generate", GREEDY) for _ in range(5)),
                )
            health = await client.get("/health")
            after = (await post(client, "/generate", GREEDY))[1]["output_ids"]
            return before, answers, health.status, after

        before, answers, health, after = run_client(srv, script)
    for i, (status, out) in enumerate(answers):
        if i % 8 < 3:  # the three whole-vocabulary requests
            assert status == 400 and out["error"]["param"] == "sampling_params.stop_token_ids", out
            assert "min_new_tokens" in out["error"]["message"]
        else:
            assert status == 200 and out["output_ids"] == before, out
    assert health == 200 and after == before


def test_min_new_tokens_suppresses_every_stop_token_when_one_token_is_left(generator):
    from areal.serving.sampling import SamplingParams

    keep = 42
    stops = tuple(t for t in range(generator.model.spec.vocab_size) if t != keep)
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            max_new_tokens=3, min_new_tokens=3, stop_token_ids=stops, temperature=temperature
        )
        (r,) = generator.generate([PROMPT], params, timeout=60)
        assert r.output_ids == [keep] * 3 and r.finish_reason == "length"


# ------------------------------------------------------------------ non-finite logits


def poison_marked_prompts(real):
    """A step whose rows for prompts holding MARK come out NaN (a numerical fault)."""

    def step(tokens, positions, prompts, cache, *starts):
        logits = real(tokens, positions, prompts, cache, *starts)
        for j, p in enumerate(prompts):
            if MARK in p.tolist():
                logits[tokens.shape[0] + j] = float("nan")
        return logits

    return step


def test_nan_logits_fail_only_their_request_with_500_and_health_counts_them(tiny_model_dir):
    from areal.serving.generator import MAX_FAILED_STEPS

    bad = [
        {"input_ids": [MARK, 5, 6], "sampling_params": {"max_new_tokens": 4, "temperature": t}}
        for t in (1.0, 0)
    ]
    rounds = MAX_FAILED_STEPS + 2
    with in_process(tiny_model_dir, poison_marked_prompts) as srv:

        async def script(client):
            before = (await post(client, "/generate", GREEDY))[1]["output_ids"]
            answers = []
            for _ in range(rounds):
                answers.append(
                    await asyncio.gather(
                        *(post(client, "/generate", b) for b in bad),
                        post(client, "/generate", GREEDY),
                        post(client, "/generate", GREEDY),
                    )
                )
            health = await client.get("/health")
            return before, answers, health.status, await health.json()

        before, answers, status, health = run_client(srv, script)
        assert srv.generator.error is None
    for (s1, b1), (s2, b2), *innocent in answers:
        for s, b in ((s1, b1), (s2, b2)):
            assert s == 500 and "non-finite logits (NaN or inf)" in b["error"]["message"], b
        assert all(s == 200 and out["output_ids"] == before for s, out in innocent)
    assert (
        status == 200 and health["nonfinite_logits"] == 2 * rounds and health["failed_steps"] == 0
    )
    assert "non-finite logits" in health["last_nonfinite"]


def test_weights_that_make_every_logit_nan_fail_requests_but_never_stop_the_server(tiny_model_dir):
    def all_nan(real):
        return lambda *args: real(*args).fill_(float("nan"))

    with in_process(tiny_model_dir, all_nan) as srv:

        async def script(client):
            out = [await post(client, "/generate", GREEDY) for _ in range(6)]
            out.append(
                await post(
                    client,
                    "/v1/completions",
                    {"prompt": [5, 6], "max_tokens": 2, "echo": True, "logprobs": 1},
                )
            )
            health = await client.get("/health")
            return out, health.status, await health.json()

        answers, status, health = run_client(srv, script)
        assert srv.generator.error is None
    assert all(s == 500 and "non-finite logits" in out["error"]["message"] for s, out in answers)
    assert status == 200 and health["nonfinite_logits"] == 7


def test_a_request_failed_by_nan_leaves_no_nan_in_its_cache_slot_for_the_next_one(tiny_model_dir):
    from areal.serving.generator import Generator
    from areal.serving.sampling import SamplingParams

    gen = Generator.from_pretrained(tiny_model_dir, max_batch_size=4, cpu_attention="torch")
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    long_prompt = list(range(20, 60))
    gen.start()
    try:
        reference = [r.output_ids for r in gen.generate([PROMPT, long_prompt], greedy, timeout=60)]
        real = gen.model.step

        def step(tokens, positions, prompts, cache, *starts):  # marked: keys and logits go NaN
            logits = real(tokens, positions, prompts, cache, *starts)
            for j, p in enumerate(prompts):
                if MARK in p.tolist():
                    for t in cache.k + cache.v:
                        t[tokens.shape[0] + j] = float("nan")
                    logits[tokens.shape[0] + j] = float("nan")
            return logits

        gen.model.step = step
        with pytest.raises(Exception, match="non-finite logits"):
            gen.generate([[MARK] * 50], greedy, timeout=60)
        # the short prompt takes the failed request's slot; the long one makes its run read past it
        again = [r.output_ids for r in gen.generate([PROMPT, long_prompt], greedy, timeout=60)]
    finally:
        gen.shutdown()
    assert again == reference


# ------------------------------------------------------------------ weights


@pytest.mark.parametrize(
    "values, source, target, ok",
    [
        ([1.0, -2.0], torch.float32, torch.bfloat16, True),
        ([1.0, float("nan")], torch.float32, torch.float32, False),  # NaN: min and max are NaN
        ([float("-inf"), 0.0], torch.bfloat16, torch.float32, False),
        ([1e300], torch.float64, torch.float32, False),  # finite in float64, inf in float32
        ([3.0e38], torch.float32, torch.bfloat16, True),  # bf16's largest is 3.39e38
        ([-3.4e38], torch.float32, torch.bfloat16, False),
        ([70000.0], torch.float32, torch.float16, False),  # fp16's largest is 65504
        ([], torch.float32, torch.float16, True),
    ],
)
def test_finite_as_reads_the_target_dtypes_range(values, source, target, ok):
    from areal.serving.model import finite_as

    assert finite_as(torch.tensor(values, dtype=source), target) is ok


def test_weight_updates_refuse_integer_tensors_and_values_that_overflow_the_model_dtype(generator):
    from areal.serving.sampling import SamplingParams

    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    before = generator.generate([PROMPT], greedy, timeout=60)[0].output_ids
    version = generator.version
    name = "model.layers.0.mlp.down_proj.weight"
    shape = generator.model.params[name].shape
    cases = {
        "once cast to torch.float32": torch.full(
            shape, 1e300, dtype=torch.float64
        ),  # finite in float64
        "is not floating point": torch.ones(shape, dtype=torch.int64),
    }
    for expected, tensor in cases.items():  # update_weights serves the disk and the broadcast paths
        with pytest.raises(ValueError, match=expected):
            generator.update_weights({name: tensor})
    assert generator.version == version
    assert generator.generate([PROMPT], greedy, timeout=60)[0].output_ids == before


# ------------------------------------------------------------------ pause / continue


def blocking_step(entered: threading.Event, release: threading.Event):
    def patch(real):
        def step(*args):
            entered.set()
            release.wait(30)
            return real(*args)

        return step

    return patch


def test_a_resume_called_while_a_pause_waits_for_the_step_is_not_undone_by_it(tiny_model_dir):
    from areal.serving.generator import Generator
    from areal.serving.sampling import SamplingParams

    gen = Generator.from_pretrained(tiny_model_dir, max_batch_size=2)
    entered, release = threading.Event(), threading.Event()
    gen.model.step = blocking_step(entered, release)(gen.model.step)
    gen.start()
    try:
        gen.submit(PROMPT, SamplingParams(max_new_tokens=2, temperature=0))
        assert entered.wait(30)
        pausing = threading.Thread(target=gen.pause)
        pausing.start()
        time.sleep(0.2)  # the pause is queued behind the running step
        resuming = threading.Thread(target=gen.resume)
        resuming.start()
        time.sleep(0.2)
        release.set()
        pausing.join(30)
        resuming.join(30)
        assert not gen.paused
        (r,) = gen.generate([PROMPT], SamplingParams(max_new_tokens=2, temperature=0), timeout=30)
        assert len(r.output_ids) == 2
    finally:
        release.set()
        gen.shutdown()


def test_pause_and_continue_over_http_take_effect_in_arrival_order(tiny_model_dir):
    entered, release = threading.Event(), threading.Event()
    with in_process(tiny_model_dir, blocking_step(entered, release)) as srv:

        async def script(client):
            running = asyncio.create_task(post(client, "/generate", GREEDY))
            await asyncio.to_thread(entered.wait, 30)
            pause = asyncio.create_task(post(client, "/pause_generation", {}))
            await asyncio.sleep(0.2)
            resume = asyncio.create_task(post(client, "/continue_generation", {}))
            await asyncio.sleep(0.2)
            release.set()
            statuses = [(await t)[0] for t in (running, pause, resume)]
            info = await (await client.get("/get_server_info")).json()
            if info["paused"]:  # a generation would wait for good
                return statuses, True, None
            return statuses, False, (await post(client, "/generate", GREEDY))[0]

        try:
            statuses, paused, after = run_client(srv, script)
        finally:
            release.set()
    assert statuses == [200, 200, 200] and paused is False and after == 200


# ------------------------------------------------------------------ the command line


def test_a_blank_api_key_is_refused_before_the_model_loads(tiny_model_dir, monkeypatch, capsys):
    from areal.api.config import ConfigError, load_config
    from areal.api.config.server import GenerationServerConfig
    from areal.api.launch import SERVER_API_KEY
    from areal.cli import main

    with pytest.raises(ConfigError, match="blank"):
        load_config(GenerationServerConfig, ["host=0.0.0.0", 'api_key=" "'])
    monkeypatch.setenv(SERVER_API_KEY, " \t")
    assert main(["serve", "--model", tiny_model_dir, "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "api_key" in capsys.readouterr().err


def test_areal_serve_on_a_busy_port_is_one_line_and_exit_2_before_loading_the_model(
    tiny_model_dir, tmp_path
):
    import shutil

    broken = tmp_path / "model"  # weights that would raise if the server got as far as loading them
    shutil.copytree(tiny_model_dir, broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not safetensors")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "areal.cli",
                "serve",
                "--model",
                str(broken),
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0], lines
