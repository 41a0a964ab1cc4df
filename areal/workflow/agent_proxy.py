"""An OpenAI-compatible HTTP proxy for agents in their own processes (``workflow.type: agent_cmd``).

An agent that only lets you set a base URL and an API key (an OpenAI Agents SDK or LangGraph
program, a CLI, a tool server in another language) trains through this proxy. The launchers run
it as a role of its own (:mod:`areal.launcher.agent_proxy_task`, beside the generation servers,
with a rollout client of its own); tests run it on their event loop over a scripted engine.

For agents, keyed by their session's key (``Authorization: Bearer <key>``):

* ``POST /v1/chat/completions`` (tools, ``tool_choice``, ``response_format``, ``n``,
  ``logprobs``, ``stream``) and ``POST /v1/completions``: each call goes to the session's
  :class:`~areal.workflow.openai_client.ArealOpenAI` (checked against the run's server limits,
  ``cfg.server``), the same code the in-process agent path uses, so the prompt is rendered,
  constrained as ``areal serve`` constrains it (a forced tool call, a response format),
  generated through the rollout client (re-submission on weight updates, per-token versions)
  and recorded in tokens exactly as there. ``stream: true`` is
  answered as server-sent events once the completion is generated (the rollout engine does not
  stream tokens): one chunk with the whole message, one with the finish reason, the usage chunk
  when ``stream_options.include_usage`` asks, ``[DONE]``.
* ``POST /v1/reward``: ``{"reward": float}`` ends the episode with that reward;
  ``{"reward": float, "completion_id": id}`` gives one call its own reward (docs/agents.md) and
  leaves the session open.
* ``GET /v1/models``: the one model name, for clients that list models first.

For the rollout side, keyed by the run's control token (``AREAL_AGENT_PROXY_TOKEN``, given by
the launcher to the proxy and the trainers only): ``POST /control/sessions`` opens a session
(its public id and its key), ``POST /control/sessions/ID/wait`` waits (long poll) until it ended,
``POST /control/sessions/ID/close`` ends it and answers its record (areal.workflow.agent_control).
The episode's admission, and with it the staleness bound, stays with the rollout side that opens
the session: the proxy generates only inside admitted episodes. ``GET /health`` needs no key.

Sessions. Each has a fresh random key (no shared or admin key for agents; keys are never logged
nor echoed) and reaches only its own calls. A call with an unknown key, or the key of a session
that ended (reward posted, closed, its deadline passed), is refused with 401; a body that is not
a JSON object (or nests deeper than the JSON parser goes), or a call the client refuses (an
argument training cannot honour, a sampling field out of the server's range), with 400; a body
over the size limit with 413, by its Content-Length before it is read. A call the generation
server refuses for what it asks (a conversation longer than the context) is answered with the
server's status and message. Refused calls count in the session's record (``rejected``) and
are the agent's error: the run goes on. None of these touch any other session, and the proxy
keeps serving. A session whose owner never closes it (a trainer that died) is dropped at its
deadline. An engine failure under a call (a server gone past its restart deadline) is answered
503 and recorded; the rollout side that owns the session stops the run with it (an
infrastructure error, never the agent's).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from areal.api.config.base import GenerationHyperparameters
from areal.api.config.server import GenerationServerConfig
from areal.api.engine import InferenceEngine
from areal.api.sampling import RequestRejected, reward_problems
from areal.utils.logging import get_logger
from areal.workflow.agent_control import record_of
from areal.workflow.openai_client import DEFAULT_SERVER, ArealOpenAI, EngineFailure

logger = get_logger("agent_proxy")
MODEL = "areal"
MAX_WAIT = 30.0  # seconds one control long poll may hold


@dataclass
class Session:
    """One episode's calls (its client) and how it ended."""

    name: str  # "<item id>/<sample index>", for logs; never the key
    client: ArealOpenAI
    id: str = field(default_factory=lambda: f"s-{secrets.token_hex(12)}")  # the control handle
    reward: float | None = None
    why: str = ""  # how it ended: reward | closed | deadline | stopped
    ended: asyncio.Event = field(default_factory=asyncio.Event)


