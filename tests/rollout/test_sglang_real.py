"""Tier 3: our rollout client (backend=sglang) against ONE real SGLang server on a GPU.

SGLang has no CPU build, so these run only where CUDA and the ``sglang`` package are present
(``pip install -e '.[sglang]'``); elsewhere they skip. The protocol mapping itself is unit-tested
on CPU in test_backends.py. Same checks as the vLLM tier (test_vllm_real.py): logprobs against
a transformers forward of the same weights, pause with in-flight requests, disk weight update.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
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
from areal.utils.process import parent_death_signal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                       reason="sglang is not installed (pip install -e '.[sglang]', CUDA only)"),
]  # fmt: skip
PROMPT = list(range(40, 80))
READY_DEADLINE = 600.0  # seconds for SGLang to load the model and answer /health


@pytest.fixture(scope="module")
def sglang_url(tiny_model_dir, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", tiny_model_dir,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=parent_death_signal())  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_DEADLINE
        while True:
            assert proc.poll() is None, (
                f"SGLang exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            )
            assert time.monotonic() < deadline, (
                f"SGLang not healthy in {READY_DEADLINE} s:\n{log.read_text()[-3000:]}"
            )
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                time.sleep(1.0)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture
def engine(sglang_url):
    eng = RemoteInferenceEngine(
        InferenceEngineConfig(backend="sglang", setup_timeout=60, request_timeout=300)
    )
    eng.initialize([sglang_url.removeprefix("http://")])
    yield eng
    eng.destroy()


def _generate(engine, seed=0, **gconfig):
    g = GenerationHyperparameters(**{"max_new_tokens": 8, "ignore_eos": True, **gconfig})
    return asyncio.run(engine.agenerate(ModelRequest(list(PROMPT), g, seed=seed)))


def _reference_logprobs(model_dir, output, temperature) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = (
            model(torch.tensor([PROMPT + output])).logits[0, len(PROMPT) - 1 : -1] / temperature
        )
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


def test_sglang_generation_logprobs_match_a_transformers_forward(engine, tiny_model_dir):
    out = _generate(engine, max_new_tokens=12, temperature=0.7)
    assert len(out.output_ids) == 12 and out.stop_reason == "length"
    assert out.output_logprobs == pytest.approx(
        _reference_logprobs(tiny_model_dir, out.output_ids, 0.7), abs=5e-3
    )


def test_sglang_pause_interrupts_and_resume_completes_in_flight_requests(engine, tiny_model_dir):
    g = GenerationHyperparameters(max_new_tokens=400, ignore_eos=True)
    future = engine._loop_thread().submit(engine.agenerate(ModelRequest(PROMPT, g, seed=1)))
    time.sleep(0.5)
    engine.pause()
    time.sleep(0.5)
    assert not future.done()
    engine.resume()
    out = future.result(120)
    assert len(out.output_ids) == 400 and out.stop_reason == "length"


def test_sglang_disk_weight_update_changes_the_served_model(engine, tiny_model_dir, tmp_path):
    from areal.utils.tiny_model import build_tiny_model

    new_dir = str(build_tiny_model(tmp_path / "v1", size="tiny", seed=1))
    engine.pause()
    engine.update_weights(WeightUpdateMeta(type="disk", path=new_dir, version=1))
    engine.set_version(1)
    engine.resume()
    out = _generate(engine, seed=3)
    assert out.output_versions == [1] * 8
    assert out.output_logprobs == pytest.approx(
        _reference_logprobs(new_dir, out.output_ids, 1.0), abs=5e-3
    )
