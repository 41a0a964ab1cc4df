"""Reading what a run recorded for ``areal view``: the trained samples
(:mod:`areal.runtime.samples` writes ``RUN_DIR/samples/step-<step:06d>-rank<r>.parquet``, one row
per trained sequence) and, for Core runs, the MFC timeline (:mod:`areal.core.record` writes
``RUN_DIR/timeline.jsonl``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

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


class SampleIndex:
    """The summary rows of a run's samples, re-read only for files that are new or changed (a
    running run adds one per step)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self._cache: dict[Path, tuple[float, list[dict[str, Any]]]] = {}

    def rows(self) -> list[dict[str, Any]]:
        """Every recorded sample's summary (:data:`SUMMARY_COLUMNS`), in step, rank, index order."""

        out, seen = [], set()
        for _, _, path in sample_files(self.run_dir):
            seen.add(path)
            mtime = path.stat().st_mtime
            cached = self._cache.get(path)
            if cached is None or cached[0] != mtime:
                cached = self._cache[path] = (mtime, _summary_rows(path))
            out.extend(cached[1])
        for gone in set(self._cache) - seen:  # a resume dropped it
            del self._cache[gone]
        return out

    def sample(self, step: int, rank: int, index: int) -> dict[str, Any]:
        """Every column of one sample; KeyError naming it when the run holds no such sample."""
        import pyarrow.parquet as pq

        path = self.run_dir / SAMPLES_DIR / f"step-{step:06d}-rank{rank}.parquet"
        if not path.is_file():
            raise KeyError(f"no samples of step {step} rank {rank} in {path.parent}")
        rows = pq.read_table(path).to_pylist()
        if not 0 <= index < len(rows):
            raise KeyError(
                f"step {step} rank {rank} holds {len(rows)} samples; index {index} is not one"
            )
        return rows[index]


def read_timeline(run_dir: str | Path) -> list[dict[str, Any]]:
    """RUN_DIR/timeline.jsonl's steps in order (the last line of a step wins: a resumed run
    wrote it again; a half-written last line is skipped); [] for a run without one (Lite)."""
    path = Path(run_dir) / TIMELINE
    steps: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # the run is writing it now
            continue
        steps[rec["step"]] = rec
    return [steps[s] for s in sorted(steps)]


def _summary_rows(path: Path) -> list[dict[str, Any]]:
    """One file's summary rows; a column an older recording lacks (server, worker) reads ""."""
    import pyarrow.parquet as pq

    have = set(pq.read_schema(path).names)
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
