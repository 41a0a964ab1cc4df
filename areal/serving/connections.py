"""A cap on open connections, so slow or idle clients cannot take every file descriptor, with
a reserve that keeps ``/health`` and the admin routes answerable under any load.

Without a cap, 1,100 clients that each send half a request head hold 1,100 sockets: against the
common 1,024 open-file limit ``accept`` fails with EMFILE and ``/health`` goes unanswered (the
head deadline, ``server.request_head_timeout``, frees them only later). :class:`ConnectionGuard`
sits in front of aiohttp's protocol factory and keeps at most ``limit`` connections open: a
new one past it closes one that is not inside a request, or, when every one is inside a request,
is closed itself at once. Which one: first the longest-open connection that never completed a
request (a flood's: half-sent heads, connections opened and left), then the least recently used
keep-alive connection, so a flood does not reset a well-behaved client's pooled connection.

Of the ``limit``, ``reserve`` are kept for control requests (``/health``, info, admin): work
requests (generation, tokenizer) may be inside at most ``limit - reserve`` connections at once;
past that the server answers them 503 with ``Retry-After`` (:meth:`ConnectionGuard.saturated`),
an answer clients take as back-pressure, not as a dead server, and a health check still finds a
connection. :func:`connection_limit` keeps the cap below the process's open-file limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from areal.api.config.loader import ConfigError

if TYPE_CHECKING:
    from aiohttp.web import RequestHandler

logger = logging.getLogger("areal.serve")
FD_RESERVE = 64  # descriptors kept for everything but client sockets: model files, logs, groups


def connection_limit(wanted: int) -> int:
    """``wanted``, or less when the open-file limit is lower: the soft limit is raised to the
    hard one first, and ``FD_RESERVE`` descriptors are kept for the rest of the process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted + FD_RESERVE:
        target = (
            wanted + FD_RESERVE
            if hard == resource.RLIM_INFINITY
            else min(hard, wanted + FD_RESERVE)
        )
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft == resource.RLIM_INFINITY or soft >= wanted + FD_RESERVE:
        return wanted
    limit = max(1, soft - FD_RESERVE)
    logger.warning(
        "max_connections=%d exceeds the open-file limit %d less %d reserved; capping at %d "
        "(raise `ulimit -n` for more)",
        wanted,
        soft,
        FD_RESERVE,
        limit,
    )
    return limit


class ConnectionGuard:
    """Protocol factory wrapping ``factory`` (aiohttp's ``web.Server``); see the module doc.

    ``in_request(handler, work)`` marks a connection as inside a request (the server enters it
    once a request's body has arrived), which exempts it from eviction; ``work`` requests count
    against ``limit - reserve``."""

    def __init__(
        self,
        factory: Callable[[], RequestHandler],
        limit: int,
        reserve: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        assert 0 <= reserve < limit, f"reserve {reserve} must be below the limit {limit}"
        self.factory, self.limit, self.clock = factory, limit, clock
        self.work_limit = limit - reserve  # connections that may be inside work requests at once
        # aiohttp's protocol -> its wrapper, until connection_lost
        self.opened: dict[RequestHandler, _Tracked] = {}
        self.busy: set[RequestHandler] = set()
        self.n_work = 0  # connections inside a work request now
        self.n_evicted = 0  # connections closed to make room for a new one
        self.n_refused = 0  # new connections closed at once: every open one was inside a request
        self.n_shed = 0  # work requests answered 503: work_limit connections were inside work

    def __call__(self) -> asyncio.BaseProtocol:
        if len(self.opened) >= self.limit and not self._evict_one():
            self.n_refused += 1
            return _Refused()
        tracked = _Tracked(self, self.factory(), self.clock())
        self.opened[tracked.inner] = tracked
        return tracked

    def _evict_one(self) -> bool:
        """Close the connection outside a request that a flood most likely holds: the
        longest-open one that never completed a request, else the least recently used."""
        idle = [t for h, t in self.opened.items() if h not in self.busy]
        if not idle:
            return False
        victim = min(
            idle,
            key=lambda t: (False, t.opened_at) if t.last_used is None else (True, t.last_used),
        )
        del self.opened[victim.inner]  # counted free now; its connection_lost comes on a later tick
        victim.evict()
        self.n_evicted += 1
        return True

    def closed(self, handler: RequestHandler) -> None:
        """Forget a connection (its connection_lost)."""
        self.opened.pop(handler, None)
        self.busy.discard(handler)

    def saturated(self, work: bool) -> bool:
        """True (and counted) when a ``work`` request must be answered 503 now: ``work_limit``
        connections are inside work requests. Control requests are never refused here."""
        if work and self.n_work >= self.work_limit:
            self.n_shed += 1
            return True
        return False

    @contextlib.contextmanager
    def in_request(self, handler: RequestHandler, work: bool = False) -> Iterator[None]:
        """While inside, ``handler``'s connection is not evicted (a ``work`` request counts
        against ``limit - reserve``); on leaving, it counts as used now."""
        self.busy.add(handler)
        self.n_work += work
        try:
            yield
        finally:
            self.busy.discard(handler)
            self.n_work -= work
            tracked = self.opened.get(handler)
            if tracked is not None:
                tracked.last_used = self.clock()

    def stats(self) -> dict[str, int]:
        """Open, busy, evicted, refused and shed counts (for /get_server_info)."""
        return {
            "connections": len(self.opened),
            "connections_busy": len(self.busy),
            "connections_evicted": self.n_evicted,
            "connections_refused": self.n_refused,
            "requests_shed": self.n_shed,
        }


class _Tracked(asyncio.Protocol):
    """aiohttp's protocol for one connection, reporting its end to the guard. Evicted between
    accept and ``connection_made`` (a burst of accepts makes many at once), it is closed as
    soon as it is made, and aiohttp never sees it."""

    def __init__(self, guard: ConnectionGuard, inner: RequestHandler, opened_at: float):
        self.guard, self.inner, self.opened_at = guard, inner, opened_at
        self.last_used: float | None = None  # when its last request ended; None: never one
        self.made = self.doomed = False

    def evict(self) -> None:
        """Close this connection (at once, or as soon as it is made)."""
        if self.made:
            self.inner.force_close()
        else:
            self.doomed = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made = True
        if self.doomed:
            transport.close()
        else:
            self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.closed(self.inner)
        if not self.doomed:
            self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self.doomed:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self.doomed else self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class _Refused(asyncio.Protocol):
    """A connection over the cap with nothing to evict: closed as soon as it is made."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class PortUnavailable(ConfigError):
    """The server's port cannot be bound: one line naming the field (``areal serve`` exits 2)."""

    def __str__(self) -> str:
        return self.problems[0]


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (port 0: a free one), made before the model loads, so a
    port in use is one line naming the field rather than a traceback after the load."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp's sites do
        sock.bind(address)  # not listening yet: clients are refused until the model has loaded
        return sock
    except OSError as e:
        if sock is not None:
            sock.close()
        raise PortUnavailable(
            [
                f"port: cannot listen on {host}:{port}: {e.strerror or e}; stop what holds it, "
                "pick another (--port N) or let the server pick one (--port 0)"
            ]
        ) from None
