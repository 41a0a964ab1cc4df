"""Host and Origin checks for our HTTP listeners (``areal serve``, ``areal view``): the defence
against DNS rebinding and against pages of other sites calling them through a browser.

A browser lets any page send requests to ``127.0.0.1``; two things keep such a page out:

- **Host** (every route): a DNS-rebinding page reaches the listener under its own DNS name, so
  the request's ``Host`` names it. Accepted: IP literals (rebinding needs a name), loopback names
  (``localhost``), the bind address, this machine's host names (``socket.gethostname()``,
  ``socket.getfqdn()``: what cluster peers address it by) and the configured names; ``*``
  accepts any. A request without ``Host`` (an HTTP/1.0 client, never a browser) passes.
- **Origin** (the routes the caller protects: admin and mutating ones): a browser names the
  calling page's origin. Accepted: no ``Origin`` (a non-browser client), the same origin as
  ``Host``, or an origin whose host is a loopback address or name, the bind address, this
  machine's name or a configured name. A page of another site (``Origin: http://evil.example``,
  ``Origin: null``, or no Origin with ``Sec-Fetch-Site: cross-site``) is refused.

A refusal is HTTP 403 with a one-line reason naming the header, its value and the setting that
would allow it.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:  # aiohttp is imported where a listener is built (the config imports this file)
    from aiohttp import web

ANY_HOST = "*"
LOOPBACK_NAMES = ("localhost",)
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def host_name(value: str) -> str | None:
    """The host of a ``Host`` header value (``name``, ``name:port``, ``[v6]:port``), lower case,
    without a trailing dot; None when it is not one."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        rest = value[end + 1 :]
        if end < 0 or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return value[1:end] if is_ip(value[1:end]) else None
    name, colon, port = value.rpartition(":")
    if not colon:
        name = value
    elif not port.isdigit() or ":" in name:
        return None
    name = name.rstrip(".")
    if not name or any(c in name for c in " /\\@?#%,;\"'<>`{}|^\t\r\n"):
        return None
    return name


def is_ip(host: str) -> bool:
    """True for an IPv4 or IPv6 literal (``fe80::1%eth0`` too)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``; False for 0.0.0.0 and real interfaces."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_host_problems(setting: str, names: Sequence[str]) -> list[str]:
    """One message per entry of ``names`` that is not a bare host name, IP or ``*``."""
    problems = []
    for name in names:
        bare = is_ip(name) or (host_name(name) == name.lower().rstrip(".") and ":" not in name)
        if name != ANY_HOST and not bare:
            problems.append(
                f"{setting}: {name!r} is not a bare host name; give names like "
                "gpu-node-3 or host.example.com (no scheme, no port), an IP, or '*' for any"
            )
    return problems


@dataclass(frozen=True)
class HostPolicy:
    """The host names a listener answers to besides IP literals (see the module docstring)."""

    names: frozenset[str]
    any_host: bool = False
    setting: str = "allowed hosts"  # where a user adds a name: named in refusals

    @classmethod
    def build(cls, bind_host: str, allowed: Sequence[str] = (), setting: str = "") -> HostPolicy:
        """The policy of a listener bound to ``bind_host`` that also accepts ``allowed``."""
        names = {*LOOPBACK_NAMES, socket.gethostname(), socket.getfqdn(), bind_host}
        names |= {a for a in allowed if a != ANY_HOST}
        names -= {"", "0.0.0.0", "::"}  # a wildcard bind is no page's host
        clean = frozenset(n for n in (x.lower() if is_ip(x) else host_name(x) for x in names) if n)
        return cls(clean, ANY_HOST in allowed, setting or "allowed hosts")

    def host_refusal(self, header: str | None) -> str:
        """Why a request with this ``Host`` header is refused, or "" when it is accepted."""
        if header is None or self.any_host:
            return ""
        host = host_name(header)
        if host is not None and (is_ip(host) or host in self.names):
            return ""
        return (
            f"Host {header!r} is not a name this listener answers to (loopback names, IP "
            f"literals, its bind address, this machine's names); add the name to "
            f"{self.setting} if clients really use it"
        )

    def origin_refusal(self, origin: str | None, fetch_site: str | None, host: str | None) -> str:
        """Why a browser request from ``origin`` to a protected route is refused, or ""."""
        if self.any_host:
            return ""
        if origin is None:
            if (fetch_site or "").strip().lower() == "cross-site":
                return (
                    "Sec-Fetch-Site: cross-site: pages of other sites may not call this "
                    f"route; add the page's host to {self.setting} to let it"
                )
            return ""
        try:
            parts = urlsplit(origin.strip())
        except ValueError:  # "http://[": not an origin a browser sends
            parts = None
        netloc = parts.netloc.lower() if parts and parts.scheme in ("http", "https") else ""
        name = host_name(netloc) if netloc else None
        if name is not None and (
            netloc == (host or "").strip().lower() or is_loopback(name) or name in self.names
        ):
            return ""
        return (
            f"Origin {origin!r} is another site: its pages may not call this route; add its "
            f"host to {self.setting} to let it"
        )


Handler = Callable[["web.Request"], Awaitable["web.StreamResponse"]]


def guard_middleware(policy: HostPolicy, protected: Callable[[web.Request], bool]):
    """An aiohttp middleware: every request's ``Host`` checked, and the ``Origin`` of those for
    which ``protected(request)`` holds; a refusal is 403 ``{"error": {"message", "type",
    "param"}}`` (``param``: the header) before the handler or the body is touched."""
    from aiohttp import web

    @web.middleware
    async def host_origin_guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host")
        reason, header = policy.host_refusal(host), "Host"
        if not reason and protected(request):
            reason = policy.origin_refusal(
                request.headers.get("Origin"), request.headers.get("Sec-Fetch-Site"), host
            )
            header = "Origin" if request.headers.get("Origin") is not None else "Sec-Fetch-Site"
        if not reason:
            return await handler(request)
        why = f"{request.method} {request.rel_url.raw_path[:200]}: {reason}"
        body = {"error": {"message": why, "type": "forbidden", "param": header, "code": 403}}
        return web.json_response(body, status=403)

    return host_origin_guard


def mutating(request: web.Request) -> bool:
    """A request that may change state: any method but GET, HEAD and OPTIONS."""
    return request.method not in SAFE_METHODS
