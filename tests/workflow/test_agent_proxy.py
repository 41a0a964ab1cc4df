"""The agent proxy and ``workflow.type: agent_cmd`` over a scripted engine (the proxy serves on
the test's loop; the workflow reaches it through its control API, as it reaches the launchers'
proxy role): the real ``openai`` client in an agent process (tests/workflow/proxy_agent.py)
trains through the proxy, each call recorded in tokens as the in-process client records it; a
killed agent loses only its session; an agent that never posts a reward is dropped at its
deadline; keys reach only their own session; hostile calls get clear 4xx and leave the proxy
serving; the control API wants the run's token. tests/workflow/test_agent_proxy_live.py runs it
on a real server across weight updates."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import aiohttp
import pytest

from areal.api.config.base import GenerationHyperparameters
from areal.api.config.reward import AgentConfig
from areal.api.engine import InferenceEngine
from areal.api.io import ModelRequest, ModelResponse
from areal.workflow.agent_cmd import AgentCommandWorkflow
from areal.workflow.agent_control import ProxyClient, ProxyUnavailable
from areal.workflow.agent_proxy import AgentProxy

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}\n</tool_call>'
AGENT = f"{sys.executable} {Path(__file__).with_name('proxy_agent.py')}"
G = GenerationHyperparameters(n_samples=2, max_new_tokens=64)
TOKEN = "control-token-of-this-test"


class ToolThenAnswer(InferenceEngine):
    """Calls the calculator until the prompt holds a tool result, then answers ``84``; logprob
    -0.25 - 0.01 * i for the i-th token; the version goes up by one after every call."""

    def __init__(self, tokenizer):
        self.tokenizer, self.version, self.responses = tokenizer, 0, []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        await asyncio.sleep(0.01)
        prompt = self.tokenizer.decode(req.input_ids)
        text = "84" if "<|im_start|>tool" in prompt or "<|im_start|>" not in prompt else CALL
        out = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [
            self.tokenizer.eos_token_id
        ]
        resp = ModelResponse(
            list(req.input_ids),
            out,
            [-0.25 - 0.01 * i for i in range(len(out))],
            [self.version] * len(out),
            "stop",
        )
        self.version += 1
        self.responses.append(resp)
        return resp

    def update_weights(self, meta) -> None: ...
    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...


def _item(i: int, **flags) -> dict:
    return {
        "id": f"q{i}",
        "messages": [{"role": "user", "content": "12 * 7 = ?"}],
        "reference": "84",
        **flags,
    }


def _workflow(tokenizer, tmp_path, proxy: AgentProxy, **agent) -> AgentCommandWorkflow:
    config = AgentConfig(**{"command": AGENT, "episode_timeout": 60.0, **agent})
    client = ProxyClient(proxy.address, TOKEN)
    return AgentCommandWorkflow(config, G, tokenizer, client, log_dir=tmp_path / "logs")


def _episodes(tokenizer, engine, tmp_path, items, **agent) -> tuple[AgentCommandWorkflow, list]:
    """The workflow's groups of ``items`` (run at once) through a proxy serving on this loop."""

    async def run():
        proxy = AgentProxy(tokenizer, engine, 1 << 24, TOKEN)
        await proxy.start()
        wf = _workflow(tokenizer, tmp_path, proxy, **agent)
        try:
            groups = await asyncio.gather(*(wf.arun_episode(engine, item) for item in items))
            assert proxy.open_sessions == 0 and not proxy._ids  # every session closed, collected
            return wf, groups
        finally:
            await wf.aclose()
            await proxy.stop()

    return asyncio.run(run())


def test_openai_client_in_a_subprocess_trains_through_the_proxy(
    tiny_tokenizer, tmp_path, monkeypatch
):
    monkeypatch.setenv("PROXY_AGENT_OUT", str(tmp_path))
    engine = ToolThenAnswer(tiny_tokenizer)
    wf, (group,) = _episodes(tiny_tokenizer, engine, tmp_path, [_item(0)])
    assert len(group) == G.n_samples and all(t.reward == 1.0 for t in group)
    for t in group:  # concat: the tool call, the tool's result untrained, the answer
        trained = [tok for tok, m in zip(t.completion_ids, t.loss_mask) if m]
        assert trained == engine.responses[0].output_ids + engine.responses[-1].output_ids
        assert t.loss_mask[0] == 1 and 0 in t.loss_mask
        calls = [v for v, m in zip(t.versions, t.loss_mask) if m]
        # the version went up between the calls: each token keeps the version that produced it
        assert len(set(calls)) == 2 and all(
            v == -1 for v, m in zip(t.versions, t.loss_mask) if not m
        )
    # the agent was answered exactly the recorded logprobs
    seen = [json.loads(p.read_text()) for p in tmp_path.glob("q0-*.json")]
    recorded = {tuple(t.logprobs[i] for i, m in enumerate(t.loss_mask) if m) for t in group}
    assert {tuple(x for lp in s["logprobs"] for x in lp) for s in seen} == recorded
    assert "agent q0 answered '84'" in (tmp_path / "logs" / "agent_stderr.log").read_text()
    assert wf.stats()["agent/episodes_failed"] == 0 and wf.stats()["agent/open_sessions"] == 0


