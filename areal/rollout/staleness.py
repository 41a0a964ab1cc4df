"""Admission control for asynchronous rollouts: a small pure class (no clock, no I/O, no lock).

The rule (the staleness-aware admission of the AReaL paper): with ``B`` groups per
training batch, weight version ``v`` and staleness bound ``s``, a rollout may start only while

    (s + v + 1) * B > accepted + running

and at most ``max_concurrent`` rollouts run at once. Rollouts are consumed oldest first, so the
n-th admitted rollout (n = accepted + running at its start, 0-based) lands in training batch
``n // B`` or later; the rule keeps ``n // B <= s + v``, i.e. it is trained at most ``s`` versions
after the version it started under. Nothing finished is discarded; a rejected rollout
(filtered out) frees its slot, so a replacement can start, and an accepted one whose data was lost
before training (Core: its rollout worker died) stops counting (:meth:`undeliver`) and is redone.
Which limit refuses a start is :meth:`refusal_cause`.

Recovery (the bug AReaL#1388 reports): after a restart the version jumps to ``V`` while a fresh
counter would say ``accepted = 0``, admitting ``(s + V + 1) * B`` rollouts at once, all at
version ``V`` -- most would be trained far more than ``s`` versions later. Hence
:meth:`load_state_dict` restores ``accepted`` and :meth:`fast_forward` raises it to at least
``V * B`` (the batches already consumed) when no state was saved.
"""

from __future__ import annotations

from typing import Literal, TypedDict

Refusal = Literal["staleness", "capacity"]  # which limit binds: the bound, or max_concurrent


class StalenessState(TypedDict):
    """The counters :meth:`StalenessManager.state_dict` saves."""

    accepted: int
    rejected: int
    max_staleness: int
    consumer_batch_size: int


class StalenessManager:
    """Counts accepted and running rollouts and says how many more may start now."""

    def __init__(self, max_staleness: int, consumer_batch_size: int, max_concurrent: int):
        if max_staleness < 0:
            raise ValueError(
                f"max_staleness must be >= 0, got {max_staleness}; use 0 for synchronous training"
            )
        if consumer_batch_size < 1 or max_concurrent < 1:
            raise ValueError(
                f"consumer_batch_size ({consumer_batch_size}) and max_concurrent "
                f"({max_concurrent}) must be >= 1"
            )
        self.max_staleness = max_staleness
        self.consumer_batch_size = consumer_batch_size
        self.max_concurrent = max_concurrent
        self.accepted = 0  # rollouts that finished and were accepted, ever (delivered or not)
        self.running = 0  # staleness-bound rollouts started and not finished
        self.running_exempt = 0  # rollouts outside the bound (evaluation): concurrency cap only
        self.rejected = 0  # finished and filtered out (counted for stats only)

    def capacity(self, version: int) -> int:
        """How many staleness-bound rollouts may start now, at trainer weight ``version``."""
        return max(0, min(self.concurrency_capacity(), self._by_staleness(version)))

    def _by_staleness(self, version: int) -> int:
        """``(s + v + 1) * B - (accepted + running)``: the bound's room (negative: past it)."""
        bound = (self.max_staleness + version + 1) * self.consumer_batch_size
        return bound - (self.accepted + self.running)

    def refusal_cause(self, version: int) -> Refusal:
        """Which limit :meth:`capacity` hits at ``version``: ``staleness`` when the bound leaves
        no more room than the concurrency cap (a tie counts as the bound), else ``capacity``."""
        if self._by_staleness(version) <= self.concurrency_capacity():
            return "staleness"
        return "capacity"

    def concurrency_capacity(self) -> int:
        """How many rollouts of any kind may start now under the concurrency cap alone."""
        return max(0, self.max_concurrent - self.running - self.running_exempt)

    def on_start(self, exempt: bool = False) -> None:
        """A rollout started (``exempt``: not bound by staleness, e.g. evaluation)."""
        if exempt:
            self.running_exempt += 1
        else:
            self.running += 1

    def on_finish(self, accepted: bool, exempt: bool = False) -> None:
        """A rollout finished; ``accepted=False`` (rejected, failed, cancelled) frees its slot."""
        if exempt:
            assert self.running_exempt > 0, "on_finish(exempt=True) without a matching on_start"
            self.running_exempt -= 1
            return
        assert self.running > 0, "on_finish without a matching on_start"
        self.running -= 1
        if accepted:
            self.accepted += 1
        else:
            self.rejected += 1

    def undeliver(self) -> None:
        """An accepted rollout will not be trained after all (its data was lost before delivery):
        it no longer counts, so its redo is admitted as a new rollout."""
        assert self.accepted > 0, "undeliver without an accepted rollout"
        self.accepted -= 1

    def fast_forward(self, version: int) -> None:
        """Count the ``version * B`` rollouts consumed before a restart at ``version``."""
        self.accepted = max(self.accepted, version * self.consumer_batch_size)

    def state_dict(self, undelivered: int = 0) -> StalenessState:
        """Counters a recover checkpoint needs (running rollouts are re-issued, not counted);
        ``undelivered``: accepted rollouts the checkpoint re-issues too, so not counted either."""
        assert 0 <= undelivered <= self.accepted, (undelivered, self.accepted)
        return {
            "accepted": self.accepted - undelivered,
            "rejected": self.rejected,
            "max_staleness": self.max_staleness,
            "consumer_batch_size": self.consumer_batch_size,
        }

    def load_state_dict(self, state: StalenessState, running: int = 0) -> None:
        """Restore counters saved by :meth:`state_dict`; nothing may be running yet.
        ``running``: rollouts started before the save that still run and will report here (a
        restarted generation manager's tickets; a recover checkpoint re-issues them instead)."""
        if self.running or self.running_exempt:
            raise RuntimeError(
                f"load_state_dict with {self.running + self.running_exempt} rollouts running; "
                "restore the executor state before submitting any rollout"
            )
        if state["consumer_batch_size"] != self.consumer_batch_size:
            raise ValueError(
                f"groups per rank and batch (train_dataset.batch_size / trainer ranks) are "
                f"{self.consumer_batch_size} but the checkpoint was saved with "
                f"{state['consumer_batch_size']}; resume with the same batch size and ranks"
            )
        self.accepted = int(state["accepted"])
        self.rejected = int(state["rejected"])
        self.running = running
