"""Tier 2, real Ray: the master's fetch of a taken group survives its rollout worker's death only
once copied; a group whose worker died first is named as lost (the manager then redoes it)."""

from __future__ import annotations

import time

import torch
from test_ray_worker import ray_driver  # noqa: F401 - fixture

from areal.core.manager import Finished
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