def test_streamed_and_text_completions_are_recorded_like_chat(tiny_tokenizer, tmp_path):
    engine = ToolThenAnswer(tiny_tokenizer)
    _, (streamed, text) = _episodes(
        tiny_tokenizer, engine, tmp_path, [_item(1, stream=True), _item(2, text=True)]
    )
    assert all(t.reward == 1.0 for t in streamed + text)
    assert all(t.loss_mask.count(0) > 0 for t in streamed)  # two calls, the tool result between
    assert all(0 not in t.loss_mask for t in text)  # one text completion


def test_a_killed_agent_loses_only_its_session_and_a_silent_one_is_dropped_at_its_deadline(
    tiny_tokenizer, tmp_path, monkeypatch
):
    monkeypatch.setenv("PROXY_AGENT_OUT", str(tmp_path))
    engine = ToolThenAnswer(tiny_tokenizer)
    items = [_item(3, die=True), _item(4, hang=True), _item(5)]
    wf, (killed, silent, fine) = _episodes(
        tiny_tokenizer, engine, tmp_path, items, episode_timeout=8.0, max_agents=4
    )
    assert killed is None and silent is None and len(fine) == G.n_samples
    stats = wf.stats()
    assert stats["agent/episodes_failed"] == 4 and stats["agent/groups_dropped"] == 2
    assert stats["agent/deadline_drops"] == 2
    for seen in tmp_path.glob("q4-*.json"):  # the silent agents were killed at their deadline
        with pytest.raises(ProcessLookupError):
            os.kill(json.loads(seen.read_text())["pid"], 0)


def test_an_agent_that_exits_without_posting_is_scored_by_the_reward_function(
    tiny_tokenizer, tmp_path
):
    engine = ToolThenAnswer(tiny_tokenizer)
    reward_path = "tests.workflow.test_agent_proxy:stdout_reward"
    _, (group,) = _episodes(
        tiny_tokenizer, engine, tmp_path, [_item(6, no_reward=True)], reward_path=reward_path
    )
    assert [t.reward for t in group] == [0.5, 0.5]


def stdout_reward(item: dict, stdout: str) -> float:
    """0.5 when the agent printed the reference (the test's reward function by import path)."""
    return 0.5 if stdout.strip() == item["reference"] else 0.0


