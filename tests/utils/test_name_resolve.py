"""Tier 1/2: the file name registry: keys, subtrees, waits, sharing between processes."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest

from areal.utils.name_resolve import (
    FileNameRepository,
    NameEntryExistsError,
    NameEntryNotFoundError,
    gen_servers_key,
    make_repository,
    trial_key,
)


@pytest.fixture
def repo(tmp_path):
    return FileNameRepository(tmp_path / "registry")


def test_add_get_delete_roundtrip(repo):
    repo.add("exp/trial/a", "1")
    assert repo.get("/exp/trial/a/") == "1"  # surrounding slashes do not matter
    with pytest.raises(NameEntryExistsError, match="replace=True|already set"):
        repo.add("exp/trial/a", "2")
    repo.add("exp/trial/a", "2", replace=True)
    assert repo.get("exp/trial/a") == "2"
    repo.delete("exp/trial/a")
    with pytest.raises(NameEntryNotFoundError):
        repo.get("exp/trial/a")
    with pytest.raises(NameEntryNotFoundError):
        repo.delete("exp/trial/a")


def test_subtree_lists_only_keys_under_the_prefix(repo):
    key = gen_servers_key("exp", "t0")
    k1 = repo.add_subentry(key, "127.0.0.1:1000")
    k2 = repo.add_subentry(key, "127.0.0.1:1001")
    repo.add("exp/t0/gen_servers_other", "x")  # shares a string prefix, not a path prefix
    repo.add("exp/t1/gen_servers/z", "y")
    assert repo.find_subtree(key) == sorted([k1, k2])
    assert sorted(repo.get_subtree(key)) == ["127.0.0.1:1000", "127.0.0.1:1001"]
    repo.clear_subtree(key)
    assert repo.find_subtree(key) == []
    assert repo.get("exp/t0/gen_servers_other") == "x"


def test_wait_returns_a_value_set_later_and_times_out_otherwise(repo):
    timer = threading.Timer(0.05, lambda: repo.add("k/late", "v"))
    timer.start()
    assert repo.wait("k/late", timeout=5, poll_interval=0.01) == "v"
    with pytest.raises(TimeoutError, match="'k/never' was not set within 0.05 s"):
        repo.wait("k/never", timeout=0.05, poll_interval=0.01)


def test_wait_subtree_returns_once_enough_entries_are_registered(repo):
    key = gen_servers_key("exp", "t0")
    repo.add_subentry(key, "h:1")
    timer = threading.Timer(0.05, lambda: repo.add_subentry(key, "h:2"))
    timer.start()
    assert sorted(repo.wait_subtree(key, 2, timeout=5, poll_interval=0.01)) == ["h:1", "h:2"]
    with pytest.raises(TimeoutError, match=r"'exp/t0/gen_servers' holds 2 of 3 entries after 0.05 s"):
        repo.wait_subtree(key, 3, timeout=0.05, poll_interval=0.01)


def test_clearing_a_trial_leaves_other_trials_alone(repo):
    repo.add_subentry(gen_servers_key("exp", "t0"), "h:1")
    repo.add_subentry(gen_servers_key("exp", "t1"), "h:2")
    repo.clear_subtree(trial_key("exp", "t0"))
    assert repo.get_subtree(gen_servers_key("exp", "t0")) == []
    assert repo.get_subtree(gen_servers_key("exp", "t1")) == ["h:2"]


def test_bad_keys_are_refused(repo):
    with pytest.raises(ValueError, match="no '.' or '..'"):
        repo.add("a/../b", "x")
    with pytest.raises(ValueError):
        repo.get("/")


def _publish(root: str, value: str) -> None:
    FileNameRepository(root).add_subentry("e/t/gen_servers", value)


def test_file_backend_is_shared_between_processes(tmp_path):
    root = str(tmp_path / "nfs")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_publish, args=(root, f"h:{i}")) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(FileNameRepository(root).get_subtree("e/t/gen_servers")) == ["h:0", "h:1"]


def test_make_repository_follows_the_config(tmp_path):
    repo = make_repository("file", str(tmp_path))
    assert isinstance(repo, FileNameRepository) and repo.root == tmp_path
    with pytest.raises(ValueError, match="must be 'file', got 'etcd3'"):
        make_repository("etcd3", str(tmp_path))
