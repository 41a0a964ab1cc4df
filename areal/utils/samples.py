"""Reading what a run recorded for ``areal view``: the trained samples
(:mod:`areal.runtime.samples` writes ``RUN_DIR/samples/step-<step:06d>-rank<r>.parquet``, one row
per trained sequence) and, for Core runs, the MFC timeline (:mod:`areal.core.record` writes
``RUN_DIR/timeline.jsonl``).

Recorded files are read defensively: a run may be writing one now, and a killed run or a full
disk leaves a file empty or truncated. Such a file or line is skipped with one warning (the viewer
re-reads every few seconds), never an error that hides the rest of the run."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from areal.utils.jsonl import parse_line
from areal.utils.logging import get_logger

logger = get_logger("viewer")

SAMPLES_DIR = "samples"
TIMELINE = "timeline.jsonl"  # Core runs: each step's MFCs per model worker (areal.core.record)
FILE_RE = re.compile(r"step-(\d+)-rank(\d+)\.parquet")
# The columns of a table row; the per-token lists are read only for one sample's page.
SUMMARY_COLUMNS = [
    "step",
    "rank",
    "index",
    "group",
    "sample_id",
    "status",
    "reward",
    "advantage",
    "trainer_version",
    "staleness",
    "prompt_len",
    "length",
    "server",
    "worker",
    "completion_text",
]


def sample_files(run_dir: str | Path) -> list[tuple[int, int, Path]]:
    """``(step, rank, path)`` of every recorded step file of RUN_DIR, in step then rank order."""
    root = Path(run_dir) / SAMPLES_DIR
    found = [
        (int(m[1]), int(m[2]), p)
        for p in root.glob("step-*-rank*.parquet")
        if (m := FILE_RE.fullmatch(p.name))
    ]
    return sorted(found)


class Skipped:
    """The unreadable pieces of a run, each logged once: ``warn(key, message)``."""

    def __init__(self) -> None:
        self.seen: set[tuple] = set()

    def warn(self, key: tuple, message: str) -> None:
        if key not in self.seen:
            self.seen.add(key)
            logger.warning(message)


def read_jsonl(path: Path, skipped: Skipped) -> list[dict[str, Any]]:
    """The JSON objects of ``path``, one a line ([] without the file); a line that is empty,
    not JSON (half-written, truncated) or not an object is skipped with one warning per line
    (unlike :func:`areal.utils.jsonl.read_records`, which warns at every read)."""
    try:
        text = path.read_bytes().decode("utf-8", "replace")
    except FileNotFoundError:
        return []
    except OSError as e:
        skipped.warn((path,), f"{path}: unreadable ({e}); skipped")
        return []
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        row = parse_line(line)
        if row is not None:
            rows.append(row)
            continue
        skipped.warn(
            (path, n),
            f"{path}:{n}: not a JSON object (empty, or half-written); skipped: {line[:80]!r}",
        )
    return rows


class SampleIndex:
    """The summary rows of a run's samples, re-read only for files that are new or changed (a
    running run adds one per step); an unreadable file is skipped with one warning."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.skipped = Skipped()
        self._cache: dict[Path, tuple[float, list[dict[str, Any]]]] = {}

    def rows(self) -> list[dict[str, Any]]:
        """Every recorded sample's summary (:data:`SUMMARY_COLUMNS`), in step, rank, index order."""

        out, seen = [], set()
        for _, _, path in sample_files(self.run_dir):
            try:
                mtime = path.stat().st_mtime
            except FileNotFoundError:  # a resume dropped it just now
                continue
            seen.add(path)
            cached = self._cache.get(path)
            if cached is None or cached[0] != mtime:
                cached = self._cache[path] = (mtime, self._read_summary(path))
            out.extend(cached[1])
        for gone in set(self._cache) - seen:  # a resume dropped it
            del self._cache[gone]
        return out

    def _read_summary(self, path: Path) -> list[dict[str, Any]]:
        """``path``'s summary rows; [] and one warning for a file that cannot be read."""
        rows, why = _read_parquet(path, _summary_rows)
        if why:
            self.skipped.warn((path, "summary"), f"{path}: {why}; its samples are skipped")
        return rows

    def sample(self, step: int, rank: int, index: int) -> dict[str, Any]:
        """Every column of one sample; KeyError naming it when the run holds no such sample or
        its file cannot be read."""
        import pyarrow.parquet as pq

        path = self.run_dir / SAMPLES_DIR / f"step-{step:06d}-rank{rank}.parquet"
        try:
            found = path.is_file()
        except OSError:  # a name past the file system's limit: a step no run has
            found = False
        if not found:
            raise KeyError(f"no samples of step {step} rank {rank} in {path.parent}")
        rows, why = _read_parquet(path, lambda p: pq.read_table(p).to_pylist())
        if why:
            raise KeyError(f"step {step} rank {rank}: {path}: {why}")
        if not 0 <= index < len(rows):
            raise KeyError(
                f"step {step} rank {rank} holds {len(rows)} samples; index {index} is not one"
            )
        return rows[index]


def read_timeline(run_dir: str | Path, skipped: Skipped | None = None) -> list[dict[str, Any]]:
    """RUN_DIR/timeline.jsonl's steps in order (the last line of a step wins: a resumed run
    wrote it again; a half-written or malformed line is skipped with a warning); [] for a run
    without one (Lite)."""
    path = Path(run_dir) / TIMELINE
    skipped = skipped or Skipped()
    steps: dict[int, dict[str, Any]] = {}
    for rec in read_jsonl(path, skipped):
        step, seconds, spans = rec.get("step"), rec.get("seconds"), rec.get("spans")
        if (
            isinstance(step, int)
            and isinstance(seconds, (int, float))
            and isinstance(spans, list)
            and all(isinstance(s, dict) for s in spans)
        ):
            steps[step] = rec
        else:
            skipped.warn(
                (path, "step", repr(step)[:40]),  # any JSON value: a list is not hashable
                f"{path}: a step record without step, seconds and spans; skipped: {str(rec)[:80]}",
            )
    return [steps[s] for s in sorted(steps)]


def _read_parquet(path: Path, read: Callable[[Path], list]) -> tuple[list, str]:
    """``(read(path), "")``, or ``([], why)`` for a file that cannot be read (empty,
    truncated, not Parquet, gone, without the step/rank/index columns)."""
    import pyarrow as pa

    try:
        return read(path), ""
    except (OSError, ValueError, KeyError, pa.ArrowException) as e:
        size = path.stat().st_size if path.exists() else 0
        first = (str(e).splitlines() or [type(e).__name__])[0][:120]
        return [], f"unreadable ({size} bytes; empty or truncated? {first})"


def _summary_rows(path: Path) -> list[dict[str, Any]]:
    """One file's summary rows; a column an older recording lacks (server, worker) reads ""."""
    import pyarrow.parquet as pq

    have = set(pq.read_schema(path).names)
    if lost := [c for c in ("step", "rank", "index") if c not in have]:
        raise KeyError(f"no column {lost[0]!r}")
    rows = pq.read_table(path, columns=[c for c in SUMMARY_COLUMNS if c in have]).to_pylist()
    missing = [c for c in SUMMARY_COLUMNS if c not in have]
    for r in rows:
        r.update(dict.fromkeys(missing, ""))
    return rows


def samples_per_step(rows: list[dict[str, Any]]) -> dict[int, int]:
    """How many samples each recorded step trained (all ranks)."""
    counts: dict[int, int] = {}
    for r in rows:
        counts[r["step"]] = counts.get(r["step"], 0) + 1
    return counts
