"""Tier 2: the agent proxy on a real generation server (``areal serve``, tiny model), with a
rollout client of its own as the launchers' proxy role has, while the trainer's client pauses
the server and updates its weights: a multi-turn episode spanning a weight update keeps each
token's version (the interrupted call's tokens from before and after it, later calls all new),
and the executor's staleness bound holds for proxy samples over several weight updates.
The agent is tests/workflow/turns_agent.py (standard library only)."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from areal.api.config.base import GenerationHyperparameters
from areal.api.config.reward import AgentConfig
from areal.api.config.rollout import InferenceEngineConfig
from areal.api.io import WeightUpdateMeta
from areal.rollout.executor import EventLoopThread, WorkflowExecutor
from areal.rollout.remote import RemoteInferenceEngine
from areal.workflow.agent_cmd import AgentCommandWorkflow
from areal.workflow.agent_control import ProxyClient
from areal.workflow.agent_proxy import AgentProxy
from tests.serving.servers import start_servers, stop_servers

pytestmark = pytest.mark.slow
AGENT = f"{sys.executable} {Path(__file__).with_name('turns_agent.py')}"
TOKEN = "control-token-of-this-test"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    procs = start_servers(tiny_model_dir, 1)
    yield procs[0][1]
    stop_servers(procs)


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory) -> str:
    from areal.utils.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_b"), size="tiny", seed=1))


@pytest.fixture
def clients(server, tiny_model_dir):
    """(the trainer's client, the proxy's client) on the one server; weights put back after."""
    made = []
    for _ in range(2):
        engine = RemoteInferenceEngine(
            InferenceEngineConfig(setup_timeout=60.0, request_timeout=300.0)
        )
        engine.initialize([server])
        made.append(engine)
    yield made
    made[0].update_weights(WeightUpdateMeta(type="disk", path=tiny_model_dir, version=0))
    for engine in made:
        engine.destroy()


@pytest.fixture
def proxy(clients, tiny_tokenizer):
    """The proxy over the proxy's client, serving on a loop of its own (as in its own process)."""
    thread = EventLoopThread("agent-proxy")
    proxy = AgentProxy(tiny_tokenizer, clients[1], 1 << 20, TOKEN)
    thread.run(proxy.start(), 30, "starting the proxy")
    yield proxy
    thread.run(proxy.stop(), 30, "stopping the proxy")
    thread.stop()


def _workflow(tokenizer, proxy, g, tmp_path) -> AgentCommandWorkflow:
    config = AgentConfig(command=AGENT, episode_timeout=600.0)
    client = ProxyClient(proxy.address, TOKEN)
    return AgentCommandWorkflow(config, g, tokenizer, client, log_dir=tmp_path / "logs")


def _running(server: str) -> int:
    with urllib.request.urlopen(f"http://{server}/get_server_info", timeout=5) as r:
        return json.loads(r.read())["running"]


def _update(trainer: RemoteInferenceEngine, path: str, version: int) -> None:
    """A weight update as the trainer's publisher makes it."""
    trainer.pause()
    trainer.update_weights(WeightUpdateMeta(type="disk", path=path, version=version))
    trainer.set_version(version)
    trainer.resume()


def test_a_weight_update_inside_a_multi_turn_episode_keeps_every_tokens_version(
    server, clients, proxy, other_weights, tiny_tokenizer, tmp_path, monkeypatch
):
    monkeypatch.setenv("PROXY_AGENT_OUT", str(tmp_path))
    trainer = clients[0]
    # tokens per call, all of them (ignore_eos): the update lands inside call 1. 120 tokens took
    # ~0.3 s on a quiet machine, so the update after 0.3 s missed the call (CI, 2026-11-26)
    n = 400
    g = GenerationHyperparameters(n_samples=1, max_new_tokens=n, ignore_eos=True)
    wf = _workflow(tiny_tokenizer, proxy, g, tmp_path)

    def update_during_the_first_call():
        deadline = time.monotonic() + 120
        while _running(server) == 0:
            assert time.monotonic() < deadline, "the agent's first call never reached the server"
            time.sleep(0.02)
        time.sleep(0.15)  # some tokens under version 0, well before the call ends
        _update(trainer, other_weights, 1)

    updater = threading.Thread(target=update_during_the_first_call)
    updater.start()

    async def run():
        try:
            return await wf.arun_episode(trainer, {"id": "q0", "question": "1 + 1 =", "turns": 3})
        finally:
            await wf.aclose()

    (t,) = asyncio.run(run())
    updater.join(timeout=60)
    trained = [i for i, m in enumerate(t.loss_mask) if m]
    assert len(trained) == 3 * n  # concat: three calls, the user turns between them untrained
    versions = [t.versions[i] for i in trained]
    first, later = versions[:n], versions[n:]
    k = first.count(0)
    assert 0 < k < n and first == [0] * k + [1] * (n - k), first  # interrupted, resumed on v1
    assert later == [1] * (2 * n)
    assert all(t.versions[i] == -1 for i, m in enumerate(t.loss_mask) if not m)
    # the agent was answered exactly the logprobs that were recorded for training
    (seen,) = [json.loads(p.read_text()) for p in tmp_path.glob("q0-*.json")]
    assert [x for call in seen for x in call] == [t.logprobs[i] for i in trained]
    assert clients[1].stats()["remote/resubmits"] >= 1  # the proxy's own client re-submitted


