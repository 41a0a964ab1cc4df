"""Tier 2, real Ray: the master's fetch of a taken group survives its rollout worker's death only
once copied; a group whose worker died first is named as lost (the manager then redoes it). A call
to a rollout actor (:class:`RestartingActor`) is made again while Ray restarts the actor, and past
its deadline, or to a hung actor, fails naming it."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch
from test_ray_worker import ray_driver  # noqa: F401 - fixture

from areal.core.manager import Finished
from areal.core.rollout_calls import RestartingActor
from areal.core.rollout_side import fetch_groups
from areal.utils.batch import PackedBatch


def test_a_group_whose_worker_died_before_the_fetch_is_lost_and_the_others_arrive(ray_driver):
    ray = ray_driver

    class GroupMaker:  # defined here: Ray ships it by value (a test module is not importable)
        """A rollout worker's part: put a packed group in the object store (this actor owns it)."""

        def __init__(self, index: int):
            self.index = index

        def make(self, ticket: int) -> Finished:
            import ray

            lens = torch.tensor([3, 2])
            ids = torch.arange(5) + 10 * ticket
            packed = PackedBatch(torch.tensor([0, 3, 5]), {"input_ids": ids}, {"seqlens": lens})
            return Finished(ticket, self.index, [ray.put(packed)], (3, 2), f"g{ticket}", (0, 0))

    makers = [ray.remote(GroupMaker).remote(i) for i in range(2)]
    groups = ray.get([makers[0].make.remote(0), makers[1].make.remote(1)])
    ray.kill(makers[0], no_restart=True)
    deadline = time.monotonic() + 30  # the owner's death reaches this driver asynchronously
    while True:
        data, dead = fetch_groups(groups, lambda ref, who: ray.get(ref, timeout=30))
        if dead or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert dead == {0}
    assert len(data) == 1 and data[0].trajectories is None
    assert data[0].packed.tokens["input_ids"].tolist() == [10, 11, 12, 13, 14]


def counter_class():
    class Counter:  # defined in a function: Ray ships it by value
        """An actor whose state a restart loses."""

        def __init__(self):
            self.n = 0

        def pid(self) -> int:
            return os.getpid()

        def add(self, k: int) -> int:
            self.n += k
            return self.n

        def sleep(self, seconds: float) -> None:
            time.sleep(seconds)

    return Counter


def test_a_call_lost_to_a_restart_is_made_again_and_answered_by_the_new_process(ray_driver):
    Counter = counter_class()
    handle = ray_driver.remote(Counter).options(max_restarts=2).remote()
    calls = RestartingActor[Counter](handle, "the counter", 60.0, 30.0, "the test's deadline")
    first = calls.call(Counter.pid)
    assert calls.call(Counter.add, 2) == 2
    os.kill(first, signal.SIGKILL)
    assert calls.call(Counter.add, 3) == 3  # 0 + 3: a new process answered
    second = calls.call(Counter.pid)
    assert second != first
    os.kill(second, signal.SIGKILL)  # the event-loop call waits for the restart too
    assert asyncio.run(calls.acall(Counter.add, k=5)) == 5
    ray_driver.kill(handle, no_restart=True)


def test_an_actor_dead_for_good_or_hung_fails_naming_it_and_the_deadline(ray_driver):
    Counter = counter_class()
    handle = ray_driver.remote(Counter).options(max_restarts=0).remote()
    calls = RestartingActor[Counter](handle, "the counter", 1.0, 30.0, "the test's deadline")
    with pytest.raises(TimeoutError, match=r"the counter \(sleep\) did not answer within 1 s"):
        calls.within(1.0).call(Counter.sleep, 60.0)
    with pytest.raises(TimeoutError, match=r"the counter \(sleep\) did not answer within 1 s"):
        asyncio.run(calls.within(1.0).acall(Counter.sleep, 60.0))
    ray_driver.kill(handle, no_restart=True)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the counter died and was not back within 1 s \(the"):
        calls.call(Counter.add, 1)
    with pytest.raises(RuntimeError, match=r"the counter died and was not back within 1 s \(the"):
        asyncio.run(calls.acall(Counter.add, 1))
    with pytest.raises(RuntimeError, match=r"the counter died and was not back within 0 s"):
        calls.within(30.0, restart_s=0.0).call(Counter.add, 1)  # no wait for a restart
    assert time.monotonic() - start < 10  # each gave up after its deadline (1 s, 1 s, 0 s)
