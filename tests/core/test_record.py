"""Tier 1: the Core recorder's worker wrappers (:class:`areal.core.record.TimedWorker`,
:class:`~areal.core.record.TimedGenerationWorker`) with a fake worker and a fake clock: call
timing, the release of kept fields held back on recorded steps, and a wrapped generation worker
still offering what the master asks of one."""

from __future__ import annotations

import inspect
from concurrent.futures import Future
from types import SimpleNamespace

from areal.core.generation import GenerationWorker
from areal.core.master import SampleSender, ServerUpdater
from areal.core.record import TimedGenerationWorker, TimedWorker, timed
from areal.core.worker import MFCReply
from areal.runtime.graphs import ACTOR


class _Worker:
    """Answers nothing by itself: the test completes its futures."""

    index = 3

    def __init__(self):
        self.freed: list[tuple[str, int]] = []
        self.futures: list[Future] = []

    def submit(self, request) -> Future:
        self.futures.append(Future())
        return self.futures[-1]

    def load_shards(self, model, token, source, target, ema) -> Future:
        self.futures.append(Future())
        return self.futures[-1]

    def update_servers(self, source, version) -> Future:
        self.futures.append(Future())
        return self.futures[-1]

    def hosts(self, model, fn) -> None:
        return None

    def free(self, items) -> None:
        self.freed += items


def test_calls_are_timed_from_queued_to_answered_with_the_workers_compute_time():
    now = [10.0]
    inner = _Worker()
    w = TimedGenerationWorker(inner, clock=lambda: now[0])
    request = SimpleNamespace(mfc=SimpleNamespace(name="actor_train"))
    mfc = w.submit(request)
    move = w.load_shards("actor@1", "tok", None, None, 0.0)  # a hook: a reallocation's load
    push = w.update_servers("actor", 2)  # a generation worker's server push: a timed hook
    assert w.hosts("actor", "ppo_update") is None  # other calls pass through untimed
    now[0] = 14.0  # answered 4 s after it was queued, 1.5 s of it computing
    mfc.set_result(MFCReply({}, (), 10, compute_time=1.5))
    now[0] = 15.0
    move.set_exception(RuntimeError("lost"))  # no reply: the whole wait counts as running
    push.set_result(None)
    assert w.take_spans() == [
        {"worker": 3, "name": "actor_train", "kind": "mfc", "queued": 10.0, "start": 12.5,
         "end": 14.0},
        {"worker": 3, "name": "load_shards actor@1", "kind": "hook", "queued": 10.0,
         "start": 10.0, "end": 15.0},
        {"worker": 3, "name": "update_servers actor", "kind": "hook", "queued": 10.0,
         "start": 10.0, "end": 15.0},
    ]  # fmt: skip
    assert w.take_spans() == []


def test_kept_fields_wait_for_release_only_while_a_step_is_recorded():
    inner = _Worker()
    w = TimedWorker(inner)
    w.free([("advantages", 1), ("input_ids", 1)])
    assert inner.freed == [("advantages", 1), ("input_ids", 1)]  # not recording: all at once
    inner.freed.clear()
    w.keep = True
    w.free([("advantages", 2), ("logprobs", 2), ("trainer_logp", 2)])
    assert inner.freed == [("logprobs", 2)] and w.held == [("advantages", 2), ("trainer_logp", 2)]
    w.release_held()
    assert inner.freed == [("logprobs", 2), ("advantages", 2), ("trainer_logp", 2)]
    assert w.held == []


def test_a_wrapped_generation_worker_declares_what_the_master_asks_of_it():
    side = SimpleNamespace(executor=SimpleNamespace(worker="rank0"))
    gen = GenerationWorker(2, side, loader=None, publisher=None, source=ACTOR)
    try:
        w = timed(gen)
        assert type(w) is TimedGenerationWorker and type(timed(_Worker())) is TimedWorker
        assert isinstance(w, ServerUpdater) and isinstance(w, SampleSender)
        # declared, not reached through __getattr__: Python 3.12's protocol check reads
        # attributes statically
        for name in ("update_servers", "send"):
            assert inspect.getattr_static(w, name) is not None
        assert side.executor.worker == "worker2"  # its samples name it as the timeline does
    finally:
        gen.close()
