"""Recover dirs (tier 1): atomic publication, manifests, verification, fallback, retention."""

import json
import logging

import pytest

from areal.utils.recover import (
    CheckpointError,
    Ranks,
    RecoverDir,
    RecoverError,
    load_state,
    resume_pending,
    save_state,
)


def write(rd: RecoverDir, step: int, shard: bytes = b"") -> None:
    """A checkpoint of step ``step``: the rank state plus a 16 KiB 'shard' (like a DCP file)."""
    with rd.writing(step) as d:
        save_state(d, 0, {"step": step})
        (d / "actor").mkdir()
        (d / "actor" / "__0_0.distcp").write_bytes(shard or bytes(range(256)) * 64)


def load(ckpt):
    return load_state(ckpt, 0)


def test_latest_is_none_before_any_checkpoint(tmp_path):
    assert RecoverDir(tmp_path / "recover").latest() is None
    assert RecoverDir(tmp_path / "recover").resume(load) is None


def test_checkpoint_is_published_only_after_the_write_completes(tmp_path):
    rd = RecoverDir(tmp_path / "recover")
    with rd.writing(3) as d:
        save_state(d, 0, {"step": 3, "order": [5, 1]})
        assert rd.latest() is None and rd.checkpoints() == []  # not visible while being written
    assert rd.latest().name == "ckpt-3"
    assert rd.resume(load) == (rd.latest(), {"step": 3, "order": [5, 1]})


def test_manifest_lists_every_file_with_size_and_digest(tmp_path):
    rd = RecoverDir(tmp_path / "recover")
    write(rd, 1)
    manifest = json.loads((rd.latest() / "MANIFEST.json").read_text())
    assert manifest["step"] == 1 and manifest["world_size"] == 1
    assert sorted(manifest["files"]) == ["actor/__0_0.distcp", "state-rank0.pt"]
    assert manifest["files"]["actor/__0_0.distcp"]["size"] == 16384
    assert len(manifest["files"]["actor/__0_0.distcp"]["blake2b"]) == 64  # 256-bit digest, hex
    assert rd.verify(rd.latest()) is None


def test_crash_during_write_leaves_previous_checkpoint_usable(tmp_path):
    rd = RecoverDir(tmp_path / "recover", keep=1)
    write(rd, 1)
    with pytest.raises(KeyboardInterrupt):
        with rd.writing(2) as d:
            save_state(d, 0, {"step": 2})
            raise KeyboardInterrupt  # the process dies mid-write
    assert rd.latest().name == "ckpt-1" and rd.resume(load)[1] == {"step": 1}
    write(rd, 2)  # the next attempt cleans the leftover temp dir
    assert rd.resume(load)[1] == {"step": 2}
    assert not (tmp_path / "recover" / "ckpt-1").exists()  # keep=1 prunes older ones


def test_keep_two_retains_the_two_newest_checkpoints(tmp_path):
    rd = RecoverDir(tmp_path / "recover")  # keep=2 by default (recover.keep)
    for step in (1, 2, 3, 4):
        write(rd, step)
    assert [p.name for p in rd.checkpoints()] == ["ckpt-4", "ckpt-3"]


def test_four_kib_overwritten_in_a_shard_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    rd = RecoverDir(tmp_path / "recover")
    write(rd, 1)
    write(rd, 2)
    shard = rd.latest() / "actor" / "__0_0.distcp"
    with open(shard, "r+b") as f:  # same size, different bytes: only the digest can tell
        f.seek(6000)
        f.write(b"\xff" * 4096)
    with caplog.at_level(logging.WARNING, logger="areal.recover"):
        ckpt, state = rd.resume(load)
    assert ckpt.name == "ckpt-1" and state == {"step": 1}
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "ckpt-2 is corrupt: actor/__0_0.distcp: content does not match" in warning
    assert "trying ckpt-1" in warning


@pytest.mark.parametrize(
    "size, says",
    [(100, "100 bytes, the manifest lists 16384"), (0, "0 bytes, the manifest lists 16384")],
)
def test_truncated_or_emptied_file_is_named_with_its_size(tmp_path, size, says):
    rd = RecoverDir(tmp_path / "recover")
    write(rd, 1)
    shard = rd.latest() / "actor" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:size])
    with pytest.raises(RecoverError) as e:
        rd.resume(load)
    assert f"ckpt-1: actor/__0_0.distcp: {says}" in str(e.value)
    assert str(e.value).startswith(
        f"cannot resume: none of the 1 recover checkpoint(s) in {rd.root} is "
        f"usable; to start the run fresh, delete {rd.root} or set "
        "recover.mode=disabled. Tried: ckpt-1: "
    )


