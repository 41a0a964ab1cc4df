"""Tier 1: the generation manager's admission, stream order, reclaim and checkpoint (no Ray)."""

from __future__ import annotations

import pytest

from areal.core.manager import Finished, GenerationManager


class ListLoader:
    """Batches of consecutive integers, resumable: what the manager draws items from."""

    def __init__(self, n_items: int, batch: int):
        self.n_items, self.batch, self.pos = n_items, batch, 0

    def __iter__(self):
        while self.pos < self.n_items:
            start = self.pos
            self.pos = min(self.n_items, start + self.batch)
            yield list(range(start, self.pos))
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def group(ticket: int, worker: int) -> Finished:
    return Finished(ticket, worker, [None], (5,), f"g{ticket}", (0,))


def drain(mgr: GenerationManager, n_workers: int, want: int) -> int:
    """Every worker asks for ``want`` slots and finishes them (accepted) until none is granted;
    returns the slots granted."""
    total = 0
    while True:
        got = [(w, t) for w in range(n_workers) for t, _ in mgr.acquire(w, want)]
        if not got:
            return total
        total += len(got)
        for w, t in got:
            assert mgr.finish(w, t, group(t, w))


@pytest.mark.parametrize("eta", [0, 1, 4])
@pytest.mark.parametrize("n_workers", [1, 2, 3])
def test_admission_is_global_over_rollout_workers(eta, n_workers):
    B = 4
    mgr = GenerationManager(eta, B, max_concurrent=1000, loader=ListLoader(10_000, B))
    first = sum(
        len(mgr.acquire(w, B)) for w in range(n_workers)
    )  # each worker asks for a batch once
    assert first == min(B * n_workers, (1 + eta) * B)
    # the first slots finish, then the workers keep asking until refused
    for t, job in list(mgr._running.items()):
        mgr.finish(job.worker, t, group(t, job.worker))
    drain(mgr, n_workers, B)
    assert mgr.staleness.accepted == (1 + eta) * B  # before the first update
    assert mgr.refused["staleness"] > 0 and mgr.refused["capacity"] == 0
    assert [g.ticket for g in mgr.take(B)] == list(range(B))  # one batch trained
    mgr.set_version(1)
    drain(mgr, n_workers, B)
    assert mgr.staleness.accepted == (2 + eta) * B  # after it


def test_refusals_are_split_by_cause():
    mgr = GenerationManager(
        max_staleness=0, batch_groups=4, max_concurrent=2, loader=ListLoader(100, 4)
    )
    assert len(mgr.acquire(0, 3)) == 2  # concurrency allows 2 of the 3
    assert mgr.refused["capacity"] == 1 and mgr.refused["staleness"] == 0  # asks, not slots
    for t in (0, 1):
        mgr.finish(0, t, group(t, 0))
    assert len(mgr.acquire(0, 5)) == 2  # the bound (0 + 0 + 1) * 4 leaves 2 of the 5
    assert mgr.refused["staleness"] == 1
    mgr.pause()
    assert mgr.acquire(1, 2) == [] and mgr.refused["paused"] == 1
    stats = mgr.stats()
    assert stats["manager/refused/staleness"] == 1.0 and stats["rollout_worker/0/in_flight"] == 2.0


def test_take_waits_for_every_older_ticket():
    mgr = GenerationManager(
        max_staleness=1, batch_groups=1, max_concurrent=10, loader=ListLoader(100, 1)
    )
    (t0, i0), (t1, i1) = mgr.acquire(0, 2)
    assert (t0, t1, i0, i1) == (0, 1, 0, 1)
    mgr.finish(0, t1, group(t1, 0))
    assert mgr.take(1) is None  # ticket 0 is older and still running
    mgr.finish(0, t0, group(t0, 0))
    assert [g.ticket for g in mgr.take(1)] == [0]
    assert [g.ticket for g in mgr.take(1)] == [1]
    assert mgr.take(1) is None


