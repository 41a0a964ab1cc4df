"""Tier 1: StalenessManager admission arithmetic (no clock, no network)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal.rollout.staleness import StalenessManager


def _start(sm: StalenessManager, n: int) -> None:
    for _ in range(n):
        sm.on_start()


def test_capacity_per_version_is_staleness_plus_one_batches():
    # s=1, B=4, v=0: (1 + 0 + 1) * 4 = 8 rollouts may be accepted-or-running.
    sm = StalenessManager(max_staleness=1, consumer_batch_size=4, max_concurrent=100)
    assert sm.capacity(version=0) == 8
    _start(sm, 5)
    assert sm.capacity(version=0) == 3  # 8 - 5 running
    for _ in range(5):
        sm.on_finish(accepted=True)
    assert sm.capacity(version=0) == 3  # 8 - 5 accepted: finishing frees nothing
    # v=1: (1 + 1 + 1) * 4 = 12 -> 12 - 5 = 7
    assert sm.capacity(version=1) == 7


def test_synchronous_mode_admits_exactly_one_batch_per_version():
    # s=0, B=3: version v allows (v + 1) * 3 in total.
    sm = StalenessManager(max_staleness=0, consumer_batch_size=3, max_concurrent=100)
    assert sm.capacity(0) == 3
    _start(sm, 3)
    assert sm.capacity(0) == 0
    for _ in range(3):
        sm.on_finish(accepted=True)
    assert sm.capacity(0) == 0  # the batch is done but the trainer has not moved on
    assert sm.capacity(1) == 3


def test_concurrency_cap_limits_even_when_staleness_allows_more():
    sm = StalenessManager(max_staleness=4, consumer_batch_size=8, max_concurrent=3)
    assert sm.capacity(0) == 3  # staleness alone would allow 40
    _start(sm, 3)
    assert sm.capacity(0) == 0
    sm.on_finish(accepted=True)
    assert sm.capacity(0) == 1


def test_exempt_rollouts_count_against_concurrency_but_not_staleness():
    sm = StalenessManager(max_staleness=0, consumer_batch_size=2, max_concurrent=3)
    sm.on_start(exempt=True)
    sm.on_start(exempt=True)
    assert sm.capacity(0) == 1  # min(3 - 2 concurrency, 2 staleness)
    sm.on_finish(accepted=True, exempt=True)
    sm.on_finish(accepted=True, exempt=True)
    assert sm.accepted == 0 and sm.capacity(0) == 2


def test_rejection_reopens_capacity_for_a_replacement():
    sm = StalenessManager(max_staleness=0, consumer_batch_size=2, max_concurrent=10)
    _start(sm, 2)
    assert sm.capacity(0) == 0
    sm.on_finish(accepted=False)  # filtered out (e.g. all rewards identical)
    assert sm.capacity(0) == 1 and sm.rejected == 1
    sm.on_finish(accepted=True)
    assert sm.capacity(0) == 1  # one accepted, one slot left in the batch


def test_resume_restores_accepted_so_the_version_jump_admits_no_burst():
    # Before the crash: s=1, B=4; 3 batches (12 rollouts) consumed, trainer at version 3,
    # 6 more accepted and buffered -> accepted = 18.
    before = StalenessManager(max_staleness=1, consumer_batch_size=4, max_concurrent=100)
    _start(before, 18)
    for _ in range(18):
        before.on_finish(accepted=True)
    assert before.capacity(3) == 2  # (1 + 3 + 1) * 4 - 18
    state = before.state_dict()

    after = StalenessManager(max_staleness=1, consumer_batch_size=4, max_concurrent=100)
    assert after.capacity(3) == 20  # the AReaL#1388 bug: a fresh counter admits a burst
    after.load_state_dict(state)
    assert after.capacity(3) == 2


def test_fast_forward_counts_consumed_batches_when_no_state_was_saved():
    sm = StalenessManager(max_staleness=2, consumer_batch_size=4, max_concurrent=100)
    sm.fast_forward(version=10)  # 10 batches of 4 consumed before the restart
    assert sm.accepted == 40
    assert sm.capacity(10) == 12  # (2 + 10 + 1) * 4 - 40: exactly s + 1 batches ahead
    sm.fast_forward(version=3)  # never lowers the count
    assert sm.accepted == 40


def test_load_state_dict_refuses_a_different_batch_size():
    sm = StalenessManager(max_staleness=1, consumer_batch_size=4, max_concurrent=10)
    other = StalenessManager(max_staleness=1, consumer_batch_size=8, max_concurrent=10)
    with pytest.raises(ValueError, match="checkpoint was saved with 4"):
        other.load_state_dict(sm.state_dict())


def test_refusal_cause_names_the_bound_when_it_leaves_no_more_room_than_the_cap():
    # s=1, B=4, cap=5, v=0: the bound's room is (1 + 0 + 1) * 4 - (accepted + running) = 8 - ...
    sm = StalenessManager(max_staleness=1, consumer_batch_size=4, max_concurrent=5)
    _start(sm, 5)  # the bound's room 8 - 5 = 3, the cap's 5 - 5 = 0: max_concurrent refuses
    assert sm.capacity(0) == 0 and sm.refusal_cause(0) == "capacity"
    for _ in range(3):
        sm.on_finish(accepted=True)  # the bound's room 8 - (3 + 2) = 3, the cap's 5 - 2 = 3
    assert sm.capacity(0) == 3 and sm.refusal_cause(0) == "staleness"  # a tie is the bound's
    _start(sm, 3)  # the bound's room 8 - (3 + 5) = 0, the cap's 0
    assert sm.capacity(0) == 0 and sm.refusal_cause(0) == "staleness"
    # v=1: the bound's room (1 + 1 + 1) * 4 - 8 = 4 > the cap's 0
    assert sm.capacity(1) == 0 and sm.refusal_cause(1) == "capacity"


def test_an_undelivered_rollout_stops_counting_so_its_redo_is_admitted():
    # s=0, B=2: one batch of room at v=0; both accepted, then one group's data is lost.
    sm = StalenessManager(max_staleness=0, consumer_batch_size=2, max_concurrent=10)
    _start(sm, 2)
    sm.on_finish(accepted=True)
    sm.on_finish(accepted=True)
    assert sm.capacity(0) == 0  # 2 - 2 accepted
    sm.undeliver()
    assert sm.accepted == 1 and sm.capacity(0) == 1  # 2 - 1: the redo may start
    assert sm.rejected == 0  # it was not filtered out


def test_a_checkpoint_leaves_out_undelivered_rollouts_and_a_restart_keeps_its_running_ones():
    # s=1, B=4: 6 accepted of which 2 wait undelivered, 3 running.
    sm = StalenessManager(max_staleness=1, consumer_batch_size=4, max_concurrent=100)
    _start(sm, 9)
    for _ in range(6):
        sm.on_finish(accepted=True)
    state = sm.state_dict(undelivered=2)
    assert state["accepted"] == 4 and sm.accepted == 6  # the counter itself is untouched
    # a recover checkpoint: the 2 undelivered and the 3 running are re-issued, not counted
    resumed = StalenessManager(max_staleness=1, consumer_batch_size=4, max_concurrent=100)
    resumed.load_state_dict(state)
    assert resumed.capacity(0) == 4  # (1 + 0 + 1) * 4 - 4
    # a restarted process whose 3 running rollouts report to it: they count as running
    restarted = StalenessManager(max_staleness=1, consumer_batch_size=4, max_concurrent=100)
    restarted.load_state_dict(sm.state_dict(), running=3)
    # v=1: (1 + 1 + 1) * 4 - (6 accepted + 3 running) = 3, as in the process that died
    assert restarted.running == 3 and restarted.capacity(1) == sm.capacity(1) == 3
    restarted.on_finish(accepted=True)  # a running one reports to the new process
    assert restarted.accepted == 7 and restarted.running == 2


def test_negative_staleness_is_rejected_with_the_fix():
    with pytest.raises(ValueError, match="use 0 for synchronous"):
        StalenessManager(max_staleness=-1, consumer_batch_size=1, max_concurrent=1)


@settings(max_examples=200, deadline=None)
@given(
    s=st.integers(0, 3),
    b=st.integers(1, 4),
    cap=st.integers(1, 6),
    ops=st.lists(st.sampled_from(["start", "accept", "reject", "consume"]), max_size=80),
)
def test_no_accepted_rollout_is_trained_more_than_s_versions_late(s, b, cap, ops):
    """Simulate a trainer consuming batches oldest first; check every trained staleness <= s."""
    sm = StalenessManager(max_staleness=s, consumer_batch_size=b, max_concurrent=cap)
    version = 0
    running: list[int] = []  # start versions, oldest first
    done: list[int] = []  # accepted, undelivered start versions, in completion order
    for op in ops:
        if op == "start" and sm.capacity(version) > 0:
            sm.on_start()
            running.append(version)
        elif op in ("accept", "reject") and running:
            v0 = running.pop(0)
            sm.on_finish(accepted=op == "accept")
            if op == "accept":
                done.append(v0)
        elif op == "consume" and len(done) >= b:
            batch, done = done[:b], done[b:]
            assert all(version - v0 <= s for v0 in batch), (version, batch)
            version += 1
        assert sm.running <= cap