def _error(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
) -> web.Response:
    """An error in OpenAI's shape, which openai's clients raise with the message; ``param``
    names the offending field when known."""
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": status}},
        status=status,
    )


class _Refused(Exception):
    """A request answered with ``response`` (a 4xx) before its handler's work: raised by the
    checks of the key, the control token and the body, answered by ``AgentProxy._errors``."""

    def __init__(self, response: web.Response):
        super().__init__(response.status)
        self.response = response


class AgentProxy:
    """The HTTP server and its sessions (module docstring); ``engine`` generates every call."""

    def __init__(
        self,
        tokenizer: Any,
        engine: InferenceEngine,
        max_request_bytes: int,
        control_token: str,
        server: GenerationServerConfig = DEFAULT_SERVER,
    ):
        if not control_token:
            raise ValueError(
                "agent proxy: empty control token; the launcher passes one by env "
                "(AREAL_AGENT_PROXY_TOKEN)"
            )
        self.tokenizer = tokenizer
        self.engine = engine
        self.max_request_bytes = max_request_bytes
        self.server = server  # the run's server limits, which each session's client checks
        self._token = control_token
        self._keys: dict[str, Session] = {}  # key -> open session
        self._ids: dict[str, tuple[str, Session]] = {}  # id -> (key, session), until collected
        self._runner: web.AppRunner | None = None
        self.address = ""  # host:port once serving

    @property
    def base_url(self) -> str:
        """What agents set as their OpenAI base URL."""
        return f"http://{self.address}/v1"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on ``host:port`` (0: a free port) of the running loop; returns ``host:port``."""
        app = web.Application(client_max_size=self.max_request_bytes, middlewares=[self._errors])
        app.add_routes(
            [
                web.post("/v1/chat/completions", self._chat),
                web.post("/v1/completions", self._text),
                web.post("/v1/reward", self._reward),
                web.get("/v1/models", self._models),
                web.post("/control/sessions", self._c_open),
                web.post("/control/sessions/{id}/wait", self._c_wait),
                web.post("/control/sessions/{id}/close", self._c_close),
                web.get("/health", self._health),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)  # no log of paths, keys or bodies
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 -- aiohttp's one way to read port 0
        self.address = f"{host}:{port}"
        logger.info("agent proxy serving on %s", self.base_url)
        return self.address

    async def stop(self) -> None:
        """Stop serving; every open session ends."""
        for key in list(self._keys):
            self.end(key, "stopped")
        self._ids.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(
        self,
        gconfig: GenerationHyperparameters,
        group_id: str,
        name: str,
        timeout: float,
        version: int | None = None,
    ) -> tuple[str, Session]:
        """A new session and its key (a secret: hand it to the agent only). Past ``timeout``
        seconds it is ended and dropped unless its owner closed it. ``version``: the opener's
        weight version, which the engine tags tokens with when a server reports none."""
        if version is not None and version > self.engine.get_version():
            self.engine.set_version(version)
        key = f"areal-{secrets.token_urlsafe(32)}"
        client = ArealOpenAI(
            self.engine, self.tokenizer, gconfig, group_id=group_id, model=MODEL,
            server=self.server,
        )  # fmt: skip
        session = Session(name, client)
        self._keys[key] = session
        self._ids[session.id] = (key, session)
        asyncio.get_running_loop().call_later(timeout, self._expire, session.id)
        return key, session

    def end(self, key: str, why: str) -> None:
        """End the session of ``key``: the key is refused from now on; its record stays for its
        owner (:meth:`collect`)."""
        session = self._keys.pop(key, None)
        if session is not None:
            session.why = why
            session.ended.set()

    def collect(self, session_id: str) -> Session | None:
        """End the session (if open) and forget it: its record, for its owner."""
        found = self._ids.pop(session_id, None)
        if found is None:
            return None
        self.end(found[0], "closed")
        return found[1]

    def _expire(self, session_id: str) -> None:
        found = self._ids.pop(session_id, None)
        if found is not None and found[0] in self._keys:
            logger.warning("agent session %s passed its deadline unclosed: dropped", found[1].name)
        if found is not None:
            self.end(found[0], "deadline")

    @property
    def open_sessions(self) -> int:
        """Sessions whose key is still accepted."""
        return len(self._keys)

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except _Refused as e:
            return e.response
        except web.HTTPRequestEntityTooLarge:  # a body without Content-Length, cut while read
            return self._too_large()
        except web.HTTPException as e:
            return _error(e.status, e.reason)

    def _session(self, request: web.Request) -> tuple[str, Session]:
        """The key and the session of the request's key, else :class:`_Refused` (401)."""
        key = _bearer(request)
        session = self._keys.get(key)
        if session is None:  # the key itself is never echoed nor logged
            raise _Refused(
                _error(
                    401,
                    "unknown or ended session key: each episode's agent must use the "
                    "OPENAI_API_KEY it was started with, until it posts its reward",
                    "authentication_error",
                )
            )
        return key, session

    def _too_large(self) -> web.Response:
        mib = self.max_request_bytes / (1 << 20)
        return _error(
            413,
            f"request body over workflow.agent.max_request_mb={mib:g} "
            f"({self.max_request_bytes} bytes); send a shorter conversation or raise the limit",
        )

    async def _body(self, request: web.Request) -> dict:
        """The request's JSON object, else :class:`_Refused` (the 4xx to answer): the size limit
        applies before a byte is read (Content-Length) and while reading (a chunked body)."""
        if (request.content_length or 0) > self.max_request_bytes:
            raise _Refused(self._too_large())
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _Refused(_error(400, f"request body is not JSON: {e}")) from e
        except RecursionError as e:  # json's parser recurses per level: ~1000 levels exhaust it
            raise _Refused(
                _error(
                    400, "request body nests JSON arrays/objects too deeply; send a flatter body"
                )
            ) from e
        if not isinstance(body, dict):
            raise _Refused(
                _error(400, f"request body must be a JSON object, got {type(body).__name__}")
            )
        return body

    async def _call(self, request: web.Request, chat: bool) -> web.StreamResponse:
        key, session = self._session(request)
        body = await self._body(request)
        stream = bool(body.pop("stream", False))
        options = body.pop("stream_options", None)
        usage = stream and isinstance(options, dict) and bool(options.get("include_usage"))
        client = session.client
        try:
            out = await (client.create(**body) if chat else client.complete(**body))
        except EngineFailure as e:
            return _error(503, f"the rollout engine failed: {e}; the run stops", "server_error")
        except RequestRejected as e:  # refused here or by the server: the agent's error
            return _error(e.status, str(e), param=e.field)
        except (ValueError, TypeError) as e:  # what training cannot honour, named by the client
            return _error(400, str(e))
        if key not in self._keys:  # the episode ended while the call ran
            return _error(
                401,
                "the session ended while this call ran (deadline or reward)",
                "authentication_error",
            )
        answer = out.model_dump(exclude_none=True)
        if not stream:
            return web.json_response(answer)
        return await _stream(request, answer, chat, usage)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._call(request, chat=True)

    async def _text(self, request: web.Request) -> web.StreamResponse:
        return await self._call(request, chat=False)

    async def _models(self, request: web.Request) -> web.Response:
        self._session(request)  # a session's key lists the models
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "areal"}],
            }
        )

    async def _reward(self, request: web.Request) -> web.Response:
        key, session = self._session(request)
        body = await self._body(request)
        reward = body.get("reward")
        problems = reward_problems("reward", reward)  # never stored: 1e308 is inf in float32
        if problems:
            return _error(400, str(RequestRejected.of(problems)), param="reward")
        if body.get("completion_id") is not None:
            try:
                session.client.set_reward(str(body["completion_id"]), float(reward))
            except ValueError as e:
                return _error(400, str(e), param="completion_id")
            return web.json_response({"ok": True, "ended": False})
        session.reward = float(reward)
        self.end(key, "reward")
        return web.json_response({"ok": True, "ended": True})

    # -- the rollout side's control API -------------------------------------------------------

    def _controller(self, request: web.Request) -> None:
        """Returns when the request carries the control token, else :class:`_Refused` (401)."""
        if not secrets.compare_digest(_bearer(request).encode(), self._token.encode()):
            raise _Refused(
                _error(401, "control API: missing or wrong control token", "authentication_error")
            )

    def _known(self, request: web.Request) -> Session:
        """The session the control request names, else :class:`_Refused` (401, 404)."""
        self._controller(request)
        found = self._ids.get(request.match_info["id"])
        if found is None:
            raise _Refused(
                _error(404, "unknown session id: never opened, closed, or past its deadline")
            )
        return found[1]

    async def _c_open(self, request: web.Request) -> web.Response:
        self._controller(request)
        body = await self._body(request)
        try:
            gconfig = GenerationHyperparameters(**body["gconfig"])
            group_id, name = str(body["group_id"]), str(body["name"])
            timeout, version = float(body["timeout"]), int(body["version"])
        except (KeyError, TypeError, ValueError) as e:
            return _error(
                400, f"control open: expected gconfig, group_id, name, timeout, version: {e!r}"
            )
        key, session = self.open(gconfig, group_id, name, timeout, version)
        return web.json_response({"id": session.id, "key": key})

    async def _c_wait(self, request: web.Request) -> web.Response:
        session = self._known(request)
        body = await self._body(request)
        timeout = body.get("timeout")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            return _error(400, f"timeout: expected seconds >= 0, got {timeout!r}")
        try:
            await asyncio.wait_for(session.ended.wait(), min(float(timeout), MAX_WAIT))
        except TimeoutError:
            pass  # still open: the caller asks again
        return web.json_response({"ended": session.ended.is_set(), "why": session.why})

    async def _c_close(self, request: web.Request) -> web.Response:
        session = self._known(request)
        self.collect(session.id)
        return web.json_response(record_of(session))

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "open_sessions": self.open_sessions})