def test_the_staleness_bound_holds_for_proxy_samples_across_weight_updates(
    clients, proxy, other_weights, tiny_model_dir, tiny_tokenizer, tmp_path
):
    trainer = clients[0]
    g = GenerationHyperparameters(n_samples=2, max_new_tokens=24, ignore_eos=True)
    wf = _workflow(tiny_tokenizer, proxy, g, tmp_path)
    ex = WorkflowExecutor(
        InferenceEngineConfig(max_staleness=1, max_concurrent_rollouts=4), trainer, batch_size=2
    )
    ex.initialize()
    data = [[{"id": f"q{i}", "question": f"{i} + 1 =", "turns": 2}] for i in range(64)]
    seen: set[int] = set()
    try:
        for step in range(3):
            batch = ex.prepare_batch(data, wf)
            assert len(batch) == 2 and all(len(grp) == 2 for grp in batch)
            for t in (t for grp in batch for t in grp):
                versions = [v for v, m in zip(t.versions, t.loss_mask) if m]
                seen |= set(versions)
                # trained now at version `step`: no token older than the bound allows
                assert min(versions) >= step - 1, (step, versions)
            assert ex.last_batch_stats["staleness/max"] <= 1
            ex.pause()
            path = other_weights if step % 2 == 0 else tiny_model_dir
            trainer.update_weights(WeightUpdateMeta(type="disk", path=path, version=step + 1))
            ex.resume(step + 1)
        assert len(seen) >= 2  # the samples spanned weight updates
        assert wf.stats()["agent/episodes_failed"] == 0
    finally:
        ex.run_on_loop(wf.aclose(), timeout=10.0)
        ex.destroy()


def test_a_conversation_longer_than_the_context_is_the_agents_400_and_the_run_goes_on(
    clients, proxy, tiny_tokenizer
):
    """The server refuses a prompt past its context (2048 tokens) with a 400: through the proxy
    the agent gets that 400 and message, counted in the session's record, and its next call is
    served; in process the agent gets openai's BadRequestError. Neither is an engine failure."""
    import aiohttp
    import openai

    from areal.workflow.openai_client import ArealOpenAI

    g = GenerationHyperparameters(n_samples=1, max_new_tokens=4)
    long = {"messages": [{"role": "user", "content": "x " * 3000}]}
    short = {"messages": [{"role": "user", "content": "1 + 1 ="}]}

    async def run():
        control = ProxyClient(proxy.address, TOKEN)
        sid, key = await control.open("q", "q/0", g, 0, 60.0)
        answers = []
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
            for body in (long, short):
                async with http.post(f"{control.base_url}/chat/completions", json=body) as r:
                    answers.append((r.status, await r.json()))
        record = await control.close(sid)
        await control.aclose()
        client = ArealOpenAI(clients[0], tiny_tokenizer, g)
        with pytest.raises(openai.BadRequestError, match="the context is 2048"):
            await client.chat.completions.create(**long)
        return answers, record, client

    (refused, served), record, client = asyncio.run(run())
    assert refused[0] == 400 and refused[1]["error"]["param"] == "input_ids"
    assert "the context is 2048" in refused[1]["error"]["message"]
    assert served[0] == 200
    assert record.rejected == 1 and record.engine_failure is None and len(record.calls) == 1
    assert client.engine_failure is None and client.n_rejected == 1


ANSWER = {  # short values only: a random model fills an unbounded number or string forever
    "type": "object",
    "properties": {"done": {"type": "boolean"}, "unit": {"enum": ["m", "s"]}},
    "required": ["done", "unit"],
    "additionalProperties": False,
}
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
TWO_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {"a": DIGIT, "b": DIGIT},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    }
    for name in ("add", "mul")
]


def test_response_format_and_a_named_tool_choice_constrain_answers_in_process_and_via_proxy(
    clients, proxy, tiny_tokenizer
):
    """The random tiny model writes JSON only when constrained: every answer parses against the
    schema, and a named tool_choice gives exactly one call of that tool with valid arguments, in
    process and through the proxy (as `areal serve`'s OpenAI routes answer them)."""
    import openai

    from areal.workflow.openai_client import ArealOpenAI

    g = GenerationHyperparameters(n_samples=1, max_new_tokens=48)
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER, "strict": True}}
    mul = {"type": "function", "function": {"name": "mul"}}
    messages = [{"role": "user", "content": "2 * 3 ="}]

    async def run():
        control = ProxyClient(proxy.address, TOKEN)
        sid, key = await control.open("q", "q/0", g, 0, 120.0)
        remote = openai.AsyncOpenAI(base_url=control.base_url, api_key=key)
        answers = []
        for client in (ArealOpenAI(clients[0], tiny_tokenizer, g), remote):
            for seed in range(3):
                answers.append(
                    await client.chat.completions.create(
                        model="areal", messages=messages, response_format=fmt, seed=seed
                    )
                )
                answers.append(
                    await client.chat.completions.create(
                        model="areal", messages=messages, tools=TWO_TOOLS, tool_choice=mul,
                        seed=seed,
                        parallel_tool_calls=False,
                    )
                )  # fmt: skip
        record = await control.close(sid)
        await control.aclose()
        await remote.close()
        return answers, record

    answers, record = asyncio.run(run())
    assert record.rejected == 0 and len(record.calls) == 6
    for formatted, called in zip(answers[::2], answers[1::2]):
        obj = json.loads(formatted.choices[0].message.content)
        assert set(obj) == {"done", "unit"}, obj
        assert isinstance(obj["done"], bool) and obj["unit"] in ("m", "s"), obj
        assert called.choices[0].finish_reason == "tool_calls", called
        (call,) = called.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "mul" and set(args) == {"a", "b"}, call
        assert all(isinstance(v, int) and 0 <= v <= 9 for v in args.values()), args
