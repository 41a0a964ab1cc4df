"""Tier 2: the name registry. One suite runs against every backend (memory, file, etcd, ray):
keys, subtrees, waits with deadlines, races between threads and between processes; etcd also
drops the entries of an owner killed with SIGKILL once its lease runs out.

etcd and Ray run as real daemons on free loopback ports (``tests/daemons.py``), each started
once per session and stopped by pid; when one cannot start, its tests skip with the reason."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

import pytest

from areal.api.config import ClusterConfig, ConfigError, NameResolveConfig, load_config
from areal.utils.name_resolve import (
    FileNameRepository,
    MemoryNameRepository,
    NameEntryExistsError,
    NameEntryNotFoundError,
    RegistryUnavailableError,
    gen_servers_key,
    make_repository,
    trial_key,
)
from areal.utils.network import free_port
from tests.daemons import DaemonUnavailable, start_etcd, start_ray_head

ETCD_TTL = 2  # seconds: etcd's smallest lease, so expiry tests stay short


@pytest.fixture(scope="module")
def etcd_address():
    try:
        daemon = start_etcd()
    except DaemonUnavailable as e:
        pytest.skip(f"etcd backend: {e}")
    yield daemon.address
    daemon.stop()


@pytest.fixture(scope="module")
def ray_address():
    try:
        daemon = start_ray_head()
    except DaemonUnavailable as e:
        pytest.skip(f"ray backend: {e}")
    import ray

    if ray.is_initialized():  # a connection an earlier test left: the registry would use it
        ray.shutdown()
    yield daemon.address
    ray.shutdown()  # the first RayNameRepository of this process connected it
    daemon.stop(grace=2.0)  # a Ray head drains for 30 s after SIGTERM; no need here


def _config(backend: str, request: pytest.FixtureRequest) -> NameResolveConfig:
    if backend == "etcd":
        return NameResolveConfig(
            type="etcd", etcd_address=request.getfixturevalue("etcd_address"), ttl=ETCD_TTL
        )
    if backend == "ray":
        return NameResolveConfig(type="ray", ray_address=request.getfixturevalue("ray_address"))
    return NameResolveConfig(type=backend)


@pytest.fixture(params=["memory", "file", "etcd", "ray"])
def config(request) -> NameResolveConfig:
    return _config(request.param, request)


@pytest.fixture(params=["file", "etcd", "ray"])
def shared_config(request) -> NameResolveConfig:
    """The backends several processes share (memory lives in one process by design)."""
    return _config(request.param, request)


@pytest.fixture
def root(tmp_path) -> str:
    """The file registry's directory and the etcd/Ray namespace: fresh per test."""
    return str(tmp_path / "registry-ü")  # non-ASCII: etcd keys are bytes, Ray names text


@pytest.fixture
def repo(config, root):
    with make_repository(config, root) as registry:
        yield registry


def test_add_get_replace_delete_roundtrip(repo):
    repo.add("exp/trial/a", "1")
    assert repo.get("/exp/trial/a/") == "1"  # surrounding slashes do not matter
    with pytest.raises(NameEntryExistsError, match="'exp/trial/a' is already set.*replace=True"):
        repo.add("exp/trial/a", "2")
    repo.add("exp/trial/a", "hôst:2 ✓", replace=True)
    assert repo.get("exp/trial/a") == "hôst:2 ✓"  # any text round-trips (etcd stores bytes)
    repo.delete("exp/trial/a")
    with pytest.raises(NameEntryNotFoundError, match="'exp/trial/a' is not set"):
        repo.get("exp/trial/a")
    with pytest.raises(NameEntryNotFoundError):
        repo.delete("exp/trial/a")


def test_subtree_lists_only_keys_under_the_prefix(repo):
    key = gen_servers_key("exp", "t0")
    k1 = repo.add_subentry(key, "127.0.0.1:1000")
    k2 = repo.add_subentry(key, "127.0.0.1:1001")
    repo.add(key, "the prefix itself")
    repo.add("exp/t0/gen_servers_other", "x")  # shares a string prefix, not a path prefix
    repo.add("exp/t0/gen_servers-x", "x")  # sorts between the prefix and the prefix + "/"
    repo.add("exp/t1/gen_servers/z", "y")
    assert repo.find_subtree(key) == sorted([key, k1, k2])
    assert sorted(repo.get_subtree(key)) == [
        "127.0.0.1:1000",
        "127.0.0.1:1001",
        "the prefix itself",
    ]
    repo.clear_subtree(key)
    assert repo.find_subtree(key) == []
    assert repo.get("exp/t0/gen_servers_other") == "x" and repo.get("exp/t0/gen_servers-x") == "x"


def test_wait_returns_a_value_set_later_and_times_out_naming_the_key(repo):
    timer = threading.Timer(0.05, lambda: repo.add("k/late", "v"))
    timer.start()
    assert repo.wait("k/late", timeout=10, poll_interval=0.01) == "v"
    with pytest.raises(TimeoutError, match="'k/never' was not set within 0.05 s"):
        repo.wait("k/never", timeout=0.05, poll_interval=0.01)


