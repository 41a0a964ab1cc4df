"""Tier 2: RemoteInferenceEngine against real ``areal serve`` processes on loopback ports.

Covers generation, pause -> partials -> weight update -> resume -> continuation with per-token
versions, a server killed during a rollout batch (the batch completes on the other one), all
servers dead (clear error), the /health deadline, address resolution and group-sticky routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
import urllib.request

import pytest

from areal.api.config.base import GenerationHyperparameters
from areal.api.config.rollout import InferenceEngineConfig
from areal.api.io import ModelRequest, RolloutStatus, Trajectory, WeightUpdateMeta
from areal.api.workflow import RolloutWorkflow
from areal.rollout.executor import RolloutError, WorkflowExecutor
from areal.rollout.remote import (
    AllServersDeadError,
    RemoteEngineError,
    RemoteInferenceEngine,
    continuation_seed,
    discover_servers,
)
from areal.utils.name_resolve import FileNameRepository, gen_servers_key
from areal.utils.network import free_port
from tests.serving.servers import start_servers, stop_servers

pytestmark = pytest.mark.slow


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def _wait_running(addresses: list[str], n: int, what: str, timeout: float = 30) -> None:
    """Until the servers at ``addresses`` run at least ``n`` requests between them."""
    deadline = time.monotonic() + timeout
    while sum(_get(f"http://{a}/get_server_info")["running"] for a in addresses) < n:
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    procs = start_servers(tiny_model_dir, 2)
    yield [addr for _, addr in procs]
    stop_servers(procs)


@pytest.fixture(scope="module")
def other_weights_dir(tmp_path_factory) -> str:
    from areal.utils.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_b"), size="tiny", seed=1))


@pytest.fixture
def make_engine():
    engines: list[RemoteInferenceEngine] = []

    def make(addresses, **cfg) -> RemoteInferenceEngine:
        cfg.setdefault("setup_timeout", 60.0)
        cfg.setdefault("request_timeout", 120.0)
        eng = RemoteInferenceEngine(InferenceEngineConfig(**cfg))
        eng.initialize(addresses)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.destroy()


class SampleN(RolloutWorkflow):
    """n samples of one prompt, sharing a group id (so they are routed to one server)."""

    def __init__(self, n: int, max_new_tokens: int):
        self.n = n
        self.g = GenerationHyperparameters(max_new_tokens=max_new_tokens, ignore_eos=True)

    async def arun_episode(self, engine, item):
        gid = f"group-{item['id']}"
        reqs = [
            ModelRequest(input_ids=item["prompt"], gconfig=self.g, group_id=gid)
            for _ in range(self.n)
        ]
        resps = await asyncio.gather(*(engine.agenerate(r) for r in reqs))
        return [
            Trajectory(
                prompt_ids=r.input_ids,
                completion_ids=r.output_ids,
                logprobs=r.output_logprobs,
                versions=r.output_versions,
                loss_mask=[1] * len(r.output_ids),
                reward=0.0,
                status=RolloutStatus.TRUNCATED,
                sample_id=f"{item['id']}/{i}",
                group_id=gid,
            )
            for i, r in enumerate(resps)
        ]


def _gather(coros) -> list:
    """Run coroutines concurrently on a fresh loop (the engine bridges to its own loop)."""

    async def main():
        return await asyncio.gather(*coros)

    return asyncio.run(main())


def test_agenerate_returns_tokens_logprobs_and_versions(servers, make_engine):
    eng = make_engine(servers, schedule_policy="least_requests")
    g = GenerationHyperparameters(max_new_tokens=12, greedy=True, ignore_eos=True)
    a, b = _gather(
        [eng.agenerate(ModelRequest(input_ids=[5, 17, 99], gconfig=g)) for _ in range(2)]
    )
    assert len(a.output_ids) == 12 and a.stop_reason == "length" and a.input_ids == [5, 17, 99]
    assert a.output_ids == b.output_ids  # greedy on identical weights, whichever server
    assert len(a.output_logprobs) == 12 and all(lp <= 0 for lp in a.output_logprobs)
    assert a.output_versions == [0] * 12 and a.latency >= a.ttft > 0
    assert a.server in servers and b.server in servers  # which server generated it


def test_a_teacher_scores_a_completion_with_the_models_own_logprobs(
    servers, make_engine, tiny_model_dir
):
    # On-policy distillation's teacher call: no token generated, log p of each completion token
    import torch
    from transformers import AutoModelForCausalLM

    prompt, completion = [5, 17, 99, 200], [3, 42, 42, 7, 11]
    eng = make_engine(servers)
    got = _gather([eng.ascore(prompt + completion, len(prompt))])[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]
    assert got == pytest.approx(ref.tolist(), abs=1e-4)
    assert _gather([eng.ascore(prompt, len(prompt))])[0] == []  # nothing to score


def test_pause_returns_partials_resumed_on_new_weights_with_per_token_versions(
    servers, make_engine, other_weights_dir, tiny_model_dir
):
    eng = make_engine(servers)
    g = GenerationHyperparameters(max_new_tokens=400, ignore_eos=True)
    reqs = [ModelRequest(input_ids=[3, 1, 4, 1, 5], gconfig=g, group_id=f"g{i}") for i in range(4)]
    results: list = []
    worker = threading.Thread(
        target=lambda: results.extend(_gather([eng.agenerate(r) for r in reqs]))
    )
    worker.start()
    _wait_running(servers, 4, "requests never started running")
    time.sleep(0.3)  # let every request produce some tokens under version 0
    eng.pause()
    eng.update_weights(WeightUpdateMeta(type="disk", path=other_weights_dir, version=1))
    eng.set_version(1)
    eng.resume()
    worker.join(timeout=120)
    assert not worker.is_alive() and len(results) == 4
    try:
        for r in results:
            assert len(r.output_ids) == 400 and r.stop_reason == "length"
            k = r.output_versions.count(0)
            assert 0 < k < 400, "each request ran both before and after the update"
            assert r.output_versions == [0] * k + [1] * (400 - k)
            assert len(r.output_logprobs) == 400
        assert eng.stats()["remote/resubmits"] >= 4
    finally:  # put the original weights back for the other tests
        eng.update_weights(WeightUpdateMeta(type="disk", path=tiny_model_dir, version=0))


def test_a_constrained_request_interrupted_by_a_weight_update_restarts_and_still_matches(
    servers, make_engine, other_weights_dir, tiny_model_dir
):
    """A grammar's state does not travel with prompt + partial output, so an aborted constrained
    generation starts again on the new weights: every token is the new version's, and valid."""
    import re

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eng = make_engine(servers)
    g = GenerationHyperparameters(max_new_tokens=400, regex="[a-z]{300}")
    reqs = [ModelRequest(input_ids=[3, 1, 4, 1, 5], gconfig=g, group_id=f"c{i}") for i in range(2)]
    results: list = []
    worker = threading.Thread(
        target=lambda: results.extend(_gather([eng.agenerate(r) for r in reqs]))
    )
    worker.start()
    _wait_running(servers, 2, "requests never started running")
    time.sleep(0.3)
    eng.pause()
    eng.update_weights(WeightUpdateMeta(type="disk", path=other_weights_dir, version=1))
    eng.set_version(1)
    eng.resume()
    worker.join(timeout=120)
    try:
        assert not worker.is_alive() and len(results) == 2
        for r in results:
            assert r.stop_reason == "stop" and r.output_versions == [1] * 300
            assert re.fullmatch("[a-z]{300}", tokenizer.decode(r.output_ids))
        assert eng.stats()["remote/resubmits"] >= 2
    finally:
        eng.update_weights(WeightUpdateMeta(type="disk", path=tiny_model_dir, version=0))


