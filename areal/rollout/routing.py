"""Which generation server serves a request, and which servers are alive: the routing and
server-loss policy of :class:`~areal.rollout.remote.RemoteInferenceEngine`, with no I/O.

The first request of a group (``ModelRequest.group_id``) picks a server by
``rollout.schedule_policy`` (``round_robin`` | ``least_requests``); later samples of the group go
to the same server (prefix reuse) unless it is excluded (it just failed) or retired. A server with
``rollout.server_failure_threshold`` consecutive failures, or one failed control call, is declared
dead and gets no request until it answers health again (the client probes and calls
:meth:`ServerPool.revive`). With none alive, :meth:`ServerPool.alive` raises
:class:`AllServersDeadError` naming each server's last error and why none comes back.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from areal.api.config.rollout import InferenceEngineConfig
from areal.utils.logging import get_logger
from areal.utils.name_resolve import NameRepository

logger = get_logger("remote")
STICKY_GROUPS = 4096  # remembered group -> server assignments (oldest forgotten first)


class RemoteEngineError(RuntimeError):
    """A generation server call failed for good (the message names server, call and cause)."""


class AllServersDeadError(RemoteEngineError):
    """Every generation server was declared dead (and none came back); the run cannot continue."""


@dataclass
class Server:
    """One generation server as the client sees it."""

    address: str  # host:port
    alive: bool = True
    outstanding: int = 0  # requests in flight now
    failures: int = 0  # consecutive failed calls
    n_requests: int = 0
    last_error: str = ""  # why the last call failed
    revivals: int = 0  # times it answered again after being declared dead

    @property
    def url(self) -> str:
        """The base URL (``http://host:port`` unless the address names a scheme)."""
        return self.address if "://" in self.address else f"http://{self.address}"


def discover_servers(
    config: InferenceEngineConfig,
    registry: NameRepository | None,
    key: str,
    n_servers: int,
    wait_s: float | None = None,
) -> list[str]:
    """Server addresses: ``rollout.addresses`` when set (servers started by hand), else the
    ``n_servers`` (at least one) entries registered under ``key``, waiting up to ``wait_s``
    seconds for them (default ``rollout.setup_timeout``; a launched run waits
    :func:`areal.runtime.rl.registration_wait`)."""
    if config.addresses:
        return list(config.addresses)
    if registry is None:
        raise ValueError(
            "no generation server addresses: set rollout.addresses=[host:port,...] "
            "or start the run with `areal launch`, which registers its servers"
        )
    return sorted(
        registry.wait_subtree(
            key, max(1, n_servers), config.setup_timeout if wait_s is None else wait_s
        )
    )


class ServerPool:
    """The servers of one client, their liveness and the routing of requests (module
    docstring). ``no_restart_reason`` says why dead servers stay dead (for the error)."""

    def __init__(self, config: InferenceEngineConfig, no_restart_reason: str):
        self.config = config
        self.no_restart_reason = no_restart_reason
        self.servers: list[Server] = []
        self.n_revived = 0
        self._rr = itertools.count()
        self._sticky: OrderedDict[str, Server] = OrderedDict()

    def alive(self, why: str = "") -> list[Server]:
        """The live servers; AllServersDeadError (naming each server's last error and ``why``
        none comes back) when there is none."""
        alive = [s for s in self.servers if s.alive]
        if not alive:
            causes = "; ".join(
                f"{s.address}: {s.last_error or 'no error recorded'}" for s in self.servers
            )
            raise AllServersDeadError(
                f"all {len(self.servers)} generation servers are dead ({causes}) and "
                f"{why or f'are not restarted ({self.no_restart_reason})'}; the run cannot "
                "continue. Check their logs, restart them and resume from the last recover "
                "checkpoint"
            )
        return alive

    def choose(self, group_id: str | None, exclude: set[str]) -> Server:
        """The server for the next request of ``group_id`` (None: no group), avoiding the
        addresses in ``exclude`` while another live server is left."""
        alive = self.alive()
        candidates = [s for s in alive if s.address not in exclude] or alive
        if group_id is not None and group_id in self._sticky:
            server = self._sticky[group_id]
            if server in candidates:
                self._sticky.move_to_end(group_id)
                return server
        if self.config.schedule_policy == "least_requests":
            server = min(candidates, key=lambda s: (s.outstanding, s.n_requests))
        else:
            server = candidates[next(self._rr) % len(candidates)]
        if group_id is not None:
            self._sticky[group_id] = server
            self._sticky.move_to_end(group_id)
            while len(self._sticky) > STICKY_GROUPS:
                self._sticky.popitem(last=False)
        return server

    def mark_failure(self, server: Server, cause: object, fatal: bool = False) -> None:
        """Count a failed call of ``server``; declare it dead (logged) after
        ``rollout.server_failure_threshold`` in a row, or at once when ``fatal``."""
        server.failures += 1
        server.last_error = str(cause)[:300]
        if server.alive and (fatal or server.failures >= self.config.server_failure_threshold):
            server.alive = False
            left = sum(s.alive for s in self.servers)
            logger.error(
                "generation server %s declared dead after %d failure(s) (last: %s); "
                "%d of %d servers left",
                server.address,
                server.failures,
                cause,
                left,
                len(self.servers),
            )

    def revive(self, server: Server, restarted: bool) -> None:
        """A dead server answers health again: it serves again (``restarted``: by the launcher,
        counted against ``launcher.server_restarts``)."""
        server.alive, server.failures = True, 0
        server.revivals += int(restarted)
        self.n_revived += 1

    def replace(self, wanted: list[str], new: dict[str, Server]) -> None:
        """Route to exactly ``wanted`` (addresses) from now on: known ones keep their state (a
        dead one serves again), ``new`` ones (health-checked by the caller) join, unlisted ones
        get no new request and lose their groups."""
        known = {s.address: s for s in self.servers}
        for a in wanted:
            if a in known and not known[a].alive:
                self.revive(known[a], restarted=False)
        self.servers = [known.get(a) or new[a] for a in wanted]
        self._sticky = OrderedDict((g, s) for g, s in self._sticky.items() if s in self.servers)
