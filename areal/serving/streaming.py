"""OpenAI streaming (``stream: true``) for /v1/completions and /v1/chat/completions: server-sent
events, one ``data: {chunk}`` per piece of new text of each choice, a last chunk per choice with
its ``finish_reason``, a usage chunk with ``stream_options.include_usage`` (as OpenAI documents:
``choices`` empty; every other chunk then carries ``"usage": null``), then
``data: [DONE]``.

Tokens reach the handler as the generator makes them (``on_token``). A chat choice's role-only
first chunk goes out with its first token (or its end), so a client's time to first token is
the model's, not the request's parse. Text is sent as it decodes,
holding back what could still change: a trailing partial UTF-8 character, and the last
``len(stop) - 1`` characters while a stop string may be forming (the final text is cut at a
matched stop string, so nothing after it was sent). A chat answer that may call tools is sent
in one chunk when it ends (content and ``tool_calls`` deltas). A failure after the stream began
is an ``error`` event, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from areal.serving.generator import GenerationResult
from areal.serving.openai_api import chat_finish
from areal.serving.protocol import Job, now, render_text, usage
from areal.serving.tools import ToolUse, answer_calls


def _chunk(
    kind: str, ident: str, model: str, index: int, text: str, finish: str | None, role: bool = False
) -> dict:
    if kind == "chat":
        delta = (
            {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        )
        body, obj = {"delta": delta}, "chat.completion.chunk"
    else:
        body, obj = {"text": text}, "text_completion"
    choice = {"index": index, **body, "logprobs": None, "finish_reason": finish}
    return {"id": ident, "object": obj, "created": now(), "model": model, "choices": [choice]}


def _safe_prefix(text: str, jobs_stop: tuple[str, ...]) -> str:
    """``text`` less what may still change: a trailing U+FFFD (a partial UTF-8 character) and
    the tail a stop string could begin in."""
    text = text.rstrip("\ufffd")
    found = [i for i in (text.find(s) for s in jobs_stop) if i >= 0]
    if found:  # a complete stop string: the final text ends before it
        return text[: min(found)]
    hold = max((len(s) for s in jobs_stop), default=1) - 1
    return text[: len(text) - hold] if hold else text


def _tool_chunk(
    ident: str, model: str, index: int, text: str, r: GenerationResult, use: ToolUse
) -> dict:
    content, calls = answer_calls(text, use)
    delta: dict[str, Any] = {"content": content} if content else {}
    if calls:
        delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
    choice = {
        "index": index,
        "delta": delta,
        "logprobs": None,
        "finish_reason": chat_finish(calls, r),
    }
    return {
        "id": ident,
        "object": "chat.completion.chunk",
        "created": now(),
        "model": model,
        "choices": [choice],
    }


class _Stream:
    """The state of one streamed request: per choice the tokens so far, the text sent, the
    result once it finished."""

    def __init__(
        self,
        resp: web.StreamResponse,
        kind: str,
        model: str,
        jobs: list[Job],
        decode: Callable,
        include_usage: bool,
    ):
        self.resp, self.kind, self.model, self.jobs, self.decode = resp, kind, model, jobs, decode
        self.include_usage = include_usage
        self.ident = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        # a chat answer that may hold tool calls is sent whole at its end (a call is known once
        # its block closes)
        uses = [job.extra.get("tool_use") for job in jobs]  # None on /v1/completions
        self.calls_parsed = {i for i, use in enumerate(uses) if use is not None and use.parse_calls}
        self.ids: list[list[int]] = [[] for _ in jobs]
        self.sent = [""] * len(jobs)
        self.opened: set[int] = set()  # chat choices whose role chunk went out
        self.results: list[GenerationResult | None] = [None] * len(jobs)

    async def send(self, obj: Any) -> None:
        if self.include_usage and "choices" in obj:
            obj.setdefault("usage", None)
        await self.resp.write(f"data: {json.dumps(obj)}\n\n".encode())

    def chunk(self, i: int, text: str, finish: str | None, role: bool = False) -> dict:
        return _chunk(
            self.kind, self.ident, self.model, self.jobs[i].extra["index"], text, finish, role
        )

    async def open(self, i: int) -> None:
        """Send chat choice ``i``'s role-only chunk, once, before its first text."""
        if self.kind == "chat" and i not in self.opened:
            self.opened.add(i)
            await self.send(self.chunk(i, "", None, role=True))

    async def advance(self, i: int) -> None:
        """Send choice ``i``'s new text that can no longer change."""
        await self.open(i)
        job = self.jobs[i]
        text = _safe_prefix(self.decode(self.ids[i], job.skip_special_tokens), job.params.stop)
        if len(text) > len(self.sent[i]) and text.startswith(self.sent[i]):
            await self.send(self.chunk(i, text[len(self.sent[i]) :], None))
            self.sent[i] = text

    async def finish(self, i: int, r: GenerationResult) -> None:
        """Send the rest of choice ``i`` with its finish reason."""
        self.results[i] = r
        await self.open(i)
        final = render_text(self.jobs[i], r, self.decode)
        if i in self.calls_parsed:
            job = self.jobs[i]
            await self.send(
                _tool_chunk(
                    self.ident,
                    self.model,
                    job.extra["index"],
                    final,
                    r,
                    job.extra["tool_use"],
                )
            )
        else:
            rest = final[len(self.sent[i]) :] if final.startswith(self.sent[i]) else ""
            await self.send(self.chunk(i, rest, r.finish_reason))

    async def step(
        self, queue: asyncio.Queue[tuple[int, int]], futures: list[asyncio.Future]
    ) -> None:
        """Wait for new tokens (``(choice, token)`` on ``queue``) or a choice's end, then send
        what became sendable: new text, and the end of each choice whose tokens all arrived."""
        getter = asyncio.ensure_future(queue.get())
        open_futures = [f for f, r in zip(futures, self.results) if r is None]
        await asyncio.wait([getter, *open_futures], return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
            getter.cancel()
        items = [getter.result()] if getter.done() and not getter.cancelled() else []
        while not queue.empty():
            items.append(queue.get_nowait())
        for i, tok in items:
            self.ids[i].append(tok)
        for i in {i for i, _ in items}:
            if i in self.calls_parsed:
                await self.open(i)
            else:
                await self.advance(i)
        for i, f in enumerate(futures):
            if self.results[i] is None and f.done() and queue.empty():
                await self.finish(i, f.result())

    async def send_usage(self) -> None:
        """The usage chunk (``stream_options.include_usage``): no choices, the request's
        token counts (sent once every result is in)."""
        await self.send(
            {
                "id": self.ident,
                "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                "created": now(),
                "model": self.model,
                "choices": [],
                "usage": usage(self.jobs, [r for r in self.results if r is not None]),
            }
        )


async def stream(
    request: web.Request,
    kind: str,
    model: str,
    jobs: list[Job],
    submit: Callable[[list[Callable[[int], object]]], list],
    decode: Callable,
    include_usage: bool,
) -> web.StreamResponse:
    """Run ``jobs`` (``submit(on_token callbacks) -> futures``) and stream their text."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    callbacks: list[Callable[[int], object]] = [  # their return is ignored
        lambda tok, i=i: loop.call_soon_threadsafe(queue.put_nowait, (i, tok))
        for i in range(len(jobs))
    ]
    futures = [asyncio.wrap_future(f) for f in submit(callbacks)]
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    st = _Stream(resp, kind, model, jobs, decode, include_usage)
    try:
        while any(r is None for r in st.results):
            await st.step(queue, futures)
        if include_usage:
            await st.send_usage()
    except (asyncio.CancelledError, ConnectionResetError):
        for f in futures:
            f.cancel()  # the client went away: free the slots
        raise
    except Exception as e:  # headers are sent: the error travels as an event
        await st.send(
            {"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error", "code": 500}}
        )
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
