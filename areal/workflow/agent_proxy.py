"""An OpenAI-compatible HTTP proxy for agents in their own processes (``workflow.type: agent_cmd``).

An agent that only lets you set a base URL and an API key (an OpenAI Agents SDK or LangGraph
program, a CLI, a tool server in another language) trains through this proxy. It serves, on
loopback:

* ``POST /v1/chat/completions`` (tools, ``tool_choice``, ``n``, ``logprobs``, ``stream``) and
  ``POST /v1/completions``: each call goes to the session's
  :class:`~areal.workflow.openai_client.ArealOpenAI`, the same code the in-process agent path
  uses, so the prompt is rendered, generated through the rollout engine (admission, the
  staleness bound, interruption on weight updates, per-token versions) and recorded in tokens
  exactly as there. ``stream: true`` is answered as server-sent events once the completion is
  generated (the rollout engine does not stream tokens): one chunk with the whole message, one
  with the finish reason, the usage chunk when ``stream_options.include_usage`` asks, ``[DONE]``.
* ``POST /v1/reward``: ``{"reward": float}`` ends the episode with that reward;
  ``{"reward": float, "completion_id": id}`` gives one call its own reward (docs/agents.md) and
  leaves the session open.
* ``GET /v1/models``: the one model name, for clients that list models first.

Sessions. The workflow opens one session per episode and hands the agent a fresh random key
(``Authorization: Bearer <key>``); there is no shared or admin key, and keys are never logged.
A key reaches only its own session. A call with an unknown key, or the key of a session that
ended (reward posted, deadline passed, agent killed), is refused with 401; a body that is not a
JSON object, or a call the client refuses (an argument training cannot honour), with 400; a body
over ``workflow.agent.max_request_mb`` with 413. None of these touch any session, and the proxy
keeps serving. An engine failure under a call is answered 503 and stops the run (an
infrastructure error, never the agent's).

The proxy runs on the event loop of the workflow that owns it (the rollout executor's), so a
call's generation is awaited on the same loop as the episode that waits for its reward.
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
from areal.api.engine import InferenceEngine
from areal.utils.logging import get_logger
from areal.workflow.openai_client import ArealOpenAI, EngineFailure

logger = get_logger("agent_proxy")
MODEL = "areal"


@dataclass
class Session:
    """One episode's calls (its client) and how it ended."""

    name: str  # "<item id>/<sample index>", for logs; never the key
    client: ArealOpenAI
    reward: float | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    """An error in OpenAI's shape, which openai's clients raise with the message."""
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )


class AgentProxy:
    """The loopback HTTP server and its sessions (module docstring)."""

    def __init__(self, tokenizer: Any, max_request_bytes: int):
        self.tokenizer = tokenizer
        self.max_request_bytes = max_request_bytes
        self._sessions: dict[str, Session] = {}  # key -> session
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    async def start(self) -> str:
        """Serve on a free loopback port of the running loop; returns the base URL (``.../v1``)."""
        app = web.Application(client_max_size=self.max_request_bytes, middlewares=[self._errors])
        app.add_routes(
            [
                web.post("/v1/chat/completions", self._chat),
                web.post("/v1/completions", self._text),
                web.post("/v1/reward", self._reward),
                web.get("/v1/models", self._models),
            ]
        )
        self._runner = web.AppRunner(
            app, access_log=None
        )  # the access log would carry no key, but no need
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 -- aiohttp's one way to read port 0
        self.base_url = f"http://127.0.0.1:{port}/v1"
        logger.info("agent proxy serving on %s", self.base_url)
        return self.base_url

    async def stop(self) -> None:
        """Stop serving; every open session ends."""
        for session in self._sessions.values():
            session.ended.set()
        self._sessions.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(
        self, engine: InferenceEngine, gconfig: GenerationHyperparameters, group_id: str, name: str
    ) -> tuple[str, Session]:
        """A new session and its key (a secret: hand it to the agent only)."""
        key = f"areal-{secrets.token_urlsafe(32)}"
        session = Session(
            name, ArealOpenAI(engine, self.tokenizer, gconfig, group_id=group_id, model=MODEL)
        )
        self._sessions[key] = session
        return key, session

    def close(self, key: str) -> None:
        """End the session: its key is refused from now on."""
        session = self._sessions.pop(key, None)
        if session is not None:
            session.ended.set()

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return _error(
                413,
                f"request body over workflow.agent.max_request_mb "
                f"({self.max_request_bytes} bytes); send a smaller conversation or raise it",
            )
        except web.HTTPException as e:
            return _error(e.status, e.reason)

    def _session(self, request: web.Request) -> tuple[str, Session] | web.Response:
        auth = request.headers.get("Authorization", "")
        key = auth[len("Bearer ") :].strip() if auth.startswith("Bearer ") else ""
        session = self._sessions.get(key)
        if session is None:  # the key itself is never echoed nor logged
            return _error(
                401,
                "unknown or ended session key: each episode's agent must use the "
                "OPENAI_API_KEY it was started with, until it posts its reward",
                "authentication_error",
            )
        return key, session

    async def _body(self, request: web.Request) -> dict | web.Response:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(400, f"request body is not JSON: {e}")
        if not isinstance(body, dict):
            return _error(400, f"request body must be a JSON object, got {type(body).__name__}")
        return body

    async def _call(self, request: web.Request, chat: bool) -> web.StreamResponse:
        found = self._session(request)
        if isinstance(found, web.Response):
            return found
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        stream = bool(body.pop("stream", False))
        usage = (
            bool((body.pop("stream_options", None) or {}).get("include_usage")) if stream else False
        )
        client = found[1].client
        try:
            out = await (client.create(**body) if chat else client.complete(**body))
        except EngineFailure as e:
            return _error(503, f"the rollout engine failed: {e}; the run stops", "server_error")
        except (ValueError, TypeError) as e:  # what training cannot honour, named by the client
            return _error(400, str(e))
        if found[0] not in self._sessions:  # the episode ended while the call ran
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
        found = self._session(request)
        if isinstance(found, web.Response):
            return found
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "areal"}],
            }
        )

    async def _reward(self, request: web.Request) -> web.Response:
        found = self._session(request)
        if isinstance(found, web.Response):
            return found
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        key, session = found
        reward = body.get("reward")
        if (
            isinstance(reward, bool)
            or not isinstance(reward, (int, float))
            or reward != reward
            or abs(reward) == float("inf")
        ):
            return _error(400, f"reward: expected a finite number, got {reward!r}")
        if body.get("completion_id") is not None:
            try:
                session.client.set_reward(str(body["completion_id"]), float(reward))
            except ValueError as e:
                return _error(400, str(e))
            return web.json_response({"ok": True, "ended": False})
        session.reward = float(reward)
        self.close(key)
        return web.json_response({"ok": True, "ended": True})


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