def test_continuation_seed_keeps_the_first_part_and_offsets_later_ones():
    assert continuation_seed(None, 3) is None and continuation_seed(7, 0) == 7
    assert continuation_seed(7, 3) == 7 + 2138041855  # zlib.crc32(b"continuation/3")
    assert continuation_seed(2**62 - 1, 1) == 2439089363 - 1  # wraps inside the seed range


def test_an_interrupted_seeded_request_continues_from_its_own_seed(servers, make_engine):
    """The part after a pause is sampled with the continuation's seed, not the request's again
    (which would repeat the first part's random draws): the server reproduces it from that seed."""
    eng = make_engine(servers[:1])
    parts: list[tuple[list[int], int, int | None]] = []
    generate = eng.backend.generate

    def recording(input_ids, g, max_new, min_new, seed):
        parts.append((list(input_ids), max_new, seed))
        return generate(input_ids, g, max_new, min_new, seed)

    eng.backend.generate = recording
    g = GenerationHyperparameters(max_new_tokens=400, ignore_eos=True)
    req = ModelRequest(input_ids=[3, 1, 4, 1, 5], gconfig=g, group_id="seeded", seed=11)
    future = eng._loop_thread().submit(eng.agenerate(req))
    _wait_running(servers[:1], 1, "the request never started running")
    time.sleep(0.3)
    eng.pause()
    eng.resume()
    out = future.result(120)
    assert len(out.output_ids) == 400 and len(parts) == 2  # one pause: two parts
    (_, _, first_seed), (prefix, budget, second_seed) = parts
    k = len(prefix) - 5
    assert 0 < k < 400 and budget == 400 - k and first_seed == 11
    assert second_seed == continuation_seed(11, k) != 11
    # the second part alone, reproduced from its seed
    direct = _gather(
        [
            eng.agenerate(
                ModelRequest(
                    input_ids=prefix,
                    gconfig=GenerationHyperparameters(max_new_tokens=budget, ignore_eos=True),
                    seed=second_seed,
                )
            )
        ]
    )[0]
    assert direct.output_ids == out.output_ids[k:]


