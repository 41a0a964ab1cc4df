"""A small key-value registry through which the processes of one trial find each other
(generation servers publish ``host:port``; clients list them).

Keys are ``/``-separated paths; a *subtree* is every key under a prefix. The keys of one trial
live under :func:`trial_key`; a launcher clears that subtree before it starts anything, so a
relaunched or repeated trial never sees the addresses of dead servers. One interface
(:class:`NameRepository`), four backends, chosen by ``cluster.name_resolve.type``:

- :class:`FileNameRepository` (``file``): one file per key under a root directory; on a shared
  filesystem (NFS) every machine sees the same registry. Writes are atomic (temp file, then
  rename, or hard link when the key must not exist yet).
- :class:`MemoryNameRepository` (``memory``): a dict inside one process, for tests and
  single-process runs.
- ``EtcdNameRepository`` (``etcd``, :mod:`areal.utils.name_resolve_etcd`): keys in an etcd v3
  server through its JSON gateway (client ``etcd3gw``). Every entry a process writes hangs on
  one lease that a thread of that process refreshes, so the entries of a process that dies (even
  by SIGKILL) vanish within ``cluster.name_resolve.ttl`` seconds.
- ``RayNameRepository`` (``ray``, :mod:`areal.utils.name_resolve_ray`): a named, detached Ray
  actor holding the dict, for the processes of one Ray cluster; it lives until the cluster stops.

The file root doubles as the namespace of the etcd and Ray registries, so runs under different
roots never see each other's keys there either.
"""

from __future__ import annotations

import abc
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, TypeVarTuple

from areal.utils.logging import get_logger

if TYPE_CHECKING:  # type-only: utils sits below api
    from areal.api.config.launcher import NameResolveConfig

logger = get_logger("name_resolve")
R = TypeVar("R")  # what a store operation returns
Args = TypeVarTuple("Args")  # its arguments after the store


class NameEntryNotFoundError(KeyError):
    """No value is registered under the key."""


class NameEntryExistsError(KeyError):
    """A value is already registered under the key and ``replace`` was False."""


class RegistryUnavailableError(ConnectionError):
    """The registry's server (etcd, the Ray actor) did not answer, or this process's lease on
    its own entries expired; the message names the address and the config field to fix."""


