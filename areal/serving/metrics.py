"""The generation server's counters as ``GET /metrics`` serves them (Prometheus' text format,
as vLLM's and SGLang's servers do, names prefixed ``areal:``) and as the periodic server log
line (:class:`StatsLog`): requests running, waiting and admitted, failed steps, and the prefix
cache's hit and query tokens and hit rate (:meth:`PrefixCache.stats`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from areal.serving.generator import Generator

logger = logging.getLogger("areal.serve")
PATH = "/metrics"

# Generator.load() key -> (Prometheus type, help); keys it lacks (prefix cache off) are left out
METRICS: dict[str, tuple[str, str]] = {
    "running": ("gauge", "Requests decoding now."),
    "waiting": ("gauge", "Requests queued for a cache slot."),
    "admitted_requests": ("counter", "Requests admitted into a cache slot since start."),
    "failed_steps": ("counter", "Generation steps that raised (their requests failed)."),
    "nonfinite_logits": ("counter", "Requests failed by NaN or inf logits."),
    "prefix_cache_hit_tokens": (
        "counter",
        "Prompt tokens found in the prefix cache (not prefilled) since start.",
    ),
    "prefix_cache_query_tokens": (
        "counter",
        "Prompt tokens looked up in the prefix cache since start.",
    ),
    "prefix_cache_hit_rate": ("gauge", "prefix_cache_hit_tokens / prefix_cache_query_tokens."),
    "prefix_cache_tokens": ("gauge", "Tokens whose keys/values the prefix cache holds now."),
    "prefix_cache_capacity_tokens": ("gauge", "The prefix cache's bound in tokens."),
    "prefix_cache_evicted_tokens": ("counter", "Tokens evicted from the prefix cache."),
}


def render(load: Mapping[str, object]) -> str:
    """``load`` (:meth:`Generator.load`) in Prometheus' text exposition format."""
    lines = []
    for key, (kind, text) in METRICS.items():
        value = load.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            name = f"areal:{key}"
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"


def route(generator: Generator) -> web.RouteDef:
    """``GET /metrics`` over ``generator``'s counters."""

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=render(generator.load()), content_type="text/plain")

    return web.get(PATH, metrics)


def summary(load: Mapping[str, object]) -> str:
    """One log line of ``load``: requests, and the prefix cache's hits when it is on."""
    line = (
        f"running {load.get('running')}, waiting {load.get('waiting')}, "
        f"admitted {load.get('admitted_requests')}"
    )
    if "prefix_cache_query_tokens" in load:
        line += (
            f"; prefix cache hit rate {load['prefix_cache_hit_rate']:.1%} "
            f"({load['prefix_cache_hit_tokens']} of {load['prefix_cache_query_tokens']} prompt "
            f"tokens), holds {load['prefix_cache_tokens']} of "
            f"{load['prefix_cache_capacity_tokens']} tokens"
        )
    return line


class StatsLog:
    """Logs :func:`summary` every ``interval`` seconds (0: never), when requests were admitted
    since the last line (an idle server stays quiet)."""

    def __init__(self, interval: float):
        self.interval = interval
        self._last_at: float | None = None
        self._last_admitted: object = 0

    def tick(self, now: float, load: Mapping[str, object]) -> bool:
        """Log a line if one is due at ``now`` (seconds, monotonic); True when logged."""
        if not self.interval:
            return False
        if self._last_at is None:
            self._last_at = now
        if now - self._last_at < self.interval or load.get("admitted_requests") == (
            self._last_admitted
        ):
            return False
        self._last_at, self._last_admitted = now, load.get("admitted_requests")
        logger.info("stats: %s", summary(load))
        return True