async def _post(http, url, key=None, data=None, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.post(url, data=data, headers=headers, **kw) as r:
        return r.status, await r.json()


def test_keys_reach_only_their_session_and_hostile_calls_get_clear_4xx(tiny_tokenizer):
    async def run():
        engine = ToolThenAnswer(tiny_tokenizer)
        proxy = AgentProxy(tiny_tokenizer, engine, 1 << 16, TOKEN)
        base = f"http://{await proxy.start()}/v1"
        key_a, a = proxy.open(G, "qa", "qa/0", 60.0)
        key_b, b = proxy.open(G, "qb", "qb/0", 60.0)
        chat = json.dumps({"model": "areal", "messages": [{"role": "user", "content": "hi"}]})
        try:
            async with aiohttp.ClientSession() as http:
                assert (await _post(http, f"{base}/chat/completions", key_a, chat))[0] == 200
                assert len(a.client.calls) == 1 and not b.client.calls  # A's call went to A only
                status, body = await _post(http, f"{base}/reward", key_a, json.dumps({"reward": 1}))
                assert (
                    status == 200 and a.reward == 1.0 and b.reward is None and not b.ended.is_set()
                )
                hostile = [
                    (key_a, chat, 401, "unknown or ended session"),  # reused key after the end
                    ("areal-guess", chat, 401, "unknown or ended session"),
                    (None, chat, 401, "unknown or ended session"),
                    (TOKEN, chat, 401, "unknown or ended session"),  # the control token is no key
                    (key_b, "{not json", 400, "not JSON"),
                    (key_b, "[1, 2]", 400, "JSON object"),
                    (key_b, json.dumps({"messages": []}), 400, "messages"),
                    (
                        key_b,
                        json.dumps(
                            {"messages": [{"role": "user", "content": "x"}], "temperature": 0.1}
                        ),
                        400,
                        "temperature",
                    ),
                    (
                        key_b,
                        json.dumps({"messages": [{"role": "user", "content": "x" * (1 << 17)}]}),
                        413,
                        "max_request_mb",
                    ),
                ]
                for key, data, want, says in hostile:
                    status, body = await _post(http, f"{base}/chat/completions", key, data)
                    assert status == want and says in body["error"]["message"], (
                        data[:40],
                        status,
                        body,
                    )
                    assert key_b[6:] not in json.dumps(body)  # no key ever echoed
                status, body = await _post(
                    http, f"{base}/reward", key_b, json.dumps({"reward": "high"})
                )
                assert status == 400 and "reward" in body["error"]["message"]
                await _thousand_sessions(http, proxy, base)
                assert (await _post(http, f"{base}/chat/completions", key_b, chat))[
                    0
                ] == 200  # still serving
                assert len(b.client.calls) == 1
        finally:
            await proxy.stop()

    asyncio.run(run())


async def _thousand_sessions(http, proxy, base) -> None:
    """1000 sessions at once, each posting a reward, half of them after a bad call."""
    keys = [proxy.open(G, f"s{i}", f"s{i}/0", 60.0) for i in range(1000)]

    async def one(i, key):
        if i % 2:
            assert (await _post(http, f"{base}/completions", key, "{"))[0] == 400
        return await _post(http, f"{base}/reward", key, json.dumps({"reward": i}))

    answers = await asyncio.gather(*(one(i, k) for i, (k, _) in enumerate(keys)))
    assert all(status == 200 for status, _ in answers)
    assert [s.reward for _, s in keys] == list(range(1000))


def test_the_control_api_wants_the_runs_token_returns_records_and_drops_unclosed_sessions(
    tiny_tokenizer,
):
    async def run():
        engine = ToolThenAnswer(tiny_tokenizer)
        proxy = AgentProxy(tiny_tokenizer, engine, 1 << 16, TOKEN)
        address = await proxy.start()
        control = ProxyClient(address, TOKEN)
        chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "logprobs": True})
        try:
            sid, key = await control.open("qc", "qc/0", G, 0, timeout=60.0)
            async with aiohttp.ClientSession() as http:
                status, answer = await _post(
                    http, f"{control.base_url}/chat/completions", key, chat
                )
                assert status == 200
                for token in ("wrong", key):  # a session key opens no control door
                    with pytest.raises(ProxyUnavailable, match="HTTP 401"):
                        await ProxyClient(address, token).open("x", "x/0", G, 0, 1.0)
                bad = json.dumps({"gconfig": {"no_such_knob": 1}})
                status, body = await _post(http, f"http://{address}/control/sessions", TOKEN, bad)
                assert status == 400 and "control open" in body["error"]["message"]
            assert await control.wait_ended(sid, 0.2) == ""  # still open
            record = await control.close(sid)
            assert record.why == "closed" and record.reward is None and not record.engine_failure
            (call,) = record.calls  # the proxy's Call, unchanged by the trip
            assert call.completion_ids == engine.responses[0].output_ids
            assert call.logprobs == [
                t["logprob"] for t in answer["choices"][0]["logprobs"]["content"]
            ]
            for ask in (control.wait_ended(sid, 0.1), control.close(sid)):
                with pytest.raises(ProxyUnavailable, match="HTTP 404"):
                    await ask
            sid, key = await control.open("qd", "qd/0", G, 0, timeout=0.3)  # its owner vanishes
            await asyncio.sleep(0.6)
            assert proxy.open_sessions == 0 and not proxy._ids
            with pytest.raises(ProxyUnavailable, match="HTTP 404"):
                await control.close(sid)
        finally:
            await control.aclose()
            await proxy.stop()

    asyncio.run(run())


@pytest.mark.parametrize("example", ["agent_arithmetic_sdk.py", "agent_arithmetic_langgraph.py"])
def test_framework_examples_run_their_agent_loop_through_the_proxy(
    example, tiny_tokenizer, tmp_path, monkeypatch
):
    pytest.importorskip(
        "agents" if "sdk" in example else "langgraph",
        reason="the framework is in the test extra: pip install -e .[test]",
    )
    monkeypatch.setattr(
        sys.modules[__name__],
        "CALL",
        '<tool_call>\n{"name": "calc", "arguments": {"e": "12 * 7"}}\n</tool_call>',
    )
    engine = ToolThenAnswer(tiny_tokenizer)
    item = {
        "id": "q7",
        "messages": [{"role": "user", "content": "12 * 7 = ? (answer)"}],
        "reference": "84",
    }
    command = f"python {Path(__file__).parents[2] / 'examples' / example}"
    wf, (group,) = _episodes(
        tiny_tokenizer, engine, tmp_path, [item], command=command, fork_server=True
    )
    assert group is not None and [t.reward for t in group] == [1.0, 1.0]
    # the framework's prompt is the in-process demo's: the bare question, the one calc(e) tool
    first = tiny_tokenizer.decode(group[0].prompt_ids)
    assert (
        first
        == "<|im_start|>system\nTools:\ncalc(e)<|im_end|>\n<|im_start|>user\n12 * 7 = ?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert (
        wf.stats()["agent/calls_per_episode"] == 2.0 and wf.stats()["agent/template_fallbacks"] == 0
    )