def _bearer(request: web.Request) -> str:
    auth = request.headers.get("Authorization", "")
    return auth[len("Bearer ") :].strip() if auth.startswith("Bearer ") else ""


def _chunks(answer: dict, chat: bool) -> list[dict]:
    """The streamed form of a whole answer: per choice its content (and tool calls), then its
    finish reason."""
    head = {
        "id": answer["id"],
        "created": answer["created"],
        "model": answer["model"],
        "object": "chat.completion.chunk" if chat else "text_completion",
    }
    out = []
    for c in answer["choices"]:
        if chat:
            message = c["message"]
            delta: dict = {"role": "assistant", "content": message.get("content") or ""}
            if message.get("tool_calls"):
                delta["tool_calls"] = [
                    {"index": j, **t} for j, t in enumerate(message["tool_calls"])
                ]
            body: dict = {"delta": delta}
            end: dict = {"delta": {}}
        else:
            body, end = {"text": c["text"]}, {"text": ""}
        piece = {"index": c["index"], **body, "logprobs": c.get("logprobs"), "finish_reason": None}
        out.append({**head, "choices": [piece]})
        out.append(
            {**head, "choices": [{"index": c["index"], **end, "finish_reason": c["finish_reason"]}]}
        )
    return out


async def _stream(
    request: web.Request, answer: dict, chat: bool, usage: bool
) -> web.StreamResponse:
    """Server-sent events of a whole answer (module docstring)."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    events = _chunks(answer, chat)
    if usage:
        events.append(
            {
                "id": answer["id"],
                "created": answer["created"] or int(time.time()),
                "model": answer["model"],
                "object": events[0]["object"],
                "choices": [],
                "usage": answer["usage"],
            }
        )
    for event in events:
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
