"""HTTP client for generation servers (ours, SGLang, vLLM): routing, retries with failover,
pause/resume with re-submission of interrupted requests, and weight updates on every server.

The client runs its own asyncio loop (and aiohttp sessions) in a background thread, so the SPMD
training script can call the synchronous methods (``pause``, ``resume``, ``update_weights``) and
coroutines on any other loop (the workflow executor's) can ``await agenerate(...)``.

Routing (:mod:`areal.rollout.routing`): the first request of a group (``ModelRequest.group_id``)
picks a server by ``rollout.schedule_policy`` (round_robin | least_requests); later samples of
the group go to the same server (prefix reuse) unless it fails. Failures: a connection error or
HTTP 5xx is retried on another server after ``retry_backoff * 2**k`` seconds, at most
``request_retries`` times, unless it is back-pressure (a 503 with Retry-After, a reset from a
server that answers health: waits and is sent again within the deadline, :mod:`.transport`);
a server with ``server_failure_threshold`` consecutive failures (or
one failed control call) is declared dead, logged and counted, and not routed to until it answers
health again. HTTP 4xx raises at once: 400, 413 and 422 (what the request asks) as
:class:`ServerRejected`, the caller's error; any other 4xx is a bug or a bad config.

Server loss: when none is left and the launcher restarts dead servers (``server_restarts`` > 0),
calls wait, logged, up to ``rollout.server_restart_timeout`` seconds for one to answer health
again, then go on (a one-server run survives its server's restart); past that deadline, or once
every dead server was restarted ``server_restarts`` times, or at once without restarts, every
call raises :class:`AllServersDeadError` naming each server's last error and why.

Interruption: ``pause()`` aborts in-flight generations on every server; each answers with its
partial tokens (finish reason ``abort``). The client waits for ``resume()`` and re-submits
prompt + partial output with the remaining token budget (and remaining ``min_new_tokens``), then
joins the parts; every token keeps the version that produced it. A seeded request's later parts
get seeds of their own (:func:`continuation_seed`). A stop string that straddles the cut is not
detected (stop token ids are).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
import zlib

import aiohttp

from areal.api.config.rollout import InferenceEngineConfig
from areal.api.engine import InferenceEngine, TokenScorer
from areal.api.io import ModelRequest, ModelResponse, WeightUpdateMeta
from areal.api.launch import server_api_key
from areal.api.protocols import SharesDevice, WeightTarget
from areal.api.sampling import RequestRejected, rejected_reply
from areal.rollout.backends import HttpCall, make_backend
from areal.rollout.routing import (
    AllServersDeadError,
    RemoteEngineError,
    Server,
    ServerPool,
    discover_servers,
)
from areal.rollout.transport import (
    Backpressure,
    ClientIO,
    Retryable,
    answers_health,
    health_error,
    open_client_io,
    retry_after,
)
from areal.utils.event_loop import EventLoopThread
from areal.utils.logging import get_logger

__all__ = [
    "AllServersDeadError",
    "RemoteEngineError",
    "RemoteInferenceEngine",
    "ServerRejected",
    "continuation_seed",
    "discover_servers",
]

logger = get_logger("remote")
REVIVE_PROBE_S = 2.0  # health probe of a dead server before a disk weight update
MAX_CONTINUATION_SEED = 2**62  # GenerationHyperparameters.seed's range, which every backend takes


def continuation_seed(seed: int | None, n_done: int) -> int | None:
    """The seed of a request's part that starts after ``n_done`` generated tokens.

    A server seeds a fresh generator per request, so a continuation sent with the request's own
    seed would draw the first part's random numbers again (its tokens would not be samples of
    the policy); each part gets its own seed, reproducible from the request's and the offset.
    """
    if seed is None or n_done == 0:
        return seed
    return (seed + zlib.crc32(f"continuation/{n_done}".encode())) % MAX_CONTINUATION_SEED


class ServerRejected(RequestRejected, RemoteEngineError):
    """A server refused a request for what it asks (HTTP 400, 413, 422: a field out of range, a
    prompt longer than its context): the caller's error (:class:`RequestRejected`, which the
    agent client answers to the agent), and a :class:`RemoteEngineError` for every other caller,
    which stops as for any 4xx."""


class RemoteInferenceEngine(InferenceEngine, TokenScorer, WeightTarget, SharesDevice):
    """An :class:`InferenceEngine` over HTTP servers; the publisher's WeightTarget/SharesDevice."""

    def __init__(
        self,
        config: InferenceEngineConfig,
        api_key: str = "",
        server_restarts: int = 0,
        no_restart_reason: str = "nothing restarts them",
    ):
        """``api_key``: the servers' admin key (``server.api_key``); empty = the one a launcher
        passed by env, if any. Sent as ``Authorization: Bearer`` on every call.
        ``server_restarts``: how many times the launcher restarts a server that dies (0: none,
        for ``no_restart_reason``); the server-loss policy of the module docstring."""
        self.config = config
        self.server_restarts = server_restarts
        self._restart_wait = config.server_restart_timeout if server_restarts else 0.0  # seconds
        self._api_key = server_api_key(api_key)
        self.backend = make_backend(config.backend, config.served_model_name)
        health = self.backend.health
        self.pool = ServerPool(config, no_restart_reason)
        self._version = 0
        self._paused = False
        self._live: ClientIO | None = None  # sessions and events, made on the client loop
        self.backpressure = Backpressure(
            config.retry_backoff,
            lambda address: answers_health(self._io.control, Server(address).url + health.path),
        )
        self._thread: EventLoopThread | None = None
        self.n_failovers = 0
        self.n_resubmits = 0

    # -- lifecycle ----------------------------------------------------------------------------

    def initialize(self, addresses: list[str]) -> None:
        """Start the client loop and wait until every server at ``addresses`` is healthy."""
        addrs = list(addresses)
        if not addrs:
            raise ValueError("RemoteInferenceEngine.initialize needs at least one server address")
        self.pool.servers = [Server(a.rstrip("/")) for a in addrs]
        self._thread = EventLoopThread("remote-inference")
        try:
            self._thread.run(self._setup(), self.config.setup_timeout + 10, "server health checks")
        except BaseException:
            self.destroy()
            raise
        logger.info("connected to %d generation server(s): %s", len(self.servers), addrs)

    async def _setup(self) -> None:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else None
        self._live = open_client_io(self.config.max_connections_per_server, headers)
        deadline = time.monotonic() + self.config.setup_timeout
        await asyncio.gather(*(self._wait_healthy(s, deadline) for s in self.servers))

    async def _wait_healthy(self, server: Server, deadline: float) -> None:
        call, last = self.backend.health, "no answer"
        while time.monotonic() < deadline:
            timeout = max(0.1, min(5.0, deadline - time.monotonic()))
            last = await health_error(self._io.control, server.url + call.path, timeout) or ""
            if not last:
                return
            await asyncio.sleep(0.2)
        raise TimeoutError(
            f"generation server {server.address} did not pass GET {call.path} within "
            f"{self.config.setup_timeout} s (rollout.setup_timeout); last: {last}. Check the "
            "server log, or raise rollout.setup_timeout"
        )

    def destroy(self) -> None:
        """Close the HTTP session and stop the client loop."""
        if self._thread is None:
            return
        for session in (self._live.session, self._live.control) if self._live else ():
            self._thread.run(session.close(), 10, "closing the HTTP session")
        self._thread.stop()
        self._thread = None

    def set_servers(self, addresses: list[str]) -> None:
        """Route to exactly ``addresses`` from now on (elastic scaling: Core's master keeps every
        client on the servers that hold the current weights). New ones are added once healthy,
        listed ones declared dead serve again, unlisted ones get no new request (their in-flight
        requests finish)."""
        wanted = list(dict.fromkeys(a.rstrip("/") for a in addresses))
        if not wanted:
            raise ValueError("set_servers needs at least one server address")
        self._loop_thread().run(
            self._aset_servers(wanted), self.config.setup_timeout + 10, "adding servers"
        )

    async def _aset_servers(self, wanted: list[str]) -> None:
        known = {s.address for s in self.servers}
        new = {a: Server(a) for a in wanted if a not in known}
        deadline = time.monotonic() + self.config.setup_timeout
        await asyncio.gather(*(self._wait_healthy(s, deadline) for s in new.values()))
        self.pool.replace(wanted, new)
        if new or len(known) != len(wanted):
            logger.info("generation servers now %s (added %s)", wanted, sorted(new))

    @property
    def servers(self) -> list[Server]:
        """The servers this client routes to (:class:`~areal.rollout.routing.ServerPool`)."""
        return self.pool.servers

    @property
    def n_revived(self) -> int:
        """Servers that serve again after being declared dead (restarted, or listed again)."""
        return self.pool.n_revived

    def _loop_thread(self) -> EventLoopThread:
        if self._thread is None:
            raise RuntimeError("RemoteInferenceEngine is not running; call initialize() first")
        return self._thread

    @property
    def _io(self) -> ClientIO:
        if self._live is None:
            raise RuntimeError("RemoteInferenceEngine is not running; call initialize() first")
        return self._live

    # -- routing and transport ----------------------------------------------------------------

    async def _await_alive(self) -> list[Server]:
        """The live servers; when none is left and the launcher restarts servers, first wait
        (logged) up to ``rollout.server_restart_timeout`` for one to answer health again."""
        if any(s.alive for s in self.servers) or not self.server_restarts:
            return self.pool.alive()
        async with self._io.revive_lock:  # concurrent calls share one wait
            if any(s.alive for s in self.servers):
                return self.pool.alive()
            if all(s.revivals >= self.server_restarts for s in self.servers):
                self.pool.alive(
                    f"were restarted launcher.server_restarts={self.server_restarts} time(s) "
                    "already"
                )
            timeout = self.config.server_restart_timeout
            logger.warning(
                "all %d generation server(s) are down; the launcher restarts them: waiting up "
                "to %.0f s (rollout.server_restart_timeout) for one to answer %s",
                len(self.servers),
                timeout,
                self.backend.health.path,
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                await self._arevive()
                if any(s.alive for s in self.servers):
                    break
                await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            return self.pool.alive(
                f"none answered within rollout.server_restart_timeout={timeout} s although "
                "the launcher restarts them; raise it if a restart takes longer"
            )

    async def _send(
        self,
        server: Server,
        call: HttpCall,
        deadline: float,
        session: aiohttp.ClientSession | None = None,
    ) -> dict:
        """One HTTP call (on ``session``, default the work pool); raises Retryable
        (connection/5xx), RemoteEngineError (4xx) or TimeoutError (``deadline`` passed)."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{call.path} on {server.address}: deadline passed before sending")
        server.outstanding += 1
        server.n_requests += 1
        try:
            async with (session or self._io.session).request(
                call.method,
                server.url + call.path,
                json=call.json,
                params=call.params,
                timeout=aiohttp.ClientTimeout(total=left),
            ) as resp:
                text = await resp.text()
                if resp.status >= 500:
                    after = retry_after(resp.headers)
                    raise Retryable(f"HTTP {resp.status}: {text[:300]}", after=after)
                rejected = rejected_reply(
                    resp.status, text, f"{server.address} ({call.method} {call.path})"
                )
                if rejected is not None:  # what the request asks: the caller's error
                    raise ServerRejected(str(rejected), rejected.field, rejected.status)
                if resp.status >= 400:
                    raise RemoteEngineError(
                        f"{server.address} answered {call.method} {call.path} with HTTP "
                        f"{resp.status}: {text[:500]}"
                    )
                server.failures = 0
                self.backpressure.answered(server.address)
                return json.loads(text) if text else {}
        except TimeoutError:
            if time.monotonic() < deadline:  # a socket-level timeout: the server is stuck
                raise Retryable(f"timeout talking to {server.address}") from None
            raise TimeoutError(
                f"{call.method} {call.path} on {server.address} got no answer before its deadline; "
                "raise rollout.request_timeout (generation) or rollout.weight_update_timeout"
            ) from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            raise Retryable(repr(e), connection=True) from e
        finally:
            server.outstanding -= 1

    async def _send_with_failover(
        self, call: HttpCall, group_id: str | None, deadline: float, what: str
    ) -> tuple[dict, str]:
        """(the answer's body, the address of the server that gave it). Back-pressure waits
        and sends again, within ``deadline``; other failures fail over, at most
        ``rollout.request_retries`` times."""
        tried: set[str] = set()
        attempt = n_waits = 0
        while True:
            await self._await_alive()
            server = self.pool.choose(group_id, tried)
            sent_at = time.monotonic()
            try:
                return await self._send(server, call, deadline), server.address
            except Retryable as e:
                if await self.backpressure.holds(server.address, sent_at, e.connection, e.after):
                    where = f"{what} on {server.address} ({e})"
                    await self.backpressure.wait(n_waits, e.after, deadline, where)
                    n_waits += 1
                    continue
                attempt += 1
                self.pool.mark_failure(server, e)
                tried.add(server.address)
                if attempt > self.config.request_retries:
                    raise RemoteEngineError(
                        f"{what} failed {attempt} times (rollout.request_retries="
                        f"{self.config.request_retries}); last: {server.address}: {e}"
                    ) from None
                self.n_failovers += 1
                backoff = self.config.retry_backoff * 2 ** (attempt - 1)
                await asyncio.sleep(max(0.0, min(backoff, deadline - time.monotonic())))

    async def _broadcast(self, calls: dict[str, HttpCall], what: str, timeout: float) -> None:
        """Send one control call per server (by address) concurrently; a server that cannot be
        reached is declared dead (it must not serve with the wrong weights or state)."""
        deadline = time.monotonic() + timeout
        targets = [s for s in await self._await_alive() if s.address in calls]
        results = await asyncio.gather(
            *(self._send(s, calls[s.address], deadline, self._io.control) for s in targets),
            return_exceptions=True,
        )
        for server, res in zip(targets, results):
            if isinstance(res, Retryable):
                self.pool.mark_failure(server, f"{what}: {res}", fatal=True)
            elif isinstance(res, BaseException):
                raise RemoteEngineError(f"{what} on {server.address} failed: {res}") from res
        await self._await_alive()

    def _call_all(self, call: HttpCall) -> dict[str, HttpCall]:
        return {s.address: call for s in self.servers if s.alive}

    async def _call_alive(self, call: HttpCall) -> dict[str, HttpCall]:
        """:meth:`_call_all`, after waiting for a restarted server when none is live."""
        await self._await_alive()
        return self._call_all(call)

    # -- generation ---------------------------------------------------------------------------

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate one completion; callable from any event loop."""
        thread = self._loop_thread()
        if asyncio.get_running_loop() is thread.loop:
            return await self._agenerate(req)
        return await asyncio.wrap_future(thread.submit(self._agenerate(req)))

    async def _wait_resumed(self, deadline: float, rid: str) -> None:
        if self._io.resumed.is_set():
            return
        try:
            await asyncio.wait_for(self._io.resumed.wait(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise TimeoutError(
                f"request {rid}: the engine stayed paused past rollout.request_timeout="
                f"{self.config.request_timeout} s; call resume() after the weight update"
            ) from None

    async def _agenerate(self, req: ModelRequest) -> ModelResponse:
        g = req.gconfig
        t0 = time.monotonic()
        deadline = t0 + self.config.request_timeout
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        ttft, stop, idle_aborts = 0.0, "length", 0
        servers: list[str] = []  # the servers that generated its chunks, in order, once each
        while len(ids) < g.max_new_tokens:
            await self._wait_resumed(deadline, req.rid)
            call = self.backend.generate(
                req.input_ids + ids,
                g,
                g.max_new_tokens - len(ids),
                max(0, g.min_new_tokens - len(ids)),
                continuation_seed(req.seed, len(ids)),
            )
            body, address = await self._send_with_failover(
                call, req.group_id, deadline, f"request {req.rid}"
            )
            servers += [address] if address not in servers else []
            chunk = self.backend.parse_generate(body)
            if chunk.output_ids and not ids:
                ttft = time.monotonic() - t0
            ids += chunk.output_ids
            logprobs += chunk.logprobs
            versions += (
                chunk.versions
                if chunk.versions is not None
                else [self._version] * len(chunk.output_ids)
            )
            stop = chunk.stop_reason
            if stop != "abort":
                break
            if g.grammar:  # a grammar's state does not travel with prompt + partial: start again
                ids, logprobs, versions = [], [], []
            self.n_resubmits += 1
            # An abort outside a pause (the server was paused by someone else, or shut down) is
            # retried too, but not forever when it makes no progress.
            idle_aborts = 0 if (self._paused or chunk.output_ids) else idle_aborts + 1
            if idle_aborts > self.config.request_retries:
                break
        if stop == "abort" and len(ids) >= g.max_new_tokens:
            stop = "length"
        return ModelResponse(
            list(req.input_ids),
            ids,
            logprobs,
            versions,
            stop,
            latency=time.monotonic() - t0,
            ttft=ttft,
            server=",".join(servers),
        )

    async def ascore(self, input_ids: list[int], start: int) -> list[float]:
        """Logprobs (temperature 1) of ``input_ids[start:]`` under the served model: a
        distillation teacher scoring a student's completion; callable from any event loop."""
        thread = self._loop_thread()
        if asyncio.get_running_loop() is not thread.loop:
            return await asyncio.wrap_future(thread.submit(self.ascore(input_ids, start)))
        if start >= len(input_ids):
            return []
        deadline = time.monotonic() + self.config.request_timeout
        body, _ = await self._send_with_failover(
            self.backend.score(input_ids, start), None, deadline, "score"
        )
        return self.backend.parse_score(body, input_ids, start)

    # -- control ------------------------------------------------------------------------------

    async def _apause(self) -> None:
        self._paused = True  # before the servers abort, so aborted requests wait for resume
        self._io.resumed.clear()
        await self._broadcast(
            await self._call_alive(self.backend.pause()), "pause", self.config.setup_timeout
        )

    async def _aresume(self) -> None:
        await self._broadcast(
            await self._call_alive(self.backend.resume()), "resume", self.config.setup_timeout
        )
        self._paused = False
        self._io.resumed.set()

    def pause(self) -> None:
        """Abort in-flight generations on every server; they are re-submitted after resume()."""
        self._loop_thread().run(
            self._apause(), self.config.setup_timeout + self._restart_wait + 5, "pause"
        )

    def resume(self) -> None:
        """Let every server generate again; interrupted requests continue."""
        self._loop_thread().run(
            self._aresume(), self.config.setup_timeout + self._restart_wait + 5, "resume"
        )

    def _on_live_servers(self, call: HttpCall, what: str) -> None:
        """Send ``call`` to every live server and wait; each must answer within
        ``setup_timeout``."""
        calls = self._call_all(call)
        self._loop_thread().run(
            self._broadcast(calls, what, self.config.setup_timeout),
            self.config.setup_timeout + 5,
            what,
        )

    def release_memory(self) -> None:
        """Paused servers give back their accelerator memory (colocated with a trainer that is
        about to step); every server must answer within ``setup_timeout``."""
        self._on_live_servers(self.backend.release_memory(), "release memory")

    def resume_memory(self) -> None:
        """Servers take back the memory :meth:`release_memory` gave back."""
        self._on_live_servers(self.backend.resume_memory(), "resume memory")

    def get_version(self) -> int:
        """The version the client tags tokens with when a server reports none."""
        return self._version

    def set_version(self, version: int) -> None:
        """Set the client's version (servers get theirs with each weight update)."""
        self._version = version

    async def _aupdate(self, calls: dict[str, HttpCall], what: str) -> None:
        await self._broadcast(calls, what, self.config.weight_update_timeout)

    async def _arevive(self) -> None:
        """Servers declared dead that answer health again (a launcher restarted them) are live
        again; the disk update that follows gives them the current weights and version."""
        for server in self.servers:
            if server.alive:
                continue
            url = server.url + self.backend.health.path
            if await health_error(self._io.control, url, REVIVE_PROBE_S) is None:
                self.pool.revive(server, restarted=True)
                logger.warning(
                    "generation server %s answers again (restarted); it serves again, with the "
                    "newest published weights or this weight update",
                    server.address,
                )

    async def _aupdate_disk(self, call: HttpCall, what: str) -> None:
        await self._arevive()
        await self._aupdate(await self._call_alive(call), what)

    def update_weights_async(
        self, meta: WeightUpdateMeta, announcement: dict[str, list] | None = None
    ) -> concurrent.futures.Future:
        """Start a weight update on every live server; returns a future (``.result(timeout)``).

        ``disk``: the servers load ``meta.path``. ``distributed``: the servers receive the
        tensors of ``announcement`` (``actor.weight_announcement()``) while the trainer
        broadcasts them, so start this first, then call ``actor.update_weights(meta)``. ``ipc``:
        the servers copy in the tensors of ``meta.shared``. The client's own version is set by
        whoever owns the update (``set_version``).
        """
        what = f"update_weights({meta.type}, version={meta.version})"
        if meta.type == "disk":  # a restarted server can load it too: dead ones are probed first
            if not meta.path:
                raise ValueError("WeightUpdateMeta.path is empty for type='disk'; set the HF dir")
            call = self.backend.update_from_disk(meta.path, meta.version)
            return self._loop_thread().submit(self._aupdate_disk(call, what))
        if meta.type == "distributed":
            if announcement is None:
                raise ValueError(
                    "type='distributed' needs announcement=actor.weight_announcement()"
                )
            call = self.backend.update_from_distributed(meta, announcement)
        elif meta.type == "ipc":
            call = self.backend.update_from_ipc(meta)
        else:
            raise ValueError(
                f"WeightUpdateMeta.type must be disk, distributed or ipc: {meta.type!r}"
            )
        return self._loop_thread().submit(self._aupdate(self._call_all(call), what))

    def update_weights(
        self, meta: WeightUpdateMeta, announcement: dict[str, list] | None = None
    ) -> None:
        """Blocking :meth:`update_weights_async` (for ``distributed`` the trainer must broadcast
        from another thread or process meanwhile)."""
        fut = self.update_weights_async(meta, announcement)
        fut.result(self.config.weight_update_timeout + self._restart_wait + 10)

    def init_weights_update_group_async(self, meta: WeightUpdateMeta) -> concurrent.futures.Future:
        """Have live server ``i`` join the trainer's weight-update group as rank ``1 + i``
        (the trainer is rank 0 and joins concurrently with world size :attr:`weight_group_size`).

        A server that dies after joining breaks the group: the trainer's next broadcast fails,
        an infrastructure error that stops the run (restart servers, resume from a checkpoint).
        """
        alive = self.pool.alive()
        calls = {
            s.address: self.backend.init_weight_group(meta, 1 + i, 1 + len(alive))
            for i, s in enumerate(alive)
        }
        return self._loop_thread().submit(self._aupdate(calls, "init_weights_update_group"))

    @property
    def weight_group_size(self) -> int:
        """World size of the weight-update group: the trainer plus every live server."""
        return 1 + len(self.pool.alive())

    def stats(self) -> dict[str, float]:
        """Server health and failover counters for logging."""
        alive = sum(s.alive for s in self.servers)
        return {
            "remote/servers_alive": float(alive),
            "remote/servers_dead": float(len(self.servers) - alive),
            "remote/failovers": float(self.n_failovers),
            "remote/backpressure_waits": float(self.backpressure.n_waits),
            "remote/resubmits": float(self.n_resubmits),
            "remote/revived": float(self.pool.n_revived),
        }
