"""Tier 1: the weight publisher owns the update's order, the version and the weight dirs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from areal.runtime.publisher import WeightPublisher


class Recorder:
    """Fake actor, client and executor writing every call to one shared log."""

    def __init__(self, log: list, name: str, version: int = 0):
        self.log, self.name, self.version = log, name, version
        self.config = SimpleNamespace(setup_timeout=5, weight_update_timeout=5)

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.log.append((self.name, "set_version", version))
        self.version = version

    def update_weights(self, meta) -> None:
        self.log.append((self.name, "update_weights", meta.version))
        if self.name == "actor":  # the trainer side writes the HF dir
            Path(meta.path).mkdir(parents=True)

    def pause(self) -> None:
        self.log.append((self.name, "pause"))

    def resume(self, version: int) -> None:
        self.log.append((self.name, "resume", version))


def _publisher(tmp_path, rank: int = 0, start: int = 0):
    log: list = []
    actor, rollout, executor = (
        Recorder(log, "actor", start),
        Recorder(log, "rollout"),
        Recorder(log, "executor"),
    )
    dist_ctx = SimpleNamespace(rank=rank, barrier=lambda: log.append(("all ranks", "barrier")))
    pub = WeightPublisher("disk", actor, rollout, executor, dist_ctx, tmp_path / "weights")
    return pub, log


def test_publish_pauses_pushes_waits_bumps_every_version_then_resumes(tmp_path):
    pub, log = _publisher(tmp_path)
    assert pub.publish() == 1 and pub.version == 1
    assert log == [
        ("executor", "pause"),
        ("actor", "update_weights", 1),
        ("rollout", "update_weights", 1),
        ("all ranks", "barrier"),
        ("actor", "set_version", 1),
        ("executor", "resume", 1),
    ]


def test_only_the_first_rank_talks_to_the_servers(tmp_path):
    pub, log = _publisher(tmp_path, rank=1)
    pub.publish()
    assert ("rollout", "update_weights", 1) not in log and ("actor", "update_weights", 1) in log
    assert ("executor", "resume", 1) in log  # every rank's client tags tokens alike


def test_disk_mode_keeps_the_two_newest_weight_dirs(tmp_path):
    pub, _ = _publisher(tmp_path)
    for _ in range(4):
        pub.publish()
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v3", "v4"]


def test_close_at_the_end_of_the_run_deletes_the_weight_dirs_it_kept(tmp_path):
    pub, _ = _publisher(tmp_path)
    for _ in range(3):
        pub.publish()
    (tmp_path / "weights" / "notes.txt").write_text("not ours")
    pub.close()  # two model copies would otherwise stay in RUN_DIR (or a tmpfs) after the run
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["notes.txt"]


def test_only_the_first_rank_deletes_the_weight_dirs_at_close(tmp_path):
    pub, _ = _publisher(tmp_path, rank=1)
    (tmp_path / "weights" / "v1").mkdir(parents=True)
    pub.close()
    assert (tmp_path / "weights" / "v1").is_dir()


def test_resume_publishes_the_checkpoint_version(tmp_path):
    pub, log = _publisher(tmp_path, start=0)
    assert pub.publish(7) == 7 and pub.publish() == 8
    assert ("actor", "set_version", 7) in log


def test_bad_mode_and_retention_are_refused(tmp_path):
    log: list = []
    parts = [Recorder(log, n) for n in ("actor", "rollout", "executor")]
    with pytest.raises(
        ValueError, match="weight_update_mode must be 'disk', 'distributed' or 'ipc'"
    ):
        WeightPublisher("nfs", *parts, SimpleNamespace(rank=0), tmp_path)
    with pytest.raises(ValueError, match="Recorder cannot take the trainer's shared tensors"):
        WeightPublisher("ipc", *parts, SimpleNamespace(rank=0), tmp_path)  # Core's servers
    with pytest.raises(ValueError, match="keep=0"):
        WeightPublisher("disk", *parts, SimpleNamespace(rank=0), tmp_path, keep=0)


def test_colocated_servers_that_cannot_give_back_memory_are_refused(tmp_path):
    log: list = []
    parts = [Recorder(log, n) for n in ("actor", "rollout", "executor")]
    with pytest.raises(ValueError, match="cluster.colocate: Recorder cannot give back"):
        WeightPublisher("disk", *parts, SimpleNamespace(rank=0), tmp_path, colocated=True)


def test_lite_and_core_classes_declare_the_seams_the_publisher_is_typed_against():
    from areal.api.protocols import (
        Admission,
        Checkpointable,
        Persistent,
        Publisher,
        SharesDevice,
        WeightSource,
        WeightTarget,
    )
    from areal.core.ray_worker import RayModel
    from areal.core.rollout_side import ManagedServers, RayRolloutSide
    from areal.engine.fsdp import FSDPEngine
    from areal.rollout.executor import WorkflowExecutor
    from areal.rollout.remote import RemoteInferenceEngine

    declared = {
        WeightSource: [FSDPEngine, RayModel],
        Persistent: [FSDPEngine, RayModel],
        WeightTarget: [RemoteInferenceEngine, ManagedServers],
        SharesDevice: [RemoteInferenceEngine],
        Admission: [WorkflowExecutor, RayRolloutSide],
        Checkpointable: [WorkflowExecutor, RayRolloutSide],
        Publisher: [WeightPublisher],
    }
    missing = [
        f"{cls.__name__} does not subclass {proto.__name__}"
        for proto, classes in declared.items()
        for cls in classes
        if proto not in cls.__mro__
    ]
    assert not missing
