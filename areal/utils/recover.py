"""Recover checkpoints under ``RUN_DIR/recover`` that are verified before a run trusts them.

Layout: ``ckpt-<step>/`` directories (whatever the trainer writes: DCP shards, per-rank
``state-rank<r>.pt`` with dataloader / executor / counter / timer state), each with a
``MANIFEST.json``, and a ``LATEST`` file naming the newest one. A checkpoint is written into
``ckpt-<step>.tmp``; once every rank finished, the ranks hash disjoint shares of its files
(blake2b) and rank 0 writes ``MANIFEST.json`` (relative path -> size, digest; the step; the
number of trainer ranks) last, then renames the dir into place, then moves ``LATEST``. A crash
at any point leaves the previous checkpoints as they were.

Resume (:meth:`RecoverDir.resume`) tries the checkpoints newest first. One whose manifest is
missing or unreadable, lists a file that is missing, of another size or with another digest, or
whose load raises on any rank, is corrupt: a warning names it and the file, and the next older
one is tried. When none is usable the resume is refused with one message: the verdict and the
fix first, then each one tried (a trainer prints it alone, no traceback: ``Run.load_recover``).
Every decision is taken from data all ranks share (rank 0's listing and manifest, every rank's
verdict gathered), so the ranks never load different checkpoints. The newest ``keep``
checkpoints stay on disk (``recover.keep``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypedDict, TypeGuard, TypeVar

from areal.utils.logging import get_logger

logger = get_logger("recover")
T = TypeVar("T")
MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 1
_CKPT = re.compile(r"ckpt-(\d+)")
_CHUNK = 8 << 20  # bytes read at a time while hashing


class CheckpointError(RuntimeError):
    """A checkpoint could not be read; the message names the checkpoint and the file."""


class RecoverError(RuntimeError):
    """A resume was refused (no usable checkpoint, or one the run cannot take); says the fix."""


class FileEntry(TypedDict):
    """One file of a checkpoint as its manifest lists it."""

    size: int
    blake2b: str  # hex digest, 32 bytes


class Manifest(TypedDict):
    """``MANIFEST.json`` of a published checkpoint."""

    format: int  # MANIFEST_FORMAT
    step: int
    world_size: int  # trainer ranks that wrote it
    digest: str  # "blake2b-256"
    files: dict[str, FileEntry]  # path relative to the checkpoint -> its entry


class AllGather(Protocol):
    """Every rank's ``obj`` in rank order; collective, with the process group's deadline."""

    def __call__(self, obj: T, /) -> list[T]: ...


def _alone(obj: T) -> list[T]:
    return [obj]


@dataclass(frozen=True)
class Ranks:
    """How the trainer ranks sharing a recover dir reach each other (one rank by default)."""

    rank: int = 0
    world_size: int = 1
    all_gather: AllGather = field(default=_alone, repr=False)

    def barrier(self) -> None:
        """Wait for every rank."""
        self.all_gather(None)

    def from_rank0(self, make: Callable[[], T]) -> T:
        """Rank 0's ``make()`` on every rank (the other ranks do not call it). Collective."""
        mine = [make()] if self.rank == 0 else []
        return self.all_gather(mine)[0][0]


