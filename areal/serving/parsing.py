"""Request parsing off the event loop, on two lanes so short requests never queue behind long
ones.

JSON decoding, chat templates and tokenizing take time proportional to the body: a 1 MB prompt
tokenizes in about a second. On one thread, four of them made a 4-token request wait 7 s while
``/health`` (which parses nothing) stayed fast, so failover never noticed. Here a body of at most
``server.parse_small_body_bytes`` bytes goes to a thread of its own (its work is bounded by that
size), and longer ones to ``server.parse_threads`` threads. At most ``server.max_queued_parses``
long bodies wait for those threads; past that a long request is refused at once (HTTP 503 with
Retry-After, the server's back-pressure answer). Every parse has a deadline,
``server.request_parse_timeout``, counted from its arrival: past it the request is answered the
same and, if its parse has not started, the parse is
dropped (a running one cannot be interrupted; its time is bounded by ``server.max_text_chars``).

The tokenizer is shared by the threads: an HF fast tokenizer call takes the Rust tokenizer
mutably only to change its truncation or padding, which the server never sets, so concurrent
encodes only read it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

from areal.serving.requests import Overloaded

T = TypeVar("T")


class ParsePool:
    """Runs a request's parse on the small or the long lane, within its deadline."""

    def __init__(self, threads: int, small_bytes: int, max_queued: int, timeout: float):
        self.small_bytes, self.max_queued, self.timeout = small_bytes, max_queued, timeout
        self.threads = threads
        self._small = concurrent.futures.ThreadPoolExecutor(1, "areal-parse-small")
        self._long = concurrent.futures.ThreadPoolExecutor(threads, "areal-parse")
        self._lock = threading.Lock()
        self._long_pending = 0  # long parses queued or running

    async def run(self, size: int, parse: Callable[[], T]) -> T:
        """``parse()`` on a parse thread for a body of ``size`` bytes; :class:`Overloaded` when
        the long lane is full or the deadline passes first."""
        if size <= self.small_bytes:
            fut = self._small.submit(parse)
        else:
            fut = self._submit_long(size, parse)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout)
        except TimeoutError:  # wrap_future's cancel dropped the parse unless it had started
            lane = "short" if size <= self.small_bytes else "long"
            raise Overloaded(
                "body",
                f"not parsed within {self.timeout} s (server.request_parse_timeout): the "
                f"{lane}-body parse threads are busy with other requests; retry later",
            ) from None

    def _submit_long(self, size: int, parse: Callable[[], T]) -> concurrent.futures.Future:
        with self._lock:
            waiting = self._long_pending - self.threads
            if waiting >= self.max_queued:
                raise Overloaded(
                    "body",
                    f"a body of {size} bytes, and {waiting} long bodies already wait for the "
                    f"{self.threads} parse threads (server.max_queued_parses="
                    f"{self.max_queued}); retry later",
                )
            self._long_pending += 1
        fut = self._long.submit(parse)
        fut.add_done_callback(self._long_done)
        return fut

    def _long_done(self, _: concurrent.futures.Future) -> None:
        with self._lock:
            self._long_pending -= 1
