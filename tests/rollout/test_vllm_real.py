"""Our rollout client (areal.rollout.remote, backend=vllm) against ONE real vLLM server.

The server is vLLM's CPU build from the separate venv of tests/vllm_env.py (``make vllm-env``),
started once for this module on the tiny model; the tests skip with the venv's build failure
as reason when it could not be built. Logprobs are checked against a transformers forward of
the same weights: that is what the trainer recomputes, so it is the contract that matters.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from areal.api.config.base import GenerationHyperparameters
from areal.api.config.rollout import InferenceEngineConfig
from areal.api.io import ModelRequest, WeightUpdateMeta
from areal.rollout.remote import RemoteInferenceEngine
from areal.utils.network import free_port
from tests import vllm_env

pytestmark = pytest.mark.slow
NAME = "tiny"
PROMPT = list(range(40, 80))  # 40 tokens: more than one KV block, so prefix caching is in play


@pytest.fixture(scope="module")
def vllm_server(tiny_model_dir, tmp_path_factory):
    python, reason = vllm_env.wait_built()  # `make test` builds it beside the tests
    if python is None and not vllm_env.FAILED.exists():
        python, reason = vllm_env.ensure()  # run directly (not via make): build it now
    if python is None:
        pytest.skip(reason)
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    server = vllm_env.VLLMServer(python, tiny_model_dir, free_port(), NAME, log)
    try:
        ready_s = server.wait_ready()
        print(f"vLLM server ready in {ready_s:.0f} s (pid {server.proc.pid})")
        yield server
    finally:
        server.stop()


@pytest.fixture
def engine(vllm_server):
    cfg = InferenceEngineConfig(backend="vllm", served_model_name=NAME, setup_timeout=60,
                                request_timeout=300, retry_backoff=0.05)  # fmt: skip
    eng = RemoteInferenceEngine(cfg)
    eng.initialize([vllm_server.url.removeprefix("http://")])
    yield eng
    eng.destroy()


def _generate(engine, prompt=PROMPT, seed=0, **gconfig):
    g = GenerationHyperparameters(**{"max_new_tokens": 8, **gconfig})
    return asyncio.run(engine.agenerate(ModelRequest(list(prompt), g, group_id="g", seed=seed)))


def _reference_logprobs(model_dir, prompt, output, temperature) -> list[float]:
    """log softmax(logits / T) of each output token under a transformers forward (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature  # [L, V]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


def _post(url: str, body: dict | None = None, timeout: float = 60) -> dict:
    req = urllib.request.Request(
        url,
        data=json.dumps(body or {}).encode(),
        method="POST",
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read().decode()
    return json.loads(text) if text else {}


def test_generation_returns_token_ids_and_temperature_scaled_logprobs_of_the_weights(
    engine, tiny_model_dir
):
    out = _generate(engine, max_new_tokens=12, temperature=0.7, ignore_eos=True)
    assert len(out.output_ids) == len(out.output_logprobs) == 12 and out.stop_reason == "length"
    assert out.output_versions == [0] * 12  # vLLM reports no version: the client's is used
    ref = _reference_logprobs(tiny_model_dir, PROMPT, out.output_ids, 0.7)
    assert out.output_logprobs == pytest.approx(ref, abs=2e-3)


def test_a_teacher_on_vllm_scores_a_completion_with_the_models_own_logprobs(engine, tiny_model_dir):
    # on-policy distillation's teacher call: prompt_logprobs of the completion, temperature 1
    completion = [3, 42, 42, 7]
    got = asyncio.run(engine.ascore(list(PROMPT) + completion, len(PROMPT)))
    assert got == pytest.approx(
        _reference_logprobs(tiny_model_dir, PROMPT, completion, 1.0), abs=1e-4
    )


def test_samples_of_a_group_differ_by_seed_and_a_seed_reproduces_its_sample(engine):
    outs = [_generate(engine, seed=s, ignore_eos=True).output_ids for s in range(4)]
    assert len({tuple(o) for o in outs}) == 4
    assert _generate(engine, seed=2, ignore_eos=True).output_ids == outs[2]
    greedy = {tuple(_generate(engine, seed=s, greedy=True).output_ids) for s in range(2)}
    assert len(greedy) == 1


def test_stop_token_ids_and_stop_strings_end_generation_keeping_the_stop(engine, tiny_tokenizer):
    free = _generate(engine, seed=5, max_new_tokens=10, ignore_eos=True).output_ids
    k = next(
        i for i, t in enumerate(free) if i >= 2 and t not in free[:i]
    )  # first new token from 2 on
    out = _generate(engine, seed=5, max_new_tokens=10, ignore_eos=True, stop_token_ids=[free[k]])
    assert (out.output_ids, out.stop_reason) == (free[: k + 1], "stop")
    late = _generate(engine, seed=5, max_new_tokens=10, ignore_eos=True, stop_token_ids=[free[k]],
                     min_new_tokens=k + 2)  # fmt: skip
    # vLLM masks stop tokens before min_tokens (it never samples them there)
    assert late.output_ids[:k] == free[:k] and free[k] not in late.output_ids[: k + 2]
    assert len(late.output_ids) >= k + 2
    j = next(i for i, t in enumerate(free) if tiny_tokenizer.decode([t]).isalnum())
    text = tiny_tokenizer.decode([free[j]])
    out = _generate(engine, seed=5, max_new_tokens=10, ignore_eos=True, stop=[text])
    first = next(i for i, t in enumerate(free) if tiny_tokenizer.decode([t]) == text)
    assert (out.output_ids, out.stop_reason) == (free[: first + 1], "stop")


def _metric(url: str, name: str) -> float:
    """One unlabelled-sum value from vLLM's Prometheus ``/metrics``."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(
        float(ln.rsplit(" ", 1)[1])
        for ln in lines
        if ln.startswith(name + "{") or ln.startswith(name + " ")
    )


def test_pause_aborts_in_flight_requests_and_resume_completes_them_with_every_token(
    engine, vllm_server, tiny_model_dir
):
    # Both requests run to the model's 2048-token limit unless paused: on 2 cores vLLM's worker can
    # starve this process for seconds, so the pause is sent once the server reports both running
    # and generating, never after a fixed sleep (a short request could finish before it).
    raw: dict = {}
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "logprobs": 0,
            "return_token_ids": True}  # fmt: skip
    tokens_before = _metric(vllm_server.url, "vllm:generation_tokens_total")
    direct = threading.Thread(
        target=lambda: raw.update(_post(vllm_server.url + "/v1/completions", body, 120))
    )
    direct.start()
    g = GenerationHyperparameters(max_new_tokens=2000, ignore_eos=True)
    future = engine._loop_thread().submit(engine.agenerate(ModelRequest(PROMPT, g, seed=1)))
    try:
        deadline = time.monotonic() + 60
        while (
            _metric(vllm_server.url, "vllm:num_requests_running") < 2
            or _metric(vllm_server.url, "vllm:generation_tokens_total") < tokens_before + 20
        ):
            assert time.monotonic() < deadline, "vLLM never ran both requests"
            time.sleep(0.05)
        engine.pause()
        direct.join(60)
        choice = raw["choices"][0]  # what vLLM does to an in-flight request on pause
        assert choice["finish_reason"] == "abort" and len(choice["token_ids"]) < 2000
        with urllib.request.urlopen(vllm_server.url + "/is_paused", timeout=10) as resp:
            assert json.loads(resp.read())["is_paused"] is True
        time.sleep(0.5)
        assert not future.done()  # the client holds the interrupted request while paused
    finally:  # the module's server never stays paused for the tests after this one
        engine.resume()
        direct.join(120)
    out = future.result(180)
    assert len(out.output_ids) == 2000 and out.stop_reason == "length" and engine.n_resubmits >= 1
    # the parts joined across the pause are one sequence the weights assign these logprobs to
    ref = _reference_logprobs(tiny_model_dir, PROMPT, out.output_ids, 1.0)
    assert out.output_logprobs == pytest.approx(ref, abs=2e-3)


def test_disk_weight_update_changes_outputs_and_tokens_carry_our_version(
    engine, tiny_model_dir, tmp_path
):
    from areal.utils.tiny_model import build_tiny_model

    new_dir = str(build_tiny_model(tmp_path / "v1", size="tiny", seed=1))
    before = _generate(
        engine, greedy=True, max_new_tokens=8, ignore_eos=True
    )  # fills the prefix cache
    try:
        engine.pause()
        engine.update_weights(WeightUpdateMeta(type="disk", path=new_dir, version=1))
        engine.set_version(1)
        engine.resume()
        after = _generate(engine, seed=3, max_new_tokens=8, ignore_eos=True)
        assert after.output_versions == [1] * 8
        ref_new = _reference_logprobs(new_dir, PROMPT, after.output_ids, 1.0)
        ref_old = _reference_logprobs(tiny_model_dir, PROMPT, after.output_ids, 1.0)
        assert after.output_logprobs == pytest.approx(ref_new, abs=2e-3)
        assert after.output_logprobs != pytest.approx(ref_old, abs=2e-3)
        assert (
            _generate(engine, greedy=True, max_new_tokens=8, ignore_eos=True).output_ids
            != before.output_ids
        )
    finally:  # the module's server goes back to the fixture's weights
        engine.pause()
        engine.update_weights(WeightUpdateMeta(type="disk", path=tiny_model_dir, version=2))
        engine.set_version(2)
        engine.resume()
    assert (
        _generate(engine, greedy=True, max_new_tokens=8, ignore_eos=True).output_ids
        == before.output_ids
    )


def test_a_broadcast_update_gives_vllm_the_next_token_logprobs_of_a_disk_update(
    engine, tiny_model_dir, tmp_path
):
    """The test process plays trainer rank 0 over gloo; vLLM's worker joins through our worker
    extension and receives the same byte buckets our server does."""
    from areal.serving.model import read_hf_dir
    from areal.utils import weight_sync
    from areal.utils.tiny_model import build_tiny_model

    new_dir = str(build_tiny_model(tmp_path / "v1", size="tiny", seed=1))
    tokens = list(PROMPT) + [3, 42, 42, 7, 100, 5]
    before = asyncio.run(engine.ascore(tokens, len(PROMPT)))
    meta = WeightUpdateMeta(type="distributed", master_port=free_port(), version=1,
                            bucket_bytes=64 << 10, timeout=120)  # fmt: skip
    joined = engine.init_weights_update_group_async(meta)
    group = weight_sync.init_weight_update_group(
        "127.0.0.1", meta.master_port, 0, engine.weight_group_size, "gloo", 120
    )
    try:
        joined.result(120)
        named = sorted(read_hf_dir(new_dir)[1].items())
        engine.pause()
        updated = engine.update_weights_async(meta, weight_sync.announcement(named))
        weight_sync.broadcast_weights(named, group, meta.bucket_bytes, timeout=120)
        updated.result(120)
        engine.resume()
        over_gloo = asyncio.run(engine.ascore(tokens, len(PROMPT)))
        engine.pause()
        engine.update_weights(WeightUpdateMeta(type="disk", path=new_dir, version=2))
        engine.resume()
        from_disk = asyncio.run(engine.ascore(tokens, len(PROMPT)))
        assert over_gloo == pytest.approx(from_disk, abs=1e-6)
        assert over_gloo == pytest.approx(
            _reference_logprobs(new_dir, PROMPT, tokens[len(PROMPT) :], 1.0), abs=1e-4
        )
        assert over_gloo != pytest.approx(before, abs=1e-3)  # the new weights are in use
    finally:  # the module's server goes back to the fixture's weights
        weight_sync.destroy_weight_update_group(group)
        engine.pause()
        engine.update_weights(WeightUpdateMeta(type="disk", path=tiny_model_dir, version=3))
        engine.resume()


def test_a_broadcast_the_trainer_abandons_leaves_vllm_on_the_old_weights_and_says_so(
    engine, vllm_server, tmp_path
):
    from areal.serving.model import read_hf_dir
    from areal.utils import weight_sync
    from areal.utils.tiny_model import build_tiny_model

    new_dir = str(build_tiny_model(tmp_path / "v1", size="tiny", seed=1))
    tokens = list(PROMPT) + [3, 42, 42, 7]
    before = asyncio.run(engine.ascore(tokens, len(PROMPT)))
    meta = WeightUpdateMeta(type="distributed", master_port=free_port(), version=1,
                            bucket_bytes=64 << 10, timeout=5)  # fmt: skip
    joined = engine.init_weights_update_group_async(meta)
    group = weight_sync.init_weight_update_group("127.0.0.1", meta.master_port, 0, 2, "gloo", 5)
    joined.result(60)
    named = sorted(read_hf_dir(new_dir)[1].items())
    call = engine.backend.update_from_distributed(meta, weight_sync.announcement(named))
    answer: dict = {}

    def post() -> None:  # straight to vLLM: the client would declare the server dead
        try:
            _post(vllm_server.url + call.path, call.json, timeout=120)
        except urllib.error.HTTPError as e:
            answer["status"] = e.code

    engine.pause()
    thread = threading.Thread(target=post)
    thread.start()
    time.sleep(1.0)  # the worker is receiving; the trainer sends one bucket and goes
    specs = weight_sync.specs_from_announcement(**weight_sync.announcement(named))
    first = [named[i] for i in weight_sync.plan_buckets(specs, meta.bucket_bytes)[0]]
    weight_sync.broadcast_weights(first, group, meta.bucket_bytes, timeout=5)
    weight_sync.destroy_weight_update_group(group)
    thread.join(120)
    engine.resume()
    assert answer.get("status") == 500
    assert "keeps serving the old weights" in vllm_server.tail(400)
    assert asyncio.run(engine.ascore(tokens, len(PROMPT))) == pytest.approx(before, abs=1e-6)


def test_requests_fail_over_from_our_killed_server_to_vllm(vllm_server, tiny_model_dir):
    """One client over our server and the vLLM server; ours is killed (it would refuse vLLM's
    request fields while alive: one client speaks one protocol), the requests go to vLLM."""
    from tests.serving.servers import start_servers, stop_servers

    ours = start_servers(tiny_model_dir, 1)
    cfg = InferenceEngineConfig(
        backend="vllm",
        served_model_name=NAME,
        setup_timeout=60,
        request_timeout=120,
        retry_backoff=0.01,
        server_failure_threshold=1,
    )
    eng = RemoteInferenceEngine(cfg)
    try:
        eng.initialize([ours[0][1], vllm_server.url.removeprefix("http://")])  # both healthy
        stop_servers(ours)  # now it refuses connections, like a crashed server
        outs = [_generate(eng, seed=s, ignore_eos=True) for s in range(3)]
        assert all(len(o.output_ids) == 8 for o in outs)
        assert eng.stats()["remote/servers_dead"] == 1.0 and eng.n_failovers == 1
    finally:
        eng.destroy()
        stop_servers(ours)