def test_killed_server_mid_batch_fails_over_then_all_dead_stops_the_run(
    tiny_model_dir, make_engine
):
    procs = start_servers(tiny_model_dir, 2)
    try:
        victim, survivor = procs
        eng = make_engine([victim[1], survivor[1]], request_retries=3, retry_backoff=0.05)
        ex = WorkflowExecutor(InferenceEngineConfig(max_concurrent_rollouts=8), eng, batch_size=1)
        ex.initialize()
        items = [{"id": i, "prompt": [7, i + 1, 9]} for i in range(8)]
        groups: list = []
        batch = threading.Thread(
            target=lambda: groups.extend(ex.rollout_batch(items, SampleN(n=2, max_new_tokens=150)))
        )
        batch.start()
        _wait_running([victim[1]], 1, "the victim never got work")
        time.sleep(0.1)
        victim[0].send_signal(signal.SIGKILL)  # dies with requests in flight
        batch.join(timeout=120)
        assert not batch.is_alive()
        assert len(groups) == 8
        assert all(len(t.completion_ids) == 150 for g in groups for t in g)
        assert eng.stats()["remote/servers_dead"] == 1 and eng.stats()["remote/failovers"] >= 1
        survivor[0].send_signal(signal.SIGKILL)
        survivor[0].wait(timeout=10)
        with pytest.raises(RolloutError, match="all 2 generation servers are dead") as e:
            ex.rollout_batch(items[:1], SampleN(n=1, max_new_tokens=5))
        assert isinstance(e.value.__cause__, AllServersDeadError)
        ex.destroy()
    finally:
        stop_servers(procs)


def test_health_wait_has_a_deadline_naming_the_setting():
    eng = RemoteInferenceEngine(InferenceEngineConfig(setup_timeout=0.5))
    with pytest.raises(
        TimeoutError, match=r"did not pass GET /health within 0.5 s \(rollout.setup_timeout\)"
    ):
        eng.initialize([f"127.0.0.1:{free_port()}"])
    eng.destroy()


def test_servers_come_from_config_else_the_trial_registry(tmp_path):
    cfg = InferenceEngineConfig(addresses=["127.0.0.1:1"])
    repo = FileNameRepository(tmp_path)
    assert discover_servers(cfg, repo, gen_servers_key("exp", "t"), 1) == ["127.0.0.1:1"]
    repo.add_subentry(gen_servers_key("exp", "t"), "127.0.0.1:4")
    quick = InferenceEngineConfig(setup_timeout=0.2)
    assert discover_servers(quick, repo, gen_servers_key("exp", "t"), 1) == ["127.0.0.1:4"]
    with pytest.raises(TimeoutError, match="'exp/t/gen_servers' holds 1 of 2 entries"):
        discover_servers(quick, repo, gen_servers_key("exp", "t"), 2)
    with pytest.raises(TimeoutError, match="'exp/t2/gen_servers' holds 0 of 1"):
        discover_servers(quick, repo, gen_servers_key("exp", "t2"), 1)
    with pytest.raises(ValueError, match="rollout.addresses"):
        discover_servers(InferenceEngineConfig(), None, gen_servers_key("exp", "t"), 1)


