"""``areal view RUN_DIR [RUN_DIR ...]``: a run viewer in the browser, served on loopback.

The page (``viewer_static/``: one HTML file, one script, one style sheet, no CDN) draws the
run's curves as plain SVG and re-reads them every few seconds while the run goes on, lists the
recorded samples (:mod:`areal.utils.samples`) with filters, and shows one sample's completion
tokens coloured by weight version or by trainer-vs-behaviour logprob difference. Given several
run dirs it draws them in the same charts, one colour each.

JSON API (``<run>`` is the run's position on the command line):
``/api/runs``; ``/api/stats/<run>`` (stats.jsonl rows plus ``perf/samples_per_second`` where the
step's samples were recorded); ``/api/samples/<run>?step_min=&step_max=&reward_min=...`` (ranges
over step, reward, staleness, length; ``server=`` / ``worker=``: samples that came from it;
``limit``; the answer lists the run's servers and workers to choose from);
``/api/sample/<run>/<step>/<rank>/<index>``; ``/api/timeline/<run>`` (Core runs: each step's
MFCs per model worker, :func:`areal.utils.samples.read_timeline`; [] for a Lite run).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from areal.utils.logging import get_logger
from areal.utils.samples import SampleIndex, read_timeline, samples_per_step

logger = get_logger("viewer")

STATIC = Path(__file__).with_name("viewer_static")
FILTER_COLUMNS = ("step", "reward", "staleness", "length")
SOURCE_COLUMNS = ("server", "worker")  # filtered by one value (a sample's server may list several)
TABLE_LIMIT = 500  # rows per answer; the page says how many matched


def read_stats_rows(run_dir: Path) -> list[dict[str, Any]]:
    """stats.jsonl's rows (none yet: an empty list; a half-written last line is skipped)."""
    path = run_dir / "stats.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # the run is writing this line now
            continue
    return rows


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

    def stats(self) -> list[dict[str, Any]]:
        """stats.jsonl rows, each with ``perf/samples_per_second`` where it can be computed."""
        rows = read_stats_rows(self.run_dir)
        counts = samples_per_step(self.samples.rows())
        for r in rows:
            secs = r.get("perf/step_seconds")
            if secs and r.get("step") in counts:
                r["perf/samples_per_second"] = counts[r["step"]] / secs
        return rows

    def table(self, query: dict[str, str]) -> dict[str, Any]:
        """Summary rows matching the ``<column>_min`` / ``<column>_max`` ranges and the
        ``server`` / ``worker`` values of ``query``; ``choices``: every server and worker."""
        bounds = parse_bounds(query)
        sources = {c: query[c] for c in SOURCE_COLUMNS if query.get(c)}
        limit = int(query.get("limit", TABLE_LIMIT))
        every = self.samples.rows()
        rows = [
            r
            for r in every
            if all(lo <= r[col] <= hi for col, (lo, hi) in bounds.items())
            and all(v in _sources(r[c]) for c, v in sources.items())
        ]
        choices = {c: sorted({s for r in every for s in _sources(r[c])}) for c in SOURCE_COLUMNS}
        return {"total": len(rows), "rows": rows[:limit], "choices": choices}


def _sources(field: str) -> list[str]:
    """A sample's servers (or worker): one, or several comma-separated after a failover."""
    return [s for s in field.split(",") if s]


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


def make_app(run_dirs: list[str | Path]):
    """The aiohttp application serving the page and the API for ``run_dirs``."""
    from aiohttp import web

    runs = [RunData(d) for d in run_dirs]

    def run_of(request) -> RunData:
        i = int(request.match_info["run"])
        if not 0 <= i < len(runs):
            raise web.HTTPNotFound(text=f"run {i}: the viewer serves runs 0..{len(runs) - 1}")
        return runs[i]

    async def index(_request):
        return web.FileResponse(STATIC / "index.html")

    async def run_list(_request):
        return web.json_response(
            [
                {
                    "id": i,
                    "name": f"{r.run_dir.parent.name}/{r.run_dir.name}",
                    "path": str(r.run_dir),
                }
                for i, r in enumerate(runs)
            ]
        )

    async def stats(request):
        return web.json_response(run_of(request).stats())

    async def table(request):
        try:
            return web.json_response(run_of(request).table(dict(request.query)))
        except ValueError as e:
            raise web.HTTPBadRequest(text=str(e)) from None

    async def timeline(request):
        return web.json_response(read_timeline(run_of(request).run_dir))

    async def sample(request):
        m = request.match_info
        try:
            return web.json_response(
                run_of(request).samples.sample(int(m["step"]), int(m["rank"]), int(m["index"]))
            )
        except KeyError as e:
            raise web.HTTPNotFound(text=str(e.args[0])) from None

    app = web.Application()
    app.router.add_get("/", index)
    app.router.add_static("/static/", STATIC)
    app.router.add_get("/api/runs", run_list)
    app.router.add_get(r"/api/stats/{run:\d+}", stats)
    app.router.add_get(r"/api/samples/{run:\d+}", table)
    app.router.add_get(r"/api/timeline/{run:\d+}", timeline)
    app.router.add_get(r"/api/sample/{run:\d+}/{step:\d+}/{rank:\d+}/{index:\d+}", sample)
    return app


def serve(run_dirs: list[str], port: int, host: str = "127.0.0.1") -> None:
    """Serve the viewer until Ctrl-C (``port`` 0: any free port; the URL is printed)."""
    import asyncio

    from aiohttp import web

    async def main() -> None:
        runner = web.AppRunner(make_app(run_dirs))
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]
        print(f"areal view: http://{host}:{bound}/ (Ctrl-C stops it)", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    asyncio.run(main())
