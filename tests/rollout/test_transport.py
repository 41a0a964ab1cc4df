"""Tier 1: the client's back-pressure policy (areal.rollout.transport) with no network: which
failed sends are back-pressure, one shared health probe per server, and the waits' pacing."""

from __future__ import annotations

import asyncio

import pytest

from areal.rollout import transport
from areal.rollout.transport import Backpressure, retry_after


def _run(coro):
    return asyncio.run(coro)


def test_retry_after_reads_the_delay_form_only():
    assert retry_after({"Retry-After": "2"}) == 2.0
    assert retry_after({"Retry-After": "0.5"}) == 0.5
    assert retry_after({}) is None
    assert retry_after({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}) is None
    assert (
        retry_after({"Retry-After": "-1"}) is None and retry_after({"Retry-After": "inf"}) is None
    )


def test_back_pressure_is_a_retry_after_or_a_connection_error_of_a_server_that_still_answers():
    probes = []

    async def probe(address):
        probes.append(address)
        await asyncio.sleep(0.01)
        return address == "up"

    clock = iter([10.0, 11.0]).__next__
    bp = Backpressure(0.2, probe, clock)

    async def main():
        assert await bp.holds("down", 0.0, connection=False, after=1.0)  # the server said so
        assert not await bp.holds("up", 0.0, connection=False, after=None)  # its own 5xx
        bp.answered("a")  # at 10: after a send at 5, before one at 12
        assert await bp.holds("a", 5.0, connection=True, after=None) and probes == []
        # two failed sends to one server at once share one probe
        both = await asyncio.gather(*(bp.holds("up", 12.0, True, None) for _ in range(2)))
        assert both == [True, True] and probes == ["up"]
        assert not await bp.holds("down", 12.0, True, None) and probes == ["up", "down"]

    _run(main())


def test_waits_double_up_to_the_cap_follow_retry_after_and_stop_at_the_deadline(monkeypatch):
    slept = []

    async def sleep(seconds):
        slept.append(seconds)

    monkeypatch.setattr(transport.asyncio, "sleep", sleep)

    async def never_asked(address):
        raise AssertionError("no probe: wait() only paces")

    bp = Backpressure(0.5, never_asked, clock=lambda: 0.0)

    async def main():
        for n in range(6):
            await bp.wait(n, None, deadline=100.0, what="request r1")
        await bp.wait(0, 2.0, deadline=100.0, what="request r1")
        with pytest.raises(TimeoutError, match=r"request r1: .*rollout.request_timeout"):
            await bp.wait(0, 3.0, deadline=2.0, what="request r1")

    _run(main())
    # 0.5 * 2**n up to BACKOFF_CAP_S (5 s), then the server's Retry-After
    assert slept == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 2.0] and bp.n_waits == 7