def test_distributed_update_over_gloo_matches_a_disk_update(
    servers, make_engine, other_weights_dir, tiny_model_dir
):
    """The test process plays trainer rank 0; both servers join the group through the client."""
    from areal.serving.model import read_hf_dir
    from areal.utils.weight_sync import (
        announcement,
        broadcast_weights,
        destroy_weight_update_group,
        init_weight_update_group,
    )

    eng = make_engine(servers)
    g = GenerationHyperparameters(max_new_tokens=10, greedy=True, ignore_eos=True)
    (before,) = _gather([eng.agenerate(ModelRequest(input_ids=[2, 7, 1], gconfig=g))])
    meta = WeightUpdateMeta(
        type="distributed", master_port=free_port(), version=2, bucket_bytes=64 << 10
    )
    joined = eng.init_weights_update_group_async(meta)
    group = init_weight_update_group(
        "127.0.0.1", meta.master_port, 0, eng.weight_group_size, "gloo", 60
    )
    joined.result(60)
    named = sorted(read_hf_dir(other_weights_dir)[1].items())
    updated = eng.update_weights_async(meta, announcement(named))
    broadcast_weights(named, group, meta.bucket_bytes, timeout=60)
    updated.result(60)
    destroy_weight_update_group(group)  # this process may join a group of that name again
    assert eng.get_version() == 0  # the client's version has one writer: the weight publisher
    try:
        over_gloo = _gather(
            [eng.agenerate(ModelRequest(input_ids=[2, 7, 1], gconfig=g)) for _ in range(2)]
        )
        assert all(r.output_versions == [2] * 10 for r in over_gloo)
        assert over_gloo[0].output_ids != before.output_ids  # the new weights are in use
        eng.update_weights(WeightUpdateMeta(type="disk", path=other_weights_dir, version=3))
        from_disk = _gather(
            [eng.agenerate(ModelRequest(input_ids=[2, 7, 1], gconfig=g)) for _ in range(2)]
        )
        assert [r.output_ids for r in over_gloo] == [r.output_ids for r in from_disk]
        # the same next-token distributions, not just the same argmax
        assert [r.output_logprobs for r in over_gloo] == [r.output_logprobs for r in from_disk]
        assert all(r.output_versions == [3] * 10 for r in from_disk)
    finally:
        eng.update_weights(WeightUpdateMeta(type="disk", path=tiny_model_dir, version=0))


def test_async_training_loop_keeps_staleness_within_the_bound(
    servers, make_engine, other_weights_dir, tiny_model_dir
):
    """prepare_batch -> pause -> update -> set_version -> resume, as a training script does."""
    eng = make_engine(servers)
    cfg = InferenceEngineConfig(max_staleness=1, max_concurrent_rollouts=4)
    ex = WorkflowExecutor(cfg, eng, batch_size=2)
    ex.initialize()
    data = [[{"id": i, "prompt": [4, i % 50 + 1, 2]}] for i in range(64)]
    wf = SampleN(n=2, max_new_tokens=80)
    seen_versions: set[int] = set()
    try:
        for step in range(3):
            batch = ex.prepare_batch(data, wf)
            assert len(batch) == 2 and all(
                len(t.completion_ids) == 80 for grp in batch for t in grp
            )
            assert ex.last_batch_stats["staleness/max"] <= 1
            seen_versions |= {v for grp in batch for t in grp for v in t.versions}
            ex.pause()
            path = other_weights_dir if step % 2 == 0 else tiny_model_dir
            eng.update_weights(WeightUpdateMeta(type="disk", path=path, version=step + 1))
            eng.set_version(step + 1)
            ex.resume()
        assert len(seen_versions) >= 2  # rollouts spanned weight updates
    finally:
        ex.destroy()
        eng.update_weights(WeightUpdateMeta(type="disk", path=tiny_model_dir, version=0))


