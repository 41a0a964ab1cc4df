"""``areal view RUN_DIR [RUN_DIR ...]``: a run viewer in the browser, served on loopback
(``--host ADDR`` listens elsewhere, with a warning: :func:`exposure_warning`).

The page (``viewer_static/``: one HTML file, one script, one style sheet, and uPlot in
``vendor/``; no CDN) draws the run's curves (RL, SFT, RM, DPO) with real axes and a smoothing
control and re-reads them every few seconds while the run goes on, lists the recorded samples
(:mod:`areal.utils.samples`) with filters, and shows one sample's prompt, reference answer and
completion tokens coloured by weight version (the staleness chart's colours), by the server's
probability or by trainer-vs-behaviour logprob difference. Given several run dirs it draws them
in the same charts, one colour each.

JSON API (``<run>`` is the run's position on the command line):
``/api/runs``; ``/api/stats/<run>`` (stats.jsonl rows plus ``perf/samples_per_second`` where the
step's samples were recorded); ``/api/samples/<run>?step_min=&step_max=&reward_min=...`` (ranges
over step, reward, staleness, length; ``server=`` / ``worker=``: samples that came from it;
``limit``; the answer lists the run's servers and workers to choose from);
``/api/sample/<run>/<step>/<rank>/<index>``; ``/api/timeline/<run>`` (Core runs: each step's
MFCs per model worker, :func:`areal.utils.samples.read_timeline`; [] for a Lite run).

Answers are strict JSON: a non-finite number (a NaN reward) is sent as the string ``"NaN"``,
``"Infinity"`` or ``"-Infinity"``, which the page shows as written. An empty or truncated recorded
file or line is skipped with one warning (:mod:`areal.utils.samples`), never an error. Every
request's ``Host`` must be a loopback name or address (or one given with ``--allowed-host``), and
the API refuses pages of other sites (:mod:`areal.utils.http_guard`).
"""

from __future__ import annotations

import json
import math
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from areal.utils.logging import get_logger
from areal.utils.samples import SampleIndex, Skipped, read_jsonl, read_timeline, samples_per_step

logger = get_logger("viewer")

STATIC = Path(__file__).with_name("viewer_static")
FILTER_COLUMNS = ("step", "reward", "staleness", "length")
SOURCE_COLUMNS = ("server", "worker")  # filtered by one value (a sample's server may list several)
TABLE_LIMIT = 500  # rows per answer; the page says how many matched


class CannotStart(Exception):
    """The viewer cannot start (its port is taken, a bad ``--allowed-host``): one line naming
    the cause and the fix."""


def strict_json(data: Any) -> str:
    """``data`` as strict JSON (a browser's ``JSON.parse`` rejects NaN): non-finite floats become
    the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``."""
    try:
        return json.dumps(data, allow_nan=False)
    except ValueError:  # rare: only then walk the data
        return json.dumps(_finite(data), allow_nan=False)


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class RunData:
    """One run dir's stats and samples, as the API serves them."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        if not self.run_dir.is_dir():
            raise FileNotFoundError(
                f"{run_dir}: not a directory; pass a RUN_DIR "
                "(fileroot/experiment_name/trial_name, holding stats.jsonl)"
            )
        self.samples = SampleIndex(self.run_dir)
        self.skipped: Skipped = self.samples.skipped

    def stats(self) -> list[dict[str, Any]]:
        """stats.jsonl rows (those with an integer step), each with ``perf/samples_per_second``
        where it can be computed; unreadable lines and sample files are skipped with a warning."""
        rows = [
            r
            for r in read_jsonl(self.run_dir / "stats.jsonl", self.skipped)
            if isinstance(r.get("step"), int)
        ]
        counts = samples_per_step(self.samples.rows())
        for r in rows:
            secs = r.get("perf/step_seconds")
            if isinstance(secs, (int, float)) and secs > 0 and r["step"] in counts:
                r["perf/samples_per_second"] = counts[r["step"]] / secs
        return rows

    def timeline(self) -> list[dict[str, Any]]:
        """The Core MFC timeline (:func:`areal.utils.samples.read_timeline`)."""
        return read_timeline(self.run_dir, self.skipped)

    def table(self, query: dict[str, str]) -> dict[str, Any]:
        """Summary rows matching the ``<column>_min`` / ``<column>_max`` ranges and the
        ``server`` / ``worker`` values of ``query``; ``choices``: every server and worker."""
        bounds = parse_bounds(query)
        sources = {c: query[c] for c in SOURCE_COLUMNS if query.get(c)}
        try:
            limit = int(query.get("limit", TABLE_LIMIT))
        except ValueError:
            limit = -1
        if limit < 0:
            raise ValueError(
                f"limit={query['limit']!r} is not a row count; give an integer >= 0 or leave it out"
            )
        every = self.samples.rows()
        rows = [
            r
            for r in every
            if all(_number(r[col]) and lo <= r[col] <= hi for col, (lo, hi) in bounds.items())
            and all(v in _sources(r[c]) for c, v in sources.items())
        ]
        choices = {c: sorted({s for r in every for s in _sources(r[c])}) for c in SOURCE_COLUMNS}
        return {"total": len(rows), "rows": rows[:limit], "choices": choices}


def _sources(field: Any) -> list[str]:
    """A sample's servers (or worker): one, or several comma-separated after a failover."""
    return [s for s in field.split(",") if s] if isinstance(field, str) else []


