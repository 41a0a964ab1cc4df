"""A small key-value registry through which the processes of one trial find each other
(generation servers publish ``host:port``; clients list them).

Keys are ``/``-separated paths; a *subtree* is every key under a prefix. The keys of one trial
live under :func:`trial_key`; a launcher clears that subtree before it starts anything, so a
relaunched or repeated trial never sees the addresses of dead servers. Backend:
:class:`FileNameRepository`, one file per key under a root directory; on a shared filesystem
(NFS) every machine sees the same registry. Writes are atomic (write to a temp file, rename).
"""

from __future__ import annotations

import abc
import os
import time
import uuid
from pathlib import Path
from typing import Literal


class NameEntryNotFoundError(KeyError):
    """No value is registered under the key."""


class NameEntryExistsError(KeyError):
    """A value is already registered under the key and ``replace`` was False."""


def _clean(name: str) -> str:
    parts = [p for p in name.strip("/").split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ValueError(f"bad registry key {name!r}: use a/b/c with no '.' or '..' parts")
    return "/".join(parts)


class NameRepository(abc.ABC):
    """Registry interface; every method is safe to call from several threads."""

    @abc.abstractmethod
    def add(self, name: str, value: str, replace: bool = False) -> None:
        """Register ``value`` under ``name``; raises NameEntryExistsError unless ``replace``."""

    @abc.abstractmethod
    def get(self, name: str) -> str:
        """The value under ``name``; raises NameEntryNotFoundError."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name``; raises NameEntryNotFoundError if absent."""

    @abc.abstractmethod
    def find_subtree(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (the prefix itself included if set), sorted."""

    def add_subentry(self, prefix: str, value: str) -> str:
        """Register ``value`` under a fresh unique key below ``prefix``; returns that key."""
        name = f"{_clean(prefix)}/{uuid.uuid4().hex[:12]}"
        self.add(name, value)
        return name

    def get_subtree(self, prefix: str) -> list[str]:
        """Values of every key under ``prefix``, ordered by key."""
        out = []
        for key in self.find_subtree(prefix):
            try:
                out.append(self.get(key))
            except NameEntryNotFoundError:  # deleted between listing and reading
                continue
        return out

    def clear_subtree(self, prefix: str) -> None:
        """Delete every key under ``prefix``."""
        for key in self.find_subtree(prefix):
            try:
                self.delete(key)
            except NameEntryNotFoundError:
                continue

    def wait_subtree(self, prefix: str, count: int, timeout: float, poll_interval: float = 0.1) -> list[str]:
        """Block until at least ``count`` values are under ``prefix`` (at most ``timeout``
        seconds) and return all of them, ordered by key."""
        deadline = time.monotonic() + timeout
        while True:
            values = self.get_subtree(prefix)
            if len(values) >= count:
                return values
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"registry key {_clean(prefix)!r} holds {len(values)} of {count} entries after "
                    f"{timeout} s; check that the processes that register there started (their "
                    "logs under RUN_DIR/logs) and use the same cluster.name_resolve settings"
                )
            time.sleep(poll_interval)

    def wait(self, name: str, timeout: float, poll_interval: float = 0.1) -> str:
        """Block until ``name`` is set (at most ``timeout`` seconds) and return its value."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.get(name)
            except NameEntryNotFoundError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"registry key {name!r} was not set within {timeout} s; check that the "
                        "process that publishes it is running and uses the same registry root"
                    ) from None
                time.sleep(poll_interval)


class FileNameRepository(NameRepository):
    """One file per key: ``<root>/<key>/ENTRY``. Safe across processes and machines (NFS)."""

    _ENTRY = "ENTRY"

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        return self.root / _clean(name) / self._ENTRY

    def add(self, name: str, value: str, replace: bool = False) -> None:
        """Register ``value`` under ``name`` (atomic rename, so readers never see half a value)."""
        path = self._path(name)
        if path.exists() and not replace:
            raise NameEntryExistsError(f"registry key {_clean(name)!r} is already set in {self.root}")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{self._ENTRY}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(str(value))
        os.replace(tmp, path)

    def get(self, name: str) -> str:
        """The value under ``name``."""
        try:
            return self._path(name).read_text()
        except FileNotFoundError:
            raise NameEntryNotFoundError(
                f"registry key {_clean(name)!r} is not set in {self.root}"
            ) from None

    def delete(self, name: str) -> None:
        """Remove ``name`` (empty parent directories are left; listing ignores them)."""
        try:
            self._path(name).unlink()
        except FileNotFoundError:
            raise NameEntryNotFoundError(
                f"registry key {_clean(name)!r} is not set in {self.root}"
            ) from None

    def find_subtree(self, prefix: str) -> list[str]:
        """Keys under ``prefix``."""
        base = self.root / _clean(prefix)
        keys = []
        for dirpath, _dirs, files in os.walk(base):
            if self._ENTRY in files:
                keys.append(Path(dirpath).relative_to(self.root).as_posix())
        return sorted(keys)


def make_repository(kind: Literal["file"], file_root: str | os.PathLike) -> NameRepository:
    """The registry of ``kind`` (``cluster.name_resolve.type``) rooted at ``file_root``."""
    if kind == "file":
        if not str(file_root):
            raise ValueError("name_resolve.type=file needs a root directory, got ''")
        return FileNameRepository(file_root)
    raise ValueError(f"cluster.name_resolve.type must be 'file', got {kind!r}")


def trial_key(experiment_name: str, trial_name: str) -> str:
    """Prefix of every key of one trial."""
    return f"{experiment_name}/{trial_name}"


def gen_servers_key(experiment_name: str, trial_name: str) -> str:
    """Prefix under which generation servers of one trial publish ``host:port``."""
    return f"{trial_key(experiment_name, trial_name)}/gen_servers"