def test_a_rejected_group_frees_its_slot_and_is_not_delivered():
    mgr = GenerationManager(
        max_staleness=0, batch_groups=2, max_concurrent=10, loader=ListLoader(100, 2)
    )
    (t0, _), (t1, _) = mgr.acquire(0, 2)
    mgr.finish(0, t0, None)  # filtered out
    mgr.finish(0, t1, None, failed=True)
    assert mgr.workers[0].rejected == 1 and mgr.workers[0].failed == 1
    assert [t for t, _ in mgr.acquire(0, 5)] == [2, 3]  # both slots free again
    assert mgr.take(1) is None


def test_a_dead_workers_slots_are_reclaimed_and_its_items_reissued():
    mgr = GenerationManager(
        max_staleness=0, batch_groups=4, max_concurrent=10, loader=ListLoader(100, 4)
    )
    dead = mgr.acquire(0, 2)
    alive = mgr.acquire(1, 2)
    assert mgr.acquire(1, 1) == []  # the bound is full
    assert mgr.reclaim(0, restarted=True) == 2
    assert mgr.workers[0].restarts == 1 and mgr.lost == 2
    again = mgr.acquire(1, 2)
    assert [i for _, i in again] == [i for _, i in dead]  # the same items, new tickets
    assert not {t for t, _ in again} & {t for t, _ in dead}
    assert mgr.finish(0, dead[0][0], group(dead[0][0], 0)) is False  # a late report is dropped
    assert mgr.late == 1
    for t, _ in alive + again:
        mgr.finish(1, t, group(t, 1))
    assert sorted(g.ticket for g in mgr.take(4)) == sorted(t for t, _ in alive + again)


def test_untaken_groups_of_a_dead_worker_are_redone():
    mgr = GenerationManager(
        max_staleness=0, batch_groups=2, max_concurrent=10, loader=ListLoader(100, 2)
    )
    slots = mgr.acquire(0, 2)
    for t, _ in slots:
        mgr.finish(0, t, group(t, 0))
    assert mgr.drop_worker_groups(0) == 2 and mgr.take(1) is None
    assert [i for _, i in mgr.acquire(1, 2)] == [i for _, i in slots]


def test_an_untaken_step_redoes_the_dead_workers_groups_and_returns_the_others():
    mgr = GenerationManager(
        max_staleness=1, batch_groups=2, max_concurrent=10, loader=ListLoader(100, 2)
    )
    a, b, c = mgr.acquire(0, 1) + mgr.acquire(1, 1) + mgr.acquire(0, 1)  # items 0, 1, 2
    for (t, _), w in zip((a, b, c), (0, 1, 0)):
        mgr.finish(w, t, group(t, w))
    assert [g.ticket for g in mgr.take(2, step=1)] == [a[0], b[0]]
    # worker 0 died before the master fetched ticket a: a and its untaken c are redone
    assert mgr.untake(1, [0]) == 2 and mgr.lost == 2
    assert mgr.untake(1, [0]) == 0  # asked again after a lost reply: already undone
    assert mgr.staleness.accepted == 1  # b only
    assert mgr.take(2, step=1) is None  # b waits for a batch-mate
    again = mgr.acquire(1, 2)
    assert [i for _, i in again] == [a[1], c[1]]  # the same items, new tickets
    for t, _ in again:
        mgr.finish(1, t, group(t, 1))
    assert [g.ticket for g in mgr.take(2, step=1)] == [b[0], again[0][0]]


def test_checkpoint_reissues_every_untrained_item_and_keeps_the_bound():
    B = 2
    mgr = GenerationManager(
        max_staleness=1, batch_groups=B, max_concurrent=10, loader=ListLoader(100, B)
    )
    slots = mgr.acquire(0, 4)  # (1 + 0 + 1) * 2
    for t, _ in [slots[0], slots[1], slots[3]]:
        mgr.finish(0, t, group(t, 0))
    assert len(mgr.take(B)) == B
    mgr.set_version(1)
    state = mgr.state_dict()  # ticket 2 running, ticket 3 done untaken

    new = GenerationManager(
        max_staleness=1, batch_groups=B, max_concurrent=10, loader=ListLoader(100, B)
    )
    new.load_state_dict(state)
    assert new.version == 1 and new.staleness.accepted == B  # the one batch trained
    got = new.acquire(0, 10)
    # in admission order, whichever finished first: items 2 and 3 again, then the loader goes on
    assert [i for _, i in got] == [2, 3, 4, 5]
    assert len(got) == (1 + 1 + 1) * B - B  # the bound holds after the resume
    with pytest.raises(RuntimeError, match="before any rollout"):
        new.load_state_dict(state)