def parse_bounds(query: dict[str, str]) -> dict[str, tuple[float, float]]:
    """``{column: (lo, hi)}`` from ``<column>_min`` / ``<column>_max`` query values (empty = open);
    ValueError naming the parameter and value when one is not a number."""
    out = {}
    for col in FILTER_COLUMNS:
        lo, hi = -math.inf, math.inf
        for side in ("min", "max"):
            raw = query.get(f"{col}_{side}", "").strip()
            if not raw:
                continue
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(
                    f"{col}_{side}={raw!r} is not a number; give a number or leave it empty"
                ) from None
            lo, hi = (value, hi) if side == "min" else (lo, value)
        if (lo, hi) != (-math.inf, math.inf):
            out[col] = (lo, hi)
    return out


class _Api:
    """The viewer's request handlers over its runs."""

    def __init__(self, run_dirs: Sequence[str | Path]):
        self.runs = [RunData(d) for d in run_dirs]

    @staticmethod
    def answer(data: Any):
        from aiohttp import web

        return web.Response(text=strict_json(data), content_type="application/json")

    def run_of(self, request) -> RunData:
        from aiohttp import web

        i = int(request.match_info["run"])
        if not 0 <= i < len(self.runs):
            raise web.HTTPNotFound(text=f"run {i}: the viewer serves runs 0..{len(self.runs) - 1}")
        return self.runs[i]

    async def index(self, _request):
        from aiohttp import web

        return web.FileResponse(STATIC / "index.html")

    async def run_list(self, _request):
        return self.answer(
            [
                {
                    "id": i,
                    "name": f"{r.run_dir.parent.name}/{r.run_dir.name}",
                    "path": str(r.run_dir),
                }
                for i, r in enumerate(self.runs)
            ]
        )

    async def stats(self, request):
        return self.answer(self.run_of(request).stats())

    async def table(self, request):
        from aiohttp import web

        try:
            return self.answer(self.run_of(request).table(dict(request.query)))
        except ValueError as e:
            raise web.HTTPBadRequest(text=str(e)) from None

    async def timeline(self, request):
        return self.answer(self.run_of(request).timeline())

    async def sample(self, request):
        from aiohttp import web

        m = request.match_info
        try:
            found = self.run_of(request).samples.sample(
                int(m["step"]), int(m["rank"]), int(m["index"])
            )
        except KeyError as e:
            raise web.HTTPNotFound(text=str(e.args[0])) from None
        return self.answer(found)


def make_app(
    run_dirs: Sequence[str | Path], allowed_hosts: Sequence[str] = (), host: str = "127.0.0.1"
):
    """The aiohttp application serving the page and the API for ``run_dirs``, listening on
    ``host``; requests must name a loopback host, ``host`` or one of ``allowed_hosts``
    (:mod:`areal.utils.http_guard`)."""
    from aiohttp import web

    from areal.utils.http_guard import HostPolicy, guard_middleware

    api = _Api(run_dirs)
    hosts = HostPolicy.build(host, allowed_hosts, "--allowed-host")
    app = web.Application(
        middlewares=[guard_middleware(hosts, lambda r: r.path.startswith("/api/"))]
    )
    app.router.add_get("/", api.index)
    app.router.add_static("/static/", STATIC)
    app.router.add_get("/api/runs", api.run_list)
    app.router.add_get(r"/api/stats/{run:\d+}", api.stats)
    app.router.add_get(r"/api/samples/{run:\d+}", api.table)
    app.router.add_get(r"/api/timeline/{run:\d+}", api.timeline)
    app.router.add_get(r"/api/sample/{run:\d+}/{step:\d+}/{rank:\d+}/{index:\d+}", api.sample)
    return app


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``; :class:`CannotStart` naming the port and ``--port`` when
    it cannot be (taken by another process)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp's sites do
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise CannotStart(
            f"cannot listen on {host}:{port}: {e.strerror or e}; stop what holds it, or pass "
            "--port N (--port 0 = any free port)"
        ) from None
    return sock


def exposure_warning(host: str, port: int) -> str:
    """The warning ``areal view --host ADDR`` prints when ADDR is not loopback (other machines
    can then read the run), naming the SSH tunnel that avoids it; "" for a loopback ADDR."""
    from areal.utils.http_guard import is_loopback

    if is_loopback(host):  # a host name other than localhost may resolve to any interface
        return ""
    return (
        f"areal view: listening on {host}:{port}, which other machines may reach: anyone who "
        "can reads this run's prompts, completions and stats (there is no login). Prefer the "
        f"default loopback address and an SSH tunnel from your machine: ssh -L {port}:127.0.0.1:"
        f"{port} THIS_HOST, then open http://127.0.0.1:{port}/ (docs/viewer.md). A browser "
        "reaching this host by a name needs --allowed-host NAME."
    )


def serve(
    run_dirs: list[str], port: int, host: str = "127.0.0.1", allowed_hosts: Sequence[str] = ()
) -> None:
    """Serve the viewer on ``host`` until Ctrl-C (``port`` 0: any free port; the URL is printed,
    and :func:`exposure_warning` to stderr when ``host`` is not loopback); :class:`CannotStart`
    when the port is taken or an allowed host is not a host name."""
    import asyncio

    from aiohttp import web

    from areal.utils.http_guard import allowed_host_problems

    if problems := allowed_host_problems("--allowed-host", allowed_hosts):
        raise CannotStart(problems[0])

    app = make_app(run_dirs, allowed_hosts, host)  # a bad RUN_DIR fails before the port is taken
    sock = bind(host, port)
    if warning := exposure_warning(host, sock.getsockname()[1]):
        print(warning, file=sys.stderr, flush=True)

    async def main() -> None:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.SockSite(runner, sock)
        await site.start()
        bound = sock.getsockname()[1]
        url_host = f"[{host}]" if ":" in host else host
        print(f"areal view: http://{url_host}:{bound}/ (Ctrl-C stops it)", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    asyncio.run(main())
