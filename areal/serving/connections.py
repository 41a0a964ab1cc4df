"""A cap on open connections, so slow or idle clients cannot take every file descriptor.

Without it, 1,100 clients that each send half a request head hold 1,100 sockets: against the
common 1,024 open-file limit ``accept`` fails with EMFILE and ``/health`` goes unanswered (the
head deadline, ``server.request_head_timeout``, frees them only later). :class:`ConnectionGuard`
sits in front of aiohttp's protocol factory and keeps at most ``limit`` connections open: a
new one past it closes the oldest connection that is not inside a request (idle, or still
sending its head or body), or, when every one is inside a request, is closed itself at once.
:func:`connection_limit` keeps the cap below the process's open-file limit.
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

    ``in_request(handler)`` marks a connection as inside a request (the server enters it once a
    request's body has arrived), which exempts it from eviction."""

    def __init__(
        self,
        factory: Callable[[], RequestHandler],
        limit: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.factory, self.limit, self.clock = factory, limit, clock
        # aiohttp's protocol -> its wrapper, until connection_lost
        self.opened: dict[RequestHandler, _Tracked] = {}
        self.busy: set[RequestHandler] = set()
        self.n_evicted = 0  # connections closed to make room for a new one
        self.n_refused = 0  # new connections closed at once: every open one was inside a request

    def __call__(self) -> asyncio.BaseProtocol:
        if len(self.opened) >= self.limit and not self._evict_oldest_idle():
            self.n_refused += 1
            return _Refused()
        tracked = _Tracked(self, self.factory(), self.clock())
        self.opened[tracked.inner] = tracked
        return tracked

    def _evict_oldest_idle(self) -> bool:
        idle = [t for h, t in self.opened.items() if h not in self.busy]
        if not idle:
            return False
        oldest = min(idle, key=lambda t: t.opened_at)
        del self.opened[oldest.inner]  # counted free now; its connection_lost comes on a later tick
        oldest.evict()
        self.n_evicted += 1
        return True

    def closed(self, handler: RequestHandler) -> None:
        """Forget a connection (its connection_lost)."""
        self.opened.pop(handler, None)
        self.busy.discard(handler)

    @contextlib.contextmanager
    def in_request(self, handler: RequestHandler) -> Iterator[None]:
        """While inside, ``handler``'s connection is not evicted."""
        self.busy.add(handler)
        try:
            yield
        finally:
            self.busy.discard(handler)

    def stats(self) -> dict[str, int]:
        """Open, evicted and refused connection counts (for /get_server_info)."""
        return {
            "connections": len(self.opened),
            "connections_evicted": self.n_evicted,
            "connections_refused": self.n_refused,
        }


class _Tracked(asyncio.Protocol):
    """aiohttp's protocol for one connection, reporting its end to the guard. Evicted between
    accept and ``connection_made`` (a burst of accepts makes many at once), it is closed as
    soon as it is made, and aiohttp never sees it."""

    def __init__(self, guard: ConnectionGuard, inner: RequestHandler, opened_at: float):
        self.guard, self.inner, self.opened_at = guard, inner, opened_at
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