def test_checkpoint_inside_a_loader_batch_loses_no_item():
    mgr = GenerationManager(
        max_staleness=4, batch_groups=1, max_concurrent=10, loader=ListLoader(100, 3)
    )
    for t, _ in mgr.acquire(0, 2):  # items 0 and 1 of the batch [0, 1, 2]
        mgr.finish(0, t, group(t, 0))
    assert len(mgr.take(2)) == 2
    mgr.set_version(2)
    new = GenerationManager(
        max_staleness=4, batch_groups=1, max_concurrent=10, loader=ListLoader(100, 3)
    )
    new.load_state_dict(mgr.state_dict())
    assert [i for _, i in new.acquire(0, 4)] == [2, 3, 4, 5]


def test_a_refused_worker_holding_fewer_slots_goes_first():
    mgr = GenerationManager(
        max_staleness=0, batch_groups=4, max_concurrent=10, loader=ListLoader(100, 4)
    )
    busy = mgr.acquire(0, 2) + mgr.acquire(1, 2)
    assert mgr.acquire(2, 2) == []  # the bound is full: worker 2 waits with nothing
    assert mgr.refused["staleness"] == 1
    t, _ = busy[0]
    mgr.finish(0, t, group(t, 0))
    assert len(mgr.take(1)) == 1
    mgr.set_version(1)  # 4 more slots
    assert (
        mgr.acquire(0, 1) == [] and mgr.refused["fair_share"] == 1
    )  # worker 0 holds 1, worker 2 none
    assert len(mgr.acquire(2, 2)) == 2  # the waiting worker first
    assert len(mgr.acquire(0, 1)) == 1  # then the others again


def test_a_waiting_worker_goes_first_on_a_tie_and_a_full_one_stops_waiting():
    mgr = GenerationManager(
        max_staleness=0, batch_groups=2, max_concurrent=10, loader=ListLoader(100, 2)
    )
    first = mgr.acquire(0, 2)
    assert mgr.acquire(1, 2) == []  # refused: waits, holding nothing
    for t, _ in first:
        mgr.finish(0, t, group(t, 0))
    assert len(mgr.take(2)) == 2
    mgr.set_version(1)
    assert (
        mgr.acquire(0, 2) == [] and mgr.refused["fair_share"] == 1
    )  # 0 holds as few, but 1 waited
    assert len(mgr.acquire(1, 2)) == 2
    assert (
        mgr.acquire(1, 0) == [] and 1 not in mgr._waiting
    )  # full (or draining): waits for nothing
    assert mgr.acquire(2, 0) == []


def test_async_ppo_config_refuses_an_in_process_backend_and_several_trainer_ranks():
    from areal.api.config.loader import ConfigError, from_dict
    from areal.core.config import CoreAsyncGRPOConfig

    base = {"actor": {"path": "m", "use_critic": False}, "cluster": {"n_servers": 1}}
    cfg = from_dict(CoreAsyncGRPOConfig, base)
    assert cfg.core.backend == "ray" and cfg.core.n_rollout_workers == 2
    with pytest.raises(ConfigError) as e:
        from_dict(
            CoreAsyncGRPOConfig,
            {
                **base,
                "core": {"backend": "in_process", "n_workers": 1},
                "cluster": {"n_servers": 1, "trainer_nprocs": 2},
            },
        )
    assert (
        "core.backend: 'in_process'; async PPO runs its rollout workers and manager as Ray actors"
        in str(e.value)
    )
    assert "cluster.trainer_nprocs: the Core master is one process (got trainer_nprocs=2" in str(
        e.value
    )
