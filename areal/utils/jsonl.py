"""Defensive reading and rewriting of the run dir's JSON-lines files (``stats.jsonl``,
``replay/hashes.jsonl``, ``trained_samples-rank<r>.jsonl``).

A run killed in the middle of a write leaves a half-written last line. Readers skip a line that
is not a complete JSON object, with a warning naming the file and the line; a writer that goes
on appending first cuts the file back to its last complete line, so the file stays valid JSONL.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from areal.utils.logging import get_logger

logger = get_logger("jsonl")


def parse_line(line: str) -> dict[str, Any] | None:
    """The JSON object on ``line``, or None when it is empty, cut short or not an object."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Every complete JSON object line of ``path`` in order ([] when there is no file); a line
    that is not one is skipped with a warning naming the file and its line numbers."""
    return [record for _, record in _read_lines(Path(path))]


def _read_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, its record) of every complete JSON object line; warns about the others."""
    if not path.is_file():
        return []
    records, bad = [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        record = parse_line(line)
        if record is None:
            bad.append(number)
        else:
            records.append((line, record))
    if bad:
        logger.warning(
            f"{path}: skipped {len(bad)} line(s) that are not a complete JSON object "
            f"(line {', '.join(map(str, bad[:5]))}; a run killed while writing leaves one)"
        )
    return records


def repair_tail(path: str | Path) -> int:
    """Cut ``path`` back to its last complete line (one ending in a newline) before appending to
    it; returns the bytes dropped (0 when it already ends with a newline, or does not exist)."""
    path = Path(path)
    if not path.is_file():
        return 0
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return 0
    keep = data.rfind(b"\n") + 1  # 0 when no line is complete
    with open(path, "r+b") as f:
        f.truncate(keep)
    logger.warning(
        f"{path}: dropped a half-written last line ({len(data) - keep} bytes: "
        f"{data[keep : keep + 60]!r}) before appending"
    )
    return len(data) - keep


def keep_steps_upto(path: str | Path, step: int) -> None:
    """Rewrite ``path`` (atomically) with its records whose ``step`` is at most ``step``: a
    resume from the checkpoint of ``step`` writes the later ones again. Lines that are not a
    record with an integer ``step`` are dropped (:func:`read_records` warns)."""
    path = Path(path)
    if not path.is_file():
        return
    kept = [
        line
        for line, r in _read_lines(path)
        if isinstance(r.get("step"), int) and not isinstance(r["step"], bool) and r["step"] <= step
    ]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