class RecoverDir:
    """Writes, verifies and resumes recover checkpoints; every rank constructs one over the
    same root."""

    def __init__(self, root: str | Path, ranks: Ranks = Ranks(), keep: int = 2):
        if keep < 1:
            raise ValueError(
                f"RecoverDir keep={keep}: keep at least 1 checkpoint (recover.keep >= 1)"
            )
        self.root = Path(root)
        self.ranks = ranks
        self.keep = keep

    def latest(self) -> Path | None:
        """The checkpoint ``LATEST`` names (newest published; not verified here), or None."""
        pointer = self.root / "LATEST"
        return self.root / pointer.read_text().strip() if pointer.is_file() else None

    def checkpoints(self) -> list[Path]:
        """Published checkpoint dirs, newest step first; a dir ``LATEST`` names that is gone
        is listed too (at its place), so a resume reports it instead of skipping it."""
        found = {
            int(m.group(1)): p
            for p in self.root.glob("ckpt-*")
            if (m := _CKPT.fullmatch(p.name)) and p.is_dir()
        }
        latest = self.latest()
        if latest is not None and (m := _CKPT.fullmatch(latest.name)):
            found.setdefault(int(m.group(1)), latest)
        return [found[step] for step in sorted(found, reverse=True)]

    # -- writing ------------------------------------------------------------------------------

    @contextmanager
    def writing(self, step: int) -> Iterator[Path]:
        """Yield a temp dir every rank writes into; when all are done, write its manifest and
        publish it atomically. Collective."""
        final = self.root / f"ckpt-{step}"
        tmp = self.root / f"ckpt-{step}.tmp"
        if self.ranks.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftover of a crash mid-write
            tmp.mkdir(parents=True)
        self.ranks.barrier()
        yield tmp
        self.ranks.barrier()
        files = self.ranks.from_rank0(lambda: _listing(tmp))
        mine = {rel: _describe(tmp / rel) for rel in self._share(files)}  # also fsyncs each file
        entries = {rel: e for part in self.ranks.all_gather(mine) for rel, e in part.items()}
        if self.ranks.rank == 0:
            manifest: Manifest = {
                "format": MANIFEST_FORMAT,
                "step": step,
                "world_size": self.ranks.world_size,
                "digest": "blake2b-256",
                "files": dict(sorted(entries.items())),
            }
            _atomic_write(tmp / MANIFEST, json.dumps(manifest, indent=1))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            _atomic_write(self.root / "LATEST", final.name)
            self._prune(step)
        self.ranks.barrier()

    def _share(self, files: list[str]) -> list[str]:
        """This rank's share of ``files`` (all ranks list them in the same order)."""
        return files[self.ranks.rank :: self.ranks.world_size]

    def _prune(self, newest: int) -> None:
        """Keep the ``keep`` newest checkpoints up to step ``newest``; drop any past it (left
        by a run that was resumed from an older checkpoint, so no longer this run's past)."""
        for path in self.checkpoints():
            step = int(_CKPT.fullmatch(path.name).group(1))
            if step > newest:
                shutil.rmtree(path, ignore_errors=True)
        for old in [p for p in self.checkpoints() if p.is_dir()][self.keep :]:
            shutil.rmtree(old, ignore_errors=True)

    # -- verifying and resuming ---------------------------------------------------------------

    def verify(self, ckpt: Path) -> str | None:
        """None if every file ``MANIFEST.json`` lists is in ``ckpt`` with its size and digest;
        else what is wrong (``'<file>: <what>'``). Ranks check disjoint shares; every rank gets
        the same answer. Collective."""
        manifest = self._manifest(ckpt)
        return manifest if isinstance(manifest, str) else self._verify_files(ckpt, manifest)

    def _manifest(self, ckpt: Path) -> Manifest | str:
        """Rank 0's reading of ``ckpt``'s manifest (or what is wrong with it), on every rank."""
        return self.ranks.from_rank0(lambda: _read_manifest(ckpt))

    def _verify_files(self, ckpt: Path, manifest: Manifest) -> str | None:
        files = sorted(manifest["files"])
        mine = [p for rel in self._share(files) if (p := _check(ckpt, rel, manifest["files"][rel]))]
        problems = sorted(p for part in self.ranks.all_gather(mine) for p in part)
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            return "; ".join(problems[:3]) + more
        return None

    def agreed(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` on every rank; if it raised on any, raise :class:`CheckpointError` on every
        rank (each failed rank's error named), so all ranks take the same next step. Collective."""
        try:
            result, error = fn(), None
        except Exception as e:  # noqa: BLE001 - reported to every rank below, then raised
            result, error = (
                None,
                str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}",
            )
        errors = [(r, e) for r, e in enumerate(self.ranks.all_gather(error)) if e is not None]
        if errors:
            ranks = "; ".join(
                f"rank {r}: {e}" if self.ranks.world_size > 1 else e for r, e in errors
            )
            raise CheckpointError(f"{what} failed: {ranks}")
        return result

    def resume(self, load: Callable[[Path], T]) -> tuple[Path, T] | None:
        """``(checkpoint, load(checkpoint))`` for the newest usable checkpoint, or None when
        there is none. ``load`` runs on every rank and wraps its steps in :meth:`agreed`.
        Raises :class:`RecoverError` when checkpoints exist but none is usable, or when they
        were written by another number of trainer ranks. Collective."""
        candidates = self.ranks.from_rank0(self.checkpoints)
        tried: list[str] = []
        for i, ckpt in enumerate(candidates):
            manifest = self._manifest(ckpt)
            if isinstance(manifest, str):
                problem = manifest
            else:
                self._check_world_size(ckpt, manifest)
                problem = self._verify_files(ckpt, manifest)
            if problem is None:
                try:
                    return ckpt, load(ckpt)
                except CheckpointError as e:  # the same on every rank (agreed)
                    problem = str(e)
            tried.append(f"{ckpt.name}: {problem}")
            after = (
                f"trying {candidates[i + 1].name}"
                if i + 1 < len(candidates)
                else "none left to try"
            )
            logger.warning(f"recover checkpoint {ckpt} is corrupt: {problem}; {after}")
        if not tried:
            return None
        raise RecoverError(  # the verdict and the fix first, then each checkpoint's problem
            f"cannot resume: none of the {len(tried)} recover checkpoint(s) in {self.root} is "
            f"usable; to start the run fresh, delete {self.root} or set recover.mode=disabled. "
            "Tried: " + " | ".join(tried)
        )

    def _check_world_size(self, ckpt: Path, manifest: Manifest) -> None:
        if manifest["world_size"] != self.ranks.world_size:
            raise RecoverError(
                f"recover checkpoint {ckpt} was written by {manifest['world_size']} trainer ranks, "
                f"this run has {self.ranks.world_size}: resume with cluster.trainer_nprocs="
                f"{manifest['world_size']}, or start fresh (delete {self.root} or set "
                "recover.mode=disabled)"
            )


def resume_pending(root: str | Path, mode: str) -> bool:
    """True when a run with ``recover.mode=mode`` will try to resume from ``root``: the run's
    config.yaml is then written only once the resume is accepted."""
    return mode != "disabled" and bool(RecoverDir(root).checkpoints())


def move_aside(path: Path) -> str:
    """Rename ``path``, an earlier run's record in the trial's run dir (a fresh run of the trial
    starts its own), to ``<name>.<k>`` with the first free k; returns the new name."""
    k = next(k for k in range(1, 10_000) if not path.with_name(f"{path.name}.{k}").exists())
    path.rename(path.with_name(f"{path.name}.{k}"))
    return f"{path.name}.{k}"


# -- per-rank state ---------------------------------------------------------------------------


def save_state(ckpt_dir: Path, rank: int, state: dict[str, Any]) -> None:
    """Write one rank's non-tensor-engine state (dataloader, executor, counters, timers)."""
    import torch  # here: the launcher reads recover dirs without torch (~1.5 s of imports)

    torch.save(state, ckpt_dir / f"state-rank{rank}.pt")


def load_state(ckpt_dir: Path, rank: int) -> dict[str, Any]:
    """Read what :func:`save_state` wrote for ``rank`` (trusted: our own file)."""
    path = ckpt_dir / f"state-rank{rank}.pt"
    if not path.is_file():
        raise RuntimeError(
            f"{path} is missing: the checkpoint was written by a run with a different number of "
            "trainer ranks; resume with the same cluster.trainer_nprocs"
        )
    return read_torch_file(path)


def read_torch_file(path: Path) -> Any:
    """``torch.load`` of one of our own checkpoint files; an unreadable file raises
    :class:`CheckpointError` naming it."""
    import torch  # here: the launcher reads recover dirs without torch (~1.5 s of imports)

    try:
        return torch.load(path, weights_only=False)
    except Exception as e:  # noqa: BLE001 - torch's errors name no file; ours does
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {e})") from e


# -- files ------------------------------------------------------------------------------------


def _listing(root: Path) -> list[str]:
    """Every file under ``root``, relative, sorted (the manifest itself excluded)."""
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def _digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _describe(path: Path) -> FileEntry:
    """Size and digest of a just-written file, flushed to disk first."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"size": path.stat().st_size, "blake2b": _digest(path)}


def _read_manifest(ckpt: Path) -> Manifest | str:
    """The manifest of ``ckpt``, or what is wrong with it (a string)."""
    path = ckpt / MANIFEST
    if not ckpt.is_dir():
        return "the directory is missing (LATEST names it)"
    if not path.is_file():
        what = "the dir is empty" if not any(ckpt.iterdir()) else "the checkpoint is incomplete"
        return (
            f"{MANIFEST} is missing: {what} (emptied or edited by hand, or written before "
            "checkpoints had manifests)"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    if not _well_formed(manifest):
        return (
            f"{MANIFEST} is not a format-{MANIFEST_FORMAT} manifest (damaged or written by "
            "another version)"
        )
    return manifest


def _well_formed(data: object) -> TypeGuard[Manifest]:
    """Whether ``data`` (a parsed ``MANIFEST.json``) is a format-``MANIFEST_FORMAT`` manifest
    whose fields a resume reads have their types."""
    if not isinstance(data, dict):
        return False
    files = data.get("files")
    return (
        isinstance(files, dict)
        and isinstance(data.get("world_size"), int)
        and all(
            isinstance(e, dict)
            and isinstance(e.get("size"), int)
            and isinstance(e.get("blake2b"), str)
            for e in files.values()
        )
        and data.get("format") == MANIFEST_FORMAT
    )


def _check(ckpt: Path, rel: str, entry: FileEntry) -> str | None:
    path = ckpt / rel
    if not path.is_file():
        return f"{rel}: missing (the manifest lists {entry['size']} bytes)"
    size = path.stat().st_size
    if size != entry["size"]:
        return f"{rel}: {size} bytes, the manifest lists {entry['size']} (truncated or replaced)"
    if _digest(path) != entry["blake2b"]:
        return f"{rel}: content does not match the manifest's blake2b digest (bytes overwritten)"
    return None


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
