"""The client's connections to its servers: two pools, health checks and back-pressure (the
transport policy of :class:`~areal.rollout.remote.RemoteInferenceEngine`).

Pools. Work requests (generation, scoring) share a pool of at most
``rollout.max_connections_per_server`` connections per server (aiohttp's ``limit_per_host``);
the rest wait in the client, in order, within their own deadline. So a client does not hold more
connections than a server keeps for work (``server.max_connections`` less
``server.control_connections``), and a burst (one agent call with n=3000) queues here instead of
being refused there. Control calls (health, pause, resume, weight updates) have a pool of their
own and never queue behind generations: a pause waiting for a connection held by a generation it
is to abort would wait for that generation to end.

Back-pressure. A server at its cap answers a work request 503 with ``Retry-After``
(``areal serve``), or closes or resets its connection (a full server, an idle pooled connection
closed as the request went out). Neither means the server died: the request waits (the server's
``Retry-After``, else ``retry_backoff * 2**k``, at most BACKOFF_CAP_S) and is sent again, within
its deadline, and the server's failure count is untouched. A connection error counts as
back-pressure when the server answered another request after this one was sent, or answers
``/health`` now (one probe per server at a time, shared by every request that asks); otherwise it
is a failure (failover, and a server that keeps failing is declared dead).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import aiohttp

from areal.utils.logging import get_logger

logger = get_logger("remote")
BACKOFF_CAP_S = 5.0  # longest wait between two sends of a request a server pushed back on
MIN_BACKOFF_S = 0.05  # shortest such wait (rollout.retry_backoff may be 0)
PROBE_TRIES = 3  # health probes, PROBE_GAP_S apart, before a connection error is a failure
PROBE_GAP_S = 0.2
PROBE_TIMEOUT_S = 2.0  # one health probe


class Retryable(Exception):
    """A connection error or HTTP 5xx: try again, elsewhere, unless it is back-pressure.
    ``connection``: no answer came; ``after``: the answer's ``Retry-After`` seconds."""

    def __init__(self, message: str, connection: bool = False, after: float | None = None):
        super().__init__(message)
        self.connection, self.after = connection, after


@dataclass(frozen=True)
class ClientIO:
    """What a client makes on its own loop at setup (aiohttp and asyncio objects belong to it)."""

    session: aiohttp.ClientSession  # work requests: bounded per server (module doc)
    control: aiohttp.ClientSession  # health and admin calls: unbounded
    resumed: asyncio.Event  # set while the client is not paused
    revive_lock: asyncio.Lock  # one waiter for a server restart at a time


def open_client_io(max_per_server: int, headers: Mapping[str, str] | None) -> ClientIO:
    """The work and control sessions (module doc), the resume event (set) and the revive lock;
    called on the client's loop."""
    work = aiohttp.TCPConnector(limit=0, limit_per_host=max_per_server)
    control = aiohttp.TCPConnector(limit=0)
    resumed = asyncio.Event()
    resumed.set()
    return ClientIO(
        aiohttp.ClientSession(connector=work, headers=headers),
        aiohttp.ClientSession(connector=control, headers=headers),
        resumed,
        asyncio.Lock(),
    )


async def health_error(session: aiohttp.ClientSession, url: str, timeout: float) -> str | None:
    """None when ``GET url`` answers 200 within ``timeout`` seconds, else what went wrong."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status == 200:
                return None
            return f"HTTP {resp.status}: {(await resp.text())[:200]}"
    except (TimeoutError, aiohttp.ClientError) as e:
        return repr(e)


async def answers_health(session: aiohttp.ClientSession, url: str) -> bool:
    """Whether ``GET url`` answers 200 within PROBE_TRIES probes, PROBE_GAP_S apart."""
    for i in range(PROBE_TRIES):
        if await health_error(session, url, PROBE_TIMEOUT_S) is None:
            return True
        if i + 1 < PROBE_TRIES:
            await asyncio.sleep(PROBE_GAP_S)
    return False


def retry_after(headers: Mapping[str, str]) -> float | None:
    """A ``Retry-After`` header's seconds (the delay form), or None without one."""
    value = headers.get("Retry-After", "")
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


class Backpressure:
    """Tells back-pressure from a failing server and paces the retries (module docstring).

    ``probe(address)`` is True when the server at ``address`` answers health."""

    def __init__(
        self,
        retry_backoff: float,
        probe: Callable[[str], Awaitable[bool]],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.backoff, self.probe, self.clock = max(retry_backoff, MIN_BACKOFF_S), probe, clock
        self.last_answer: dict[str, float] = {}  # address -> when it last answered a request
        self._probes: dict[str, asyncio.Future[bool]] = {}
        self.n_waits = 0  # requests sent again after back-pressure

    def answered(self, address: str) -> None:
        """The server at ``address`` answered a request now."""
        self.last_answer[address] = self.clock()

    async def holds(
        self, address: str, sent_at: float, connection: bool, after: float | None
    ) -> bool:
        """Whether a failed send (sent at ``sent_at``; ``connection``: a connection error;
        ``after``: the answer's Retry-After) is back-pressure rather than a failing server."""
        if after is not None:
            return True
        if not connection:  # the server answered, with an error of its own
            return False
        if self.last_answer.get(address, -math.inf) > sent_at:
            return True
        probe = self._probes.get(address)
        if probe is None or probe.done():
            probe = self._probes[address] = asyncio.ensure_future(self.probe(address))
        return await asyncio.shield(probe)

    async def wait(self, n_waits: int, after: float | None, deadline: float, what: str) -> None:
        """Sleep before sending again (``after``: the server's Retry-After); TimeoutError when
        that would pass ``deadline``."""
        doubled = self.backoff * 2 ** min(n_waits, 32)  # capped below anyway; no overflow
        delay = min(doubled if after is None else after, BACKOFF_CAP_S)
        if self.clock() + delay >= deadline:
            raise TimeoutError(
                f"{what}: the server kept pushing back until the request's deadline; add "
                "servers, lower rollout.max_connections_per_server or raise "
                "rollout.request_timeout"
            )
        self.n_waits += 1
        if n_waits == 0:
            logger.debug("%s: pushed back, sending again in %.2f s", what, delay)
        await asyncio.sleep(delay)