def test_wait_subtree_returns_once_enough_entries_are_registered(repo):
    key = gen_servers_key("exp", "t0")
    repo.add_subentry(key, "h:1")
    timer = threading.Timer(0.05, lambda: repo.add_subentry(key, "h:2"))
    timer.start()
    assert sorted(repo.wait_subtree(key, 2, timeout=10, poll_interval=0.01)) == ["h:1", "h:2"]
    with pytest.raises(
        TimeoutError, match=r"'exp/t0/gen_servers' holds 2 of 3 entries after 0.05 s"
    ):
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


def test_subentries_added_from_many_threads_are_all_kept(repo):
    key = gen_servers_key("exp", "t0")
    added: list[str] = []

    def publish(thread: int) -> None:
        for i in range(10):
            added.append(repo.add_subentry(key, f"h{thread}:{i}"))

    threads = [threading.Thread(target=publish, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(set(added)) == 40 and repo.find_subtree(key) == sorted(added)
    assert sorted(repo.get_subtree(key)) == sorted(f"h{t}:{i}" for t in range(4) for i in range(10))


def test_exactly_one_of_racing_adds_of_one_key_wins(repo):
    start, winners, losers = threading.Barrier(8, timeout=30), [], []

    def claim(i: int) -> None:
        start.wait()
        try:
            repo.add("race/leader", str(i))
            winners.append(i)
        except NameEntryExistsError:
            losers.append(i)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(winners) == 1 and len(losers) == 7
    assert repo.get("race/leader") == str(winners[0])


# A process that registers `value` under `key`, says so, and keeps its registry (and, on
# etcd, its lease) until the parent closes its stdin; then it closes the registry and exits.
OWNER = """
import json, sys
from areal.api.config import NameResolveConfig
from areal.utils.name_resolve import make_repository
config, root, key, value = NameResolveConfig(**json.loads(sys.argv[1])), *sys.argv[2:]
with make_repository(config, root) as registry:
    print(registry.add_subentry(key, value), flush=True)
    sys.stdin.read()
"""


def _start_owner(config: NameResolveConfig, root: str, key: str, value: str, timeout: float = 60.0):
    """The owner process and the key it registered (within ``timeout`` seconds)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER, json.dumps(dataclasses.asdict(config)), root, key, value],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline().strip() if ready else ""
    if not line:
        proc.kill()
        raise AssertionError(
            f"owner did not register within {timeout} s: {proc.communicate(timeout=30)[1]}"
        )
    return proc, line


def test_entries_are_shared_between_processes(shared_config, root):
    key = gen_servers_key("e", "t")
    owners = [_start_owner(shared_config, root, key, f"h:{i}") for i in range(2)]
    with make_repository(shared_config, root) as registry:
        assert sorted(registry.wait_subtree(key, 2, timeout=30)) == ["h:0", "h:1"]
        assert registry.find_subtree(key) == sorted(name for _, name in owners)
        for proc, _ in owners:
            proc.communicate(input="", timeout=60)  # the owner closes its registry and exits
            assert proc.returncode == 0
        # etcd: closing revoked each owner's lease, so its entries went with it; the file and
        # Ray registries keep entries until someone deletes them
        expected = [] if shared_config.type == "etcd" else ["h:0", "h:1"]
        assert sorted(registry.get_subtree(key)) == expected


def test_etcd_entries_of_a_killed_owner_vanish_within_the_ttl(etcd_address, root):
    config = NameResolveConfig(type="etcd", etcd_address=etcd_address, ttl=ETCD_TTL)
    key = gen_servers_key("e", "t")
    proc, name = _start_owner(config, root, key, "h:0")
    with make_repository(config, root) as registry:
        time.sleep(ETCD_TTL + 1.5)  # longer than the lease: the owner's thread keeps it alive
        assert registry.get(name) == "h:0"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        killed = time.monotonic()
        while registry.find_subtree(key) and time.monotonic() - killed < ETCD_TTL + 5:
            time.sleep(0.05)
        gone_after = time.monotonic() - killed  # seconds
        assert registry.find_subtree(key) == []
        assert gone_after <= ETCD_TTL + 2  # the last refresh was <= ttl/3 s ago; etcd revokes
        # expired leases every 0.5 s; 1 s more for a busy machine


def test_unreachable_etcd_is_an_error_naming_the_address_and_the_field(root):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    config = NameResolveConfig(type="etcd", etcd_address=address, timeout=5)
    with pytest.raises(
        RegistryUnavailableError, match=f"etcd at {address} \\(cluster.name_resolve.etcd_address\\)"
    ):
        make_repository(config, root)


def test_make_repository_follows_the_config(tmp_path):
    repo = make_repository(NameResolveConfig(type="file"), str(tmp_path))
    assert isinstance(repo, FileNameRepository) and repo.root == tmp_path
    assert isinstance(make_repository(NameResolveConfig(type="memory"), ""), MemoryNameRepository)
    with pytest.raises(
        ConfigError, match=r"name_resolve.etcd_address must be host:port .* got 'localhost'"
    ):
        load_config(
            ClusterConfig, ["name_resolve.type=etcd", "name_resolve.etcd_address=localhost"]
        )
    with pytest.raises(ConfigError, match=r"name_resolve.ttl"):
        load_config(ClusterConfig, ["name_resolve.ttl=1"])
