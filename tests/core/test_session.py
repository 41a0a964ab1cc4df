"""Tier 1: Core's session helpers that need no workers: the actor's version as a recover
checkpoint keeps it (the master's count), and async PPO's manager entry restoring it."""

from __future__ import annotations

import pytest

from areal.core.session import ActorWeights, ManagerCheckpoint
from areal.runtime.graphs import ACTOR


class FakeMaster:
    def __init__(self, version: int):
        self.versions = {ACTOR: version}

    def set_version(self, model, version: int) -> None:
        self.versions[model] = version


class FakePublisher:
    def __init__(self, log: list):
        self.log = log

    def publish(self, version: int) -> int:
        self.log.append(("publish", version))
        return version


class FakeRollout:
    def __init__(self, log: list, state: dict):
        self.log, self.state = log, state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.log.append(("manager", "load", state["version"]))


def test_actor_weights_record_the_masters_count_and_a_resume_sets_it_before_publishing():
    log: list = []
    master = FakeMaster(4)
    weights = ActorWeights(master, FakePublisher(log))
    assert weights.version == 4  # what Run.checkpoint records as "version"
    assert weights.publish(9) == 9
    assert master.versions[ACTOR] == 9 and log == [("publish", 9)]


def test_manager_checkpoint_restores_the_manager_then_the_actor_at_its_version():
    log: list = []
    master = FakeMaster(0)
    entry = ManagerCheckpoint(
        FakeRollout(log, {"version": 3}), ActorWeights(master, FakePublisher(log))
    )
    assert entry.state_dict() == {"version": 3}
    entry.load_state_dict({"version": 5, "items": []})
    assert log == [("manager", "load", 5), ("publish", 5)] and master.versions[ACTOR] == 5
    with pytest.raises(TypeError, match="holds version '5', not an int"):
        entry.load_state_dict({"version": "5"})
