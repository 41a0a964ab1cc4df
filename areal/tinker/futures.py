"""The API's futures: a POST queues work and answers ``{"request_id": ...}``; the SDK then polls
``/api/v1/retrieve_future`` until the result is there.

A retrieve call waits up to ``wait_s`` for its result (a long poll; the SDK's own timeout is
45 s), then answers ``{"type": "try_again", ...}`` and the SDK asks again. A failed request
answers ``{"error": ..., "category": "user" | "server"}``, which the SDK raises as
``tinker.RequestFailedError``; the worker goes on with the next request.

Training requests of all models run on one thread (:class:`SerialWorker`), in arrival order: the
SDK sends a training client's requests one after the other (each POST waits for the previous
one's), so arrival order is the client's order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from areal.tinker.wire import ApiError

logger = logging.getLogger(__name__)
KEEP_S = 3600.0  # seconds a finished result stays retrievable (the SDK retrieves it at once)


@dataclass
class Reply:
    """A future's result: the body and its content type (JSON or protobuf)."""

    body: bytes
    content_type: str = "application/json"


@dataclass
class Entry:
    owner: str
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    done_at: float = 0.0


class FutureStore:
    """request id -> its future, its owner's only."""

    def __init__(self):
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()

    def create(self, owner: str) -> tuple[str, Entry]:
        rid = f"req-{secrets.token_hex(8)}"
        entry = Entry(owner)
        entry.future.add_done_callback(lambda _: setattr(entry, "done_at", time.time()))
        now = time.time()
        with self._lock:
            stale = [k for k, e in self._entries.items() if e.done_at and now - e.done_at > KEEP_S]
            for k in stale:
                del self._entries[k]
            self._entries[rid] = entry
        return rid, entry

    def get(self, request_id: str, owner: str) -> Entry:
        entry = self._entries.get(request_id)
        if entry is None:
            raise ApiError(404, f"request_id: {request_id!r} is not a pending or recent request")
        if entry.owner != owner:
            raise ApiError(403, f"request_id: {request_id!r} belongs to another API key")
        return entry

    async def wait(self, entry: Entry, timeout: float) -> Reply | None:
        """The entry's reply, or None when it is not done within ``timeout`` seconds. A failure
        comes back as an error reply (the request's error, not the poll's)."""
        try:
            reply = await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(entry.future)), timeout
            )
        except TimeoutError:
            return None
        except ApiError as e:
            return failure(e.message, "user")
        except Exception as e:
            return failure(f"{type(e).__name__}: {e}", "server")
        return reply


def failure(message: str, category: str) -> Reply:
    """The body of a failed future (``tinker.RequestFailedError`` on the client)."""
    return Reply(json.dumps({"error": message, "category": category}).encode())


class SerialWorker:
    """One thread running queued jobs in order; a job's exception fails its future only."""

    def __init__(self, name: str):
        self._queue: queue.Queue[tuple[Callable[[], Reply], Entry] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Reply], entry: Entry) -> None:
        self._queue.put((fn, entry))

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, entry = item
            try:
                entry.future.set_result(fn())
            except ApiError as e:
                entry.future.set_exception(e)
            except Exception as e:  # a failed request fails alone; the service goes on
                logger.exception("tinker request failed")
                entry.future.set_exception(e)

    def stop(self, timeout: float = 60.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
