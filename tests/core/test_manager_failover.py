"""The generation manager survives its death (issue 38).

Tier 1 (no Ray): a manager rebuilt from its failover record (:meth:`GenerationManager.snapshot`)
and its rollout workers' rejoins goes on as the one that died would have: running tickets are
reported once, lost grants and lost groups are re-issued once, the last take is handed out again
for the same step, the loader, the version and the bound go on. The end-to-end run with its
manager SIGKILLed is in ``test_health_timeout.py`` (one launch for three faults).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from areal.core.manager import GenerationManager

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_manager import ListLoader, group  # noqa: E402


def restarted(mgr: GenerationManager, loader_items: int = 100, batch: int = 2) -> GenerationManager:
    """A new manager (a restarted process) rebuilt from ``mgr``'s record."""
    s = mgr.staleness
    new = GenerationManager(
        s.max_staleness, s.consumer_batch_size, s.max_concurrent, ListLoader(loader_items, batch)
    )
    new.restore(mgr.snapshot())
    return new


def test_a_restarted_manager_goes_on_from_its_record():
    B = 2
    mgr = GenerationManager(
        max_staleness=1, batch_groups=B, max_concurrent=10, loader=ListLoader(100, B)
    )
    slots = mgr.acquire(0, 3) + mgr.acquire(1, 1)  # tickets 0-2 on worker 0, 3 on worker 1
    assert [t for t, _ in slots] == [0, 1, 2, 3]
    kept = {t: group(t, w) for t, w in [(0, 0), (1, 0), (3, 1)]}
    for t in (0, 1, 3):
        assert mgr.finish(kept[t].worker, t, kept[t])
    assert [g.ticket for g in mgr.take(B, step=1)] == [0, 1]
    mgr.set_version(1)

    new = restarted(mgr)
    assert new.restarts == 1 and new.version == 1 and new.staleness.running == 1
    assert new.must_rejoin(0) and new.must_rejoin(1)
    assert new.take(B, step=1) is None  # the step-1 groups wait for worker 0's references
    # worker 0 still runs ticket 2 and keeps the groups the master has not confirmed
    assert new.rejoin(0, held=[2], kept=[kept[0], kept[1]]) == 0
    assert [g.ticket for g in new.take(B, step=1)] == [0, 1]  # asked again: the same groups
    assert new.take(B, step=2) is None  # ticket 3 waits for worker 1's rejoin
    assert new.confirmed == 1  # asking for step 2 confirmed step 1
    assert new.rejoin(1, held=[], kept=[kept[3]]) == 0
    assert new.finish(0, 2, group(2, 0))  # the running episode is reported once
    assert [g.ticket for g in new.take(B, step=2)] == [2, 3]
    # the loader and the bound go on: (1 + 1 + 1) * 2 - 4 accepted = 2 more slots, items 4, 5
    assert [(t, i) for t, i in new.acquire(0, 10)] == [(4, 4), (5, 5)]


def test_a_grant_whose_reply_was_lost_is_reissued_once():
    mgr = GenerationManager(max_staleness=0, batch_groups=2, max_concurrent=10,
                            loader=ListLoader(100, 2))  # fmt: skip
    mgr.acquire(0, 2)  # recorded, but worker 0 never got the reply
    new = restarted(mgr)
    assert new.must_rejoin(0)  # the actor answers its asks with "rejoin first"
    assert new.rejoin(0, held=[], kept=[]) == 2 and new.lost == 2
    again = new.acquire(0, 2)
    assert [i for _, i in again] == [0, 1] and [t for t, _ in again] == [2, 3]  # new tickets
    assert new.finish(0, 0, group(0, 0)) is False and new.late == 1  # a stray report is dropped


def test_a_finished_group_lost_with_its_worker_is_redone():
    mgr = GenerationManager(max_staleness=0, batch_groups=2, max_concurrent=10,
                            loader=ListLoader(100, 2))  # fmt: skip
    for t, _ in mgr.acquire(0, 2):
        mgr.finish(0, t, group(t, 0))
    new = restarted(mgr)
    assert new.staleness.accepted == 2
    # worker 0 was restarted too: it keeps nothing; both groups are redone, the bound is freed
    assert new.rejoin(0, held=[], kept=[]) == 2 and new.staleness.accepted == 0
    assert new.take(1) is None
    assert [i for _, i in new.acquire(1, 2)] == [0, 1]


def test_a_take_lost_with_both_the_manager_and_its_worker_stops_with_the_cause():
    mgr = GenerationManager(max_staleness=0, batch_groups=1, max_concurrent=10,
                            loader=ListLoader(100, 1))  # fmt: skip
    ((t, _),) = mgr.acquire(0, 1)
    mgr.finish(0, t, group(t, 0))
    assert len(mgr.take(1, step=1)) == 1
    new = restarted(mgr)
    new.rejoin(0, held=[], kept=[])
    with pytest.raises(RuntimeError, match="groups of step 1 were lost.*rollout worker 0"):
        new.take(1, step=1)


def test_a_paused_manager_restarts_paused_and_a_drained_worker_holds_until_confirmed():
    mgr = GenerationManager(max_staleness=0, batch_groups=1, max_concurrent=10,
                            loader=ListLoader(100, 1))  # fmt: skip
    ((t, _),) = mgr.acquire(0, 1)
    mgr.finish(0, t, group(t, 0))
    mgr.take(1, step=1)
    assert mgr.holds(0) == 1  # the master may still ask for it again
    mgr.pause()
    new = restarted(mgr)
    new.rejoin(0, held=[], kept=[group(t, 0)])
    assert new.acquire(0, 1) == [] and new.refused["paused"] == 1
    new.take(1, step=2)
    assert new.holds(0) == 0 and new.confirmed == 0