def test_missing_file_is_named(tmp_path):
    rd = RecoverDir(tmp_path / "recover")
    write(rd, 1)
    (rd.latest() / "state-rank0.pt").unlink()
    assert rd.verify(rd.latest()).startswith("state-rank0.pt: missing (the manifest lists ")


def test_emptied_checkpoint_dir_is_diagnosed_as_emptied_not_as_another_world_size(tmp_path):
    rd = RecoverDir(tmp_path / "recover")
    write(rd, 1)
    for p in sorted(rd.latest().rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    with pytest.raises(RecoverError) as e:
        rd.resume(load)
    msg = str(e.value)
    assert "ckpt-1: MANIFEST.json is missing: the dir is empty" in msg, msg
    assert "trainer_nprocs" not in msg and "world size" not in msg
    assert f"delete {rd.root} or set recover.mode=disabled" in msg


def test_checkpoint_latest_names_but_that_is_gone_is_reported_then_the_older_one_used(tmp_path):
    rd = RecoverDir(tmp_path / "recover")
    write(rd, 1)
    write(rd, 2)
    (rd.root / "LATEST").write_text("ckpt-3")  # e.g. removed by hand after being published
    ckpt, state = rd.resume(load)
    assert ckpt.name == "ckpt-2" and state == {"step": 2}


def test_a_load_that_raises_counts_as_corrupt_and_names_the_file(tmp_path, caplog):
    rd = RecoverDir(tmp_path / "recover")
    write(rd, 1)
    write(rd, 2)

    def bad_magic():
        raise ValueError("bad magic")

    def fragile(ckpt):
        if ckpt.name == "ckpt-2":  # e.g. a file the manifest vouches for, of another format
            rd.agreed(bad_magic, f"loading {ckpt}/actor")
        return load(ckpt)

    with caplog.at_level(logging.WARNING, logger="areal.recover"):
        assert rd.resume(fragile)[1] == {"step": 1}
    assert "ckpt-2/actor failed: ValueError: bad magic" in caplog.text


def test_no_usable_checkpoint_names_each_one_tried_and_the_fix(tmp_path):
    rd = RecoverDir(tmp_path / "recover")
    write(rd, 1)
    write(rd, 2)
    for ckpt in rd.checkpoints():
        (ckpt / "state-rank0.pt").write_bytes(b"")
    with pytest.raises(RecoverError) as e:
        rd.resume(load)
    msg = str(e.value)
    assert "ckpt-2: state-rank0.pt: 0 bytes" in msg and "ckpt-1: state-rank0.pt: 0 bytes" in msg
    assert "recover.mode=disabled" in msg


def test_checkpoint_of_another_world_size_is_refused_naming_trainer_nprocs(tmp_path):
    gather2 = lambda obj: [obj, obj]  # noqa: E731 - two ranks that agree on everything
    rd2 = RecoverDir(tmp_path / "recover", Ranks(0, 2, gather2))
    write(rd2, 1)
    with pytest.raises(
        RecoverError,
        match="written by 2 trainer ranks, this run has 1: resume with cluster.trainer_nprocs=2",
    ):
        RecoverDir(tmp_path / "recover").resume(load)


def test_ranks_agree_a_failure_on_one_rank_fails_all(tmp_path):
    # rank 0's view of a two-rank job in which rank 1's load raised
    rd = RecoverDir(tmp_path / "recover", Ranks(0, 2, lambda obj: [obj, "OSError: disk gone"]))
    with pytest.raises(CheckpointError, match="loading x failed: rank 1: OSError: disk gone"):
        rd.agreed(lambda: 1, "loading x")


def test_unreadable_state_file_error_names_the_file(tmp_path):
    rd = RecoverDir(tmp_path / "recover")
    write(rd, 1)
    path = rd.latest() / "state-rank0.pt"
    path.write_bytes(path.read_bytes()[:50])  # what torch.load says names no file
    with pytest.raises(CheckpointError, match=f"{path} is unreadable"):
        load_state(rd.latest(), 0)


def test_missing_rank_state_names_the_fix(tmp_path):
    rd = RecoverDir(tmp_path / "recover")
    with rd.writing(1) as d:
        save_state(d, 0, {})
    with pytest.raises(RuntimeError, match="same cluster.trainer_nprocs"):
        load_state(rd.latest(), 1)


def test_resume_is_pending_only_with_a_checkpoint_and_recover_enabled(tmp_path):
    root = tmp_path / "recover"
    assert not resume_pending(root, "auto")
    write(RecoverDir(root), 1)
    assert resume_pending(root, "auto") and resume_pending(root, "resume")
    assert not resume_pending(root, "disabled")
