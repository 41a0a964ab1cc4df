"""Tier 2 without network: WorkflowExecutor with a fake engine and gated fake workflows."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from areal.api.config.rollout import InferenceEngineConfig
from areal.api.engine import InferenceEngine
from areal.api.io import ModelRequest, ModelResponse, RolloutStatus, Trajectory
from areal.api.workflow import RolloutWorkflow
from areal.rollout.executor import RolloutError, RolloutWatchdogError, WorkflowExecutor


class FakeEngine(InferenceEngine):
    """Version counter plus an agenerate that returns two tokens tagged with the version."""

    def __init__(self) -> None:
        self.version = 0
        self.paused = False

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        v = self.version
        return ModelResponse(req.input_ids, [7, 8], [-0.5, -0.5], [v, v], "stop")

    def update_weights(self, meta) -> None:
        self.version = meta.version

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = version

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False


class GatedWorkflow(RolloutWorkflow):
    """One-trajectory groups; item {"id": i} finishes once gate i is opened (or at once)."""

    def __init__(self, gated: bool = True, fail_on: int | None = None) -> None:
        self.gated = gated
        self.fail_on = fail_on
        self.gates: dict[int, threading.Event] = {}
        self.started: list[tuple[int, int]] = []  # (item id, version at start)
        self._lock = threading.Lock()

    def gate(self, i: int) -> threading.Event:
        with self._lock:
            return self.gates.setdefault(i, threading.Event())

    def release(self, *ids: int) -> None:
        for i in ids:
            self.gate(i).set()

    async def arun_episode(self, engine, item: dict[str, Any]) -> list[Trajectory] | None:
        i = item["id"]
        self.started.append((i, engine.get_version()))
        while self.gated and not self.gate(i).is_set():
            await asyncio.sleep(0.002)
        if i == self.fail_on:
            raise ValueError("reward parser exploded")
        resp = await engine.agenerate(ModelRequest(input_ids=[1, 2]))
        traj = Trajectory(
            prompt_ids=[1, 2],
            completion_ids=resp.output_ids,
            logprobs=resp.output_logprobs,
            versions=resp.output_versions,
            loss_mask=[1, 1],
            reward=float(i),
            status=RolloutStatus.COMPLETED,
            sample_id=str(i),
        )
        return [traj]


def _ids(groups) -> list[int]:
    return [int(g[0].sample_id) for g in groups]


def _until(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


@pytest.fixture
def make_executor():
    made: list[WorkflowExecutor] = []

    def make(engine=None, batch_size=4, **cfg) -> WorkflowExecutor:
        cfg.setdefault("max_concurrent_rollouts", 8)
        cfg.setdefault("max_staleness", 4)
        ex = WorkflowExecutor(
            InferenceEngineConfig(**cfg),
            engine or FakeEngine(),
            batch_size,
            poll_interval=0.005,
            worker="rank3",
        )
        ex.initialize()
        made.append(ex)
        return ex

    yield make
    for ex in made:
        ex.destroy()


def test_results_come_back_oldest_submitted_first(make_executor):
    ex = make_executor()
    wf = GatedWorkflow()
    for i in range(4):
        ex.submit({"id": i}, wf)
    wf.release(3)
    assert _ids(ex.wait(1, timeout=5)) == [3]  # older ones are not finished: no blocking on them
    wf.release(2, 1, 0)  # finish in reverse submission order
    _until(lambda: ex.stats()["rollout/buffered"] == 3)
    groups = ex.wait(3, timeout=5)
    assert _ids(groups) == [0, 1, 2]
    assert {t.worker for g in groups for t in g} == {"rank3"}  # stamped with the executor's name


def test_nothing_finished_is_discarded_in_synchronous_mode(make_executor):
    engine = FakeEngine()
    ex = make_executor(engine, max_staleness=0, batch_size=2)
    wf = GatedWorkflow(gated=False)
    for i in range(6):
        ex.submit({"id": i}, wf)
    delivered = []
    for step in range(3):
        delivered += _ids(ex.wait(2, timeout=5))
        engine.set_version(step + 1)
    assert delivered == [0, 1, 2, 3, 4, 5]
    # Synchronous: each item started at the version it is trained at.
    assert [v for _, v in sorted(wf.started)] == [0, 0, 1, 1, 2, 2]


def test_admission_stops_at_the_staleness_bound_until_the_version_moves(make_executor):
    engine = FakeEngine()
    ex = make_executor(engine, max_staleness=1, batch_size=2)
    wf = GatedWorkflow(gated=False)
    for i in range(8):
        ex.submit({"id": i}, wf)
    _until(lambda: ex.stats()["rollout/buffered"] == 4)  # (1 + 0 + 1) * 2
    time.sleep(0.05)
    assert len(wf.started) == 4 and ex.stats()["rollout/queued"] == 4
    engine.set_version(1)
    _until(lambda: len(wf.started) == 6)


def test_concurrency_cap_bounds_running_rollouts(make_executor):
    ex = make_executor(max_concurrent_rollouts=2, max_staleness=8)
    wf = GatedWorkflow()
    for i in range(5):
        ex.submit({"id": i}, wf)
    _until(lambda: len(wf.started) == 2)
    time.sleep(0.05)
    assert len(wf.started) == 2
    wf.release(0)
    _until(lambda: len(wf.started) == 3)
    wf.release(1, 2, 3, 4)
    assert _ids(ex.wait(5, timeout=5)) == [0, 1, 2, 3, 4]


def test_rejected_groups_are_replaced_so_the_batch_size_stays_fixed(make_executor):
    engine = FakeEngine()
    ex = make_executor(engine, max_staleness=0, batch_size=3)
    wf = GatedWorkflow(gated=False)
    data = [[{"id": i} for i in range(j, j + 3)] for j in range(0, 30, 3)]  # batches of 3 items

    def even_only(group):
        return int(group[0].sample_id) % 2 == 0

    batch = ex.prepare_batch(data, wf, should_accept=even_only)
    assert _ids(batch) == [0, 2, 4]
    assert ex.stats()["rollout/rejected"] >= 2
    engine.set_version(1)
    assert _ids(ex.prepare_batch(data, wf, should_accept=even_only)) == [6, 8, 10]
    assert ex.last_batch_stats["staleness/n_tokens"] == 6.0


def test_prepare_batch_keeps_rollouts_in_flight_within_the_staleness_bound(make_executor):
    engine = FakeEngine()
    ex = make_executor(engine, max_staleness=1, batch_size=2, max_concurrent_rollouts=4)
    wf = GatedWorkflow(gated=False)
    data = [[{"id": i}] for i in range(100)]
    first = ex.prepare_batch(data, wf)
    # While the trainer works on batch 0, the next batch is already generated: (1 + 0 + 1) * 2.
    _until(lambda: len(wf.started) == 4)
    for step in range(5):
        batch = first if step == 0 else ex.prepare_batch(data, wf)
        assert len(batch) == 2
        lags = [engine.version - v for g in batch for t in g for v in t.versions]
        assert max(lags) <= 1, lags
        assert ex.last_batch_stats["staleness/max"] <= 1
        assert len(wf.started) <= (1 + engine.version + 1) * 2
        engine.set_version(step + 1)


def test_prepare_batch_at_staleness_zero_trains_only_tokens_of_the_current_version(make_executor):
    # The one training path: max_staleness=0 gives on-policy batches, with rejections refilled.
    engine = FakeEngine()
    ex = make_executor(engine, max_staleness=0, batch_size=3, max_concurrent_rollouts=8)
    wf = GatedWorkflow(gated=False)
    data = [[{"id": i} for i in range(j, j + 2)] for j in range(0, 200, 2)]
    for step in range(4):
        batch = ex.prepare_batch(data, wf, should_accept=lambda g: int(g[0].sample_id) % 3 != 1)
        assert len(batch) == 3
        assert {v for g in batch for t in g for v in t.versions} == {engine.version}
        assert ex.last_batch_stats["staleness/max"] == 0
        started = len(wf.started)
        time.sleep(0.02)  # nothing may start at the old version while the "trainer" works
        assert len(wf.started) == started
        ex.pause()
        engine.set_version(step + 1)
        ex.resume()


def test_prepare_batch_delivers_in_submission_order_whatever_finishes_first(make_executor):
    # The trained sequence must not depend on completion timing (lossless resume compares it).
    ex = make_executor(max_staleness=1, batch_size=2, max_concurrent_rollouts=4)
    wf = GatedWorkflow()
    wf.release(1, 2, 3)  # item 0 is the slow one
    result: list = []
    t = threading.Thread(
        target=lambda: result.append(ex.prepare_batch([[{"id": i}] for i in range(8)], wf))
    )
    t.start()
    _until(lambda: ex.stats()["rollout/buffered"] == 3)
    time.sleep(0.05)
    assert not result, "prepare_batch returned before the oldest rollout finished"
    wf.release(0)
    t.join(timeout=5)
    assert _ids(result[0]) == [0, 1]


def test_a_failed_item_without_an_id_is_shown_short_not_with_all_its_tokens(make_executor):
    # the launcher prints the error as the run's one-line cause: 1,000 token ids made it 640+
    class Exploding(GatedWorkflow):
        async def arun_episode(self, engine, item):
            raise ValueError("reward parser exploded")

    ex = make_executor()
    ex.submit({"question": "2+2", "prompt_ids": list(range(1000))}, Exploding())
    with pytest.raises(RolloutError) as e:
        _until(lambda: ex.stats()["rollout/errors"] == 1)
        ex.wait(1, timeout=5)
    assert len(str(e.value)) < 250 and str(e.value).endswith("reward parser exploded")


def test_workflow_exception_reaches_wait_with_the_item(make_executor):
    ex = make_executor()
    wf = GatedWorkflow(gated=False, fail_on=3)
    ex.submit({"id": 2, "question": "1+1"}, wf)
    ex.submit({"id": 3, "question": "2+2"}, wf)
    with pytest.raises(
        RolloutError,
        match=r"^GatedWorkflow on item #1 \(id 3\) failed: ValueError: reward parser exploded$",
    ) as e:
        _until(lambda: ex.stats()["rollout/errors"] == 1)
        ex.wait(2, timeout=5)
    assert isinstance(e.value.__cause__, ValueError)
    with pytest.raises(RolloutError):  # the run stays stopped
        ex.wait(1, timeout=5)


def test_workflow_returning_a_non_list_is_an_error_naming_the_contract(make_executor):
    class Bad(RolloutWorkflow):
        async def arun_episode(self, engine, item):
            return {"oops": 1}

    ex = make_executor()
    ex.submit({"id": 0}, Bad())
    with pytest.raises(RolloutError, match=r"must return list\[Trajectory\] or None, got dict"):
        ex.wait(1, timeout=5)


def test_watchdog_stops_the_run_when_nothing_completes(make_executor):
    ex = make_executor(watchdog_timeout=0.1)
    wf = GatedWorkflow()  # never released
    ex.submit({"id": 0}, wf)
    t0 = time.monotonic()
    with pytest.raises(
        RolloutWatchdogError, match=r"no rollout completed in .*watchdog_timeout=0.1\)"
    ):
        ex.wait(1, timeout=10)
    assert time.monotonic() - t0 < 5


def test_watchdog_does_not_count_time_spent_paused(make_executor):
    engine = FakeEngine()
    ex = make_executor(engine, watchdog_timeout=0.15)
    wf = GatedWorkflow()
    ex.submit({"id": 0}, wf)
    _until(lambda: len(wf.started) == 1)
    ex.pause()
    assert engine.paused
    time.sleep(0.3)  # twice the watchdog timeout
    assert ex.stats()["rollout/errors"] == 0
    ex.resume()
    wf.release(0)
    assert _ids(ex.wait(1, timeout=5)) == [0]


def test_wait_that_can_never_return_says_so(make_executor):
    ex = make_executor()
    with pytest.raises(RuntimeError, match=r"wait\(1\) can never return"):
        ex.wait(1, timeout=5)


def test_rollout_batch_returns_accepted_groups_in_item_order(make_executor):
    ex = make_executor(max_staleness=0, batch_size=1, max_concurrent_rollouts=3)
    wf = GatedWorkflow(gated=False)
    groups = ex.rollout_batch(
        [{"id": i} for i in range(7)], wf, should_accept=lambda g: g[0].sample_id != "4"
    )
    assert _ids(groups) == [0, 1, 2, 3, 5, 6]  # not bound by staleness; rejected one dropped
    assert ex.staleness.accepted == 0  # evaluation does not use up training capacity


def test_state_dict_roundtrip_loses_no_item(make_executor):
    engine = FakeEngine()
    ex = make_executor(engine, max_staleness=1, batch_size=2)
    wf = GatedWorkflow()
    data = [[{"id": i}] for i in range(100)]
    wf.release(0, 1)
    first = ex.prepare_batch(data, wf)
    wf.release(3)  # 3 finishes; 2 and the rest stay in flight
    _until(lambda: ex.stats()["rollout/buffered"] == 1)
    state = ex.state_dict()
    pulled = state["next_seq"]
    ex.destroy()

    engine2 = FakeEngine()
    engine2.set_version(1)
    ex2 = make_executor(engine2, max_staleness=1, batch_size=2)
    ex2.load_state_dict(state)
    assert ex2.staleness.accepted == 3
    wf2 = GatedWorkflow(gated=False)
    rest = data[pulled:]  # the dataloader resumes where the checkpoint left it
    second = ex2.prepare_batch(rest, wf2)
    third = ex2.prepare_batch(rest, wf2)
    ids = _ids(first) + _ids(second) + _ids(third)
    assert ids[:4] == [0, 1, 2, 3]  # the restored buffer and re-issued items come first
    assert sorted(ids) == list(range(6)) and len(set(ids)) == 6


def test_a_long_wait_for_a_batch_logs_progress_with_the_rejections(make_executor, caplog):
    import logging

    ex = make_executor(max_staleness=0, batch_size=2)
    ex.progress_interval = 0.2
    wf = GatedWorkflow(gated=False)
    data = [[{"id": i} for i in range(j, j + 2)] for j in range(0, 10_000, 2)]
    first: list[float] = []

    def reject_for_a_while(group):  # like dynamic sampling on a model that solves nothing
        first.append(time.monotonic())
        return time.monotonic() - first[0] > 0.6  # then accept: three progress periods passed

    with caplog.at_level(logging.INFO):
        assert len(ex.prepare_batch(data, wf, should_accept=reject_for_a_while)) == 2
    lines = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert (
        lines and "for a batch of 2 groups" in lines[0] and "rejected by should_accept" in lines[0]
    ), lines


def test_resume_at_a_version_tags_new_tokens_with_it_and_admits_from_it(make_executor):
    # The weight publisher's resume(version): the version travels with the call.
    engine = FakeEngine()
    ex = make_executor(engine, max_staleness=0, batch_size=1)
    ex.pause()
    ex.resume(3)
    assert engine.version == 3 and not engine.paused
    batch = ex.prepare_batch([[{"id": i}] for i in range(4)], GatedWorkflow(gated=False))
    assert {v for g in batch for t in g for v in t.versions} == {3}
