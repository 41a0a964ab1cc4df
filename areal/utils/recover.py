"""Atomic recover checkpoints under ``RUN_DIR/recover``.

Layout: ``ckpt-<step>/`` directories (whatever the trainer writes: DCP shards, per-rank
``state-rank<r>.pt`` with dataloader / executor / counter / timer state) and a ``LATEST`` file
naming the newest complete one. A checkpoint is written into ``ckpt-<step>.tmp``, renamed into
place only after every rank finished, and only then does ``LATEST`` move (itself replaced
atomically). A crash at any point leaves ``LATEST`` naming the previous, complete checkpoint.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch


def _noop() -> None:
    pass


class RecoverDir:
    """Writes and finds recover checkpoints; every rank constructs one over the same root."""

    def __init__(self, root: str | Path, rank: int = 0, barrier: Callable[[], None] = _noop, keep: int = 1):
        self.root = Path(root)
        self.rank = rank
        self.barrier = barrier
        self.keep = keep

    def latest(self) -> Path | None:
        """The newest complete checkpoint directory, or None."""
        pointer = self.root / "LATEST"
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        if not path.is_dir():
            raise RuntimeError(
                f"{pointer} names {path.name}, which does not exist; the recover dir was edited "
                f"by hand? Delete {self.root} to start fresh"
            )
        return path

    @contextmanager
    def writing(self, step: int) -> Iterator[Path]:
        """Yield a temp dir every rank writes into; publish it atomically when all are done."""
        final = self.root / f"ckpt-{step}"
        tmp = self.root / f"ckpt-{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftover of a crash mid-write
            tmp.mkdir(parents=True)
        self.barrier()
        yield tmp
        self.barrier()
        if self.rank == 0:
            _fsync_tree(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _atomic_write(self.root / "LATEST", final.name)
            self._prune(final)
        self.barrier()

    def _prune(self, newest: Path) -> None:
        done = sorted(
            (p for p in self.root.glob("ckpt-*") if p.is_dir() and not p.name.endswith(".tmp")),
            key=lambda p: int(p.name.split("-")[1]),
        )
        for old in done[: max(0, len(done) - self.keep)]:
            if old != newest:
                shutil.rmtree(old, ignore_errors=True)


def save_state(ckpt_dir: Path, rank: int, state: dict[str, Any]) -> None:
    """Write one rank's non-tensor-engine state (dataloader, executor, counters, timers)."""
    torch.save(state, ckpt_dir / f"state-rank{rank}.pt")


def load_state(ckpt_dir: Path, rank: int) -> dict[str, Any]:
    """Read what :func:`save_state` wrote for ``rank`` (trusted: our own file)."""
    path = ckpt_dir / f"state-rank{rank}.pt"
    if not path.is_file():
        raise RuntimeError(
            f"{path} is missing: the checkpoint was written by a run with a different number of "
            "trainer ranks; resume with the same cluster.trainer_nprocs"
        )
    return torch.load(path, weights_only=False)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