def _serve_on(model_dir: str, port: int, version: int = 0):
    """``areal serve`` on a given port (a launcher's restart), healthy within the deadline."""
    import os
    import subprocess
    import sys

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal.cli",
            "serve",
            "--model",
            model_dir,
            "--port",
            str(port),
            f"weight_version={version}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 90
    while True:
        try:
            _get(f"http://127.0.0.1:{port}/health")
            return proc
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)


def test_a_restarted_server_rejoins_at_the_next_disk_update_with_its_weights(
    make_engine, tiny_model_dir, other_weights_dir
):
    port = free_port()
    proc = _serve_on(tiny_model_dir, port)
    addr = f"127.0.0.1:{port}"
    restarted = None
    try:
        eng = make_engine([addr], server_failure_threshold=1, request_retries=0)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        req = ModelRequest(
            input_ids=[5, 17, 99], gconfig=GenerationHyperparameters(max_new_tokens=2)
        )
        with pytest.raises(RemoteEngineError, match="failed 1 times"):
            asyncio.run(eng.agenerate(req))
        assert eng.stats()["remote/servers_alive"] == 0
        restarted = _serve_on(tiny_model_dir, port, version=3)  # the launcher's restart
        assert _get(f"http://{addr}/get_model_info")["weight_version"] == 3
        eng.update_weights(WeightUpdateMeta("disk", path=other_weights_dir, version=4))
        assert eng.stats()["remote/servers_alive"] == 1 and eng.stats()["remote/revived"] == 1
        assert _get(f"http://{addr}/get_model_info")["weight_version"] == 4
        resp = asyncio.run(eng.agenerate(req))
        assert resp.output_versions == [4, 4]
    finally:
        for p in (proc, restarted):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)


def test_a_lone_server_killed_mid_run_is_waited_for_when_the_launcher_restarts_servers(
    tiny_model_dir, other_weights_dir
):
    """The server-loss policy: with restarts on, a call made while the only server is down
    waits for the restart (was: AllServersDeadError 3 s after the kill); without restarts, or
    past the deadline, the call fails at once naming each server's last error and why."""
    port = free_port()
    addr = f"127.0.0.1:{port}"
    procs = [_serve_on(tiny_model_dir, port)]
    req = ModelRequest(input_ids=[5, 17, 99], gconfig=GenerationHyperparameters(max_new_tokens=2))
    cfg = dict(
        setup_timeout=60.0,
        request_timeout=120.0,
        server_failure_threshold=1,
        request_retries=2,
        retry_backoff=0.05,
    )
    waits = RemoteInferenceEngine(
        InferenceEngineConfig(**cfg, server_restart_timeout=60.0), server_restarts=2
    )
    fails = RemoteInferenceEngine(
        InferenceEngineConfig(**cfg), no_restart_reason="launcher.server_restarts=0"
    )
    try:
        waits.initialize([addr])
        fails.initialize([addr])
        procs[0].kill()
        procs[0].wait(10)
        started = time.monotonic()
        with pytest.raises(
            AllServersDeadError,
            match=rf"dead \({addr}: .*\) and are not restarted "
            r"\(launcher.server_restarts=0\)",
        ):
            asyncio.run(fails.agenerate(req))
        assert time.monotonic() - started < 10  # fast: no waiting without restarts
        restart = threading.Timer(
            1.0, lambda: procs.append(_serve_on(tiny_model_dir, port, version=3))
        )
        restart.start()  # the launcher's restart, while the request below is waiting
        resp = asyncio.run(waits.agenerate(req))
        restart.join()
        assert resp.output_versions == [3, 3] and waits.stats()["remote/revived"] == 1
        waits.update_weights(
            WeightUpdateMeta("disk", path=other_weights_dir, version=4)
        )  # it serves on
        procs[-1].kill()
        procs[-1].wait(10)
        waits.config = InferenceEngineConfig(**cfg, server_restart_timeout=1.0)
        with pytest.raises(
            AllServersDeadError, match=r"none answered within rollout.server_restart_timeout=1.0 s"
        ):
            asyncio.run(waits.agenerate(req))
    finally:
        waits.destroy()
        fails.destroy()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_set_servers_adds_revives_and_retires(servers, make_engine):
    a, b = servers
    eng = make_engine([a])
    eng.pool.choose("g1", set())  # pinned to a
    eng.servers[0].alive = False  # declared dead meanwhile
    eng.set_servers([a, b])  # b is new (health-checked), a serves again
    assert [(s.address, s.alive) for s in eng.servers] == [
        (a, True),
        (b, True),
    ] and eng.n_revived == 1
    eng.set_servers([b])  # a retired: no new request goes there, nor does the group stay on it
    assert [s.address for s in eng.servers] == [b] and eng.pool.choose("g1", set()).address == b
    out = _gather([SampleN(2, 3).arun_episode(eng, {"id": 0, "prompt": [1, 2, 3]})])[0]
    assert len(out) == 2 and all(len(t.completion_ids) == 3 for t in out)
    with pytest.raises(ValueError, match="at least one"):
        eng.set_servers([])
    with pytest.raises(TimeoutError, match="did not pass GET"):
        make_engine([b], setup_timeout=1.0).set_servers([b, "127.0.0.1:9"])  # nothing listens there


