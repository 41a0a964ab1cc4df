"""ServerPool: group-sticky routing, failover exclusion, death after the failure threshold,
revival and retirement (tier 1: no servers, no I/O)."""

from __future__ import annotations

import pytest

from areal.api.config.rollout import InferenceEngineConfig
from areal.rollout.routing import AllServersDeadError, Server, ServerPool


def _pool(policy: str = "least_requests", threshold: int = 3) -> ServerPool:
    cfg = InferenceEngineConfig(schedule_policy=policy, server_failure_threshold=threshold)
    pool = ServerPool(cfg, "nothing restarts them")
    pool.servers = [Server("a:1"), Server("b:1")]
    return pool


def test_group_samples_stick_to_one_server_and_failover_moves_the_group():
    pool = _pool()
    pool.servers[0].outstanding = 3
    first = pool.choose("g1", set())
    assert first.address == "b:1"  # fewest outstanding requests
    first.outstanding = 10
    assert pool.choose("g1", set()) is first  # sticky despite the load
    assert pool.choose("g2", set()).address == "a:1"
    assert pool.choose("g1", {"b:1"}).address == "a:1"  # failover re-pins the group
    assert pool.choose("g1", set()).address == "a:1"
    pool.servers[0].alive = pool.servers[1].alive = False
    with pytest.raises(AllServersDeadError, match="all 2 generation servers are dead"):
        pool.choose("g3", set())


def test_round_robin_alternates_requests_without_a_group():
    pool = _pool("round_robin")
    assert [pool.choose(None, set()).address for _ in range(4)] == ["a:1", "b:1"] * 2


def test_a_server_dies_at_the_failure_threshold_and_the_error_names_each_cause():
    pool = _pool(threshold=2)
    a, b = pool.servers
    pool.mark_failure(a, "HTTP 502")
    assert a.alive and a.failures == 1  # one failure is not enough
    pool.mark_failure(a, "connection refused")
    assert not a.alive and a.last_error == "connection refused"
    assert pool.choose("g", set()) is b  # the only one left
    pool.mark_failure(b, "pause: timeout", fatal=True)  # a failed control call: dead at once
    with pytest.raises(AllServersDeadError) as e:
        pool.alive()
    assert "a:1: connection refused; b:1: pause: timeout" in str(e.value)
    assert "are not restarted (nothing restarts them)" in str(e.value)


def test_revived_server_serves_again_and_restarts_are_counted():
    pool = _pool()
    a, _ = pool.servers
    pool.mark_failure(a, "gone", fatal=True)
    pool.revive(a, restarted=True)
    assert (a.alive, a.failures, a.revivals, pool.n_revived) == (True, 0, 1, 1)


def test_replace_revives_listed_servers_adds_new_ones_and_drops_groups_of_retired_ones():
    pool = _pool()
    a, b = pool.servers
    pool.choose("g1", {"b:1"})  # g1 pinned to a
    a.alive = False
    c = Server("c:1")
    pool.replace(["a:1", "c:1"], {"c:1": c})  # a listed again, b retired, c new
    assert pool.servers == [a, c] and a.alive and a.revivals == 0 and pool.n_revived == 1
    pool.replace(["c:1"], {})
    assert pool.choose("g1", set()) is c  # the group left the retired server