def clean_key(name: str) -> str:
    """``name`` as a registry key: ``a/b/c``, no empty, ``.`` or ``..`` parts (ValueError)."""
    parts = [p for p in name.strip("/").split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ValueError(f"bad registry key {name!r}: use a/b/c with no '.' or '..' parts")
    return "/".join(parts)


class NameRepository(abc.ABC):
    """Registry interface; every method is safe to call from several threads."""

    @abc.abstractmethod
    def add(self, name: str, value: str, replace: bool = False) -> None:
        """Register ``value`` under ``name``; raises NameEntryExistsError unless ``replace``.
        Of several processes adding one absent key without ``replace``, exactly one wins."""

    @abc.abstractmethod
    def get(self, name: str) -> str:
        """The value under ``name``; raises NameEntryNotFoundError."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name``; raises NameEntryNotFoundError if absent."""

    @abc.abstractmethod
    def find_subtree(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (the prefix itself included if set), sorted."""

    def close(self) -> None:  # noqa: B027 (a no-op by default: only etcd holds a lease)
        """Release what the registry holds (the etcd lease: this process's entries go at once)."""

    def __enter__(self) -> NameRepository:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_subentry(self, prefix: str, value: str) -> str:
        """Register ``value`` under a fresh unique key below ``prefix``; returns that key."""
        name = f"{clean_key(prefix)}/{uuid.uuid4().hex[:12]}"
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

    def wait_subtree(
        self, prefix: str, count: int, timeout: float, poll_interval: float = 0.1
    ) -> list[str]:
        """Block until at least ``count`` values are under ``prefix`` (at most ``timeout``
        seconds) and return all of them, ordered by key."""
        deadline = time.monotonic() + timeout
        while True:
            values = self.get_subtree(prefix)
            if len(values) >= count:
                return values
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"registry key {clean_key(prefix)!r} holds {len(values)} of {count} entries "
                    f"after {timeout} s; check that the processes that register there started "
                    "(their logs under RUN_DIR/logs) and use the same cluster.name_resolve "
                    "settings"
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
                        "process that publishes it is running and uses the same "
                        "cluster.name_resolve settings"
                    ) from None
                time.sleep(poll_interval)


class FileNameRepository(NameRepository):
    """One file per key: ``<root>/<key>/ENTRY``. Safe across processes and machines (NFS)."""

    _ENTRY = "ENTRY"

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        return self.root / clean_key(name) / self._ENTRY

    def add(self, name: str, value: str, replace: bool = False) -> None:
        """Register ``value`` under ``name``. Readers never see half a value: the value is
        written to a temp file, then renamed over the key (``replace``) or hard-linked to it,
        which fails if the key exists, atomically, also on NFS."""
        path = self._path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{self._ENTRY}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(str(value))
        if replace:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise NameEntryExistsError(
                f"registry key {clean_key(name)!r} is already set in {self.root}; pass "
                "replace=True to overwrite it"
            ) from None
        except OSError as e:
            raise OSError(
                f"the file registry at {self.root} needs a filesystem with hard links (local disk, "
                f"NFS) for atomic adds; linking {path} failed: {e}; set "
                "cluster.name_resolve.file_root to such a directory or use "
                "cluster.name_resolve.type=etcd"
            ) from e
        finally:
            tmp.unlink()

    def get(self, name: str) -> str:
        """The value under ``name``."""
        try:
            return self._path(name).read_text()
        except FileNotFoundError:
            raise NameEntryNotFoundError(
                f"registry key {clean_key(name)!r} is not set in {self.root}"
            ) from None

    def delete(self, name: str) -> None:
        """Remove ``name`` (empty parent directories are left; listing ignores them)."""
        try:
            self._path(name).unlink()
        except FileNotFoundError:
            raise NameEntryNotFoundError(
                f"registry key {clean_key(name)!r} is not set in {self.root}"
            ) from None

    def find_subtree(self, prefix: str) -> list[str]:
        """Keys under ``prefix``."""
        base = self.root / clean_key(prefix)
        keys = []
        for dirpath, _dirs, files in os.walk(base):
            if self._ENTRY in files:
                keys.append(Path(dirpath).relative_to(self.root).as_posix())
        return sorted(keys)


class KeyValueStore:
    """A dict of clean keys behind a lock: the memory registry, and the Ray actor's state."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kv: dict[str, str] = {}

    def put(self, name: str, value: str, replace: bool) -> bool:
        """Set ``name``; False (and nothing changed) if it exists and not ``replace``."""
        with self._lock:
            if name in self._kv and not replace:
                return False
            self._kv[name] = value
            return True

    def get(self, name: str) -> str | None:
        with self._lock:
            return self._kv.get(name)

    def delete(self, name: str) -> bool:
        with self._lock:
            return self._kv.pop(name, None) is not None

    def items(self, prefix: str) -> list[tuple[str, str]]:
        """(key, value) of ``prefix`` and every key below it, sorted by key."""
        with self._lock:
            return sorted(
                (k, v) for k, v in self._kv.items() if k == prefix or k.startswith(prefix + "/")
            )

    def delete_subtree(self, prefix: str) -> None:
        with self._lock:
            for key in [k for k in self._kv if k == prefix or k.startswith(prefix + "/")]:
                del self._kv[key]

    def apply(self, op: Callable[[KeyValueStore, *Args], R], *args: *Args) -> R:
        """``op(self, *args)``: how a Ray caller runs one of the methods above in the actor."""
        return op(self, *args)


class StoreRepository(NameRepository):
    """A registry over a :class:`KeyValueStore` reached through ``_call(op, *args)``."""

    where: str  # where the store lives, for error messages

    @abc.abstractmethod
    def _call(self, op: Callable[[KeyValueStore, *Args], R], *args: *Args) -> R:
        """``op(store, *args)`` for a method ``op`` of :class:`KeyValueStore`, wherever the
        store is."""

    def add(self, name: str, value: str, replace: bool = False) -> None:
        """Register ``value`` under ``name``."""
        if not self._call(KeyValueStore.put, clean_key(name), str(value), replace):
            raise NameEntryExistsError(
                f"registry key {clean_key(name)!r} is already set in {self.where}; pass "
                "replace=True to overwrite it"
            )

    def get(self, name: str) -> str:
        """The value under ``name``."""
        value = self._call(KeyValueStore.get, clean_key(name))
        if value is None:
            raise NameEntryNotFoundError(
                f"registry key {clean_key(name)!r} is not set in {self.where}"
            )
        return value

    def delete(self, name: str) -> None:
        """Remove ``name``."""
        if not self._call(KeyValueStore.delete, clean_key(name)):
            raise NameEntryNotFoundError(
                f"registry key {clean_key(name)!r} is not set in {self.where}"
            )

    def find_subtree(self, prefix: str) -> list[str]:
        """Keys under ``prefix``."""
        return [key for key, _ in self._call(KeyValueStore.items, clean_key(prefix))]

    def get_subtree(self, prefix: str) -> list[str]:
        """Values under ``prefix`` (one call: a consistent snapshot)."""
        return [value for _, value in self._call(KeyValueStore.items, clean_key(prefix))]

    def clear_subtree(self, prefix: str) -> None:
        """Delete every key under ``prefix`` at once."""
        self._call(KeyValueStore.delete_subtree, clean_key(prefix))


class MemoryNameRepository(StoreRepository):
    """A registry inside this process only: share the object, not the config."""

    where = "this process's memory registry"

    def __init__(self) -> None:
        self._store = KeyValueStore()

    def _call(self, op: Callable[[KeyValueStore, *Args], R], *args: *Args) -> R:
        return op(self._store, *args)


def make_repository(config: NameResolveConfig, root: str | os.PathLike) -> NameRepository:
    """The registry ``config`` (``cluster.name_resolve``) names. ``root`` (``name_resolve_root``
    of the run config) is the file registry's directory and the etcd and Ray namespace."""
    if config.type == "file":
        if not str(root):
            raise ValueError("cluster.name_resolve.type=file needs a root directory, got ''")
        return FileNameRepository(root)
    if config.type == "memory":
        return MemoryNameRepository()
    if config.type == "etcd":
        from areal.utils.name_resolve_etcd import EtcdNameRepository

        return EtcdNameRepository(
            config.etcd_address, str(root), config.ttl, config.timeout, config.etcd_prefix
        )
    if config.type == "ray":
        from areal.utils.name_resolve_ray import RayNameRepository

        return RayNameRepository(config.ray_address, str(root), config.timeout)
    raise ValueError(
        f"cluster.name_resolve.type must be file, memory, etcd or ray; got {config.type!r}"
    )


def trial_key(experiment_name: str, trial_name: str) -> str:
    """Prefix of every key of one trial."""
    return f"{experiment_name}/{trial_name}"


def agent_proxy_key(experiment_name: str, trial_name: str) -> str:
    """Registry prefix under which a trial's agent proxy publishes ``host:port``."""
    return f"{trial_key(experiment_name, trial_name)}/agent_proxy"


def gen_servers_key(experiment_name: str, trial_name: str) -> str:
    """Prefix under which generation servers of one trial publish ``host:port``."""
    return f"{trial_key(experiment_name, trial_name)}/gen_servers"


def gen_teacher_key(experiment_name: str, trial_name: str) -> str:
    """Prefix under which a trial's distillation teacher servers publish ``host:port``."""
    return f"{trial_key(experiment_name, trial_name)}/teacher_servers"