# ------------------------------------------------------------------ load: connections, resets

# 8 connections, 2 kept for health and admin: at most 6 inside generation requests at once
CAPPED = ("max_connections=8", "control_connections=2")


@pytest.fixture(scope="module")
def capped(tiny_model_dir):
    procs = start_servers(tiny_model_dir, 1, *CAPPED)
    yield procs[0][1]
    stop_servers(procs)


def _burst(eng: RemoteInferenceEngine, n: int) -> list:
    g = GenerationHyperparameters(max_new_tokens=8, ignore_eos=True)
    return _gather(
        [eng.agenerate(ModelRequest(input_ids=[5, i + 1, 7], gconfig=g)) for i in range(n)]
    )


def test_more_requests_than_a_server_has_connections_wait_in_the_client(capped, make_engine):
    eng = make_engine([capped], max_connections_per_server=4, request_retries=0)
    shed = _get(f"http://{capped}/get_server_info")["requests_shed"]
    assert all(len(r.output_ids) == 8 for r in _burst(eng, 24))
    stats = eng.stats()
    assert stats["remote/backpressure_waits"] == 0 and stats["remote/servers_dead"] == 0
    assert _get(f"http://{capped}/get_server_info")["requests_shed"] == shed  # none refused


def test_a_server_pushing_back_is_waited_for_not_declared_dead(capped, make_engine):
    eng = make_engine(
        [capped], max_connections_per_server=32, request_retries=0, server_failure_threshold=1
    )
    assert all(len(r.output_ids) == 8 for r in _burst(eng, 24))  # 24 at once on 6 connections
    stats = eng.stats()
    assert stats["remote/backpressure_waits"] > 0 and stats["remote/failovers"] == 0
    assert stats["remote/servers_dead"] == 0


@contextlib.contextmanager
def _fake_server(routes: list):
    """An aiohttp app with ``routes`` on a loopback port, on a loop of its own; its address."""
    from aiohttp import web

    loop, port = asyncio.new_event_loop(), free_port()
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_a_connection_closed_under_a_request_is_sent_again_when_the_server_answers_health(
    make_engine,
):
    """A pooled connection the server closes as a request goes out on it (evicted by a flood,
    or at its keep-alive deadline) is back-pressure: sent again, no failure counted."""
    from aiohttp import web

    calls = []

    async def generate(request):
        calls.append(request.transport)
        if len(calls) == 1:
            request.transport.close()  # no answer: the client sees the connection go
        meta = {
            "output_token_logprobs": [[-0.5, 3, None]],
            "finish_reason": {"type": "length"},
            "weight_version": 0,
        }
        return web.json_response({"output_ids": [3], "meta_info": meta})

    async def health(request):
        return web.json_response({"status": "ok"})

    routes = [web.post("/generate", generate), web.get("/health", health)]
    with _fake_server(routes) as addr:
        eng = make_engine([addr], request_retries=0, server_failure_threshold=1)
        req = ModelRequest(input_ids=[1, 2], gconfig=GenerationHyperparameters(max_new_tokens=1))
        assert asyncio.run(eng.agenerate(req)).output_ids == [3]
        assert len(calls) == 2 and eng.stats()["remote/backpressure_waits"] == 1
        assert eng.stats()["remote/servers_dead"] == 0
