"""OpenAI streaming (``stream: true``) for /v1/completions and /v1/chat/completions: server-sent
events, one ``data: {chunk}`` per piece of new text of each choice, a last chunk per choice with
its ``finish_reason``, a usage chunk with ``stream_options.include_usage``, then
``data: [DONE]``.

Tokens reach the handler as the generator makes them (``on_token``). Text is sent as it decodes,
holding back what could still change: a trailing partial UTF-8 character, and the last
``len(stop) - 1`` characters while a stop string may be forming (the final text is cut at a
matched stop string, so nothing after it was sent). A failure after the stream began is an
``error`` event, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Callable

from aiohttp import web

from areal.serving.generator import GenerationResult
from areal.serving.protocol import Job, now, render_text, usage


def _chunk(kind: str, ident: str, model: str, index: int, text: str, finish: str | None,
           role: bool = False) -> dict:
    if kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"id": ident, "object": "chat.completion.chunk", "created": now(), "model": model,
                "choices": [choice]}
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": ident, "object": "text_completion", "created": now(), "model": model, "choices": [choice]}


def _safe_prefix(text: str, jobs_stop: tuple[str, ...]) -> str:
    """``text`` less what may still change: a trailing U+FFFD (a partial UTF-8 character) and
    the tail a stop string could begin in."""
    text = text.rstrip("\ufffd")
    found = [i for i in (text.find(s) for s in jobs_stop) if i >= 0]
    if found:  # a complete stop string: the final text ends before it
        return text[: min(found)]
    hold = max((len(s) for s in jobs_stop), default=1) - 1
    return text[: len(text) - hold] if hold else text


async def stream(request: web.Request, kind: str, model: str, jobs: list[Job],
                 submit: Callable[[list[Callable[[int], None]]], list], decode: Callable,
                 include_usage: bool) -> web.StreamResponse:
    """Run ``jobs`` (``submit(on_token callbacks) -> futures``) and stream their text."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    callbacks = [lambda tok, i=i: loop.call_soon_threadsafe(queue.put_nowait, (i, tok)) for i in range(len(jobs))]
    futures = [asyncio.wrap_future(f) for f in submit(callbacks)]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    ident = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"

    async def send(obj: Any) -> None:
        await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

    if kind == "chat":
        for job in jobs:
            await send(_chunk(kind, ident, model, job.extra["index"], "", None, role=True))
    ids: list[list[int]] = [[] for _ in jobs]
    sent = [""] * len(jobs)
    results: list[GenerationResult | None] = [None] * len(jobs)
    try:
        while any(r is None for r in results):
            getter = asyncio.ensure_future(queue.get())
            open_futures = [f for f, r in zip(futures, results) if r is None]
            await asyncio.wait([getter, *open_futures], return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
            items = [getter.result()] if getter.done() and not getter.cancelled() else []
            while not queue.empty():
                items.append(queue.get_nowait())
            for i, tok in items:
                ids[i].append(tok)
            for i in {i for i, _ in items}:
                text = _safe_prefix(decode(ids[i], jobs[i].skip_special_tokens), jobs[i].params.stop)
                if len(text) > len(sent[i]) and text.startswith(sent[i]):
                    await send(_chunk(kind, ident, model, jobs[i].extra["index"], text[len(sent[i]):], None))
                    sent[i] = text
            for i, f in enumerate(futures):
                if results[i] is None and f.done() and queue.empty():
                    results[i] = f.result()
                    final = render_text(jobs[i], results[i], decode)
                    rest = final[len(sent[i]):] if final.startswith(sent[i]) else ""
                    await send(_chunk(kind, ident, model, jobs[i].extra["index"], rest,
                                      results[i].finish_reason))
        if include_usage:
            await send({"id": ident, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                        "created": now(), "model": model, "choices": [], "usage": usage(jobs, results)})
    except (asyncio.CancelledError, ConnectionResetError):
        for f in futures:
            f.cancel()  # the client went away: free the slots
        raise
    except Exception as e:  # headers are sent: the error travels as an event
        await send({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error", "code": 500}})
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
